"""What the service layer costs, measured in one run (`solrl bench serve`):

1. epoch time: the distributed loop divided by the embedded loop (`Session.epoch`), same config and
   seed, median over the epochs after the first (model loading and warm-up excluded). The distributed
   side is either `solrl up` (reward, explorer(s), regenerator and trainer as separate processes over
   Redis Streams and gRPC; the default of a full run) or the in-process runner (the same services,
   stream workers, gRPC servers, adapter pushes and Redis, as threads of this process; the default
   at --small, where five interpreter start-ups would not fit the time budget). Every side runs
   with one torch thread per process;
2. reward throughput: the reward service (its own process) through unmodified `tritonclient.grpc`
   (ModelInfer on the `shapes` model, batches of ground-truth renders; one client thread and
   connection per concurrent caller) at several concurrencies, with p50/p99 latency, divided by the
   in-process scorer on the same images;
3. adapter hot reload (`PUT /v1/adapter`: check, merge, re-quantize, swap) divided by one Explore RPC
   of the preset's size, on a running explorer service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results

REDIS_URL = os.environ.get("SOLRL_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
SERVICE_MODES = ("up", "inproc")
# Evaluation is not part of an epoch's time; the distributed run still evaluates before and after
# training, so it is kept tiny to save wall time.
EVAL_SETS = ["tensorboard=false", "eval.every=0", "eval.prompts=2", "eval.seeds_per_prompt=1", "eval.steps=2",
             "threads=1"]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


# ------------------------------------------------------------------ 1. services vs embedded epochs

def _run_up(cfg, sets: list[str], run_dir: Path, ns: str, explorers: int) -> None:
    """The distributed run as `solrl up` processes."""
    cmd = [sys.executable, "-m", "solrl.deploy.up", "--redis-url", REDIS_URL, "--namespace", ns, "--out", str(run_dir),
           "--threads", "1", "--explorers", str(explorers), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"solrl up failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def _run_inproc(cfg, sets: list[str], run_dir: Path, ns: str, explorers: int) -> None:
    """The distributed run in this process: the reward, explorer(s) and regenerator services on loopback
    gRPC ports, their Redis stream workers, and the trainer's driver pushing adapters with LoadAdapter."""
    from services.common.metrics import ServiceMetrics
    from services.explorer.consumer import explorer_worker
    from services.explorer.dataplane import ExplorerDataPlane
    from services.explorer.server import start as start_explorer
    from services.regenerator.consumer import regenerator_worker
    from services.regenerator.dataplane import RegeneratorDataPlane
    from services.regenerator.server import start as start_regenerator
    from services.reward.dataplane import RewardDataPlane
    from services.reward.server import start as start_reward
    from services.rollout.plane import build_scorer
    from services.trainer.server import AdapterPusher
    from solrl.adapters import LoraSpec
    from solrl.engine.queue_loop import run_distributed
    from solrl.models import load_model
    from solrl.precision import PrecisionConfig, build_backend
    from solrl.queue import QueueConfig, build_queue
    from solrl.rewards import build_reward

    r, token = cfg.rollout, uuid.uuid4().hex
    queue = build_queue(REDIS_URL, QueueConfig(namespace=ns))
    servers: list[Any] = []   # RunningService: stop() drains, closes the plane (and its remote scorer)
    workers: list[Any] = []   # StreamWorker: stop() lets the job in progress finish
    try:
        reward = start_reward(RewardDataPlane({cfg.reward: build_reward(cfg.reward)}), ServiceMetrics("reward"))
        servers.append(reward)

        def plane(cls, precision, **kw):
            model = load_model(cfg.model.name, cfg.model.path)
            build_backend(r.precision).prepare(model.transformer)  # the trainer's base rounding
            lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                            target_modules=tuple(cfg.lora.targets) or model.spec.lora_targets)
            return cls(model, PrecisionConfig(precision.backend), lora,
                       build_scorer(cfg.reward, reward.grpc.address), micro_batch=r.micro_batch, **kw)

        addrs: dict[str, list[str]] = {"explorer": [], "regenerator": []}
        for _ in range(explorers):
            ex = plane(ExplorerDataPlane, r.explore_precision, steps=r.explore_steps, kept=r.kept,
                       selection=r.selection)
            svc = start_explorer(ex, ServiceMetrics("explorer"), adapter_token=token)
            servers.append(svc)
            workers.append(explorer_worker(queue, ex).start())
            addrs["explorer"].append(svc.grpc.address)
        rg = plane(RegeneratorDataPlane, r.precision, steps=r.steps)
        svc = start_regenerator(rg, ServiceMetrics("regenerator"), adapter_token=token)
        servers.append(svc)
        workers.append(regenerator_worker(queue, rg).start())
        addrs["regenerator"].append(svc.grpc.address)
        pusher = AdapterPusher(addrs["explorer"], addrs["regenerator"], token)
        try:
            run_distributed(cfg, run_dir, queue, pusher, run_id=f"bench-{ns[-8:]}", rollout_timeout_s=1200,
                            log=lambda line: None)
        finally:
            pusher.close()
    finally:
        for worker in workers:
            worker.stop()
        for svc in reversed(servers):  # the reward service last: the rollout services score with it
            svc.stop(0)
        queue.close()


def epoch_times(sets: list[str], epochs: int, services: str = "up", explorers: int = 1) -> dict[str, Any]:
    import redis

    from solrl.config import apply_overrides, get_preset
    from solrl.engine.session import Session

    if services not in SERVICE_MODES:
        raise ValueError(f"services must be one of {SERVICE_MODES}, got {services!r}")
    if isinstance(explorers, bool) or not isinstance(explorers, int) or explorers < 1:
        raise ValueError(f"explorers must be an int >= 1, got {explorers!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as exc:
        return {"skipped": f"no Redis at {REDIS_URL}: {exc}"}
    sets = [*sets, f"epochs={epochs}", *EVAL_SETS]
    cfg = apply_overrides(get_preset("shapes-sol-rl"), sets).validate()
    sess = Session.build(cfg)
    emb_recs = [sess.epoch(e) for e in range(epochs)]
    embedded = [r["time_epoch_s"] for r in emb_recs]
    ns = f"solrl-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="solrl-bench-serve-") as tmp:  # the run's checkpoints are not kept
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        try:
            (_run_up if services == "up" else _run_inproc)(cfg, sets, run_dir, ns, explorers)
        finally:
            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(f"{ns}:*"))
            if keys:
                client.delete(*keys)
        wall = time.perf_counter() - t0
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("epoch", 0) > 0]
    dist = [r["time_epoch_s"] for r in recs]
    warm = slice(1, None) if epochs > 1 else slice(None)
    emb_med, svc_med = float(np.median(embedded[warm])), float(np.median(dist[warm]))

    def med(rs: list[dict], *keys: str) -> float:
        return float(np.median([sum(r[k] for k in keys) for r in rs[warm]]))

    return {"epochs": epochs, "services": services, "explorers": explorers, "settings": sets,
            "embedded_epoch_s": embedded, "services_epoch_s": dist,
            "embedded_median_s": emb_med, "services_median_s": svc_med, "ratio": svc_med / emb_med,
            "embedded_rollout_median_s": med(emb_recs, "time_explore_s", "time_regenerate_s"),
            "services_rollout_median_s": med(recs, "time_rollout_s"),
            "embedded_train_median_s": med(emb_recs, "time_train_s"),
            "services_train_median_s": med(recs, "time_train_s"),
            "rewards_equal_first_epoch": bool(abs(recs[0]["rollout.reward_mean"] - emb_recs[0]["rollout.reward_mean"])
                                              <= 1e-6),
            "services_wall_s_incl_startup": wall}


# ------------------------------------------------------------------ 2. reward service via tritonclient

def _drive(address: str, infer, clients: int, per_client: int) -> tuple[list[float], int, float]:
    """`clients` threads, each with its own tritonclient connection, making `per_client` calls of `infer`:
    the latency of every call that succeeded, the failed calls, and the wall time of the whole."""
    import tritonclient.grpc as tgrpc

    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def client_loop() -> None:
        with tgrpc.InferenceServerClient(address) as c:
            for _ in range(per_client):
                t = time.perf_counter()
                try:
                    infer(c)
                except Exception:  # noqa: BLE001 - counted and reported, never hidden
                    with lock:
                        errors[0] += 1
                    continue
                with lock:
                    lat.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat, errors[0], time.perf_counter() - t0


def _reward_process(reward: str) -> tuple[subprocess.Popen, str]:
    """`python -m services.reward.server` (what `solrl serve reward` runs) on free loopback ports, once it
    answers /readyz: its own process, so the benchmark's client threads do not share its interpreter."""
    import urllib.request

    from solrl.deploy.up import free_port

    grpc_port, http_port = free_port(), free_port()
    # output to a file, not a pipe: a chatty server never blocks on a full pipe (the child keeps its descriptor)
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.reward.server", "--rewards", reward, "--host",
                                 "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the reward service exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1.0) as response:
                if response.status == 200:
                    return proc, f"127.0.0.1:{grpc_port}"
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the reward service was not ready within 120 s")
        time.sleep(0.2)


def reward_throughput(batch: int, requests: int, concurrencies: tuple[int, ...]) -> dict[str, Any]:
    import tritonclient.grpc as tgrpc

    from solrl.rewards import build_reward
    from solrl.shapes.world import parse, render, split_prompts

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

    proc, address = _reward_process("shapes")
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
            lat, errors, wall = _drive(address, infer, conc, max(1, requests // conc))
            ips = len(lat) * batch / wall
            rows.append({"concurrency": conc, "requests": len(lat), "errors": errors, "images_per_s": ips,
                         "p50_ms": 1e3 * _pct(lat, 50), "p99_ms": 1e3 * _pct(lat, 99),
                         "ratio_vs_in_process": ips / inproc_ips})
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"batch": batch, "in_process_images_per_s": inproc_ips, "server": "separate process", "rows": rows}


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

    cfg = get_preset("shapes-sol-rl").validate()   # the explorer this machine runs (bf16-cpu where it is native)
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


def run(out: Path, small: bool = False, epochs: int | None = None, services: str | None = None,
        explorers: int = 1) -> dict[str, Any]:
    """All three measurements; `services`: "up" (processes; full default) or "inproc" (--small default)."""
    if services is not None and services not in SERVICE_MODES:
        raise ValueError(f"services must be one of {SERVICE_MODES}, got {services!r}")
    if isinstance(explorers, bool) or not isinstance(explorers, int) or explorers < 1:
        raise ValueError(f"explorers must be an int >= 1, got {explorers!r}")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if small:
        sets = ["rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2", "rollout.explore_steps=2",
                "rollout.steps=2", "train.micro_batch=4", "lora.rank=4", "lora.alpha=8"]
        ep, mode = epochs or 2, services or "inproc"
        rew = reward_throughput(batch=8, requests=16, concurrencies=(1, 4, 16))
        hot = reload_vs_explore(pool=4, steps=2, reps=2)
    else:
        sets = []
        ep, mode = epochs or 4, services or "up"
        rew = reward_throughput(batch=16, requests=96, concurrencies=(1, 4, 16))
        hot = reload_vs_explore(pool=16, steps=6, reps=5)
    ep_res = epoch_times(sets, ep, mode, explorers)
    result = {"small": small, "epoch_time": ep_res, "reward_service": rew, "hot_reload": hot}
    return write_results(out, "serve", result, markdown(result))


def markdown(r: dict[str, Any]) -> str:
    e, w, h = r["epoch_time"], r["reward_service"], r["hot_reload"]
    lines = [("The CPU is shared with other work while this runs (other processes, other benchmarks), so "
              "absolute times are noisy; the ratios, each measured within this one run, are what to read."), ""]
    if "skipped" in e:
        lines.append(f"Epoch time: skipped ({e['skipped']}).")
    else:
        how = (f"`solrl up` processes (reward, {e['explorers']} explorer(s), regenerator, trainer) over Redis "
               f"Streams + gRPC" if e["services"] == "up" else
               f"the in-process distributed runner (the same services, stream workers and gRPC adapter pushes "
               f"over loopback sockets and Redis, as threads of one process; {e['explorers']} explorer(s))")
        span = f"epochs 2..{e['epochs']}" if e["epochs"] > 1 else "the single epoch"
        lines += [(f"**Epoch time, services / embedded: {e['ratio']:.2f}x** (median of {span}: "
                   f"{e['services_median_s']:.2f} s with {how} vs {e['embedded_median_s']:.2f} s embedded; "
                   f"wall time of the distributed run including start-up and the before/after evaluation "
                   f"{e['services_wall_s_incl_startup']:.0f} s). One torch thread per process on every side"
                   + ("; the services can explore one prompt while regenerating another (two cores), the "
                      "embedded loop runs its stages one after another." if e["services"] == "up" else ".")), "",
                  "| median per epoch | embedded | services |", "|---|---|---|",
                  (f"| rollout (explore + regenerate) s | {e['embedded_rollout_median_s']:.2f} | "
                   f"{e['services_rollout_median_s']:.2f} |"),
                  f"| train s | {e['embedded_train_median_s']:.2f} | {e['services_train_median_s']:.2f} |",
                  f"| epoch s | {e['embedded_median_s']:.2f} | {e['services_median_s']:.2f} |", "",
                  f"Settings: `{' '.join(e['settings'])}` on the `shapes-sol-rl` preset."]
    lines += ["", (f"Reward service (own process; `tritonclient.grpc` ModelInfer from one client thread per "
                   f"concurrent caller, model `shapes`, batches of {w['batch']} images; in process "
                   f"`build_reward('shapes')`: {w['in_process_images_per_s']:.0f} images/s):"), "",
              "| concurrency | requests | errors | images/s | / in process | p50 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    for row in w["rows"]:
        lines.append(f"| {row['concurrency']} | {row['requests']} | {row['errors']} | {row['images_per_s']:.0f} | "
                     f"{row['ratio_vs_in_process']:.2f}x | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} |")
    lines += ["", (f"**Hot reload / one explore call: {h['ratio']:.3f}** (`PUT /v1/adapter` of {h['adapter_bytes']} "
                   f"bytes: median {1e3 * h['reload_median_s']:.0f} ms; Explore of {h['pool']} seeds x {h['steps']} "
                   f"steps: median {1e3 * h['explore_median_s']:.0f} ms).")]
    return "\n".join(lines) + "\n"
