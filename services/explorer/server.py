"""Explorer service: two gRPC front doors over one ExplorerDataPlane, plus the ops app with hot reload.

  solrl.explorer.v1.Explorer        Explore, Info, LoadAdapter (solrl's own contract)
  inference.GRPCInferenceService    KServe v2 / Triton protocol, model "explore", so
                                    `tritonclient.grpc.InferenceServerClient` can drive it
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info, PUT|GET /v1/adapter (hot reload)

Run: `python -m services.explorer.server [--model shapes] [--precision nvfp4-emu] [--reward shapes]`
(SOLRL_BIND_HOST, SOLRL_GRPC_PORT, SOLRL_HTTP_PORT, SOLRL_REWARD_ADDR give defaults; the adapter
token comes only from SOLRL_ADAPTER_TOKEN). Each handler converts the request, makes one data-plane
call and converts the result; errors map to status codes in services.common.grpc_server.ErrorInterceptor,
adapter refusals in services.common.adapter_reload.REJECTIONS.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import solrl
from services.common.adapter_reload import (
    DEFAULT_MAX_ADAPTER_BYTES,
    ENV_ADAPTER_TOKEN,
    AdapterEndpoint,
    HotSwapModel,
)
from services.common.env import Addresses
from services.common.grpc_server import GrpcServer, GrpcService, build_grpc_server, service_name
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.common.tensors import DEFAULT_MAX_TENSOR_BYTES
from services.common.workers import add_consumer_arguments, start_consumer
from services.explorer.dataplane import (
    ENV_REWARD_ADDR,
    OPTIONAL_INPUTS,
    ExplorerDataPlane,
    build_scorer,
    resolve_sampler,
)
from services.reward.server import InferenceServicer, _config_type
from solrl.adapters import LoraSpec
from solrl.algo.selection import SELECTION_MODES
from solrl.models import available_models, load_model
from solrl.models.base import T2IModel
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.precision import PrecisionConfig, available_backends, build_backend

log = logging.getLogger("solrl.services.explorer")

DEFAULT_GRPC_PORT = 8011
DEFAULT_HTTP_PORT = 8091
SERVER_NAME = "solrl-explorer"
JOB_FIELDS = {"prompts": "job.prompt", "seeds": "job.seeds", "n": "n", "steps": "job.steps", "kept": "job.kept",
              "selection": "job.selection", "min_version": "job.min_adapter_version"}


class ExplorerServicer(explorer_pb2_grpc.ExplorerServicer):
    """solrl.explorer.v1.Explorer over the data plane."""

    def __init__(self, plane: ExplorerDataPlane, adapters: AdapterEndpoint) -> None:
        self.plane, self.adapters = plane, adapters

    def Explore(self, request: explorer_pb2.ExploreRequest,
                context: grpc.ServicerContext) -> explorer_pb2.ExploreResponse:
        if not request.HasField("job"):
            raise ValueError("job: required")
        job = request.job
        sampler = resolve_sampler(self.plane.sampler, job.sampler.solver, job.sampler.shift, job.sampler.guidance,
                                  field="job.sampler")
        out = self.plane.explore([job.prompt], [list(job.seeds)] if job.seeds else None, n=request.n or None,
                                 steps=job.steps or None, kept=job.kept or None, selection=job.selection or None,
                                 sampler=sampler, min_version=job.min_adapter_version, fields=JOB_FIELDS)
        selection = common_pb2.SeedSelection(
            job_id=job.job_id, prompt=job.prompt, seeds=out.seeds[0], proxy_scores=out.scores[0].tolist(),
            kept_indices=out.kept[0], adapter_version=common_pb2.AdapterVersion(version=out.version, sha256=out.sha256),
            sampler=common_pb2.SamplerSpec(solver=sampler.solver, steps=job.sampler.steps, shift=sampler.shift,
                                           guidance=sampler.guidance))
        return explorer_pb2.ExploreResponse(selection=selection)

    def Info(self, request: explorer_pb2.InfoRequest, context: grpc.ServicerContext) -> explorer_pb2.InfoResponse:
        info = self.plane.info()
        return explorer_pb2.InfoResponse(
            model=info["model"], precision=info["precision"], reward=info["reward"],
            adapter_version=common_pb2.AdapterVersion(version=info["adapter_version"], sha256=info["adapter_sha256"]),
            resident_weight_bytes=info["resident_weight_bytes"])

    def LoadAdapter(self, request: explorer_pb2.LoadAdapterRequest,
                    context: grpc.ServicerContext) -> explorer_pb2.LoadAdapterResponse:
        result = self.adapters.grpc_load(context, request.safetensors, request.version, request.sha256)
        return explorer_pb2.LoadAdapterResponse(
            adapter_version=common_pb2.AdapterVersion(version=result.version, sha256=result.sha256),
            swap_ms=result.swap_ms)


class ExplorerInferenceServicer(InferenceServicer):
    """The reward service's KServe v2 / Triton servicer, with this server's name and model config."""

    def ServerMetadata(self, request: service_pb2.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=solrl.__version__)

    def ModelConfig(self, request: service_pb2.ModelConfigRequest,
                    context: grpc.ServicerContext) -> service_pb2.ModelConfigResponse:
        md = self.plane.metadata(request.name, request.version)
        # max_batch_size 0: the shapes above already include the batch axis (prompts)
        config = model_config_pb2.ModelConfig(
            name=md.name, platform=md.platform, max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape),
                                               optional=s.name in OPTIONAL_INPUTS) for s in md.inputs],
            output=[model_config_pb2.ModelOutput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape))
                    for s in md.outputs])
        return service_pb2.ModelConfigResponse(config=config)


def build_server(plane: ExplorerDataPlane, adapters: AdapterEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 16, metrics: ServiceMetrics | None = None,
                 max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> GrpcServer:
    """The explorer gRPC server (not started): Explorer + GRPCInferenceService + health + reflection."""
    return build_grpc_server(
        [GrpcService(service_name(explorer_pb2, "Explorer"), explorer_pb2_grpc.add_ExplorerServicer_to_server,
                     ExplorerServicer(plane, adapters)),
         GrpcService(service_name(service_pb2, "GRPCInferenceService"),
                     service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                     ExplorerInferenceServicer(plane, max_tensor_bytes))],
        host=host, port=port, max_workers=max_workers, metrics=metrics)


@dataclass
class RolloutService:
    """A running explorer or regenerator: data plane, adapter endpoint, gRPC server and ops HTTP server."""

    plane: Any
    adapters: AdapterEndpoint
    grpc: GrpcServer
    http: HttpServer
    metrics: ServiceMetrics
    stopping: threading.Event

    def stop(self, grace: float = 5.0) -> None:
        """Not ready, NOT_SERVING, drain in-flight RPCs, then close the plane and the HTTP server."""
        self.stopping.set()
        self.grpc.stop(grace)
        self.plane.close()
        self.http.stop()


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
    return RolloutService(plane, adapters, server, http, metrics, stopping)


def start(plane: ExplorerDataPlane, metrics: ServiceMetrics, *, host: str = "127.0.0.1", grpc_port: int = 0,
          http_port: int = 0, max_workers: int = 16, adapter_token: str | None = None,
          max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
          max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> RolloutService:
    """Serve `plane` over gRPC and the ops app over HTTP (ports 0 = any free port).

    adapter_token: the bearer token hot reload needs (None: pushes are refused with 403)."""
    return serve(plane, plane.hot, metrics,
                 lambda adapters: build_server(plane, adapters, host=host, port=grpc_port, max_workers=max_workers,
                                                  metrics=metrics, max_tensor_bytes=max_tensor_bytes),
                 host=host, http_port=http_port, adapter_token=adapter_token, max_adapter_bytes=max_adapter_bytes)


# ---------------------------------------------------------------------- command line

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


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The explorer's command-line options (for `solrl serve explorer` too)."""
    add_model_arguments(p, os.environ if environ is None else environ, precision="nvfp4-emu", steps=6,
                        grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    p.add_argument("--kept", type=int, default=24, help="default seeds kept per prompt (k)")
    p.add_argument("--selection", default="best_worst", choices=SELECTION_MODES, help="default selection mode")
    add_consumer_arguments(p, os.environ if environ is None else environ)


def load_served_model(args: argparse.Namespace) -> tuple[T2IModel, LoraSpec]:
    """The model with its base weights rounded as the trainer holds them, and the LoRA spec."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, args.model_path)
    build_backend(PrecisionConfig(args.base_precision)).prepare(model.transformer)
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()) or model.spec.lora_targets
    return model, LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=targets)


def wait_and_stop(svc: RolloutService, stop: threading.Event | None, banner: str) -> int:
    """Print `banner`, serve until SIGTERM / SIGINT (or `stop`), then shut down gracefully."""
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    if not svc.adapters.enabled:
        log.warning("%s is not set: adapter hot reload is refused (403)", ENV_ADAPTER_TOKEN)
    print(banner, flush=True)
    try:
        while not stop.wait(0.5):
            pass
        log.info("shutting down")
        svc.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def run(args: argparse.Namespace, stop: threading.Event | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set)."""
    environ = os.environ if environ is None else environ
    model, lora = load_served_model(args)
    metrics = ServiceMetrics("explorer")
    plane = ExplorerDataPlane(model, PrecisionConfig(args.precision), lora,
                              build_scorer(args.reward, args.reward_addr or None), steps=args.steps,
                              kept=args.kept, selection=args.selection, micro_batch=args.micro_batch,
                              version_wait_s=args.version_wait_s)
    svc = start(plane, metrics, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                max_workers=args.max_workers, adapter_token=environ.get(ENV_ADAPTER_TOKEN) or None,
                max_adapter_bytes=args.max_adapter_bytes)
    consumer = start_consumer("explorer", plane, args.redis_url, args.queue_namespace) \
        if getattr(args, "redis_url", "") else None
    try:
        return wait_and_stop(svc, stop, f"solrl explorer: grpc {svc.grpc.address}, http {svc.http.host}:"
                                        f"{svc.http.port}, model {plane.model_name} ({plane.hot.backend}), "
                                        f"reward {plane.info()['reward']}")
    finally:
        if consumer is not None:
            consumer.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.explorer.server", description="solrl explorer service")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
