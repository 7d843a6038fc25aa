"""Prometheus metrics of one service, in its own registry (several servers may share a process in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServiceMetrics:
    """gRPC request counts and latencies by method and status code; dynamic-batcher calls by model."""

    def __init__(self, service: str) -> None:
        if not isinstance(service, str) or not service:
            raise ValueError(f"service must be a non-empty string, got {service!r}")
        self.service = service
        self.registry = CollectorRegistry()
        self.requests = Counter("solrl_grpc_requests", "gRPC requests handled, by method and status code",
                                ["service", "method", "code"], registry=self.registry)
        self.latency = Histogram("solrl_grpc_request_seconds", "gRPC request handling time",
                                 ["service", "method"], registry=self.registry)
        self.batch_calls = Counter("solrl_batch_calls", "Calls of a batched model function",
                                   ["service", "model"], registry=self.registry)
        self.batch_requests = Counter("solrl_batch_requests", "Requests served by batched calls",
                                      ["service", "model"], registry=self.registry)
        self.batch_items = Histogram("solrl_batch_items", "Items (e.g. images) per batched call",
                                     ["service", "model"], buckets=_BATCH_BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram("solrl_batch_seconds", "Time of one batched call",
                                       ["service", "model"], registry=self.registry)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(self.service, method, code).inc()
        self.latency.labels(self.service, method).observe(seconds)

    def observe_batch(self, model: str, requests: int, items: int, seconds: float) -> None:
        self.batch_calls.labels(self.service, model).inc()
        self.batch_requests.labels(self.service, model).inc(requests)
        self.batch_items.labels(self.service, model).observe(items)
        self.batch_seconds.labels(self.service, model).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
