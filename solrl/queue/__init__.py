"""The work queue between roles: Redis Streams (services, cluster) or an in-memory twin (embedded).

This package is the only part of `solrl` that imports redis, and only when a Redis queue is built or
`RedisStreamQueue` is asked for: a process that merely reads the queue's settings (`QueueConfig`, e.g. the
reward service in its own hpsv3 environment, which has no redis) imports no redis client. Payloads are opaque bytes (serialized
protobuf messages); see `solrl.queue.base` for the semantics both implementations share.
"""

from __future__ import annotations

from solrl.queue.base import (
    DeadLetter,
    Deduplicator,
    Delivery,
    Queue,
    QueueAuthError,
    QueueConfig,
    QueueFull,
    QueueUnavailable,
    redact_url,
)
from solrl.queue.memory import InMemoryQueue
from solrl.queue.signing import RejectHook, SignedQueue, check_signing_key, message_tag

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def build_queue(url: str | None, cfg: QueueConfig = QueueConfig(), *, password: str | None = None,
                signing_key: bytes | str | None = None, on_reject: RejectHook | None = None) -> Queue:
    """None or "memory://" -> InMemoryQueue; "redis://", "rediss://" or "unix://" -> RedisStreamQueue.

    password: the Redis password (AUTH), for a URL without one; the user is the URL's
    (redis://trainer@redis:6379/0), else Redis' `default`. The services take it from env SOLRL_REDIS_PASSWORD
    so that the URL they log and pass around holds no secret.
    signing_key: wrap the queue in a `SignedQueue` (HMAC-SHA256 on every message, verified on consume;
    `on_reject(delivery, reason)` hears of each message dropped); None: messages as they are.
    """
    if url is None or url == "memory://":
        if password:
            raise ValueError("password is for a redis URL; the in-memory queue has none")
        queue: Queue = InMemoryQueue(cfg)
    elif isinstance(url, str) and url.startswith(_REDIS_SCHEMES):
        from solrl.queue.redis_streams import RedisStreamQueue

        queue = RedisStreamQueue(url, cfg, password=password)
    else:
        raise ValueError(f"url must be None, 'memory://' or a redis URL ({', '.join(_REDIS_SCHEMES)}...), "
                         f"got {redact_url(url)!r}")
    if signing_key is None:
        return queue
    return SignedQueue(queue, signing_key, cfg.namespace, on_reject)


def __getattr__(name: str):
    # RedisStreamQueue on first use (PEP 562), so that importing this package needs no redis client
    if name == "RedisStreamQueue":
        from solrl.queue.redis_streams import RedisStreamQueue

        return RedisStreamQueue
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DeadLetter",
    "Deduplicator",
    "Delivery",
    "InMemoryQueue",
    "Queue",
    "QueueAuthError",
    "QueueConfig",
    "QueueFull",
    "QueueUnavailable",
    "RedisStreamQueue",
    "SignedQueue",
    "build_queue",
    "check_signing_key",
    "message_tag",
    "redact_url",
]
