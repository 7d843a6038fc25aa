"""What the service layer costs, measured in one run:

1. epoch time: `solrl up` (reward, explorer, regenerator, trainer as processes over Redis Streams and
   gRPC) divided by the embedded loop (`Session.epoch`), same config and seed, median over epochs
   after the first (model loading and warm-up excluded);
2. reward throughput: the reward service through unmodified `tritonclient.grpc` (ModelInfer on the
   `shapes` model, batches of ground-truth renders) at several concurrencies, with p50/p99 latency,
   divided by the in-process scorer on the same images;
3. adapter hot reload (`PUT /v1/adapter`: check, merge, re-quantize, swap) divided by one Explore RPC
   of the preset's size, on a running explorer service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results

REDIS_URL = os.environ.get("SOLRL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# ------------------------------------------------------------------ 1. services vs embedded epochs

def epoch_times(out: Path, sets: list[str], epochs: int) -> dict[str, Any]:
    import redis

    from solrl.config import apply_overrides, get_preset
    from solrl.loop import Session

    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as exc:
        return {"skipped": f"no Redis at {REDIS_URL}: {exc}"}
    sets = [*sets, f"epochs={epochs}", "tensorboard=false", "eval.every=0"]
    cfg = apply_overrides(get_preset("shapes-sol-rl"), sets).validate()
    sess = Session.build(cfg)
    embedded = [sess.epoch(e)["time_epoch_s"] for e in range(epochs)]
    ns = f"solrl-bench-{uuid.uuid4().hex[:8]}"
    run_dir = out / "serve_up_run"
    cmd = [sys.executable, "-m", "solrl.up", "--redis-url", REDIS_URL, "--namespace", ns, "--out", str(run_dir),
           "--threads", "1", *[a for s in sets for a in ("--set", s)]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{ns}:*"))
    if keys:
        client.delete(*keys)
    if proc.returncode != 0:
        raise RuntimeError(f"solrl up failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    services = [r["time_epoch_s"] for r in recs if r.get("epoch", 0) > 0]
    warm = slice(1, None) if epochs > 1 else slice(None)
    emb_med, svc_med = float(np.median(embedded[warm])), float(np.median(services[warm]))
    return {"epochs": epochs, "settings": sets, "embedded_epoch_s": embedded, "services_epoch_s": services,
            "embedded_median_s": emb_med, "services_median_s": svc_med, "ratio": svc_med / emb_med,
            "services_wall_s_incl_startup": wall}


# ------------------------------------------------------------------ 2. reward service via tritonclient

def reward_throughput(batch: int, requests: int, concurrencies: tuple[int, ...]) -> dict[str, Any]:
    import tritonclient.grpc as tgrpc

    from services.common.metrics import ServiceMetrics
    from services.reward.dataplane import RewardDataPlane
    from services.reward.server import start
    from solrl.rewards import build_reward
    from solrl.world.shapes import parse, render, split_prompts

    train, _ = split_prompts()
    rng = np.random.default_rng(0)
    prompts = [train[i] for i in rng.integers(len(train), size=batch)]
    images = np.stack([render(parse(p), rng) for p in prompts])
    scorer = build_reward("shapes")
    t0 = time.perf_counter()
    reps = max(3, requests // 4)
    for _ in range(reps):
        expected = scorer(images, prompts)
    inproc_ips = reps * batch / (time.perf_counter() - t0)

    metrics = ServiceMetrics("reward")
    svc = start(RewardDataPlane({"shapes": scorer}, observe=metrics.observe_batch), metrics)
    address = svc.grpc.address
    try:
        def infer(client) -> np.ndarray:
            inputs = [tgrpc.InferInput("IMAGES", list(images.shape), "UINT8"),
                      tgrpc.InferInput("PROMPTS", [len(prompts)], "BYTES")]
            inputs[0].set_data_from_numpy(images)
            inputs[1].set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object))
            return client.infer("shapes", inputs).as_numpy("SCORES")

        with tgrpc.InferenceServerClient(address) as c:
            assert c.is_server_live() and c.is_model_ready("shapes")
            got = infer(c)  # warm-up, and the scores must be the in-process ones
            if not np.allclose(got, expected):
                raise RuntimeError("reward service scores differ from the in-process scorer")
        rows = []
        for conc in concurrencies:
            lat: list[float] = []
            errors = 0
            lock = threading.Lock()
            per_client = max(1, requests // conc)

            def client_loop() -> None:
                nonlocal errors
                with tgrpc.InferenceServerClient(address) as c:
                    for _ in range(per_client):
                        t = time.perf_counter()
                        try:
                            infer(c)
                        except Exception:  # noqa: BLE001 - counted and reported, never hidden
                            with lock:
                                errors += 1
                            continue
                        with lock:
                            lat.append(time.perf_counter() - t)

            threads = [threading.Thread(target=client_loop) for _ in range(conc)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            ips = len(lat) * batch / wall
            rows.append({"concurrency": conc, "requests": len(lat), "errors": errors, "images_per_s": ips,
                         "p50_ms": 1e3 * _pct(lat, 50), "p99_ms": 1e3 * _pct(lat, 99),
                         "ratio_vs_in_process": ips / inproc_ips})
    finally:
        svc.stop(0)
    return {"batch": batch, "in_process_images_per_s": inproc_ips, "rows": rows}


# ------------------------------------------------------------------ 3. hot reload vs one explore call

def reload_vs_explore(pool: int, steps: int, reps: int) -> dict[str, Any]:
    import grpc
    import httpx
    import torch

    from services.common.metrics import ServiceMetrics
    from services.explorer.dataplane import ExplorerDataPlane
    from services.explorer.server import start
    from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
    from solrl.config import get_preset
    from solrl.models import load_model
    from solrl.pb.solrl.common.v1 import common_pb2
    from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
    from solrl.precision import PrecisionConfig
    from solrl.rewards import build_reward

    cfg = get_preset("shapes-sol-rl")
    model = load_model("shapes")
    lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=model.spec.lora_targets)
    plane = ExplorerDataPlane(model, PrecisionConfig(cfg.rollout.explore_precision.backend), lora,
                              build_reward("shapes"), steps=steps, kept=min(cfg.rollout.kept, pool // 2))
    token = uuid.uuid4().hex
    svc = start(plane, ServiceMetrics("explorer"), adapter_token=token)
    adapters = LoraAdapters(load_model("shapes").transformer, lora, seed=1)
    payloads = []
    for v in range(1, reps + 1):
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for p in adapters.parameters("default"):
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        payloads.append(encode_adapter(adapters.state_dict("default"), v, lora))
    reload_s, explore_s = [], []
    try:
        with grpc.insecure_channel(svc.grpc.address) as ch, \
                httpx.Client(base_url=f"http://127.0.0.1:{svc.http.port}", timeout=120) as http:
            stub = explorer_pb2_grpc.ExplorerStub(ch)
            seeds = list(range(1000, 1000 + pool))
            for v, data in enumerate(payloads, start=1):
                t = time.perf_counter()
                r = http.put("/v1/adapter", content=data, headers={
                    "X-Adapter-Version": str(v), "X-Adapter-Sha256": sha256_hex(data),
                    "Authorization": f"Bearer {token}"})
                reload_s.append(time.perf_counter() - t)
                if r.status_code != 200:
                    raise RuntimeError(f"adapter push refused: {r.status_code} {r.text}")
                t = time.perf_counter()
                stub.Explore(explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(
                    prompt="a red circle", seeds=seeds, steps=steps, kept=min(cfg.rollout.kept, pool // 2))), timeout=300)
                explore_s.append(time.perf_counter() - t)
    finally:
        svc.stop(0)
    return {"adapter_bytes": len(payloads[0]), "pool": pool, "steps": steps, "reload_s": reload_s,
            "explore_s": explore_s, "reload_median_s": float(np.median(reload_s)),
            "explore_median_s": float(np.median(explore_s)),
            "ratio": float(np.median(reload_s) / np.median(explore_s))}


def run(out: Path, small: bool = False, epochs: int | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    if small:
        sets = ["rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2", "rollout.explore_steps=2",
                "rollout.steps=2", "train.micro_batch=4", "lora.rank=4", "lora.alpha=8"]
        ep = epochs or 2
        rew = reward_throughput(batch=8, requests=8, concurrencies=(1, 4))
        hot = reload_vs_explore(pool=4, steps=2, reps=2)
    else:
        sets = []
        ep = epochs or 4
        rew = reward_throughput(batch=16, requests=96, concurrencies=(1, 4, 16))
        hot = reload_vs_explore(pool=16, steps=6, reps=5)
    ep_res = epoch_times(out, sets, ep)
    result = {"epoch_time": ep_res, "reward_service": rew, "hot_reload": hot}
    return write_results(out, "serve", result, markdown(result))


def markdown(r: dict[str, Any]) -> str:
    e, w, h = r["epoch_time"], r["reward_service"], r["hot_reload"]
    lines = []
    if "skipped" in e:
        lines.append(f"Epoch time: skipped ({e['skipped']}).")
    else:
        lines.append(f"**Epoch time, services / embedded: {e['ratio']:.2f}x** (median of epochs 2..{e['epochs']}: "
                     f"{e['services_median_s']:.2f} s with `solrl up` processes over Redis + gRPC vs "
                     f"{e['embedded_median_s']:.2f} s embedded; `solrl up` wall time including start-up "
                     f"{e['services_wall_s_incl_startup']:.0f} s). On 2 cores the five processes share the CPU.")
    lines += ["", f"Reward service (`tritonclient.grpc`, `shapes`, batches of {w['batch']} images; in process: "
              f"{w['in_process_images_per_s']:.0f} images/s):", "",
              "| concurrency | requests | errors | images/s | / in process | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    for row in w["rows"]:
        lines.append(f"| {row['concurrency']} | {row['requests']} | {row['errors']} | {row['images_per_s']:.0f} | "
                     f"{row['ratio_vs_in_process']:.2f}x | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
    lines += ["", f"**Hot reload / one explore call: {h['ratio']:.3f}** (`PUT /v1/adapter` of {h['adapter_bytes']} bytes: "
              f"median {1e3 * h['reload_median_s']:.0f} ms; Explore of {h['pool']} seeds x {h['steps']} steps: "
              f"median {1e3 * h['explore_median_s']:.0f} ms)."]
    return "\n".join(lines) + "\n"
