"""Trainer service: runs the distributed loop's driver (solrl.engine.queue_loop) over Redis.

  solrl.trainer.v1.Trainer  Status
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info

Run: `python -m services.trainer.server [--preset shapes-sol-rl] [--set key=value ...] [--out runs/x]`
(or `--resume runs/x` to continue a run from its last checkpoint)
The environment gives the defaults: SOLRL_REDIS_URL (the queue), SOLRL_QUEUE_NAMESPACE,
SOLRL_EXPLORER_ADDRS and SOLRL_REGENERATOR_ADDRS (comma-separated gRPC host:port that adapters are
pushed to with LoadAdapter), SOLRL_BIND_HOST / SOLRL_GRPC_PORT / SOLRL_HTTP_PORT; the secrets only from the
environment: the adapter token from SOLRL_ADAPTER_TOKEN, the Redis password of the URL's user from
SOLRL_REDIS_PASSWORD, the run's queue key from SOLRL_QUEUE_KEY (set: every queue message is HMAC-signed, and a
rollout that does not verify is dropped, counted in solrl_queue_rejected_messages and never trained on), the data
planes' optional token (sent with the Info calls) from SOLRL_DATA_TOKEN. The process exits when the run is done
(0) or failed (1).

Data-parallel: `torchrun --nproc-per-node K --no-python solrl serve trainer ...` (gloo on CPU, nccl on GPU, each rank
on cuda:LOCAL_RANK). Rank 0 is the service: it consumes the rollouts, serves gRPC and the ops app, pushes adapters
and writes the run directory; it broadcasts each epoch's batch and generator state to the other ranks
(solrl/engine/data_parallel.py, as the embedded loop under torchrun does), and every rank trains its share of each optimizer step
under DDP. The other ranks bind no port, open no queue and write nothing: they follow (solrl.engine.loop.train's rank > 0
path). A rank that dies ends the launch: torchrun stops the others and exits non-zero, and a restart resumes from
the last checkpoint with any K.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse, Response

import solrl
from services.common.adapter_headers import SHA256_HEADER, VERSION_HEADER
from services.common.auth import authorized, metadata, read_data_token
from services.common.budget import budget_for
from services.common.env import (
    ENV_ADAPTER_TOKEN,
    ENV_QUEUE_KEY,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_URL,
    secret,
    split_overrides,
)
from services.common.grpc_server import (
    DEFAULT_MAX_RECEIVE_BYTES,
    MAX_GRPC_MESSAGE_SIZE,
    GrpcService,
    build_grpc_server,
    service_name,
)
from services.common.lifecycle import run_main, stop_on_signals
from services.common.metrics import ServiceMetrics, TrainingMetrics
from services.common.ops import HttpServer, create_ops_app
from services.trainer.args import (  # noqa: F401 (the options live there, light; re-exported here)
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    ENV_EXPLORER_ADDRS,
    ENV_REGENERATOR_ADDRS,
    add_arguments,
)
from solrl.config import ConfigError, RunConfig, resolve_run
from solrl.dashboard import mount_dashboard
from solrl.engine import data_parallel as ddp
from solrl.engine.checkpoint import latest_checkpoint
from solrl.engine.queue_loop import PIPELINE, RemoteSession, run_distributed
from solrl.models import device_info
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2_grpc
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2_grpc
from solrl.pb.solrl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from solrl.precision.registry import same_format
from solrl.queue import QueueConfig, build_queue

log = logging.getLogger("solrl.services.trainer")

ALL_PREFIX = "all+"  # "all+host:port": every address the name resolves to (a headless Service's pods)


def parse_addrs(text: str, field: str) -> list[str]:
    """Comma-separated host:port addresses (empty entries dropped); `all+host:port` entries stand for
    every address `host` resolves to at push time (Kubernetes headless Services, scaled explorers)."""
    addrs = [a.strip() for a in (text or "").split(",") if a.strip()]
    for a in addrs:
        host, _, port = a.removeprefix(ALL_PREFIX).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{field}: {a!r} is not host:port or {ALL_PREFIX}host:port")
    return addrs


def expand_addrs(addrs: Sequence[str]) -> list[str]:
    """Resolve `all+host:port` entries to one ip:port per address of host (sorted, deduplicated);
    plain entries pass through. A name that does not resolve is an error naming it."""
    out: list[str] = []
    for a in addrs:
        if not a.startswith(ALL_PREFIX):
            out.append(a)
            continue
        host, _, port = a.removeprefix(ALL_PREFIX).rpartition(":")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise RuntimeError(f"cannot resolve {a!r}: {exc}") from None
        ips = sorted({info[4][0] for info in infos})
        out.extend(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
    return list(dict.fromkeys(out))


# LoadAdapter outcomes that mean "this pod is not there (now)": retried, then the pod is dropped from
# this push (it fetches the current adapter itself when it comes back, see AdapterFetcher). Any other
# failure (a refused token, a layout that does not fit, a stale version) is a configuration error
# and ends the run.
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class AdapterPusher:
    """Pushes an adapter to every explorer and regenerator with the LoadAdapter RPC (bearer token).

    A target that is gone (UNAVAILABLE / DEADLINE_EXCEEDED) is retried for up to `retry_s` seconds,
    then dropped from this push with a warning: a scaled-down or evicted pod does not end the run.
    The last pushed adapter stays in `current` (served on the trainer's GET /v1/adapter/current)."""

    def __init__(self, explorers: Sequence[str], regenerators: Sequence[str], token: str | None,
                 timeout_s: float = 120.0, retry_s: float = 30.0, data_token: str | None = None) -> None:
        if (explorers or regenerators) and not token:
            raise ValueError(f"{ENV_ADAPTER_TOKEN} must be set to push adapters to the rollout services")
        self.metadata = metadata(token)
        self.data_metadata = metadata(data_token)   # the other calls (Info): the data planes' token, if any
        self.timeout_s, self.retry_s = float(timeout_s), float(retry_s)
        self.explorers, self.regenerators = list(explorers), list(regenerators)
        self._channels: dict[str, grpc.Channel] = {}
        self.current: tuple[bytes, int, str] | None = None   # (safetensors, version, sha256)
        self.dropped: list[tuple[int, str, str]] = []         # (version, address, why)

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            options = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                       ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE)]
            self._channels[address] = grpc.insecure_channel(address, options=options)
        return self._channels[address]

    def workers(self) -> list[tuple[str, str, Any]]:
        """(role, address, stub) per rollout service, `all+` names resolved now, so pods added since the
        last call (a scaled Deployment) are included."""
        out: list[tuple[str, str, Any]] = []
        for a in expand_addrs(self.explorers):
            out.append(("explorer", a, explorer_pb2_grpc.ExplorerStub(self._channel(a))))
        for a in expand_addrs(self.regenerators):
            out.append(("regenerator", a, regenerator_pb2_grpc.RegeneratorStub(self._channel(a))))
        return out

    @property
    def targets(self) -> list[tuple[str, Callable]]:
        """(address, LoadAdapter stub) per rollout service (one LoadAdapter contract: common.v1)."""
        return [(a, stub.LoadAdapter) for _, a, stub in self.workers()]

    def __call__(self, data: bytes, version: int, sha256: str) -> None:
        self.current = (bytes(data), version, sha256)
        for address, rpc in self.targets:
            deadline = time.monotonic() + self.retry_s
            wait = 0.5
            while True:
                try:
                    rpc(common_pb2.LoadAdapterRequest(safetensors=data, version=version, sha256=sha256),
                        metadata=self.metadata,
                        timeout=self.timeout_s)
                    break
                except grpc.RpcError as exc:
                    why = f"{exc.code().name}: {exc.details()}"
                    if exc.code() not in TRANSIENT_CODES:
                        raise RuntimeError(f"pushing adapter version {version} to {address}: {why}") from None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        log.warning("adapter version %d not pushed to %s after %.1f s (%s): dropped from this "
                                    "push; it fetches the adapter itself when it is back", version, address,
                                    self.retry_s, why)
                        self.dropped.append((version, address, why))
                        break
                    time.sleep(min(wait, left))
                    wait = min(wait * 2, 5.0)

    def close(self) -> None:
        for c in self._channels.values():
            c.close()


def counted_push(pusher: AdapterPusher, training: TrainingMetrics) -> Callable[[bytes, int, str], None]:
    """`pusher` with each push's outcome counted in solrl_train_adapter_pushes (ok, failed, dropped)."""
    def push(data: bytes, version: int, sha256: str) -> None:
        before = len(pusher.dropped)
        try:
            pusher(data, version, sha256)
        except Exception:
            training.observe_push("failed")
            raise
        training.observe_push("ok")
        for _ in pusher.dropped[before:]:
            training.observe_push("dropped")

    return push


def worker_mismatches(role: str, address: str, info: Any, cfg: RunConfig) -> list[str]:
    """What a rollout service's Info says that disagrees with the run's config (empty: it fits)."""
    r = cfg.rollout
    want_precision = r.explore_precision.backend if role == "explorer" else r.precision.backend
    checks = [("model", info.model, cfg.model.name, "model.name"),
              ("model path", info.model_path, cfg.model.path or "", "model.path"),
              ("base precision", info.base_precision, r.precision.backend, "rollout.precision.backend"),
              ("reward", info.reward, cfg.reward, "reward")]
    if cfg.model.device:   # "" = each model's own default, which the trainer cannot know for another machine
        checks.append(("on device", info.device, run_device(cfg), "model.device"))
    out = [f"{role} {address} serves {what} {got!r}, the run has {key}={want!r}"
           for what, got, want, key in checks if got != want]
    out += clip_mismatches(role, address, info, cfg)
    if role == "explorer" and want_precision == "auto":
        # the adaptive proxy names the precision in each job: the explorer must be able to build every candidate
        from solrl.rollout.candidates import parse_candidate

        available = set(getattr(info, "available_precisions", ()))
        missing = sorted({c.backend for c in map(parse_candidate, r.proxy.candidates)} - available)
        if missing:
            out.append(f"{role} {address} cannot serve the adaptive proxy's candidate precision(s) {missing} "
                       f"(rollout.proxy.candidates); it serves {sorted(available)}")
        return out
    # an emulated backend and its kernel compute the same format: the trainer cannot tell a CPU test bed from a
    # GPU node by config alone
    if not same_format(info.precision, want_precision):
        key = "rollout.explore_precision.backend" if role == "explorer" else "rollout.precision.backend"
        out.append(f"{role} {address} serves precision {info.precision!r}, the run has {key}={want_precision!r}")
    return out


def run_device(cfg: RunConfig) -> str:
    """The run's model.device as a role reports it ("cuda", "cuda:1"; "" = the model's default)."""
    import torch

    return str(torch.device(cfg.model.device)) if cfg.model.device else ""


def run_clip(cfg: RunConfig) -> dict[str, Any]:
    """The clip a video run samples, as its model resolves it (model.frames / height / width, 0 = the model's
    default) and the frames its reward scores; {} for an image model."""
    from solrl.config import VIDEO_MODELS

    if cfg.model.name not in VIDEO_MODELS:
        return {}
    from solrl.models.wan import WAN_FAMILIES

    frames, height, width = WAN_FAMILIES[cfg.model.name].clip(cfg.model.frames, cfg.model.height, cfg.model.width)
    return {"frames": frames, "height": height, "width": width, "reward_frames": cfg.reward_frames}


def clip_mismatches(role: str, address: str, info: Any, cfg: RunConfig) -> list[str]:
    """A video run's clip and reward frames against what a rollout service's Info says it samples (a service of
    another clip would send latents of another shape, or score other frames)."""
    want = run_clip(cfg)
    if not want:
        return []
    keys = {"frames": "model.frames", "height": "model.height", "width": "model.width",
            "reward_frames": "reward_frames"}
    return [f"{role} {address} serves {name}={getattr(info, name)!r}, the run has {keys[name]}={value!r}"
            for name, value in want.items() if getattr(info, name) != value]


def check_workers(pusher: AdapterPusher, cfg: RunConfig, timeout_s: float = 600.0,
                  version: int = 0) -> list[dict[str, Any]]:
    """Ask every rollout service (Info RPC, waiting up to `timeout_s` for it to come up) what it serves;
    RuntimeError naming every mismatch with the run's config (model, path, precisions, reward) and
    every service that holds a newer adapter than the run's `version` (another run's: its first
    epoch would be sampled with it). Returns what each service reported."""
    problems, seen = [], []
    for role, address, stub in pusher.workers():
        request = common_pb2.InfoRequest()  # one Info contract for both rollout roles (common.v1)
        try:
            info = stub.Info(request, timeout=timeout_s, wait_for_ready=True, metadata=pusher.data_metadata)
        except grpc.RpcError as exc:
            problems.append(f"{role} {address} did not answer Info within {timeout_s:g}s "
                            f"({exc.code().name}: {exc.details()})")
            continue
        seen.append({"role": role, "address": address, "model": info.model, "precision": info.precision,
                     "base_precision": info.base_precision, "reward": info.reward, "device": info.device,
                     "adapter_version": info.adapter_version.version})
        problems += worker_mismatches(role, address, info, cfg)
        if info.adapter_version.version > version:
            problems.append(f"{role} {address} serves adapter version {info.adapter_version.version}, newer than "
                            f"this run's {version} (another run's adapter): restart it before this run")
    if problems:
        raise RuntimeError("the rollout services do not serve this run: " + "; ".join(problems))
    return seen


def mount_current_adapter(app: FastAPI, pusher: AdapterPusher, token: str | None) -> None:
    """GET /v1/adapter/current on the trainer's ops app: the last pushed adapter (safetensors body,
    X-Adapter-Version / X-Adapter-Sha256 headers; 204 before the first push), for a rollout service
    that starts or restarts mid-run to fetch itself. Same bearer token as the pushes."""
    secret = token.encode() if token else b""   # encoded once, compared per call

    @app.get("/v1/adapter/current")
    def current_adapter(authorization: str | None = Header(default=None)) -> Response:
        if not token or not authorized(authorization, secret):
            status = 403 if not token else 401
            return JSONResponse({"error": "unauthenticated" if token else "disabled",
                                 "detail": "Authorization: Bearer <SOLRL_ADAPTER_TOKEN> is required" if token
                                 else f"{ENV_ADAPTER_TOKEN} is not set on the trainer"}, status_code=status)
        current = pusher.current
        if current is None:
            return Response(status_code=204)
        data, version, sha256 = current
        return Response(data, media_type="application/octet-stream",
                        headers={VERSION_HEADER: str(version), SHA256_HEADER: sha256})


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    """solrl.trainer.v1.Trainer over the driver's status."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.remote: RemoteSession | None = None
        self.failed = False  # the driver failed (possibly before it had a session)

    def state(self) -> str:
        if self.failed:
            return "failed"
        return self.remote.status.state if self.remote is not None else "starting"

    def Status(self, request: trainer_pb2.StatusRequest, context: grpc.ServicerContext) -> trainer_pb2.StatusResponse:
        if self.remote is None:
            return trainer_pb2.StatusResponse(run_id=self.run_id, state=self.state())
        st = self.remote.status
        return trainer_pb2.StatusResponse(
            run_id=st.run_id, state=self.state(), epoch=st.epoch, optimizer_step=st.optimizer_step,
            adapter_version=common_pb2.AdapterVersion(version=st.adapter_version, sha256=st.adapter_sha256),
            mean_reward=st.mean_reward, rollouts_consumed=st.rollouts_consumed)


def run_config(args: argparse.Namespace) -> tuple[RunConfig, Path, bool]:
    """The run's config, directory and whether it resumes: a new run from --preset / --config /
    env SOLRL_SET + --set (--out), or, with --resume RUN_DIR, the config saved in RUN_DIR plus the
    overrides (as `solrl train --resume`).

    Restarted with the same arguments on a run directory that holds a checkpoint (what a Kubernetes
    Job or a compose restart does), the trainer resumes from it when the config it resolves is the
    one saved there, and refuses naming the keys that differ otherwise: it never starts the run
    over in a directory that holds one."""
    overrides = [*split_overrides(getattr(args, "env_set", "")), *(args.set or [])]
    if args.resume:
        cfg, run_dir = resolve_run(None, None, overrides, args.out, args.resume)
        return cfg, run_dir, True
    cfg, run_dir = resolve_run(args.preset, args.config, overrides, args.out, None)
    if latest_checkpoint(run_dir) is None:
        return cfg, run_dir, False
    saved = RunConfig.load(run_dir / "config.json")
    diff = sorted(_differences(saved.to_dict(), cfg.to_dict()))
    if diff:
        raise ConfigError(f"{run_dir} holds a run with another config (differs in {', '.join(diff)}); "
                          f"resume it with --resume {run_dir} [--set ...] or use another --out")
    return saved, run_dir, True


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".")]


def run(args: argparse.Namespace, stop: threading.Event | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Serve Status while the driver runs: 0 when the run finishes (or on SIGTERM / SIGINT), 1 if it fails.
    Under torchrun, rank 0 serves and the other ranks follow (module doc)."""
    environ = os.environ if environ is None else environ
    if not args.redis_url:
        raise ValueError(f"--redis-url (or {ENV_REDIS_URL}) is required")
    cfg, run_dir, resume = run_config(args)
    ddp.check_ranks(cfg, ddp.from_env(environ).world)  # before the process group: every rank refuses alike
    with ddp.launch(environ) as ranks:
        if not ranks.is_main:
            return follow(cfg, run_dir, resume, ranks)
        return serve(args, cfg, run_dir, resume, stop, environ, ranks)


def follow(cfg: RunConfig, run_dir: Path, resume: bool, ranks: ddp.Ranks) -> int:
    """A data-parallel rank > 0: the embedded loop's follower (solrl.engine.loop.train with ranks > 0): the same session
    and checkpoint as rank 0, then each epoch's batch from rank 0 and this rank's share of the update."""
    from solrl.engine.loop import train

    log.info("rank %d of %d: training rank 0's batches (%s)", ranks.rank, ranks.world, run_dir)
    train(cfg, run_dir, resume=resume, progress=False, log=lambda *_: None, ranks=ranks)
    return 0


def serve(args: argparse.Namespace, cfg: RunConfig, run_dir: Path, resume: bool, stop: threading.Event | None,
          environ: Mapping[str, str], ranks: ddp.Ranks = ddp.SINGLE) -> int:
    """Rank 0 (or the only process): the service and the driver."""
    run_id = args.run_id or run_dir.name.replace(":", "-")
    token = secret(environ, ENV_ADAPTER_TOKEN)
    pusher = AdapterPusher(parse_addrs(args.explorer_addrs, "--explorer-addrs"),
                           parse_addrs(args.regenerator_addrs, "--regenerator-addrs"), token,
                           data_token=read_data_token(environ))
    metrics = ServiceMetrics("trainer")
    signing_key = secret(environ, ENV_QUEUE_KEY)
    if signing_key is None:
        log.warning("%s is not set: queue messages are neither signed nor verified (anyone who can write the "
                    "rollouts stream can have the trainer train on a forged rollout)", ENV_QUEUE_KEY)
    queue = build_queue(args.redis_url, QueueConfig(namespace=args.namespace),
                        password=secret(environ, ENV_REDIS_PASSWORD), signing_key=signing_key,
                        on_reject=lambda d, reason: metrics.observe_rejected(d.stream, reason))
    training = TrainingMetrics(metrics, run_id, cfg.epochs)
    training.watch_queue([stream for stream, _ in PIPELINE], queue.length)
    servicer = TrainerServicer(run_id)
    stop = stop or threading.Event()
    budget = budget_for(args.max_inflight_bytes, DEFAULT_MAX_RECEIVE_BYTES)   # both doors' requests in flight
    server = build_grpc_server([GrpcService(service_name(trainer_pb2, "Trainer"),
                                            trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                               host=args.host, port=args.grpc_port, metrics=metrics, budget=budget)
    device = run_device(cfg)
    device_fields = device_info(device)   # fixed for the run: resolved once, not per /v1/info

    def info() -> dict[str, Any]:
        st = servicer.remote.status if servicer.remote else None
        return {"service": "trainer", "version": solrl.__version__, "run_id": run_id, "run_dir": str(run_dir),
                "grpc_port": server.port, "state": servicer.state(), "epochs": cfg.epochs, "trainer_ranks": ranks.world,
                "epoch": st.epoch if st else 0, "error": st.error if st else "", "history": st.history if st else [],
                **device_fields}

    app = create_ops_app(metrics=metrics, ready=lambda: not stop.is_set(), info=info)
    mount_current_adapter(app, pusher, token)
    mount_dashboard(app, run_dir)  # the live run dashboard at /dashboard
    http = HttpServer(app, args.host, args.http_port, budget=budget)
    outcome = {"rc": 0}

    def drive() -> None:
        try:
            def say(s: str) -> None:
                print(f"solrl trainer: {s}", flush=True)

            ckpt = latest_checkpoint(run_dir) if resume else None
            version = json.loads((ckpt / "state.json").read_text())["adapter_version"] if ckpt else 0
            for w in check_workers(pusher, cfg, args.workers_timeout_s, version):
                say(f"{w['role']} {w['address']}: {w['model']} {w['precision']} (base {w['base_precision']}) on "
                    f"{w['device']}, reward {w['reward']}, adapter version {w['adapter_version']}")
            summary = run_distributed(cfg, run_dir, queue, counted_push(pusher, training), run_id=run_id,
                            rollout_timeout_s=args.rollout_timeout_s, log=say,
                            on_session=lambda remote: setattr(servicer, "remote", remote),
                            resume=resume, pickup_timeout_s=args.pickup_timeout_s, on_record=training.observe_epoch,
                            ranks=ranks)
            before, after = summary["eval_before"], summary["eval_after"]
            held = (f"held-out reward {before:.4f} -> {after:.4f}" if before is not None and after is not None else
                    f"held-out reward {after:.4f}" if after is not None else "no held-out evaluation")
            say(f"finished {summary['epochs']} epochs (adapter version {summary['adapter_version']}): {held}; "
                f"run directory {run_dir} (metrics.jsonl, eval/, checkpoints/, adapter_ema.safetensors)")
        except Exception:
            servicer.failed = True
            log.exception("the run failed")
            outcome["rc"] = 1
        finally:
            stop.set()

    with stop_on_signals(stop):
        server.start()
        http.start()
        print(f"solrl trainer: grpc {server.address}, http {http.host}:{http.port}, run {run_id} -> {run_dir}, "
              f"{cfg.epochs} epochs, model on {device or 'its default device'}"
              + (f", {ranks.world} data-parallel ranks" if ranks.parallel else ""), flush=True)
        # a daemon thread: on a signal the process exits without waiting for the epoch in progress
        threading.Thread(target=drive, name="driver", daemon=True).start()
        while not stop.wait(0.5):
            pass
        log.info("shutting down (%s)", servicer.state())
        server.stop(2.0)
        http.stop()
        pusher.close()
        queue.close()
    return outcome["rc"]


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("python -m services.trainer.server", "solrl trainer service", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
