"""Process lifecycle shared by every service shell: signal handling, the serve loop, `main()`."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from services.common.budget import InflightBudget
from services.common.grpc_server import GrpcServer
from services.common.logs import configure_logging
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer


@dataclass
class RunningService:
    """A started service: its data plane, gRPC server and ops HTTP server, and the budget both doors share."""

    plane: Any
    grpc: GrpcServer
    http: HttpServer
    metrics: ServiceMetrics
    stopping: threading.Event
    budget: InflightBudget | None = None

    def stop(self, grace: float = 5.0) -> None:
        """Not ready, NOT_SERVING, drain in-flight RPCs, then close the plane and the HTTP server."""
        self.stopping.set()
        self.grpc.stop(grace)
        self.plane.close()
        self.http.stop()


@contextmanager
def stop_on_signals(stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """An event set by SIGTERM / SIGINT (handlers only on the main thread) or by the caller; the
    previous handlers come back on exit."""
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_until_stopped(stop: threading.Event | None, banner: str, shutdown: Callable[[], None],
                        log: logging.Logger) -> int:
    """Print `banner`, wait for a signal (or `stop`), then `shutdown()` gracefully."""
    with stop_on_signals(stop) as event:
        print(banner, flush=True)
        while not event.wait(0.5):
            pass
        log.info("shutting down")
        shutdown()
    return 0


def run_main(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """The `python -m services.<role>.server` entry point."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        configure_logging()
    except ValueError as err:
        p.error(str(err))
    return run(args)


def serve_dashboard(run_dir, host: str, port: int) -> int:
    """`solrl dashboard RUN_DIR`: serve the run's live page until Ctrl-C / SIGTERM; the page re-reads the directory
    while a run writes it."""
    from solrl.dashboard import create_app

    http = HttpServer(create_app(run_dir), host, port)
    stop = threading.Event()
    with stop_on_signals(stop):
        http.start()
        print(f"solrl dashboard: http://{http.host}:{http.port}/dashboard  ({run_dir})", flush=True)
        while not stop.wait(0.5):
            pass
        http.stop()
    return 0
