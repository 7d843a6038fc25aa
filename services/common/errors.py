"""Service-level errors and the one table that maps exceptions to gRPC status codes."""

from __future__ import annotations

import grpc


class NotFoundError(KeyError):
    """A named thing (model, reward, version) that this server does not serve -> NOT_FOUND."""

    def __str__(self) -> str:  # KeyError's str() would repr() the message
        return str(self.args[0]) if self.args else "not found"


class TooLargeError(ValueError):
    """A request (body, message, tensor) over a size limit -> RESOURCE_EXHAUSTED (HTTP 413)."""


class BodyTimeoutError(TimeoutError):
    """A request body that did not arrive within its deadline (a stalled or trickling client) ->
    DEADLINE_EXCEEDED (HTTP 408)."""


class OverloadedError(RuntimeError):
    """The service's budget for the requests in flight cannot take this one now (services.common.budget): a
    transient refusal -> RESOURCE_EXHAUSTED with a retry-after trailer (HTTP 503 with Retry-After)."""


class UnavailableError(RuntimeError):
    """The server cannot take the request now (shutting down, not ready) -> UNAVAILABLE."""


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code of an exception raised by a handler."""
    if isinstance(exc, (TooLargeError, OverloadedError)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, BodyTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, KeyError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The status details for an exception: its message (a bare KeyError's key unquoted)."""
    if type(exc) is KeyError and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return f"not found: {exc.args[0]}"
    return str(exc) or type(exc).__name__
