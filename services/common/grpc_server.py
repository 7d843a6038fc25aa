"""The gRPC server every service uses: error mapping, metrics, health, reflection, message limits."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.auth import TokenInterceptor
from services.common.budget import RETRY_AFTER_S, InflightBudget
from services.common.errors import OverloadedError, message_for, status_for
from services.common.metrics import ServiceMetrics

log = logging.getLogger(__name__)

# INT32_MAX, as Triton: the server calls builder.SetMaxMessageSize(MAX_GRPC_MESSAGE_SIZE) with
# MAX_GRPC_MESSAGE_SIZE = INT32_MAX (triton-inference-server/core constants.h), and tritonclient.grpc
# sets grpc.max_send/receive_message_length to the same value. Clients and the sending side use it.
MAX_GRPC_MESSAGE_SIZE = 2**31 - 1
# What a server accepts in one request unless its door says more (gRPC's own default, 4 MiB: the trainer's
# Status); the data doors pass theirs (services.common.args, --max-request-bytes). A bigger request is refused
# by gRPC itself with RESOURCE_EXHAUSTED before the handler sees it (and before it is buffered whole).
DEFAULT_MAX_RECEIVE_BYTES = 4 << 20


@dataclass(frozen=True)
class _Undecodable:
    """Stands for a request whose bytes did not parse as the method's message type."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserializer` that returns _Undecodable instead of raising: grpc itself would answer a
    request it cannot parse with INTERNAL ("Exception deserializing request!"), a server fault,
    where the fault is the client's."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's bytes
            return _Undecodable(f"{type(exc).__name__}: {exc}")

    return parse


class ErrorInterceptor(grpc.ServerInterceptor):
    """Maps exceptions from unary handlers to status codes (services.common.errors) and counts RPCs.

    A handler that set a status itself (context.abort / set_code) keeps it. A request whose bytes
    are not the method's message is INVALID_ARGUMENT. Streaming handlers (the health Watch,
    reflection) come from the grpc libraries and pass through unwrapped. With a `budget`
    (services.common.budget), each request message is charged to it for as long as its handler runs: one that
    does not fit is refused before the handler with RESOURCE_EXHAUSTED and a `retry-after` trailer.
    """

    def __init__(self, metrics: ServiceMetrics | None = None, budget: InflightBudget | None = None) -> None:
        self.metrics, self.budget = metrics, budget

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method, behavior = handler_call_details.method, handler.unary_unary

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            t0, code = time.perf_counter(), grpc.StatusCode.OK
            lease = self.budget.lease() if self.budget is not None else None
            try:
                if isinstance(request, _Undecodable):
                    raise TypeError(f"the request is not a valid message for {method}: {request.error}")
                if lease is not None:   # (a method without a deserializer gets the bytes)
                    size = len(request) if isinstance(request, (bytes, bytearray)) else request.ByteSize()
                    lease.take(size, f"{method} request")
                response = behavior(request, context)
                code = context.code() or grpc.StatusCode.OK
                return response
            except Exception as exc:
                if context.code() not in (None, grpc.StatusCode.OK):  # the handler chose its status
                    code = context.code()
                    raise
                code = status_for(exc)
                if isinstance(exc, OverloadedError):
                    context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", method)
                else:
                    log.info("%s -> %s: %s", method, code.name, exc)
                context.abort(code, message_for(exc))
            finally:
                if lease is not None:
                    lease.release()
                if self.metrics is not None:
                    self.metrics.observe_rpc(method, code.name, time.perf_counter() - t0)

        return grpc.unary_unary_rpc_method_handler(wrapped, request_deserializer=_tolerant(handler.request_deserializer),
                                                   response_serializer=handler.response_serializer)


@dataclass(frozen=True)
class GrpcService:
    """One service to register: its full name (for health and reflection), the generated
    `add_<Name>Servicer_to_server` function and the servicer."""

    name: str
    add: Callable[[Any, grpc.Server], None]
    servicer: Any


def service_name(pb2_module: Any, service: str) -> str:
    """Full name of a service declared in a generated *_pb2 module, e.g. 'solrl.reward.v1.Reward'."""
    services = pb2_module.DESCRIPTOR.services_by_name
    if service not in services:
        raise KeyError(f"{pb2_module.__name__} declares no service {service!r}; it has {sorted(services)}")
    return services[service].full_name


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class GrpcServer:
    """A built server: start() marks every service SERVING in grpc.health.v1, stop() drains it."""

    def __init__(self, server: grpc.Server, host: str, port: int, health_servicer: health.HealthServicer,
                 names: Sequence[str]) -> None:
        self.server, self.host, self.port, self.health, self.names = server, host, port, health_servicer, list(names)

    @property
    def address(self) -> str:
        return _address(self.host, self.port)

    def start(self) -> None:
        self.server.start()
        for name in ["", *self.names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING for health checks, then finish in-flight RPCs for up to `grace` seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def build_grpc_server(services: Sequence[GrpcService], *, host: str = "127.0.0.1", port: int = 0,
                      max_workers: int = 16, metrics: ServiceMetrics | None = None,
                      reflect: bool = True, max_receive_bytes: int = DEFAULT_MAX_RECEIVE_BYTES,
                      token: str | None = None, budget: InflightBudget | None = None) -> GrpcServer:
    """A gRPC server with the services, grpc.health.v1 (and reflection), bound to host:port (0 = free port).

    max_workers bounds the RPCs handled at once; batching services need it above the number of
    requests they should be able to batch together. max_receive_bytes bounds one request message
    (RESOURCE_EXHAUSTED above it). token: the data planes' bearer token (services.common.auth; None: open).
    budget: the service's budget for the requests in flight, shared with its REST door (None: unbounded).
    """
    if not services:
        raise ValueError("services must name at least one service")
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
    if not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    if isinstance(max_receive_bytes, bool) or not isinstance(max_receive_bytes, int) \
            or not 1 <= max_receive_bytes <= MAX_GRPC_MESSAGE_SIZE:
        raise ValueError(f"max_receive_bytes must be an int in [1, {MAX_GRPC_MESSAGE_SIZE}], got {max_receive_bytes!r}")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        # the token check inside the error mapping, so refusals are counted in the RPC metrics too
        interceptors=[ErrorInterceptor(metrics, budget), *([TokenInterceptor(token)] if token else [])],
        options=[("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                 ("grpc.max_receive_message_length", max_receive_bytes),
                 # identity only: gRPC core decompresses a gzip / deflate message whole before it compares
                 # its size with the limit above (grpcio 1.81: a 0.5 MB message that inflates to 512 MiB
                 # took the server's peak memory up by 544 MB), so compressed requests are refused unread
                 ("grpc.compression_enabled_algorithms_bitset", 1),
                 # one server per port (Triton's default too): a second bind fails instead of sharing
                 ("grpc.so_reuseport", 0)])
    for s in services:
        s.add(s.servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.name for s in services]
    if reflect:
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = _address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind the gRPC server to {address}: {exc}") from None
    if bound == 0:
        raise OSError(f"cannot bind the gRPC server to {address}")
    return GrpcServer(server, host, bound, health_servicer, names)
