"""The ops plane of every service: a small FastAPI app (/healthz, /readyz, /metrics, /v1/info) and a
uvicorn runner for it on a socket bound up front (so port 0 works and the bound port is known)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from services.common.budget import BudgetMiddleware, InflightBudget
from services.common.metrics import ServiceMetrics


def create_ops_app(*, metrics: ServiceMetrics, ready: Callable[[], bool],
                   info: Callable[[], dict[str, Any]]) -> FastAPI:
    """/healthz: the process is up; /readyz: 200 when ready() else 503; /metrics: Prometheus text;
    /v1/info: info() as JSON."""
    app = FastAPI(title=f"solrl {metrics.service} ops", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok = bool(ready())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/info")
    def service_info() -> dict[str, Any]:
        return info()

    return app


class NoDelayHTTPProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP/1.1 protocol with TCP_NODELAY on every accepted connection.

    uvicorn writes a response's headers and its body in two sends. With Nagle's algorithm on, the body waits
    until the client acknowledges the headers, and a client on a kept-alive connection delays that
    acknowledgement (40 ms on Linux): every REST answer stalled ~40 ms (issue 58). asyncio sets TCP_NODELAY only
    on sockets whose `proto` is IPPROTO_TCP, which a listening socket from `socket.create_server` (proto 0)
    does not pass on to the sockets it accepts; so it is set here, for every connection, whatever the socket."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class HttpServer:
    """uvicorn serving an app from a background thread; signals stay with the caller. Every connection has
    TCP_NODELAY (NoDelayHTTPProtocol)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 budget: InflightBudget | None = None) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise OSError(f"cannot bind the HTTP server to {host}:{port}: {exc}") from None
        self.host, self.port = host, self._sock.getsockname()[1]
        # with a budget, every request holds a lease on it until answered (services.common.budget)
        served = app if budget is None else BudgetMiddleware(app, budget)
        self._server = uvicorn.Server(uvicorn.Config(served, log_level="warning", access_log=False, lifespan="off",
                                                    http=NoDelayHTTPProtocol))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="ops-http", daemon=True)

    def start(self, timeout: float = 10.0) -> None:
        """Start serving; returns once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()
