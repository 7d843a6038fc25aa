"""Explorer service: two gRPC front doors over one ExplorerDataPlane, plus the ops app with hot reload.

  solrl.explorer.v1.Explorer        Explore, Info, LoadAdapter (solrl's own contract)
  inference.GRPCInferenceService    KServe v2 / Triton protocol, model "explore", so
                                    `tritonclient.grpc.InferenceServerClient` can drive it
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info, PUT|GET /v1/adapter (hot reload)

Run: `python -m services.explorer.server [--model shapes] [--precision nvfp4-emu] [--reward shapes]`
(SOLRL_BIND_HOST, SOLRL_GRPC_PORT, SOLRL_HTTP_PORT, SOLRL_REWARD_ADDR give defaults; the adapter
token comes only from SOLRL_ADAPTER_TOKEN, the optional data token both doors then require, and the reward
client sends, only from SOLRL_DATA_TOKEN). Each handler converts the request, makes one data-plane
call and converts the result; errors map to status codes in services.common.grpc_server.ErrorInterceptor,
adapter refusals in services.rollout.hot_swap.REJECTIONS.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Mapping, Sequence

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from services.common.args import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_ROLLOUT_REQUEST_BYTES, MESSAGE_MARGIN
from services.common.budget import InflightBudget
from services.common.grpc_server import (
    GrpcServer,
    GrpcService,
    build_grpc_server,
    service_name,
)
from services.common.lifecycle import run_main
from services.common.metrics import ServiceMetrics
from services.explorer.args import (  # noqa: F401 (the options live there, light; re-exported here)
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    add_arguments,
)
from services.explorer.consumer import explorer_worker
from services.explorer.dataplane import (
    JOB_FIELDS,
    OPTIONAL_INPUTS,
    ExplorerDataPlane,
    resolve_sampler,
)
from services.kserve.grpc import InferenceServicer
from services.kserve.http import mount_kserve_http
from services.rollout.adapter_endpoint import AdapterEndpoint
from services.rollout.shell import RolloutRPCs, RolloutService, run_rollout_role, serve
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.precision import PrecisionConfig

SERVER_NAME = "solrl-explorer"


class ExplorerServicer(RolloutRPCs, explorer_pb2_grpc.ExplorerServicer):
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
                                 sampler=sampler, min_version=job.min_adapter_version, precision=job.precision,
                                 policy=job.precision_policy, gate=job.gate, fields=JOB_FIELDS)
        selection = common_pb2.SeedSelection(
            job_id=job.job_id, prompt=job.prompt, seeds=out.seeds[0], proxy_scores=out.scores[0].tolist(),
            kept_indices=out.kept[0], adapter_version=common_pb2.AdapterVersion(version=out.version, sha256=out.sha256),
            sampler=common_pb2.SamplerSpec(solver=sampler.solver, steps=job.sampler.steps, shift=sampler.shift,
                                           guidance=sampler.guidance), proxy=out.proxy, gate=out.gate,
            gate_failed=out.gate_failed)
        return explorer_pb2.ExploreResponse(selection=selection)


def explorer_inference(plane: ExplorerDataPlane,
                       max_tensor_bytes: int = DEFAULT_MAX_ROLLOUT_REQUEST_BYTES) -> InferenceServicer:
    """The KServe door's servicer for the model `explore` (K is an optional input)."""
    return InferenceServicer(plane, max_tensor_bytes, server_name=SERVER_NAME, optional_inputs=OPTIONAL_INPUTS)


def build_server(plane: ExplorerDataPlane, adapters: AdapterEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 16, metrics: ServiceMetrics | None = None,
                 max_request_bytes: int = DEFAULT_MAX_ROLLOUT_REQUEST_BYTES,
                 inference: InferenceServicer | None = None, token: str | None = None,
                 budget: InflightBudget | None = None) -> GrpcServer:
    """The explorer gRPC server (not started): Explorer + GRPCInferenceService (`inference`, shared with the
    REST door; default a new one) + health + reflection. It receives a request of up to max_request_bytes, or
    an adapter push of up to the endpoint's max_bytes; token: the data token (None: open)."""
    return build_grpc_server(
        [GrpcService(service_name(explorer_pb2, "Explorer"), explorer_pb2_grpc.add_ExplorerServicer_to_server,
                     ExplorerServicer(plane, adapters)),
         GrpcService(service_name(service_pb2, "GRPCInferenceService"),
                     service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                     inference or explorer_inference(plane, max_request_bytes))],
        host=host, port=port, max_workers=max_workers, metrics=metrics, token=token, budget=budget,
        max_receive_bytes=max(max_request_bytes, adapters.max_bytes) + MESSAGE_MARGIN)


def start(plane: ExplorerDataPlane, metrics: ServiceMetrics, *, host: str = "127.0.0.1", grpc_port: int = 0,
          http_port: int = 0, max_workers: int = 16, adapter_token: str | None = None,
          max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
          max_request_bytes: int = DEFAULT_MAX_ROLLOUT_REQUEST_BYTES, data_token: str | None = None,
          max_inflight_bytes: int = 0) -> RolloutService:
    """Serve `plane` over gRPC and the ops app over HTTP (ports 0 = any free port).

    adapter_token: the bearer token hot reload needs (None: pushes are refused with 403); data_token: the one
    Explore and the KServe doors need (None: open); max_request_bytes: the largest request they take."""
    inference = explorer_inference(plane, max_request_bytes)
    return serve(plane, plane.hot, metrics,
                 lambda adapters, budget: build_server(plane, adapters, budget=budget, host=host, port=grpc_port,
                                                       max_workers=max_workers,
                                                       metrics=metrics, max_request_bytes=max_request_bytes,
                                                       inference=inference, token=data_token),
                 host=host, http_port=http_port, adapter_token=adapter_token, max_adapter_bytes=max_adapter_bytes,
                 max_request_bytes=max_request_bytes, max_inflight_bytes=max_inflight_bytes,
                 mount=lambda app: mount_kserve_http(app, inference, max_body_bytes=max_request_bytes + MESSAGE_MARGIN,
                                                     token=data_token))


# ---------------------------------------------------------------------- command line
# (the options, add_arguments: services/explorer/args.py)

def run(args: argparse.Namespace, stop: threading.Event | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set)."""
    return run_rollout_role("explorer", args, stop, environ, start, lambda model, lora, scorer: ExplorerDataPlane(
        model, PrecisionConfig(args.precision), lora, scorer, steps=args.steps, kept=args.kept,
        selection=args.selection, micro_batch=args.micro_batch, version_wait_s=args.version_wait_s), explorer_worker)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("python -m services.explorer.server", "solrl explorer service", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
