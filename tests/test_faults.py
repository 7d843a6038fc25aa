"""Faults with real processes and the real Redis: nothing is lost, nothing is counted twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from solrl.distributed import GROUP_EXPLORERS, GROUP_REGENERATORS, STREAM_EXPLORE, STREAM_REGENERATE, ensure_pipeline
from solrl.models.shapes import ShapesModel
from solrl.queue import QueueConfig, build_queue

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/0"


def explorer_process(model_dir: Path, ns: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.explorer.server", "--model-path", str(model_dir), "--precision", "fp32",
           "--base-precision", "fp32", "--reward", "jpeg_compressibility", "--threads", "1", "--host", "127.0.0.1",
           "--grpc-port", "0", "--http-port", "0", "--redis-url", REDIS_URL, "--queue-namespace", ns,
           "--claim-idle-ms", "1500", "--micro-batch", "8"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_sigkilled_explorer_job_is_reclaimed_and_delivered_exactly_once(tmp_path):
    from solrl.pb.solrl.common.v1 import common_pb2

    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    model_dir = tmp_path / "model"
    ShapesModel.random(seed=0).save(model_dir)
    ns = f"solrl-test-faults-{uuid.uuid4().hex[:8]}"
    queue = build_queue(REDIS_URL, QueueConfig(namespace=ns, claim_idle_ms=1500))
    ensure_pipeline(queue)
    jobs = [f"job-{i}" for i in range(4)]
    for i, job_id in enumerate(jobs):  # big enough that a job is in flight for seconds
        job = common_pb2.ExploreJob(job_id=job_id, run_id="faults", prompt="a red circle",
                                    seeds=list(range(100 * i, 100 * i + 48)), steps=20, kept=4, selection="best_worst")
        queue.publish(STREAM_EXPLORE, job.SerializeToString(), key=job_id)
    victim = explorer_process(model_dir, ns, tmp_path / "victim.log")
    survivor = None
    try:
        deadline = time.monotonic() + 120
        while queue.pending(STREAM_EXPLORE, GROUP_EXPLORERS) == 0:  # the victim took a job
            assert time.monotonic() < deadline and victim.poll() is None, (tmp_path / "victim.log").read_text()
            time.sleep(0.1)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        assert queue.pending(STREAM_EXPLORE, GROUP_EXPLORERS) >= 1  # its job is still un-acked
        survivor = explorer_process(model_dir, ns, tmp_path / "survivor.log")
        keys: list[str] = []
        while len(set(keys)) < len(jobs):
            assert time.monotonic() < deadline, (tmp_path / "survivor.log").read_text()[-3000:]
            for d in queue.consume(STREAM_REGENERATE, GROUP_REGENERATORS, "test", count=16, block_ms=500):
                keys.append(d.key)
                sel = common_pb2.SeedSelection.FromString(d.payload)
                assert sel.job_id == d.key and len(sel.kept_indices) == 4
                queue.ack(STREAM_REGENERATE, GROUP_REGENERATORS, [d.id])
    finally:
        for p in (victim, survivor):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)
        client = redis.Redis.from_url(REDIS_URL)
        stale = list(client.scan_iter(f"{ns}:*"))
        if stale:
            client.delete(*stale)
    assert sorted(keys) == sorted(jobs)  # every job's result exactly once: none lost, none duplicated
    log = (tmp_path / "survivor.log").read_text()
    redelivered = [line for line in log.splitlines() if "done by" in line and "(delivery 1)" not in line]
    assert len(redelivered) >= 1, log[-3000:]  # the survivor finished the victim's job on a redelivery
    print(f"jobs {len(jobs)}, results {len(keys)}, redelivered {len(redelivered)}, duplicates {len(keys) - len(set(keys))}")


TRAIN_SETS = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=6", "rollout.kept=4",
              "rollout.explore_steps=2", "rollout.steps=3", "train.micro_batch=4", "eval.prompts=2",
              "eval.seeds_per_prompt=1", "eval.every=0", "tensorboard=false", "lora.rank=4", "lora.alpha=8",
              "epochs=6", "threads=1"]


def train_cmd(model_dir: Path, out: Path, resume: bool = False) -> list[str]:
    sets = [*TRAIN_SETS, f"model.path={model_dir}"]
    head = ["--resume", str(out)] if resume else ["--preset", "shapes-sol-rl", "--out", str(out)]
    return [sys.executable, "-m", "solrl.cli", "train", *head, "--no-progress", *[a for s in sets for a in ("--set", s)]]


@pytest.mark.slow
def test_sigkilled_trainer_resumes_to_the_same_adapter_bytes(tmp_path):
    model_dir = tmp_path / "model"
    ShapesModel.random(seed=0).save(model_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, part = tmp_path / "full", tmp_path / "part"
    subprocess.run(train_cmd(model_dir, full), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.Popen(train_cmd(model_dir, part), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (part / "checkpoints" / "epoch_0002" / "state.json").exists():  # killed somewhere after epoch 2
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    done = sorted(p.name for p in (part / "checkpoints").glob("epoch_*"))
    assert "epoch_0006" not in done  # it really was cut short
    subprocess.run(train_cmd(model_dir, part, resume=True), cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=300)
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        assert (full / "checkpoints/epoch_0006" / name).read_bytes() == (part / "checkpoints/epoch_0006" / name).read_bytes()
    assert (full / "adapter_ema.safetensors").read_bytes() == (part / "adapter_ema.safetensors").read_bytes()
    print(f"killed after {done[-1]}; resumed run's final adapter bytes equal the uninterrupted run's")
