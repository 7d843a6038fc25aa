"""The trainer's command-line options (`solrl serve trainer`, `python -m services.trainer.server`), light:
no grpc, fastapi, torch or the driver, so the parser and its help build fast (services.common.args)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from services.common.args import DEFAULT_NAMESPACE, add_inflight_limit
from services.common.env import (
    ENV_QUEUE_NAMESPACE,
    ENV_REDIS_URL,
    Addresses,
    add_address_arguments,
    add_run_arguments,
)

DEFAULT_GRPC_PORT = 8031
DEFAULT_HTTP_PORT = 8093
ENV_EXPLORER_ADDRS = "SOLRL_EXPLORER_ADDRS"
ENV_REGENERATOR_ADDRS = "SOLRL_REGENERATOR_ADDRS"


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The trainer's command-line options (for `solrl serve trainer` too)."""
    environ = os.environ if environ is None else environ
    addr = Addresses.from_env(environ, grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    add_run_arguments(p, environ, "trainer")
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
    p.add_argument("--pickup-timeout-s", type=float, default=120.0,
                   help="fail the epoch, naming its jobs, when no explorer takes any of them this long")
    p.add_argument("--workers-timeout-s", type=float, default=600.0,
                   help="how long to wait at start for every rollout service to answer Info")
    add_inflight_limit(p)
    add_address_arguments(p, addr)
