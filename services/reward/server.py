"""Reward service: two gRPC front doors over one RewardDataPlane, plus the FastAPI ops app.

  solrl.reward.v1.Reward            Score, ListRewards (solrl's own contract)
  inference.GRPCInferenceService    KServe v2 / Triton protocol on tritonclient's generated stubs,
                                    so `tritonclient.grpc.InferenceServerClient` works unchanged
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info, and KServe v2 REST (/v2/...: services.kserve.http) over
        the same servicer, so `tritonclient.http` and curl work too

Run: `python -m services.reward.server [--rewards shapes,jpeg_compressibility] [--grpc-port N] [--http-port M]`
(SOLRL_BIND_HOST, SOLRL_GRPC_PORT and SOLRL_HTTP_PORT give the defaults; the optional data token, which both
doors then require, comes only from SOLRL_DATA_TOKEN: services.common.auth). Each handler converts the
request, makes one data-plane call and converts the result; errors map to status codes in one place
(services.common.grpc_server.ErrorInterceptor).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from services.common.args import DEFAULT_MAX_REWARD_REQUEST_BYTES, MESSAGE_MARGIN
from services.common.auth import read_data_token
from services.common.budget import InflightBudget, budget_for
from services.common.grpc_server import (
    GrpcServer,
    GrpcService,
    build_grpc_server,
    service_name,
)
from services.common.lifecycle import RunningService, run_main, serve_until_stopped
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.common.tensors import tensor_to_numpy
from services.kserve.grpc import InferenceServicer
from services.kserve.http import mount_kserve_http
from services.reward.args import (  # noqa: F401 (the options live there, light; re-exported here)
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    DEFAULT_REWARDS,
    add_arguments,
)
from services.reward.dataplane import RewardDataPlane
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger("solrl.services.reward")

SERVER_NAME = "solrl-reward"


class RewardServicer(reward_pb2_grpc.RewardServicer):
    """solrl.reward.v1.Reward over the data plane."""

    def __init__(self, plane: RewardDataPlane, max_tensor_bytes: int = DEFAULT_MAX_REWARD_REQUEST_BYTES) -> None:
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


def reward_inference(plane: RewardDataPlane,
                     max_tensor_bytes: int = DEFAULT_MAX_REWARD_REQUEST_BYTES) -> InferenceServicer:
    """The KServe door's servicer for the rewards (each a model); the batcher's settings as config parameters."""
    return InferenceServicer(plane, max_tensor_bytes, server_name=SERVER_NAME,
                             parameters=lambda: {"max_batch": str(plane.max_batch),
                                                 "max_delay_ms": str(plane.max_delay_ms)})


def build_server(plane: RewardDataPlane, *, host: str = "127.0.0.1", port: int = 0, max_workers: int = 16,
                 metrics: ServiceMetrics | None = None, max_request_bytes: int = DEFAULT_MAX_REWARD_REQUEST_BYTES,
                 max_receive_bytes: int | None = None, inference: InferenceServicer | None = None,
                 token: str | None = None, budget: InflightBudget | None = None) -> GrpcServer:
    """The reward gRPC server (not started): Reward + GRPCInferenceService (`inference`, shared with the REST
    door; default a new one) + health + reflection. A tensor may hold up to max_request_bytes, a message
    max_receive_bytes (default: max_request_bytes + MESSAGE_MARGIN); token: the data token (None: open); budget:
    the one for the requests in flight the REST door shares (services.common.budget; None: unbounded)."""
    return build_grpc_server(
        [GrpcService(service_name(reward_pb2, "Reward"), reward_pb2_grpc.add_RewardServicer_to_server,
                     RewardServicer(plane, max_request_bytes)),
         GrpcService(service_name(service_pb2, "GRPCInferenceService"),
                     service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server,
                     inference or reward_inference(plane, max_request_bytes))],
        host=host, port=port, max_workers=max_workers, metrics=metrics, token=token, budget=budget,
        max_receive_bytes=max_request_bytes + MESSAGE_MARGIN if max_receive_bytes is None else max_receive_bytes)


RewardService = RunningService  # a running reward service: data plane, gRPC and ops HTTP servers


def start(plane: RewardDataPlane, metrics: ServiceMetrics, *, host: str = "127.0.0.1", grpc_port: int = 0,
          http_port: int = 0, max_workers: int = 16, max_request_bytes: int = DEFAULT_MAX_REWARD_REQUEST_BYTES,
          token: str | None = None, max_inflight_bytes: int = 0) -> RewardService:
    """Serve `plane` over gRPC and the ops app over HTTP (ports 0 = any free port). On failure the
    plane is closed. Build the plane with observe=metrics.observe_batch to export batch metrics.
    max_request_bytes: the largest request either door takes; token: the data token (None: open);
    max_inflight_bytes: what all requests in flight may hold together (0: one largest request's worth)."""
    stopping = threading.Event()

    def ready() -> bool:
        return not stopping.is_set() and plane.ready()

    server: GrpcServer | None = None
    http: HttpServer | None = None
    try:
        budget = budget_for(max_inflight_bytes, max_request_bytes)
        inference = reward_inference(plane, max_request_bytes)
        server = build_server(plane, host=host, port=grpc_port, max_workers=max_workers, metrics=metrics,
                              max_request_bytes=max_request_bytes, inference=inference, token=token, budget=budget)
        grpc_port = server.port
        app = create_ops_app(metrics=metrics, ready=ready,
                             info=lambda: {**plane.info(), "ready": ready(), "grpc_port": grpc_port})
        mount_kserve_http(app, inference, max_body_bytes=max_request_bytes + MESSAGE_MARGIN, token=token)
        http = HttpServer(app, host, http_port, budget=budget)
        server.start()
        http.start()
    except BaseException:
        for part in (http, server):
            if part is not None:
                part.stop(0)
        plane.close()
        raise
    return RewardService(plane, server, http, metrics, stopping, budget)


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set), then shut down gracefully."""
    rewards = [r.strip() for r in args.rewards.split(",") if r.strip()]
    if not rewards:
        raise ValueError("--rewards: list at least one reward")
    metrics = ServiceMetrics("reward")
    plane = RewardDataPlane.build(rewards, args.device, max_batch=args.max_batch, max_delay_ms=args.max_delay_ms,
                                  observe=metrics.observe_batch)
    svc = start(plane, metrics, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                max_workers=args.max_workers, max_request_bytes=args.max_request_bytes,
                token=read_data_token(os.environ), max_inflight_bytes=args.max_inflight_bytes)
    banner = (f"solrl reward: grpc {svc.grpc.address}, http {svc.http.host}:{svc.http.port}, "
              f"rewards {svc.plane.models} on {plane.info()['device']}")
    return serve_until_stopped(stop, banner, svc.stop, log)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("python -m services.reward.server", "solrl reward service", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
