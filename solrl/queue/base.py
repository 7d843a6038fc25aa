"""The work-queue contract shared by the Redis Streams queue and its in-memory twin.

Semantics (both implementations):

- A stream holds opaque `bytes` payloads, each with an optional idempotency `key`. Consumer groups
  each receive every message; inside a group each message goes to one consumer at a time.
- `ensure_group` creates a group that starts at the beginning of the stream, so jobs published
  before the workers started are not lost. Create groups before publishing: an entry acked by every
  group that exists at the time is deleted, and a group created later does not see it.
- An entry is deleted as soon as every group has acked it, so `length(stream)` is exactly the number
  of entries some group has not acked yet (unread + in flight). `publish` refuses to grow it past
  `maxlen` (back-pressure): it waits up to `timeout_s` for acks, then raises `QueueFull`.
- `consume` first reclaims entries delivered to any consumer of the group and left un-acked for
  `claim_idle_ms` (the worker is presumed dead), then reads new ones. A message is delivered at most
  `max_deliveries` times; the next reclaim moves it to the dead-letter stream (with the reason and
  its delivery count) and acks it instead of delivering it.
- Delivery is at-least-once; `Deduplicator` skips a redelivered job whose result was already
  published, which makes it effectively exactly-once at the consumer.
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

_ID_RE = re.compile(r"^(\d+)-(\d+)$")


class QueueFull(RuntimeError):
    """`publish` found the stream at `maxlen` un-acked entries for the whole of its timeout."""


class QueueAuthError(PermissionError):
    """The queue's server refused the credentials (wrong user or password), or the user may not run a
    command on a key (an ACL user of another role). Never retried; the message names the URL redacted."""


class QueueUnavailable(ConnectionError):
    """The queue's server could not be reached within the configured reconnect budget."""


@dataclass(frozen=True)
class QueueConfig:
    namespace: str = "solrl:default"  # keys: f"{namespace}:{stream}", dead letters f"{namespace}:{stream}:dead"
    maxlen: int = 10_000              # back-pressure bound on a stream's un-acked entries (unread + pending)
    max_deliveries: int = 5           # a message is delivered at most this often, then dead-lettered
    claim_idle_ms: int = 30_000       # a delivered, un-acked message idle this long may be reclaimed
    retry_backoff_s: float = 0.05     # Redis reconnects: first wait, doubling ...
    retry_backoff_cap_s: float = 2.0  # ... up to this ...
    retry_give_up_s: float = 30.0     # ... until this long has passed since the call started

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError(f"namespace must be a non-empty str, got {self.namespace!r}")
        for name in ("maxlen", "max_deliveries", "claim_idle_ms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("retry_backoff_s", "retry_backoff_cap_s", "retry_give_up_s"):
            check_seconds(getattr(self, name), name, positive=True)


@dataclass(frozen=True)
class Delivery:
    stream: str
    id: str               # the entry's id in its stream ("<ms>-<seq>"), what `ack` takes
    key: str | None       # the publisher's idempotency key
    payload: bytes
    deliveries: int       # how many times this message has been delivered, this one included


@dataclass(frozen=True)
class DeadLetter(Delivery):
    """A message moved to the dead-letter stream; `id` is its id in the original stream."""

    reason: str


@runtime_checkable
class Queue(Protocol):
    """Both implementations have identical semantics (see the module docstring)."""

    def ensure_group(self, stream: str, group: str) -> None:
        """Create the consumer group (and the stream) if missing; idempotent."""

    def publish(self, stream: str, payload: bytes, key: str | None = None, timeout_s: float = 0.0) -> str:
        """Append a message and return its id; waits up to `timeout_s` while the stream is full."""

    def consume(self, stream: str, group: str, consumer: str, count: int = 1, block_ms: int = 0) -> list[Delivery]:
        """Up to `count` messages: reclaimed idle ones first, then new ones.

        block_ms = 0 returns at once; block_ms > 0 waits up to that long for at least one message.
        """

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        """Acknowledge messages for `group`; returns how many were pending. Deletes fully acked entries."""

    def pending(self, stream: str, group: str) -> int:
        """Messages delivered to `group` and not acked yet."""

    def undelivered(self, stream: str, group: str, ids: Sequence[str]) -> list[str]:
        """Those of `ids` (as `publish` returned them) that `group` has not yet delivered to any consumer."""

    def length(self, stream: str) -> int:
        """Entries not yet acked by every group (what back-pressure bounds)."""

    def dead_letters(self, stream: str) -> list[DeadLetter]:
        """The stream's dead letters, oldest first (the newest `maxlen` are kept)."""

    def mark_processed(self, stream: str, group: str, key: str, ttl_s: float) -> None:
        """Remember for `ttl_s` seconds that `group` has processed the job with idempotency `key`."""

    def is_processed(self, stream: str, group: str, key: str) -> bool:
        """Whether `mark_processed` recorded `key` for `group` within its TTL."""

    def close(self) -> None:
        """Release resources; later calls raise RuntimeError."""


class Deduplicator:
    """Consumer-side idempotency for one group: at-least-once delivery, effectively exactly-once work.

    Worker loop: `if dedup.skip(d): continue`, process, publish the result, `dedup.done(d)`.
    A job redelivered after its result was published (the worker died before its ack) is skipped.
    Messages without a key are never skipped.
    """

    def __init__(self, queue: Queue, group: str, ttl_s: float = 86_400.0) -> None:
        check_name(group, "group")
        check_seconds(ttl_s, "ttl_s", positive=True)
        self.queue, self.group, self.ttl_s = queue, group, float(ttl_s)

    def skip(self, delivery: Delivery) -> bool:
        """True, and the delivery acked, if its key was already processed by this group."""
        if delivery.key is None or not self.queue.is_processed(delivery.stream, self.group, delivery.key):
            return False
        self.queue.ack(delivery.stream, self.group, [delivery.id])
        return True

    def done(self, delivery: Delivery) -> None:
        """Record the delivery's key as processed, then ack it (call once its result is published)."""
        if delivery.key is not None:
            self.queue.mark_processed(delivery.stream, self.group, delivery.key, self.ttl_s)
        self.queue.ack(delivery.stream, self.group, [delivery.id])


# Argument checks shared by the implementations, so that both reject bad input the same way.


def check_name(value: object, arg: str) -> None:
    """Stream and group names: non-empty str without ':' (which separates key parts in Redis)."""
    if not isinstance(value, str) or not value or ":" in value:
        raise ValueError(f"{arg} must be a non-empty str without ':', got {value!r}")


def check_publish(stream: str, payload: bytes, key: str | None, timeout_s: float) -> None:
    check_name(stream, "stream")
    if not isinstance(payload, bytes):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    if key is not None and (not isinstance(key, str) or not key):
        raise ValueError(f"key must be None or a non-empty str, got {key!r}")
    check_seconds(timeout_s, "timeout_s")


def check_key(stream: str, group: str, key: str) -> None:
    check_name(stream, "stream")
    check_name(group, "group")
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty str, got {key!r}")


def check_consume(stream: str, group: str, consumer: str, count: int, block_ms: int) -> None:
    check_name(stream, "stream")
    check_name(group, "group")
    if not isinstance(consumer, str) or not consumer:
        raise ValueError(f"consumer must be a non-empty str, got {consumer!r}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    if not isinstance(block_ms, int) or isinstance(block_ms, bool) or block_ms < 0:
        raise ValueError(f"block_ms must be an int >= 0, got {block_ms!r}")


def check_seconds(value: float, arg: str, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value < math.inf
    if not (ok and (value > 0 if positive else value >= 0)):
        raise ValueError(f"{arg} must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def parse_ids(ids: Sequence[str]) -> list[tuple[int, int]]:
    """Stream ids "<ms>-<seq>" as sortable (ms, seq) pairs."""
    if isinstance(ids, (str, bytes)):
        raise TypeError("ids must be a sequence of id strings, not a single str")
    parsed = []
    for i in ids:
        match = _ID_RE.match(i) if isinstance(i, str) else None
        if match is None:
            raise ValueError(f"ids must be stream ids like '1700000000000-0', got {i!r}")
        parsed.append((int(match[1]), int(match[2])))
    return parsed


def dead_letter_reason(max_deliveries: int) -> str:
    return f"not acked after {max_deliveries} deliveries (max_deliveries={max_deliveries})"


def full_message(stream: str, maxlen: int, timeout_s: float) -> str:
    return f"stream {stream!r} holds >= maxlen={maxlen} un-acked entries; still full after {timeout_s}s"


def no_group(stream: str, group: str) -> ValueError:
    return ValueError(f"group {group!r} does not exist on stream {stream!r}; call ensure_group first")


def redact_url(url: str) -> str:
    """`url` with its password replaced by '***' (redis://user:secret@host -> redis://user:***@host), for
    anything printed, logged or raised; a URL without a password comes back unchanged."""
    if not isinstance(url, str) or "@" not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
