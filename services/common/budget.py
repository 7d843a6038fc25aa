"""One memory budget for all the requests a service holds at once, both doors together.

A per-request limit (--max-request-bytes, services.common.bodies) bounds one request; it does not bound many:
64 gzip bodies of 1.5 MB, each inflating to the limit, raised a reward service's peak by 8.1 GB (issue 58). The
budget bounds their sum: every request takes a `Lease` and charges it with the bytes it holds, as received (the
declared Content-Length up front, else each chunk as it arrives; a gRPC message's size) and as decompressed (a
lease covers the larger of the two: each compressed piece is dropped once inflated; what it inflates to is
charged before it is kept). A charge that does not fit beside the other requests refuses the request at once,
before the bytes are kept: REST 503 with `Retry-After`, gRPC RESOURCE_EXHAUSTED with a `retry-after` trailer
(OverloadedError); one that would not fit the whole budget alone is too large (TooLargeError: 413). The lease
is given back when the request's answer has been sent.

Where it is charged: `BudgetMiddleware` (every HTTP request of a service's app, services.common.ops.HttpServer),
`services.common.bodies.read_body` (what a body decompresses to), the gRPC ErrorInterceptor
(services.common.grpc_server). Written by hand: a counter under a lock; nothing in Starlette, uvicorn or grpcio
bounds the bytes of the requests in flight (uvicorn's `limit_concurrency` counts connections, grpcio's
`maximum_concurrent_rpcs` counts calls).
"""

from __future__ import annotations

import threading
from typing import Any

from services.common.args import MESSAGE_MARGIN
from services.common.errors import OverloadedError, TooLargeError

RETRY_AFTER_S = 1          # what a refused client is told to wait, in seconds (Retry-After / retry-after)
SCOPE_KEY = "solrl.lease"  # where BudgetMiddleware puts the request's lease in the ASGI scope


def budget_for(limit_bytes: int, largest_request: int) -> InflightBudget:
    """A service's budget: `limit_bytes` (--max-inflight-bytes), or with 0 the largest single request a door takes
    plus MESSAGE_MARGIN (that request, or many small ones, at a time)."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"--max-inflight-bytes must be an int >= 0, got {limit_bytes!r}")
    return InflightBudget(limit_bytes or largest_request + MESSAGE_MARGIN)


class InflightBudget:
    """At most `limit_bytes` held by the requests in flight together (Lease)."""

    def __init__(self, limit_bytes: int) -> None:
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 1:
            raise ValueError(f"limit_bytes must be a positive int, got {limit_bytes!r}")
        self.limit = limit_bytes
        self._used = 0
        self.refused = 0      # requests refused since start (for the tests and /v1/info)
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def room(self) -> int:
        """Bytes a request could still take now."""
        return max(0, self.limit - self._used)

    def _take(self, n: int) -> bool:
        with self._lock:
            if self._used + n > self.limit:
                self.refused += 1
                return False
            self._used += n
            return True

    def _give(self, n: int) -> None:
        with self._lock:
            self._used -= n

    def lease(self) -> Lease:
        return Lease(self)


class Lease:
    """What one request holds of a budget: `take` more, `release` all of it (once; idempotent)."""

    def __init__(self, budget: InflightBudget) -> None:
        self.budget, self.held = budget, 0

    def take(self, n: int, what: str = "request") -> None:
        """Charge `n` more bytes; OverloadedError (nothing charged) when they do not fit beside the other
        requests, TooLargeError when they would not fit the whole budget alone."""
        if n <= 0:
            return
        if self.held + n > self.budget.limit:
            raise TooLargeError(f"{what}: {self.held + n} bytes, over the server's budget of {self.budget.limit} "
                                f"bytes for all requests in flight")
        if not self.budget._take(n):
            raise OverloadedError(
                f"{what}: the server holds {self.budget.used} of its {self.budget.limit} bytes for requests in "
                f"flight and cannot take {n} more now; retry after {RETRY_AFTER_S} s")
        self.held += n

    def cover(self, total: int, what: str = "request") -> None:
        """Hold at least `total` bytes in all (take the difference, as `take`)."""
        self.take(total - self.held, what)

    def room(self) -> int:
        """Bytes this request could hold in all now: what it holds and what the budget has left."""
        return self.held + self.budget.room()

    def release(self) -> None:
        held, self.held = self.held, 0
        if held:
            self.budget._give(held)


def scope_lease(scope: dict[str, Any]) -> Lease | None:
    """The lease BudgetMiddleware gave this HTTP request (None: the app runs without a budget)."""
    return scope.get(SCOPE_KEY)


class BudgetMiddleware:
    """ASGI middleware: every HTTP request holds a lease on `budget` until its answer is sent. A declared
    Content-Length is charged before a byte is read (503 + Retry-After at once when it does not fit; one over the
    whole budget is left to the route's own size limit, 413); a body without one is charged chunk by chunk as it
    is received (the route's read then fails with OverloadedError)."""

    def __init__(self, app: Any, budget: InflightBudget) -> None:
        self.app, self.budget = app, budget

    def __getattr__(self, name: str) -> Any:
        # the wrapped app's own attributes (FastAPI's openapi(), routes, state) stay reachable through the middleware
        if name == "app":   # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.app, name)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lease = self.budget.lease()
        scope[SCOPE_KEY] = lease
        try:
            declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
            upfront = declared.isdigit() and int(declared) <= self.budget.limit
            if upfront:
                try:
                    lease.take(int(declared), "request body")
                except OverloadedError as exc:
                    await refuse(send, exc)
                    return

            async def counted() -> dict[str, Any]:
                message = await receive()
                if message["type"] == "http.request":
                    lease.take(len(message.get("body", b"")), "request body")
                return message

            await self.app(scope, receive if upfront else counted, send)
        finally:
            lease.release()


async def refuse(send: Any, exc: OverloadedError) -> None:
    """A 503 with Retry-After for a request the budget cannot take; its body is left unread, so the connection
    is closed after the answer."""
    import json

    body = json.dumps({"error": str(exc)}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def retry_headers() -> dict[str, str]:
    """The headers of a REST refusal (OverloadedError) raised inside a route."""
    return {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
