"""The regenerator's command-line options (`solrl serve regenerator`, `python -m services.regenerator.server`),
light: no grpc, torch or the data plane, so the parser and its help build fast (services.common.args)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from services.common.args import add_consumer_arguments, add_model_arguments

DEFAULT_GRPC_PORT = 8021
DEFAULT_HTTP_PORT = 8092


def add_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """The regenerator's command-line options (for `solrl serve regenerator` too)."""
    add_model_arguments(p, os.environ if environ is None else environ, precision="bf16", steps=10,
                        grpc_port=DEFAULT_GRPC_PORT, http_port=DEFAULT_HTTP_PORT)
    add_consumer_arguments(p, os.environ if environ is None else environ)
