"""Reward service: two gRPC front doors over one RewardDataPlane, plus the FastAPI ops app.

  solrl.reward.v1.Reward            Score, ListRewards (solrl's own contract)
  inference.GRPCInferenceService    KServe v2 / Triton protocol on tritonclient's generated stubs,
                                    so `tritonclient.grpc.InferenceServerClient` works unchanged
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info, and KServe v2 REST (/v2/...: services.common.kserve_http) over
        the same servicer, so `tritonclient.http` and curl work too

Run: `python -m services.reward.server [--rewards shapes,jpeg_compressibility] [--grpc-port N] [--http-port M]`
(SOLRL_BIND_HOST, SOLRL_GRPC_PORT and SOLRL_HTTP_PORT give the defaults). Each handler converts the
request, makes one data-plane call and converts the result; errors map to status codes in one place
(services.common.grpc_server.ErrorInterceptor).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import solrl
from services.common.batching import queue_timer
from services.common.env import Addresses
from services.common.errors import NotFoundError
from services.common.grpc_server import (
    DEFAULT_MAX_RECEIVE_BYTES,
    GrpcServer,
    GrpcService,
    build_grpc_server,
    service_name,
)
from services.common.kserve import InferStats, decode_inputs, encode_output
from services.common.kserve_http import mount_kserve_http
from services.common.lifecycle import RunningService, run_main, serve_until_stopped
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.common.tensors import DEFAULT_MAX_TENSOR_BYTES, tensor_to_numpy
from services.reward.dataplane import MODEL_VERSION, RewardDataPlane, TensorSpec
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger("solrl.services.reward")

DEFAULT_GRPC_PORT = 8001  # Triton's gRPC port
DEFAULT_HTTP_PORT = 8080
DEFAULT_REWARDS = ("shapes", "shapes_dense", "jpeg_compressibility")   # need no weights
SERVER_NAME = "solrl-reward"


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """solrl.reward.v1.Reward over the data plane."""

    def __init__(self, plane: RewardDataPlane, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> None:
        self.plane, self.max_tensor_bytes = plane, max_tensor_bytes

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        if not request.HasField("images"):
            raise ValueError("images: required")
        name = self.plane.resolve(request.reward, field="reward")
        images = tensor_to_numpy(request.images, "images", self.max_tensor_bytes)
        scores = self.plane.score(name, images, list(request.prompts))
        return reward_pb2.ScoreResponse(reward=name, scores=scores.tolist())

    def ListRewards(self, request: reward_pb2.ListRewardsRequest,
                    context: grpc.ServicerContext) -> reward_pb2.ListRewardsResponse:
        return reward_pb2.ListRewardsResponse(names=self.plane.models)   # no default: requests name their reward


def _tensor_metadata(spec: TensorSpec) -> service_pb2.ModelMetadataResponse.TensorMetadata:
    return service_pb2.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype,
                                                            shape=list(spec.shape))


def _config_type(datatype: str) -> int:
    # Triton's model config calls the BYTES datatype TYPE_STRING; the others are TYPE_<datatype>.
    return model_config_pb2.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 / Triton inference protocol over the data plane, with Triton's statistics and the
    repository index (the REST door, services.common.kserve_http, calls these same methods). RPCs not
    overridden here (streaming inference, repository load / unload, shared memory, tracing, logging) answer
    UNIMPLEMENTED: the models are fixed at start-up and run in this process."""

    EXTENSIONS = ("binary_tensor_data", "statistics", "model_configuration", "model_repository(index)")

    def __init__(self, plane: RewardDataPlane, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                 server_name: str = "") -> None:
        self.plane, self.max_tensor_bytes = plane, max_tensor_bytes
        self.server_name = server_name or SERVER_NAME
        self.stats = InferStats()

    def ServerLive(self, request: service_pb2.ServerLiveRequest,
                   context: grpc.ServicerContext) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: service_pb2.ServerReadyRequest,
                    context: grpc.ServicerContext) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.plane.ready())

    def ModelReady(self, request: service_pb2.ModelReadyRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version))

    def ServerMetadata(self, request: service_pb2.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=self.server_name, version=solrl.__version__,
                                                  extensions=list(self.EXTENSIONS))

    def ModelStatistics(self, request: service_pb2.ModelStatisticsRequest,
                        context: grpc.ServicerContext) -> service_pb2.ModelStatisticsResponse:
        names = [self.plane.resolve(request.name, request.version, field="name")] if request.name else self.plane.models
        return json_format.ParseDict({"model_stats": [self.stats.model_stats(n, request.version or MODEL_VERSION)
                                                      for n in names]}, service_pb2.ModelStatisticsResponse())

    def RepositoryIndex(self, request: service_pb2.RepositoryIndexRequest,
                        context: grpc.ServicerContext) -> service_pb2.RepositoryIndexResponse:
        if request.repository_name:
            raise NotFoundError(f"repository_name: this server has one unnamed repository, not "
                                f"{request.repository_name!r}")
        out = service_pb2.RepositoryIndexResponse()
        for name in self.plane.models:
            ready = self.plane.model_ready(name)
            if ready or not request.ready:
                out.models.add(name=name, version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE",
                               reason="" if ready else "the model's worker is not running")
        return out

    def ModelMetadata(self, request: service_pb2.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> service_pb2.ModelMetadataResponse:
        md = self.plane.metadata(request.name, request.version)
        return service_pb2.ModelMetadataResponse(name=md.name, versions=list(md.versions), platform=md.platform,
                                                 inputs=[_tensor_metadata(s) for s in md.inputs],
                                                 outputs=[_tensor_metadata(s) for s in md.outputs])

    def ModelConfig(self, request: service_pb2.ModelConfigRequest,
                    context: grpc.ServicerContext) -> service_pb2.ModelConfigResponse:
        md = self.plane.metadata(request.name, request.version)
        # max_batch_size 0: the shapes above already include the batch axis; batching is done by
        # this server's own dynamic batcher, whose settings travel as parameters.
        config = model_config_pb2.ModelConfig(
            name=md.name, platform=md.platform, max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape))
                   for s in md.inputs],
            output=[model_config_pb2.ModelOutput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape))
                    for s in md.outputs],
            parameters={"max_batch": model_config_pb2.ModelParameter(string_value=str(self.plane.max_batch)),
                         "max_delay_ms": model_config_pb2.ModelParameter(string_value=str(self.plane.max_delay_ms))})
        return service_pb2.ModelConfigResponse(config=config)

    def ModelInfer(self, request: service_pb2.ModelInferRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelInferResponse:
        if not request.model_name:
            raise ValueError("model_name: required")
        name = self.plane.resolve(request.model_name, request.model_version)  # NOT_FOUND before decoding
        version = request.model_version or MODEL_VERSION
        t0 = time.perf_counter_ns()
        try:
            inputs = decode_inputs(request, self.max_tensor_bytes)
            t1 = time.perf_counter_ns()
            with queue_timer() as waits:
                outputs = self.plane.infer(name, inputs, request.model_version, [o.name for o in request.outputs])
            t2 = time.perf_counter_ns()
            response = service_pb2.ModelInferResponse(model_name=name, model_version=version, id=request.id)
            for out_name, array in outputs.items():
                meta, raw = encode_output(out_name, array)
                response.outputs.append(meta)
                response.raw_output_contents.append(raw)
        except BaseException:
            self.stats.record(name, version, ok=False, total_ns=time.perf_counter_ns() - t0)
            raise
        t3 = time.perf_counter_ns()
        queued = int(sum(waits) * 1e9)
        self.stats.record(name, version, ok=True, total_ns=t3 - t0, queue_ns=queued, input_ns=t1 - t0,
                          infer_ns=max(0, t2 - t1 - queued), output_ns=t3 - t2)
        return response


def build_server(plane: RewardDataPlane, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
                 metrics: ServiceMetrics | None = None, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
                 max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
                 inference: InferenceServicer | None = None) -> GrpcServer:
    """The reward gRPC server (not started): Reward + GRPCInferenceService (`inference`, shared with the REST
    door; default a new one) + health + reflection."""
    return build_grpc_server(
        [GrpcService(service_name(reward_pb2, "Reward"), reward_pb2_grpc.add_RewardServicer_to_server,
                     RewardServicer(plane, max_tensor_bytes)),
         GrpcService(service_name(service_pb2, "GRPCInferenceService"),
                     service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                     inference or InferenceServicer(plane, max_tensor_bytes))],
        host=host, port=port, max_workers=max_workers, metrics=metrics, max_receive_bytes=max_receive_bytes)


RewardService = RunningService  # a running reward service: data plane, gRPC and ops HTTP servers


def start(plane: RewardDataPlane, metrics: ServiceMetrics, *, host: str = "127.0.0.1", grpc_port: int = 0,
          http_port: int = 0, max_workers: int = 16, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> RewardService:
    """Serve `plane` over gRPC and the ops app over HTTP (ports 0 = any free port). On failure the
    plane is closed. Build the plane with observe=metrics.observe_batch to export batch metrics."""
    stopping = threading.Event()

    def ready() -> bool:
        return not stopping.is_set() and plane.ready()

    server: GrpcServer | None = None
    http: HttpServer | None = None
    try:
        inference = InferenceServicer(plane, max_tensor_bytes)
        server = build_server(plane, host=host, port=grpc_port, max_workers=max_workers, metrics=metrics,
                              max_tensor_bytes=max_tensor_bytes, inference=inference)
        grpc_port = server.port
        app = create_ops_app(metrics=metrics, ready=ready,
                             info=lambda: {**plane.info(), "ready": ready(), "grpc_port": grpc_port})
        mount_kserve_http(app, inference, max_body_bytes=DEFAULT_MAX_RECEIVE_BYTES)
        http = HttpServer(app, host, http_port)
        server.start()
        http.start()
    except BaseException:
        for part in (http, server):
            if part is not None:
                part.stop(0)
        plane.close()
        raise
    return RewardService(plane, server, http, metrics, stopping)


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The reward service's command-line options (for `solrl serve reward` too)."""
    addr = Addresses.from_env(os.environ if environ is None else environ,
                              grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    p.add_argument("--rewards", default=",".join(DEFAULT_REWARDS),
                   help="comma-separated rewards to serve; start-up fails naming any that cannot be built "
                        f"(default: {','.join(DEFAULT_REWARDS)}, the ones that need no weights)")
    p.add_argument("--host", default=addr.host, help="bind address (env SOLRL_BIND_HOST)")
    p.add_argument("--grpc-port", type=int, default=addr.grpc_port, help="gRPC port, 0 = any (env SOLRL_GRPC_PORT)")
    p.add_argument("--http-port", type=int, default=addr.http_port, help="ops HTTP port, 0 = any (env SOLRL_HTTP_PORT)")
    p.add_argument("--max-batch", type=int, default=64, help="images per scorer call")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="how long a request waits for others to batch with")
    p.add_argument("--max-workers", type=int, default=16, help="gRPC handler threads (RPCs in flight)")


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set), then shut down gracefully."""
    rewards = [r.strip() for r in args.rewards.split(",") if r.strip()]
    if not rewards:
        raise ValueError("--rewards: list at least one reward")
    metrics = ServiceMetrics("reward")
    plane = RewardDataPlane.build(rewards, max_batch=args.max_batch, max_delay_ms=args.max_delay_ms,
                                  observe=metrics.observe_batch)
    svc = start(plane, metrics, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                max_workers=args.max_workers)
    banner = f"solrl reward: grpc {svc.grpc.address}, http {svc.http.host}:{svc.http.port}, rewards {svc.plane.models}"
    return serve_until_stopped(stop, banner, svc.stop, log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("python -m services.reward.server", "solrl reward service", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
