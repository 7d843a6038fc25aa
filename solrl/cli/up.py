"""`solrl up`: every role as a local process (solrl/deploy/up.py)."""

from __future__ import annotations

import argparse

from solrl.cli.common import missing_services
from solrl.config import ConfigError


def cmd_up(a: argparse.Namespace) -> int:
    from solrl.deploy.up import run

    try:
        return run(a)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start every role as a local process against a Redis URL (Ctrl-C stops all)")
    try:
        from solrl.deploy.up import add_arguments as _up_args

        _up_args(up)
        up.set_defaults(fn=cmd_up)
    except ImportError as err:
        up.set_defaults(fn=lambda a, err=err: missing_services(err))

