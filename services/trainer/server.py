"""Trainer service: runs the distributed loop's driver (solrl.distributed) over Redis.

  solrl.trainer.v1.Trainer  Status
  grpc.health.v1.Health, reflection
  HTTP: /healthz /readyz /metrics /v1/info

Run: `python -m services.trainer.server [--preset shapes-sol-rl] [--set key=value ...] [--out runs/x]`
(or `--resume runs/x` to continue a run from its last checkpoint)
The environment gives the defaults: SOLRL_REDIS_URL (the queue), SOLRL_QUEUE_NAMESPACE,
SOLRL_EXPLORER_ADDRS and SOLRL_REGENERATOR_ADDRS (comma-separated gRPC host:port that adapters are
pushed to with LoadAdapter), SOLRL_BIND_HOST / SOLRL_GRPC_PORT / SOLRL_HTTP_PORT; the adapter token
comes only from SOLRL_ADAPTER_TOKEN. The process exits when the run is done (0) or failed (1).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

import solrl
from services.common.adapter_reload import ENV_ADAPTER_TOKEN
from services.common.env import Addresses
from services.common.grpc_server import (
    MAX_GRPC_MESSAGE_SIZE,
    GrpcService,
    build_grpc_server,
    service_name,
)
from services.common.lifecycle import run_main, stop_on_signals
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.common.workers import (
    DEFAULT_NAMESPACE,
    ENV_QUEUE_NAMESPACE,
    ENV_REDIS_URL,
)
from solrl.config import RunConfig, resolve_run
from solrl.distributed import RemoteSession, run_distributed
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2, regenerator_pb2_grpc
from solrl.pb.solrl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from solrl.queue import QueueConfig, build_queue

log = logging.getLogger("solrl.services.trainer")

DEFAULT_GRPC_PORT = 8031
DEFAULT_HTTP_PORT = 8093
ENV_EXPLORER_ADDRS = "SOLRL_EXPLORER_ADDRS"
ENV_REGENERATOR_ADDRS = "SOLRL_REGENERATOR_ADDRS"


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


class AdapterPusher:
    """Pushes an adapter to every explorer and regenerator with the LoadAdapter RPC (bearer token)."""

    def __init__(self, explorers: Sequence[str], regenerators: Sequence[str], token: str | None,
                 timeout_s: float = 120.0) -> None:
        if (explorers or regenerators) and not token:
            raise ValueError(f"{ENV_ADAPTER_TOKEN} must be set to push adapters to the rollout services")
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.timeout_s = float(timeout_s)
        self.explorers, self.regenerators = list(explorers), list(regenerators)
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            options = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                       ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE)]
            self._channels[address] = grpc.insecure_channel(address, options=options)
        return self._channels[address]

    @property
    def targets(self) -> list[tuple[str, Callable, type]]:
        """(address, LoadAdapter stub, request class) per rollout service, `all+` names resolved now,
        so pods added since the last push (a scaled Deployment) get the adapter too."""
        out: list[tuple[str, Callable, type]] = []
        for a in expand_addrs(self.explorers):
            out.append((a, explorer_pb2_grpc.ExplorerStub(self._channel(a)).LoadAdapter, explorer_pb2.LoadAdapterRequest))
        for a in expand_addrs(self.regenerators):
            out.append((a, regenerator_pb2_grpc.RegeneratorStub(self._channel(a)).LoadAdapter,
                        regenerator_pb2.LoadAdapterRequest))
        return out

    def __call__(self, data: bytes, version: int, sha256: str) -> None:
        for address, rpc, request in self.targets:
            try:
                rpc(request(safetensors=data, version=version, sha256=sha256), metadata=self.metadata,
                    timeout=self.timeout_s, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise RuntimeError(f"pushing adapter version {version} to {address}: "
                                   f"{exc.code().name}: {exc.details()}") from None

    def close(self) -> None:
        for c in self._channels.values():
            c.close()


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


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The trainer's command-line options (for `solrl serve trainer` too)."""
    environ = os.environ if environ is None else environ
    addr = Addresses.from_env(environ, grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    p.add_argument("--preset", default=None, help="run preset (default shapes-sol-rl)")
    p.add_argument("--config", default=None, help="a config JSON instead of a preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. rollout.pool=48")
    p.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint (its config.json, plus --set)")
    p.add_argument("--run-id", default="", help="names the run's queue jobs (default: the run directory's name)")
    p.add_argument("--redis-url", default=environ.get(ENV_REDIS_URL, ""), help=f"the work queue (env {ENV_REDIS_URL})")
    p.add_argument("--queue-namespace", "--namespace", dest="namespace",
                   default=environ.get(ENV_QUEUE_NAMESPACE, "") or DEFAULT_NAMESPACE,
                   help=f"queue key namespace, as the rollout services' --queue-namespace (env {ENV_QUEUE_NAMESPACE})")
    p.add_argument("--explorer-addrs", default=environ.get(ENV_EXPLORER_ADDRS, ""),
                   help=f"explorer gRPC addresses, comma-separated (env {ENV_EXPLORER_ADDRS})")
    p.add_argument("--regenerator-addrs", default=environ.get(ENV_REGENERATOR_ADDRS, ""),
                   help=f"regenerator gRPC addresses, comma-separated (env {ENV_REGENERATOR_ADDRS})")
    p.add_argument("--rollout-timeout-s", type=float, default=1800.0,
                   help="how long one epoch waits for its rollouts before failing")
    p.add_argument("--host", default=addr.host, help="bind address (env SOLRL_BIND_HOST)")
    p.add_argument("--grpc-port", type=int, default=addr.grpc_port, help="gRPC port, 0 = any (env SOLRL_GRPC_PORT)")
    p.add_argument("--http-port", type=int, default=addr.http_port, help="ops HTTP port, 0 = any (env SOLRL_HTTP_PORT)")


def run_config(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The run's config and directory: a new run from --preset / --config / --set (--out), or, with
    --resume RUN_DIR, the config saved in RUN_DIR plus --set (as `solrl train --resume`)."""
    return resolve_run(args.preset, args.config, list(args.set or []), args.out, args.resume)


def run(args: argparse.Namespace, stop: threading.Event | None = None,
        environ: Mapping[str, str] | None = None) -> int:
    """Serve Status while the driver runs: 0 when the run finishes (or on SIGTERM / SIGINT), 1 if it fails."""
    environ = os.environ if environ is None else environ
    if not args.redis_url:
        raise ValueError(f"--redis-url (or {ENV_REDIS_URL}) is required")
    cfg, run_dir = run_config(args)
    run_id = args.run_id or run_dir.name.replace(":", "-")
    pusher = AdapterPusher(parse_addrs(args.explorer_addrs, "--explorer-addrs"),
                           parse_addrs(args.regenerator_addrs, "--regenerator-addrs"),
                           environ.get(ENV_ADAPTER_TOKEN) or None)
    queue = build_queue(args.redis_url, QueueConfig(namespace=args.namespace))
    metrics = ServiceMetrics("trainer")
    servicer = TrainerServicer(run_id)
    stop = stop or threading.Event()
    server = build_grpc_server([GrpcService(service_name(trainer_pb2, "Trainer"),
                                            trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                               host=args.host, port=args.grpc_port, metrics=metrics)

    def info() -> dict[str, Any]:
        st = servicer.remote.status if servicer.remote else None
        return {"service": "trainer", "version": solrl.__version__, "run_id": run_id, "run_dir": str(run_dir),
                "grpc_port": server.port, "state": servicer.state(), "epochs": cfg.epochs,
                "epoch": st.epoch if st else 0, "error": st.error if st else "", "history": st.history if st else []}

    http = HttpServer(create_ops_app(metrics=metrics, ready=lambda: not stop.is_set(), info=info),
                      args.host, args.http_port)
    outcome = {"rc": 0}

    def drive() -> None:
        try:
            run_distributed(cfg, run_dir, queue, pusher, run_id=run_id, rollout_timeout_s=args.rollout_timeout_s,
                            log=lambda s: print(f"solrl trainer: {s}", flush=True),
                            on_session=lambda remote: setattr(servicer, "remote", remote),
                            resume=bool(args.resume))
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
              f"{cfg.epochs} epochs", flush=True)
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
