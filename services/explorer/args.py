"""The explorer's command-line options (`solrl serve explorer`, `python -m services.explorer.server`), light:
no grpc, torch or the data plane, so the parser and its help build fast (services.common.args)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from services.common.args import add_consumer_arguments, add_model_arguments
from solrl.config import SELECTIONS

DEFAULT_GRPC_PORT = 8011
DEFAULT_HTTP_PORT = 8091


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The explorer's command-line options (for `solrl serve explorer` too)."""
    add_model_arguments(p, os.environ if environ is None else environ, precision="nvfp4-emu", steps=6,
                        grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    p.add_argument("--kept", type=int, default=None, help="default seeds kept per prompt (k; default: the run's, else 24)")
    p.add_argument("--selection", default=None, choices=SELECTIONS,
                   help="default selection mode (default: the run's, else best_worst)")
    add_consumer_arguments(p, os.environ if environ is None else environ)
