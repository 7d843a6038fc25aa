"""Load: bounded concurrent clients against the reward service and the explorer, each a real server
process on loopback. Zero errors; latency percentiles are reported (printed and written to
load.json under the test's tmp directory), not asserted; the server's resident memory
(/proc/<pid>/status VmRSS) must not keep growing from round to round."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from diffusers import PixArtTransformer2DModel
from transformers import CLIPTextModel

from services.common.tensors import numpy_to_tensor
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 8
ROUNDS = 4
# Generous: a leak of a few KiB per request over a few hundred requests still shows, while the
# allocator's own settling (arenas, caches) in the first rounds does not.
RSS_GROWTH_LIMIT_MIB = 40.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def serve(args: list[str], prefix: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", *args, "--host", "127.0.0.1", "--grpc-port", "0",
                             "--http-port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"),
                            text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return proc, line.split("grpc ")[1].split(",")[0]
    proc.kill()
    raise AssertionError(f"{args[0]} did not start: {log.read_text()[-2000:]}")


def hammer(call: Callable[[int, int], None], requests_per_client: int) -> tuple[list[float], list[str]]:
    """CLIENTS threads, each making `requests_per_client` calls; latencies (s) and errors."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests_per_client):
            t0 = time.perf_counter()
            try:
                call(c, i)
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return latencies, errors


def run_load(name: str, proc: subprocess.Popen, call: Callable[[int, int], None], per_round: int,
             out: Path) -> dict:
    hammer(call, 2)  # warm-up: first-call allocations, thread pools
    rss = [rss_mib(proc.pid)]
    latencies: list[float] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        lat, err = hammer(call, per_round)
        latencies += lat
        errors += err
        rss.append(rss_mib(proc.pid))
    wall = time.perf_counter() - t0
    ms = np.asarray(latencies) * 1000
    report = {"service": name, "clients": CLIENTS, "requests": len(latencies) + len(errors), "errors": len(errors),
              "throughput_rps": round(len(latencies) / wall, 1),
              "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
              "max_ms": round(float(ms.max()), 2), "rss_mib_after_warmup_and_each_round": [round(r, 1) for r in rss]}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    assert not errors, errors[:5]
    assert proc.poll() is None
    growth = rss[-1] - rss[1]  # from the end of round 1 to the end of the last round
    assert growth < RSS_GROWTH_LIMIT_MIB, report
    return report


@pytest.mark.slow
def test_reward_service_under_concurrent_clients(tmp_path):
    proc, address = serve(["services.reward.server", "--rewards", "jpeg_compressibility,shapes", "--max-workers",
                           "32"], "solrl reward:", tmp_path / "reward.log")
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8) for _ in range(CLIENTS)]
    triton = tgrpc.InferenceServerClient(address)
    channel = grpc.insecure_channel(address)
    score = reward_pb2_grpc.RewardStub(channel).Score

    def call(c: int, i: int) -> None:
        if (c + i) % 2:  # half over the Triton protocol, half over solrl.reward.v1
            a = tgrpc.InferInput("IMAGES", list(images[c].shape), "UINT8")
            a.set_data_from_numpy(images[c])
            b = tgrpc.InferInput("PROMPTS", [4], "BYTES")
            b.set_data_from_numpy(np.array([b"a red circle"] * 4, dtype=object))
            scores = triton.infer("shapes", [a, b], client_timeout=60).as_numpy("SCORES")
        else:
            scores = score(reward_pb2.ScoreRequest(reward="jpeg_compressibility", images=numpy_to_tensor(images[c]),
                                                   prompts=["a red circle"] * 4), timeout=60).scores
        assert len(scores) == 4
    try:
        run_load("reward", proc, call, per_round=25, out=tmp_path / "load.json")
    finally:
        triton.close()
        channel.close()
        proc.terminate()
        proc.wait(30)


def tiny_shapes() -> ShapesModel:
    torch.manual_seed(0)
    config = {**transformer_config(), "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
              "cross_attention_dim": 32}
    return ShapesModel(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))


@pytest.mark.slow
def test_explorer_under_concurrent_clients(tmp_path):
    tiny_shapes().save(tmp_path / "model")
    proc, address = serve(["services.explorer.server", "--model-path", str(tmp_path / "model"), "--precision",
                           "nvfp4-emu", "--reward", "jpeg_compressibility", "--threads", "1", "--lora-rank", "2",
                           "--lora-alpha", "4", "--steps", "2", "--kept", "2"], "solrl explorer:",
                          tmp_path / "explorer.log")
    channel = grpc.insecure_channel(address)
    explore = explorer_pb2_grpc.ExplorerStub(channel).Explore

    def call(c: int, i: int) -> None:
        job = common_pb2.ExploreJob(job_id=f"c{c}-{i}", prompt="a red circle", seeds=[c * 1000 + i * 8 + s for s in range(8)],
                                    steps=2, kept=2)
        sel = explore(explorer_pb2.ExploreRequest(job=job), timeout=120).selection
        assert sel.job_id == job.job_id and len(sel.proxy_scores) == 8 and len(sel.kept_indices) == 2
    try:
        run_load("explorer", proc, call, per_round=5, out=tmp_path / "load.json")
    finally:
        channel.close()
        proc.terminate()
        proc.wait(30)
