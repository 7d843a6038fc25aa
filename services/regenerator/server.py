"""Regenerator service: solrl.regenerator.v1 over one RegeneratorDataPlane, plus the ops app with hot reload.

  solrl.regenerator.v1.Regenerator  Regenerate, Info, LoadAdapter
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info, PUT|GET /v1/adapter (hot reload)

Run: `python -m services.regenerator.server [--model shapes] [--precision bf16] [--reward shapes]`
(SOLRL_BIND_HOST, SOLRL_GRPC_PORT, SOLRL_HTTP_PORT, SOLRL_REWARD_ADDR give defaults; the adapter
token comes only from SOLRL_ADAPTER_TOKEN, the optional data token Regenerate then requires, and the reward
client sends, only from SOLRL_DATA_TOKEN). The serving plumbing and the options it shares with
the explorer live in services.rollout.shell and services.rollout.plane.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Mapping, Sequence

import grpc

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
from services.common.tensors import numpy_to_tensor, torch_to_tensor
from services.regenerator.args import (  # noqa: F401 (the options live there, light; re-exported here)
    DEFAULT_GRPC_PORT,
    DEFAULT_HTTP_PORT,
    add_arguments,
)
from services.regenerator.consumer import regenerator_worker
from services.regenerator.dataplane import RegeneratorDataPlane
from services.rollout.adapter_endpoint import AdapterEndpoint
from services.rollout.plane import resolve_sampler, sde_rollout_fields
from services.rollout.shell import RolloutRPCs, RolloutService, run_rollout_role, serve
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2, regenerator_pb2_grpc
from solrl.precision import PrecisionConfig

FIELDS = {"prompt": "selection.prompt", "seeds": "selection.seeds", "steps": "selection.sampler.steps",
          "min_version": "selection.adapter_version.version"}


class RegeneratorServicer(RolloutRPCs, regenerator_pb2_grpc.RegeneratorServicer):
    """solrl.regenerator.v1.Regenerator over the data plane."""

    def __init__(self, plane: RegeneratorDataPlane, adapters: AdapterEndpoint) -> None:
        self.plane, self.adapters = plane, adapters

    def Regenerate(self, request: regenerator_pb2.RegenerateRequest,
                   context: grpc.ServicerContext) -> regenerator_pb2.RegenerateResponse:
        if not request.HasField("selection"):
            raise ValueError("selection: required")
        sel = request.selection
        if sel.proxy_scores and len(sel.proxy_scores) != len(sel.seeds):
            raise ValueError(f"selection.proxy_scores: {len(sel.proxy_scores)} scores for {len(sel.seeds)} seeds")
        kept = list(sel.kept_indices) or list(range(len(sel.seeds)))
        for j, i in enumerate(kept):
            if not 0 <= i < len(sel.seeds):
                raise ValueError(f"selection.kept_indices[{j}]: {i} is not an index into selection.seeds "
                                 f"({len(sel.seeds)} seeds)")
        sampler = resolve_sampler(self.plane.sampler, sel.sampler.solver, sel.sampler.shift, sel.sampler.guidance,
                                  field="selection.sampler", sde_eta=sel.sampler.sde_eta)
        out = self.plane.regenerate(sel.prompt, [sel.seeds[i] for i in kept], steps=sel.sampler.steps or None,
                                    sampler=sampler, min_version=sel.adapter_version.version, fields=FIELDS)
        version = common_pb2.AdapterVersion(version=out.version, sha256=out.sha256)
        rollouts = [common_pb2.Rollout(job_id=sel.job_id, prompt=sel.prompt, seed=seed, x0=torch_to_tensor(x0),
                                       reward=float(reward), adapter_version=version,
                                       proxy_reward=sel.proxy_scores[i] if sel.proxy_scores else 0.0,
                                       explore_adapter_version=sel.adapter_version if sel.HasField("adapter_version")
                                       else None, gate=sel.gate, gate_failed=sel.gate_failed,
                                       **sde_rollout_fields(out, j, sampler))
                    for j, (i, seed, x0, reward) in enumerate(zip(kept, out.seeds, out.x0, out.rewards))]
        response = regenerator_pb2.RegenerateResponse(rollouts=rollouts)
        if request.return_images:
            response.images.CopyFrom(numpy_to_tensor(out.images))
        return response


def build_server(plane: RegeneratorDataPlane, adapters: AdapterEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 max_workers: int = 16, metrics: ServiceMetrics | None = None,
                 max_request_bytes: int = DEFAULT_MAX_ROLLOUT_REQUEST_BYTES, token: str | None = None,
                 budget: InflightBudget | None = None) -> GrpcServer:
    """The regenerator gRPC server (not started): Regenerator + health + reflection. It receives a request of up
    to max_request_bytes, or an adapter push of up to the endpoint's max_bytes; token: the data token (None: open)."""
    return build_grpc_server(
        [GrpcService(service_name(regenerator_pb2, "Regenerator"),
                     regenerator_pb2_grpc.add_RegeneratorServicer_to_server, RegeneratorServicer(plane, adapters))],
        host=host, port=port, max_workers=max_workers, metrics=metrics, token=token, budget=budget,
        max_receive_bytes=max(max_request_bytes, adapters.max_bytes) + MESSAGE_MARGIN)


def start(plane: RegeneratorDataPlane, metrics: ServiceMetrics, *, host: str = "127.0.0.1", grpc_port: int = 0,
          http_port: int = 0, max_workers: int = 16, adapter_token: str | None = None,
          max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
          max_request_bytes: int = DEFAULT_MAX_ROLLOUT_REQUEST_BYTES, data_token: str | None = None,
          max_inflight_bytes: int = 0) -> RolloutService:
    """Serve `plane` over gRPC and the ops app over HTTP (ports 0 = any free port).

    adapter_token: the bearer token hot reload needs (None: pushes are refused with 403); data_token: the one
    Regenerate and Info need (None: open); max_request_bytes: the largest request they take."""
    return serve(plane, plane.hot, metrics,
                 lambda adapters, budget: build_server(plane, adapters, budget=budget, host=host, port=grpc_port,
                                                       max_workers=max_workers,
                                                       metrics=metrics, max_request_bytes=max_request_bytes, token=data_token),
                 host=host, http_port=http_port, adapter_token=adapter_token, max_adapter_bytes=max_adapter_bytes,
                 max_request_bytes=max_request_bytes, max_inflight_bytes=max_inflight_bytes)


def run(args: argparse.Namespace, stop: threading.Event | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Serve until SIGTERM / SIGINT (or until `stop` is set)."""
    return run_rollout_role("regenerator", args, stop, environ, start, lambda model, lora, scorer: RegeneratorDataPlane(
        model, PrecisionConfig(args.precision), lora, scorer, steps=args.steps, micro_batch=args.micro_batch,
        version_wait_s=args.version_wait_s), regenerator_worker)


def main(argv: Sequence[str] | None = None) -> int:
    return run_main("python -m services.regenerator.server", "solrl regenerator service", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
