"""Signed messages: an HMAC-SHA256 over every message a queue carries, with a key the run's roles share.

`SignedQueue` wraps a `Queue`. `publish` prefixes each payload with a 32-byte tag,
HMAC-SHA256(key, namespace, stream, idempotency key, payload) (each part length-prefixed), and `consume`
returns only deliveries whose tag verifies (tag removed). A delivery that does not verify (no tag, a
wrong one, or a message moved to another stream or given another idempotency key) is acked, so it is
never redelivered, reported to `on_reject(delivery, reason)` and logged as a warning (without the key),
and never returned: the consumer never sees it.

Replay: the tag binds a message to its stream and its idempotency key (the job id, or job id and
kept position of a Rollout), which is unique in a run (job ids name the trainer's attempt and the
epoch). A captured message added again is therefore the same job's result twice, which the consumers
already drop: the trainer keeps one Rollout per (job, position) of the epoch it collects and drops
rollouts of any other job; the workers' `Deduplicator` skips a job id they have processed. Moving a
captured Rollout to another kept position (to have it trained on twice) changes its idempotency key and
fails verification. Messages without an idempotency key are signed too, but nothing binds them to one
use (every pipeline message has a key).

The key is bytes; the services take it from the environment (SOLRL_QUEUE_KEY), never from a flag, and
never print it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable, Sequence

from solrl.queue.base import DeadLetter, Delivery, Queue

TAG_BYTES = 32  # HMAC-SHA256
_DOMAIN = b"solrl-queue-hmac-v1"
MIN_KEY_BYTES = 16

log = logging.getLogger("solrl.queue")

RejectHook = Callable[[Delivery, str], None]


def message_tag(key: bytes, namespace: str, stream: str, idempotency_key: str | None, payload: bytes) -> bytes:
    """HMAC-SHA256 over the domain, namespace, stream, idempotency key ('' for none) and payload, each
    length-prefixed (8 bytes, big-endian) so that no two different tuples hash the same bytes."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (_DOMAIN, namespace.encode(), stream.encode(), (idempotency_key or "").encode(), payload):
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def check_signing_key(key: object, field: str = "key") -> bytes:
    """The key as bytes: a non-empty str (UTF-8) or bytes of at least MIN_KEY_BYTES; ValueError naming
    `field` (never the key) otherwise."""
    if isinstance(key, str):
        key = key.strip().encode()
    if not isinstance(key, bytes):
        raise TypeError(f"{field} must be str or bytes, got {type(key).__name__}")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{field} must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`), "
                         f"got {len(key)}")
    return key


class SignedQueue:
    """A `Queue` whose messages carry an HMAC-SHA256 tag (module doc). `rejected` counts the deliveries
    dropped, by (stream, reason)."""

    def __init__(self, inner: Queue, key: bytes | str, namespace: str, on_reject: RejectHook | None = None) -> None:
        if not isinstance(inner, Queue):
            raise TypeError(f"inner must be a solrl.queue.Queue, got {type(inner).__name__}")
        self.inner, self._key, self.namespace = inner, check_signing_key(key), namespace
        self.on_reject = on_reject
        self.rejected: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:  # never the key
        return f"SignedQueue({self.inner!r}, namespace={self.namespace!r})"

    def _tag(self, stream: str, key: str | None, payload: bytes) -> bytes:
        return message_tag(self._key, self.namespace, stream, key, payload)

    def publish(self, stream: str, payload: bytes, key: str | None = None, timeout_s: float = 0.0) -> str:
        if not isinstance(payload, bytes):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        return self.inner.publish(stream, self._tag(stream, key, payload) + payload, key=key, timeout_s=timeout_s)

    def verify(self, d: Delivery) -> tuple[Delivery | None, str]:
        """(the delivery with its tag removed, "") if its tag verifies, else (None, reason)."""
        if len(d.payload) < TAG_BYTES:
            return None, "unsigned"
        tag, body = d.payload[:TAG_BYTES], d.payload[TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(d.stream, d.key, body)):
            return None, "bad_signature"
        return Delivery(d.stream, d.id, d.key, body, d.deliveries), ""

    def consume(self, stream: str, group: str, consumer: str, count: int = 1, block_ms: int = 0) -> list[Delivery]:
        out, bad = [], []
        for d in self.inner.consume(stream, group, consumer, count=count, block_ms=block_ms):
            ok, reason = self.verify(d)
            if ok is not None:
                out.append(ok)
                continue
            bad.append(d.id)
            self.rejected[(stream, reason)] = self.rejected.get((stream, reason), 0) + 1
            log.warning("dropped message %s of stream %r (idempotency key %r, %d bytes): %s -- not signed with "
                        "this run's queue key (SOLRL_QUEUE_KEY)", d.id, stream, d.key, len(d.payload),
                        "no signature" if reason == "unsigned" else "signature does not verify")
            if self.on_reject is not None:
                self.on_reject(d, reason)
        if bad:
            self.inner.ack(stream, group, bad)   # dropped for good: never redelivered, never dead-lettered
        return out

    def dead_letters(self, stream: str) -> list[DeadLetter]:
        """Dead letters; those whose tag verifies without it, the others as stored."""
        out = []
        for d in self.inner.dead_letters(stream):
            ok, _ = self.verify(d)
            out.append(DeadLetter(d.stream, d.id, d.key, ok.payload, d.deliveries, d.reason) if ok else d)
        return out

    def ensure_group(self, stream: str, group: str) -> None:
        self.inner.ensure_group(stream, group)

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        return self.inner.ack(stream, group, ids)

    def pending(self, stream: str, group: str) -> int:
        return self.inner.pending(stream, group)

    def undelivered(self, stream: str, group: str, ids: Sequence[str]) -> list[str]:
        return self.inner.undelivered(stream, group, ids)

    def length(self, stream: str) -> int:
        return self.inner.length(stream)

    def mark_processed(self, stream: str, group: str, key: str, ttl_s: float) -> None:
        self.inner.mark_processed(stream, group, key, ttl_s)

    def is_processed(self, stream: str, group: str, key: str) -> bool:
        return self.inner.is_processed(stream, group, key)

    def close(self) -> None:
        self.inner.close()
