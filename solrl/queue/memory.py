"""In-memory twin of the Redis Streams queue, for the embedded (one-process) mode and for tests.

Hand-written: it mirrors the subset of Redis Streams the queue uses (entry ids "<ms>-<seq>", one
pending-entries list per group with delivery counts and times, XAUTOCLAIM-style idle reclaim), with
the same back-pressure and dead-letter rules as `RedisStreamQueue`. Thread-safe: one lock, and a
condition that wakes blocked `consume` / `publish` calls.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from solrl.queue.base import (
    DeadLetter,
    Delivery,
    QueueConfig,
    QueueFull,
    check_consume,
    check_key,
    check_name,
    check_publish,
    check_seconds,
    dead_letter_reason,
    full_message,
    no_group,
    parse_ids,
)

Id = tuple[int, int]  # (ms, seq), ordered like Redis stream ids


@dataclass
class _Pending:
    consumer: str
    delivered_at: float  # clock() seconds
    deliveries: int


@dataclass
class _Group:
    last_delivered: Id = (0, 0)
    pel: dict[Id, _Pending] = field(default_factory=dict)


@dataclass
class _Stream:
    dead: collections.deque[DeadLetter]
    entries: dict[Id, tuple[str | None, bytes]] = field(default_factory=dict)  # insertion = id order
    groups: dict[str, _Group] = field(default_factory=dict)
    last_id: Id = (0, 0)

    def next_id(self) -> Id:
        """Like Redis' "*": wall-clock ms, a sequence number within the ms, never going back."""
        ms = int(time.time() * 1000)
        return (ms, 0) if ms > self.last_id[0] else (self.last_id[0], self.last_id[1] + 1)


def _fmt(i: Id) -> str:
    return f"{i[0]}-{i[1]}"


class InMemoryQueue:
    """`Queue` held in this process. `clock` (seconds) times idleness and dedup TTLs; `block_ms` and
    `timeout_s` are waited in real time."""

    def __init__(self, cfg: QueueConfig = QueueConfig(), clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(cfg, QueueConfig):
            raise TypeError(f"cfg must be a QueueConfig, got {type(cfg).__name__}")
        self.cfg, self._clock = cfg, clock
        self._cond = threading.Condition()
        self._streams: dict[str, _Stream] = {}
        self._processed: dict[tuple[str, str, str], float] = {}  # (stream, group, key) -> expiry (clock s)
        self._closed = False

    def ensure_group(self, stream: str, group: str) -> None:
        check_name(stream, "stream")
        check_name(group, "group")
        with self._cond:
            self._check_open()
            self._stream(stream).groups.setdefault(group, _Group())

    def publish(self, stream: str, payload: bytes, key: str | None = None, timeout_s: float = 0.0) -> str:
        check_publish(stream, payload, key, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_open()
                s = self._stream(stream)
                if len(s.entries) < self.cfg.maxlen:
                    s.last_id = s.next_id()
                    s.entries[s.last_id] = (key, payload)
                    self._cond.notify_all()
                    return _fmt(s.last_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueFull(full_message(stream, self.cfg.maxlen, timeout_s))
                self._cond.wait(remaining)

    def consume(self, stream: str, group: str, consumer: str, count: int = 1, block_ms: int = 0) -> list[Delivery]:
        check_consume(stream, group, consumer, count, block_ms)
        deadline = time.monotonic() + block_ms / 1000
        with self._cond:
            while True:
                self._check_open()
                s, g = self._group(stream, group)
                out = self._reclaim(stream, s, g, consumer, count)
                out += self._read_new(stream, s, g, consumer, count - len(out))
                remaining = deadline - time.monotonic()
                if out or remaining <= 0:
                    return out
                # Wake at least every claim_idle_ms, as the Redis queue does, to reclaim in between.
                self._cond.wait(min(remaining, self.cfg.claim_idle_ms / 1000))

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        check_name(stream, "stream")
        check_name(group, "group")
        parsed = parse_ids(ids)
        with self._cond:
            self._check_open()
            s, g = self._group(stream, group)
            acked = sum(g.pel.pop(i, None) is not None for i in parsed)
            for i in parsed:
                self._delete_if_done(s, i)
            self._cond.notify_all()
            return acked

    def pending(self, stream: str, group: str) -> int:
        check_name(stream, "stream")
        check_name(group, "group")
        with self._cond:
            self._check_open()
            return len(self._group(stream, group)[1].pel)

    def undelivered(self, stream: str, group: str, ids: Sequence[str]) -> list[str]:
        check_name(stream, "stream")
        check_name(group, "group")
        parsed = parse_ids(ids)
        with self._cond:
            self._check_open()
            last = self._group(stream, group)[1].last_delivered
            return [i for i, p in zip(ids, parsed) if p > last]

    def length(self, stream: str) -> int:
        check_name(stream, "stream")
        with self._cond:
            self._check_open()
            s = self._streams.get(stream)
            return 0 if s is None else len(s.entries)

    def dead_letters(self, stream: str) -> list[DeadLetter]:
        check_name(stream, "stream")
        with self._cond:
            self._check_open()
            s = self._streams.get(stream)
            return [] if s is None else list(s.dead)

    def mark_processed(self, stream: str, group: str, key: str, ttl_s: float) -> None:
        check_key(stream, group, key)
        check_seconds(ttl_s, "ttl_s", positive=True)
        with self._cond:
            self._check_open()
            now = self._clock()
            for k in [k for k, expiry in self._processed.items() if expiry <= now]:
                del self._processed[k]
            self._processed[(stream, group, key)] = now + ttl_s

    def is_processed(self, stream: str, group: str, key: str) -> bool:
        check_key(stream, group, key)
        with self._cond:
            self._check_open()
            return self._processed.get((stream, group, key), -float("inf")) > self._clock()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._streams.clear()
            self._processed.clear()
            self._cond.notify_all()

    # -- internals (called with the lock held) --

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the queue is closed")

    def _stream(self, stream: str) -> _Stream:
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = _Stream(dead=collections.deque(maxlen=self.cfg.maxlen))
        return s

    def _group(self, stream: str, group: str) -> tuple[_Stream, _Group]:
        s = self._streams.get(stream)
        if s is None or group not in s.groups:
            raise no_group(stream, group)
        return s, s.groups[group]

    def _reclaim(self, stream: str, s: _Stream, g: _Group, consumer: str, count: int) -> list[Delivery]:
        """XAUTOCLAIM: take over entries idle >= claim_idle_ms, oldest id first; dead-letter the
        ones already delivered max_deliveries times."""
        now, idle_s, out = self._clock(), self.cfg.claim_idle_ms / 1000, []
        for i in sorted(g.pel):
            if len(out) >= count:
                break
            p = g.pel[i]
            if now - p.delivered_at < idle_s:
                continue
            key, payload = s.entries[i]
            if p.deliveries >= self.cfg.max_deliveries:
                reason = dead_letter_reason(self.cfg.max_deliveries)
                s.dead.append(DeadLetter(stream, _fmt(i), key, payload, p.deliveries, reason))
                del g.pel[i]
                self._delete_if_done(s, i)
                self._cond.notify_all()
                continue
            p.consumer, p.delivered_at, p.deliveries = consumer, now, p.deliveries + 1
            out.append(Delivery(stream, _fmt(i), key, payload, p.deliveries))
        return out

    def _read_new(self, stream: str, s: _Stream, g: _Group, consumer: str, count: int) -> list[Delivery]:
        """XREADGROUP ">": entries after the group's last delivered id."""
        out: list[Delivery] = []
        if count <= 0:
            return out
        now = self._clock()
        for i, (key, payload) in s.entries.items():
            if i <= g.last_delivered:
                continue
            g.pel[i] = _Pending(consumer, now, 1)
            g.last_delivered = i
            out.append(Delivery(stream, _fmt(i), key, payload, 1))
            if len(out) == count:
                break
        return out

    def _delete_if_done(self, s: _Stream, i: Id) -> None:
        """Delete an entry once every group has read and acked it."""
        if i in s.entries and all(i <= g.last_delivered and i not in g.pel for g in s.groups.values()):
            del s.entries[i]
