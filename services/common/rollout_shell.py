"""The shell shared by the rollout services (explorer, regenerator): start-up with the adapter
endpoint, the model and serving options, and the serve loop with the optional stream consumer."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from services.common.adapter_reload import (
    DEFAULT_MAX_ADAPTER_BYTES,
    ENV_ADAPTER_TOKEN,
    AdapterEndpoint,
    HotSwapModel,
)
from services.common.env import Addresses
from services.common.grpc_server import GrpcServer
from services.common.lifecycle import RunningService, serve_until_stopped
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.common.rollout_plane import ENV_REWARD_ADDR, build_scorer
from services.common.workers import start_consumer
from solrl.adapters import LoraSpec
from solrl.models import available_models, load_model
from solrl.models.base import T2IModel
from solrl.precision import PrecisionConfig, available_backends, build_backend


@dataclass
class RolloutService(RunningService):
    """A running explorer or regenerator: a `RunningService` with its adapter endpoint."""

    adapters: AdapterEndpoint | None = None


def serve(plane: Any, hot: HotSwapModel, metrics: ServiceMetrics,
          build: Callable[[AdapterEndpoint], GrpcServer], *, host: str, http_port: int,
          adapter_token: str | None, max_adapter_bytes: int) -> RolloutService:
    """Start `build(adapters)`'s gRPC server and the ops app with /v1/adapter; on failure the
    plane is closed. Shared by the explorer and the regenerator."""
    stopping = threading.Event()

    def ready() -> bool:
        return not stopping.is_set() and plane.ready()

    server: GrpcServer | None = None
    http: HttpServer | None = None
    try:
        adapters = AdapterEndpoint(hot, token=adapter_token, max_bytes=max_adapter_bytes, metrics=metrics)
        server = build(adapters)
        grpc_port = server.port
        app = create_ops_app(metrics=metrics, ready=ready,
                             info=lambda: {**plane.info(), "ready": ready(), "grpc_port": grpc_port,
                                           "adapter_loading": adapters.enabled})
        adapters.mount(app)
        http = HttpServer(app, host, http_port)
        server.start()
        http.start()
    except BaseException:
        for part in (http, server):
            if part is not None:
                part.stop(0)
        plane.close()
        raise
    return RolloutService(plane, server, http, metrics, stopping, adapters=adapters)


def add_model_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str], *, precision: str,
                        steps: int, grpc_port: int, http_port: int) -> None:
    """Options shared by the explorer and the regenerator."""
    addr = Addresses.from_env(environ, grpc_port=grpc_port, http_port=http_port)
    p.add_argument("--model", default="shapes", choices=available_models(), help="model registry name")
    p.add_argument("--model-path", default=None, help="local weights directory (default: the model's own)")
    p.add_argument("--precision", default=precision, choices=available_backends(), help="serving precision backend")
    p.add_argument("--base-precision", default="bf16", choices=("bf16", "fp32"),
                   help="precision the trainer holds its base weights in (RunConfig rollout.precision); "
                        "adapters are merged into base weights rounded the same way")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=float, default=64.0)
    p.add_argument("--lora-targets", default="", help="comma-separated LoRA target modules (default: the model's)")
    p.add_argument("--reward", default="shapes", help="reward (scorer) name")
    p.add_argument("--reward-addr", default=environ.get(ENV_REWARD_ADDR, ""),
                   help=f"host:port of a reward service to score with (env {ENV_REWARD_ADDR}; empty: in process)")
    p.add_argument("--steps", type=int, default=steps, help="default sampling steps")
    p.add_argument("--micro-batch", type=int, default=64, help="images per model forward")
    p.add_argument("--version-wait-s", type=float, default=30.0,
                   help="how long a request for a newer adapter version waits for its push")
    p.add_argument("--max-adapter-bytes", type=int, default=DEFAULT_MAX_ADAPTER_BYTES)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--host", default=addr.host, help="bind address (env SOLRL_BIND_HOST)")
    p.add_argument("--grpc-port", type=int, default=addr.grpc_port, help="gRPC port, 0 = any (env SOLRL_GRPC_PORT)")
    p.add_argument("--http-port", type=int, default=addr.http_port, help="ops HTTP port, 0 = any (env SOLRL_HTTP_PORT)")
    p.add_argument("--max-workers", type=int, default=16, help="gRPC handler threads (RPCs in flight)")


def load_served_model(args: argparse.Namespace) -> tuple[T2IModel, LoraSpec]:
    """The model with its base weights rounded as the trainer holds them, and the LoRA spec."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, args.model_path)
    build_backend(PrecisionConfig(args.base_precision)).prepare(model.transformer)
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) or model.spec.lora_targets
    return model, LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=targets)


def run_rollout_role(role: str, args: argparse.Namespace, stop: threading.Event | None,
                     environ: Mapping[str, str] | None, start: Callable[..., RolloutService],
                     build_plane: Callable[[T2IModel, LoraSpec, Any], Any]) -> int:
    """Load the model, build the role's data plane, serve it (and consume its stream when
    --redis-url is set) until SIGTERM / SIGINT or `stop`."""
    environ = os.environ if environ is None else environ
    log = logging.getLogger(f"solrl.services.{role}")
    model, lora = load_served_model(args)
    plane = build_plane(model, lora, build_scorer(args.reward, args.reward_addr or None))
    svc = start(plane, ServiceMetrics(role), host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                max_workers=args.max_workers, adapter_token=environ.get(ENV_ADAPTER_TOKEN) or None,
                max_adapter_bytes=args.max_adapter_bytes)
    consumer = start_consumer(role, plane, args.redis_url, args.queue_namespace, args.claim_idle_ms) \
        if getattr(args, "redis_url", "") else None
    if not svc.adapters.enabled:
        log.warning("%s is not set: adapter hot reload is refused (403)", ENV_ADAPTER_TOKEN)
    banner = (f"solrl {role}: grpc {svc.grpc.address}, http {svc.http.host}:{svc.http.port}, "
              f"model {plane.model_name} ({plane.hot.backend}), reward {plane.info()['reward']}")
    try:
        return serve_until_stopped(stop, banner, svc.stop, log)
    finally:
        if consumer is not None:
            consumer.stop()
