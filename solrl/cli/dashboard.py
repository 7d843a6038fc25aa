"""`solrl dashboard`: a run directory's live page (the services' HTTP server, found by name)."""

from __future__ import annotations

import argparse
from pathlib import Path

from solrl.cli.common import missing_services


def cmd_dashboard(a: argparse.Namespace) -> int:
    """Serve RUN_DIR's dashboard until Ctrl-C / SIGTERM (the services' HTTP server, found by name: solrl/plugins.py)."""
    from solrl import plugins

    run_dir = Path(a.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    try:
        serve_dashboard = plugins.load("dashboard")
    except ImportError as err:
        return missing_services(err)
    return serve_dashboard(run_dir, a.host, a.port)


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("dashboard", help="serve the live dashboard of a run directory (reward curves, proxy "
                                         "agreement, stage times, the latest evaluation grid, the config)")
    d.add_argument("run_dir", help="a run directory (solrl train --out, or the trainer service's)")
    d.add_argument("--host", default="127.0.0.1", help="bind address")
    d.add_argument("--port", type=int, default=8094, help="HTTP port (0: any free port)")
    d.set_defaults(fn=cmd_dashboard)

