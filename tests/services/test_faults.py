"""Faults with real processes and the real Redis: nothing is lost, nothing is counted twice."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from solrl.engine.queue_loop import (
    GROUP_EXPLORERS,
    GROUP_REGENERATORS,
    STREAM_EXPLORE,
    STREAM_REGENERATE,
    ensure_pipeline,
)
from solrl.queue import QueueConfig, build_queue
from solrl.shapes.model import ShapesModel

ROOT = Path(__file__).resolve().parents[2]
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
    ShapesModel.random(seed=0, layers=6, heads=4).save(model_dir)
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
    ShapesModel.random(seed=0, layers=6, heads=4).save(model_dir)
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


# ---------------------------------------------------------------------- the distributed run: trainer service,
# explorer and regenerator processes, and a Redis of the test's own (AOF on, fsync always) that it may kill -9.

TOKEN = "faults-token-0123456789abcdef"
DIST_SETS = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=6", "rollout.kept=2",
             "rollout.explore_steps=2", "rollout.steps=3", "train.micro_batch=4", "eval.prompts=2",
             "eval.seeds_per_prompt=1", "eval.every=0", "eval.steps=2", "tensorboard=false", "lora.rank=4",
             "lora.alpha=8", "threads=1", "epochs=2", "rollout.precision.backend=fp32",
             "rollout.explore_precision.backend=fp32"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server on a free loopback port, persisting every write to its AOF before replying
    (appendfsync always), so that kill -9 loses nothing it acknowledged."""

    def __init__(self, workdir: Path) -> None:
        self.dir, self.port = workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        import redis

        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
            stdout=(self.dir / "redis.log").open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline and self.proc.poll() is None, (self.dir / "redis.log").read_text()
                time.sleep(0.05)

    def kill9_and_restart(self, down_s: float = 1.0) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        time.sleep(down_s)
        self.restarts += 1
        self.start()

    def connections_received(self) -> int:
        import redis

        return int(redis.Redis(port=self.port).info("stats")["total_connections_received"])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    pytest.importorskip("redis")
    r = OwnRedis(tmp_path_factory.mktemp("redis"))
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def dist_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dist_model")
    ShapesModel.random(seed=0, layers=6, heads=4).save(d)
    return d


class DistRun:
    """One distributed run: explorer, regenerator and trainer service processes on loopback."""

    def __init__(self, name: str, model_dir: Path, redis_url: str, workdir: Path) -> None:
        self.run_dir, self.logs = workdir / name, workdir / f"{name}-logs"
        self.logs.mkdir(parents=True)
        self.model_dir, self.redis_url, self.ns = model_dir, redis_url, f"faults-{name}-{uuid.uuid4().hex[:6]}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "SOLRL_ADAPTER_TOKEN": TOKEN}
        self.ports = {role: free_port() for role in ("explorer", "regenerator")}
        self.procs: dict[str, subprocess.Popen] = {}
        self.trainer_starts = 0

    def _spawn(self, role: str, args: list[str]) -> subprocess.Popen:
        log = (self.logs / f"{role}.log").open("a")
        return subprocess.Popen([sys.executable, "-m", f"services.{role}.server", *args], cwd=ROOT, env=self.env,
                                stdout=log, stderr=subprocess.STDOUT)

    def start_workers(self) -> None:
        for role, precision in (("explorer", "fp32"), ("regenerator", "fp32")):
            self.procs[role] = self._spawn(role, [
                "--model-path", str(self.model_dir), "--precision", precision, "--base-precision", "fp32",
                "--reward", "jpeg_compressibility", "--lora-rank", "4", "--lora-alpha", "8", "--threads", "1",
                "--micro-batch", "8", "--host", "127.0.0.1", "--grpc-port", str(self.ports[role]), "--http-port", "0",
                "--redis-url", self.redis_url, "--queue-namespace", self.ns, "--claim-idle-ms", "1500"])

    def start_trainer(self, resume: bool = False) -> subprocess.Popen:
        head = ["--resume", str(self.run_dir)] if resume else \
            ["--preset", "shapes-sol-rl", "--out", str(self.run_dir), *[a for s in self.sets() for a in ("--set", s)]]
        self.trainer_starts += 1
        self.procs["trainer"] = self._spawn("trainer", [
            *head, "--redis-url", self.redis_url, "--namespace", self.ns, "--rollout-timeout-s", "180",
            "--explorer-addrs", f"127.0.0.1:{self.ports['explorer']}",
            "--regenerator-addrs", f"127.0.0.1:{self.ports['regenerator']}",
            "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0"])
        return self.procs["trainer"]

    def sets(self) -> list[str]:
        return [*DIST_SETS, f"model.path={self.model_dir}"]

    def wait_trainer(self, timeout_s: float = 240) -> int:
        try:
            return self.procs["trainer"].wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainer still running after {timeout_s}s:\n{self.tail()}")

    def wait_for(self, path: Path, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            dead = [r for r, p in self.procs.items() if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"{dead} exited / timed out waiting for {path}\n{self.tail()}"
            time.sleep(0.05)

    def wait_for_log(self, role: str, text: str, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log(role):
            assert time.monotonic() < deadline and self.procs[role].poll() is None, f"no {text!r}\n{self.tail()}"
            time.sleep(0.02)

    def tail(self, n: int = 2500) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-n:]}" for f in sorted(self.logs.glob("*.log")))

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text()

    def final_bytes(self) -> dict[str, bytes]:
        last = self.run_dir / "checkpoints" / "epoch_0002"
        return {"adapters": (last / "adapters.safetensors").read_bytes(),
                "optimizer": (last / "optimizer.safetensors").read_bytes(),
                "ema": (self.run_dir / "adapter_ema.safetensors").read_bytes()}

    def redeliveries(self) -> dict[str, int]:
        """From the workers' logs: jobs finished on a redelivery, and redelivered jobs skipped as done."""
        text = self.log("explorer") + self.log("regenerator")
        done = [line for line in text.splitlines() if " done by " in line]
        return {"jobs_done": len(done), "done_on_redelivery": sum("(delivery 1)" not in line for line in done),
                "skipped_as_done": text.count("already processed; skipped")}

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def reference_run(own_redis, dist_model, tmp_path_factory):
    """An uninterrupted distributed run: what every faulted run must end on, byte for byte."""
    run = DistRun("reference", dist_model, own_redis.url, tmp_path_factory.mktemp("dist"))
    try:
        run.start_workers()
        run.start_trainer()
        t0 = time.monotonic()
        assert run.wait_trainer() == 0, run.tail()
        return {"bytes": run.final_bytes(), "seconds": time.monotonic() - t0}
    finally:
        run.stop()


@pytest.mark.slow
def test_distributed_run_survives_redis_restarts_and_a_sigkilled_trainer(own_redis, dist_model, reference_run,
                                                                         tmp_path):
    """Redis is killed -9 and restarted three times (between epochs, while the trainer is dead, and
    under the resumed trainer); the trainer service is SIGKILLed mid-epoch and restarted with
    --resume. The run ends on the uninterrupted run's adapter, optimizer and EMA bytes."""
    run = DistRun("faulted", dist_model, own_redis.url, tmp_path)
    restarts0 = own_redis.restarts
    try:
        run.start_workers()
        trainer = run.start_trainer()
        run.wait_for(run.run_dir / "checkpoints" / "epoch_0001" / "state.json")
        own_redis.kill9_and_restart(down_s=2.0)  # 1: between epochs, as epoch 2's jobs are published
        run.wait_for_log("explorer", "-e000001-p00000 done by")  # epoch 2 under way: its adapter pushed,
        trainer.send_signal(signal.SIGKILL)                      # jobs and rollouts in the queue
        trainer.wait(10)
        done = sorted(p.name for p in (run.run_dir / "checkpoints").glob("epoch_*"))
        assert "epoch_0002" not in done, done
        own_redis.kill9_and_restart(down_s=1.0)  # 2: workers mid-job, no trainer
        run.start_trainer(resume=True)
        run.wait_for_log("trainer", "resuming")
        time.sleep(1.0)
        own_redis.kill9_and_restart(down_s=1.0)  # 3: under the resumed trainer
        assert run.wait_trainer() == 0, run.tail()
        reconnected = own_redis.connections_received()
        alive = {role: run.procs[role].poll() is None for role in ("explorer", "regenerator")}
        final = run.final_bytes()
        log = run.log("trainer")
        stats = run.redeliveries()
    finally:
        run.stop()
    assert f"resuming {run.run_dir} after epoch {int(done[-1][-4:])}" in log, log[-3000:]
    assert alive == {"explorer": True, "regenerator": True}  # the workers rode out every restart
    # the resumed trainer and at least one worker reconnected to the last server (a worker idle in its
    # backoff at that moment reconnects on its next poll; under CI load that can come after the run ends)
    assert reconnected >= 2
    for name, data in reference_run["bytes"].items():
        assert final[name] == data, f"{name} differs from the uninterrupted run"
    epochs = [json.loads(line)["epoch"] for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2]  # the killed attempt's records after its checkpoint were truncated
    print(f"reference run {reference_run['seconds']:.0f} s; faulted run: redis kill -9 x{own_redis.restarts - restarts0}"
          f" ({reconnected} client connections to the last server), trainer SIGKILLed after {done[-1]} and "
          f"resumed; final adapter/optimizer/EMA bytes equal the reference; workers {stats}")
