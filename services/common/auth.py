"""The optional bearer token of the data planes (env SOLRL_DATA_TOKEN): explore, regenerate and reward, over
gRPC and the KServe REST door. Unset (local use): the doors are open, as before. Set: every call needs
`authorization: Bearer <token>` (compared in constant time), except what probes and the adapter pushes need:

  gRPC   grpc.health.v1 and reflection stay open (kubelet gRPC probes, grpcurl); LoadAdapter checks the
         adapter token (SOLRL_ADAPTER_TOKEN) itself. Anything else without the token: UNAUTHENTICATED.
  HTTP   /v2/... needs it except /v2/health/* (kubelet HTTP probes): 401 {"error": ...}. The ops routes
         (/healthz, /readyz, /metrics, /v1/info) and /v1/adapter (its own token) are not data plane.

Clients (the rollout services' reward client, the trainer's Info calls) send `metadata(token)`. The token
is read from the environment only (never a flag: `ps` shows those) and never logged.
Written by hand: grpc has no token interceptor, and Starlette's AuthenticationMiddleware rejects nothing
by itself (it needs `requires` on every route).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.env import ENV_DATA_TOKEN, secret

# gRPC methods open without the data token: probes, reflection, and the adapter pushes (their own token)
OPEN_GRPC = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_GRPC_SUFFIX = "/LoadAdapter"


def read_data_token(environ: Mapping[str, str]) -> str | None:
    """The data planes' token from `environ` (SOLRL_DATA_TOKEN), None when unset or empty."""
    return secret(environ, ENV_DATA_TOKEN)


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata that carries `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer_token(value: str | None) -> str | None:
    """The token of an 'Authorization: Bearer <token>' value (None if absent or another scheme)."""
    if not value:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def refusal(authorization: str | None, token: bytes) -> str | None:
    """Why the Authorization value does not carry `token` (compared in constant time); None when it does."""
    given = bearer_token(authorization)
    if given is None:
        return "missing bearer token (Authorization: Bearer <token>)"
    return None if hmac.compare_digest(given.encode(), token) else "invalid bearer token"


def authorized(authorization: str | None, token: bytes) -> bool:
    """Whether the Authorization value carries `token` (constant-time comparison)."""
    return refusal(authorization, token) is None


def _secret(token: str) -> bytes:
    """A server's token, checked and encoded once for the comparisons of every call."""
    if not isinstance(token, str) or not token:
        raise ValueError("token must be a non-empty str")
    return token.encode()


_HANDLERS = {"unary_unary": grpc.unary_unary_rpc_method_handler, "unary_stream": grpc.unary_stream_rpc_method_handler,
             "stream_unary": grpc.stream_unary_rpc_method_handler,
             "stream_stream": grpc.stream_stream_rpc_method_handler}


class TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED for any call without the token, but those of OPEN_GRPC (and LoadAdapter)."""

    def __init__(self, token: str) -> None:
        self._token = _secret(token)

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_GRPC) or method.endswith(OPEN_GRPC_SUFFIX):
            return handler
        authorization = next((v for k, v in handler_call_details.invocation_metadata or ()
                              if k == "authorization" and isinstance(v, str)), None)
        why = refusal(authorization, self._token)
        if why is None:
            return handler

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        kind = next(k for k in _HANDLERS if getattr(handler, k) is not None)
        return _HANDLERS[kind](refuse)


class TokenMiddleware:
    """ASGI middleware: 401 {"error": ...} for an HTTP request under `prefix` (but not under `open_prefix`)
    without the token, before the route reads a byte of its body."""

    def __init__(self, app: ASGIApp, token: str, prefix: str = "/v2", open_prefix: str = "/v2/health/") -> None:
        self.app, self._token, self.prefix, self.open_prefix = app, _secret(token), prefix, open_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path.startswith(self.prefix) and not path.startswith(self.open_prefix):
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            why = refusal(authorization, self._token)
            if why is not None:
                response = JSONResponse({"error": why}, status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
