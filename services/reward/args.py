"""The reward service's command-line options (`solrl serve reward`, `python -m services.reward.server`), light:
no grpc, tritonclient or the scorers, so the parser and its help build fast."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from services.common.args import DEFAULT_MAX_REWARD_REQUEST_BYTES, add_request_limit
from services.common.env import Addresses, add_address_arguments

DEFAULT_GRPC_PORT = 8001  # Triton's gRPC port
DEFAULT_HTTP_PORT = 8080
DEFAULT_REWARDS = ("shapes", "shapes_dense", "jpeg_compressibility")   # need no weights


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The reward service's command-line options (for `solrl serve reward` too)."""
    addr = Addresses.from_env(os.environ if environ is None else environ,
                              grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    p.add_argument("--rewards", default=",".join(DEFAULT_REWARDS),
                   help="comma-separated rewards to serve; start-up fails naming any that cannot be built "
                        f"(default: {','.join(DEFAULT_REWARDS)}, the ones that need no weights)")
    p.add_argument("--device", default="",
                   help="torch device of the scorers' models, e.g. cuda (default: CUDA where present, else the CPU)")
    add_address_arguments(p, addr)
    p.add_argument("--max-batch", type=int, default=64, help="images per scorer call")
    p.add_argument("--max-delay-ms", type=float, default=5.0, help="how long a request waits for others to batch with")
    p.add_argument("--max-workers", type=int, default=16, help="gRPC handler threads (RPCs in flight)")
    add_request_limit(p, DEFAULT_MAX_REWARD_REQUEST_BYTES)
