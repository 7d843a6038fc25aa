"""The work queue between roles: Redis Streams (services, cluster) or an in-memory twin (embedded).

This package is the only part of `solrl` that imports redis. Payloads are opaque bytes (serialized
protobuf messages); see `solrl.queue.base` for the semantics both implementations share.
"""

from __future__ import annotations

from solrl.queue.base import (
    DeadLetter,
    Deduplicator,
    Delivery,
    Queue,
    QueueConfig,
    QueueFull,
    QueueUnavailable,
    redact_url,
)
from solrl.queue.memory import InMemoryQueue
from solrl.queue.redis_streams import RedisStreamQueue

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def build_queue(url: str | None, cfg: QueueConfig = QueueConfig()) -> Queue:
    """None or "memory://" -> InMemoryQueue; "redis://", "rediss://" or "unix://" -> RedisStreamQueue."""
    if url is None or url == "memory://":
        return InMemoryQueue(cfg)
    if isinstance(url, str) and url.startswith(_REDIS_SCHEMES):
        return RedisStreamQueue(url, cfg)
    raise ValueError(f"url must be None, 'memory://' or a redis URL ({', '.join(_REDIS_SCHEMES)}...), "
                     f"got {redact_url(url)!r}")


__all__ = [
    "DeadLetter",
    "Deduplicator",
    "Delivery",
    "InMemoryQueue",
    "Queue",
    "QueueConfig",
    "QueueFull",
    "QueueUnavailable",
    "RedisStreamQueue",
    "build_queue",
    "redact_url",
]
