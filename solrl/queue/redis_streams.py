"""The queue on Redis Streams (Redis >= 7): consumer groups, XAUTOCLAIM reclaim, dead letters.

Entries carry fields `p` (payload) and, if given, `k` (idempotency key); dead letters add `id`
(the original id), `n` (deliveries) and `reason`. Three small Lua scripts make the multi-step
operations atomic: publish-if-not-full, ack-and-delete-once-every-group-acked, and
reclaim-or-dead-letter. Redis 8.2's XACKDEL / XADD ACKED would cover part of this; Redis 7 has
neither, so the scripts are hand-written.

Reconnects: redis-py's own per-command retry is switched off and every queue call runs under one
`redis.retry.Retry` with `ExponentialBackoff` (retry_backoff_s doubling to retry_backoff_cap_s),
bounded by time rather than attempts: after retry_give_up_s the call raises `QueueUnavailable`. A
retried publish whose reply was lost may add the message twice (at-least-once; keys deduplicate).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError, ResponseError
from redis.retry import Retry

from solrl.queue.base import (
    DeadLetter,
    Delivery,
    QueueAuthError,
    QueueConfig,
    QueueFull,
    QueueUnavailable,
    check_consume,
    check_key,
    check_name,
    check_publish,
    check_seconds,
    dead_letter_reason,
    full_message,
    no_group,
    parse_ids,
    redact_url,
)

T = TypeVar("T")

_ACK_CHUNK = 1_000  # ids per ack script call (Lua's unpack() is bounded by the C stack)
_POLL_S = (0.005, 0.1)  # publish polls for room from 5 ms, doubling to 100 ms

# Lua helpers: stream-id order, each group's last delivered id, delete an entry every group acked.
_LUA_COMMON = """
local function id_le(a, b)
  local ams, aseq = string.match(a, '^(%d+)%-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)%-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq <= bseq)
end
local function group_marks(key)
  local marks = {}
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local name, last
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    marks[#marks + 1] = {name, last}
  end
  return marks
end
local function delete_if_done(key, marks, id)
  for _, m in ipairs(marks) do
    if not id_le(id, m[2]) then return end
    if #redis.call('XPENDING', key, m[1], id, id, 1) > 0 then return end
  end
  redis.call('XDEL', key, id)
end
"""

# KEYS: stream. ARGV: maxlen, payload[, key]. Returns the new id, or nil when the stream is full.
_PUBLISH = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
if #ARGV == 3 then return redis.call('XADD', KEYS[1], '*', 'p', ARGV[2], 'k', ARGV[3]) end
return redis.call('XADD', KEYS[1], '*', 'p', ARGV[2])
"""

# KEYS: stream. ARGV: group, ids... Returns how many ids were pending. (XACK alone answers 0 for a
# missing group; NOGROUP is raised here to match the other commands.)
_ACK = _LUA_COMMON + """
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('NOGROUP no such stream') end
local marks, known = group_marks(KEYS[1]), false
for _, m in ipairs(marks) do known = known or m[1] == ARGV[1] end
if not known then return redis.error_reply('NOGROUP no such consumer group') end
if #ARGV == 1 then return 0 end
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
for i = 2, #ARGV do delete_if_done(KEYS[1], marks, ARGV[i]) end
return n
"""

# KEYS: stream, dead-letter stream. ARGV: group, consumer, min idle ms, count, max deliveries,
# dead-letter maxlen, reason. XAUTOCLAIM (which counts a delivery) until `count` are claimed or the
# pending list is scanned; a claimed entry now past max deliveries is dead-lettered and acked.
# Returns {{id, deliveries, {field, value, ...}}, ...}.
_RECLAIM = _LUA_COMMON + """
local key, dead, group = KEYS[1], KEYS[2], ARGV[1]
local count, max_deliveries = tonumber(ARGV[4]), tonumber(ARGV[5])
local out, cursor, marks = {}, '0-0', nil
repeat
  local r = redis.call('XAUTOCLAIM', key, group, ARGV[2], ARGV[3], cursor, 'COUNT', count - #out)
  cursor = r[1]
  for _, e in ipairs(r[2]) do
    local id, fields = e[1], e[2]
    local n = redis.call('XPENDING', key, group, id, id, 1)[1][4]
    if n > max_deliveries then
      redis.call('XADD', dead, 'MAXLEN', ARGV[6], '*', 'id', id, 'n', n - 1, 'reason', ARGV[7], unpack(fields))
      redis.call('XACK', key, group, id)
      marks = marks or group_marks(key)
      delete_if_done(key, marks, id)
    else
      out[#out + 1] = {id, n, fields}
    end
  end
until #out >= count or cursor == '0-0'
return out
"""



def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStreamQueue:
    """`Queue` on a Redis server (`url` as redis-py takes it, e.g. "redis://host:6379/0")."""

    def __init__(self, url: str, cfg: QueueConfig = QueueConfig(), password: str | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"url must be a non-empty redis URL str, got {redact_url(url)!r}")
        if not isinstance(cfg, QueueConfig):
            raise TypeError(f"cfg must be a QueueConfig, got {type(cfg).__name__}")
        parts = urllib.parse.urlsplit(url)
        if password is not None and not isinstance(password, str):
            raise TypeError(f"password must be a str, got {type(password).__name__}")
        if password and parts.password is not None:
            raise ValueError(f"the URL {redact_url(url)!r} holds a password and one was given apart: give one")
        self.cfg = cfg
        self._url = url
        self._user = urllib.parse.unquote(parts.username) if parts.username else "default"
        # The client itself never retries: `_call` does, under one time budget. The client name
        # shows which run a connection serves in CLIENT LIST.
        self._redis = redis.Redis.from_url(
            url, decode_responses=False, retry=Retry(NoBackoff(), 0), socket_keepalive=True,
            client_name=f"solrl-queue:{cfg.namespace}", **({"password": password} if password else {}),
        )
        self._backoff = ExponentialBackoff(cap=cfg.retry_backoff_cap_s, base=cfg.retry_backoff_s / 2)
        self._retry = Retry(self._backoff, retries=-1)  # until `_call`'s deadline
        self._publish = self._redis.register_script(_PUBLISH)
        self._ack = self._redis.register_script(_ACK)
        self._reclaim = self._redis.register_script(_RECLAIM)
        self._closed = False

    def ensure_group(self, stream: str, group: str) -> None:
        check_name(stream, "stream")
        check_name(group, "group")

        def create() -> None:
            try:
                self._redis.xgroup_create(self._key(stream), group, id="0", mkstream=True)
            except ResponseError as e:
                if not str(e).startswith("BUSYGROUP"):
                    raise

        self._call(create)

    def publish(self, stream: str, payload: bytes, key: str | None = None, timeout_s: float = 0.0) -> str:
        check_publish(stream, payload, key, timeout_s)
        args: list[bytes | str | int] = [self.cfg.maxlen, payload] + ([key] if key is not None else [])
        deadline, poll_s = time.monotonic() + timeout_s, _POLL_S[0]
        while True:
            new_id = self._call(lambda: self._publish(keys=[self._key(stream)], args=args), stream)
            if new_id is not None:
                return new_id.decode()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QueueFull(full_message(stream, self.cfg.maxlen, timeout_s))
            time.sleep(min(poll_s, remaining))
            poll_s = min(2 * poll_s, _POLL_S[1])

    def consume(self, stream: str, group: str, consumer: str, count: int = 1, block_ms: int = 0) -> list[Delivery]:
        check_consume(stream, group, consumer, count, block_ms)
        key, dead = self._key(stream), self._key(stream) + ":dead"
        reason = dead_letter_reason(self.cfg.max_deliveries)
        cfg = self.cfg
        reclaim_args = [group, consumer, cfg.claim_idle_ms, count, cfg.max_deliveries, cfg.maxlen, reason]
        deadline = time.monotonic() + block_ms / 1000
        while True:
            claimed = self._call(lambda: self._reclaim(keys=[key, dead], args=reclaim_args), stream, group)
            out = [self._delivery(stream, i, n, fields) for i, n, fields in claimed]
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if len(out) < count:
                # Block only when nothing was reclaimed, and at most claim_idle_ms at a time so that
                # a job a worker abandons meanwhile is reclaimed on the next turn.
                wait_ms = min(remaining_ms, self.cfg.claim_idle_ms) if not out else 0
                want, block = count - len(out), (wait_ms if wait_ms > 0 else None)
                new = self._call(  # the call runs now, inside this iteration (the defaults pin it anyway)
                    lambda want=want, block=block: self._redis.xreadgroup(group, consumer, {key: ">"}, count=want,
                                                                          block=block),
                    stream, group,
                )
                for _, entries in new or []:
                    out += [self._delivery(stream, i, 1, fields) for i, fields in entries]
            if out or time.monotonic() >= deadline:
                return out

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> int:
        check_name(stream, "stream")
        check_name(group, "group")
        parse_ids(ids)
        ids, acked = list(ids), 0
        for start in range(0, max(len(ids), 1), _ACK_CHUNK):  # one call even for no ids: checks the group
            chunk = [group, *ids[start:start + _ACK_CHUNK]]
            acked += self._call(lambda chunk=chunk: self._ack(keys=[self._key(stream)], args=chunk), stream, group)
        return acked

    def pending(self, stream: str, group: str) -> int:
        check_name(stream, "stream")
        check_name(group, "group")
        return int(self._call(lambda: self._redis.xpending(self._key(stream), group), stream, group)["pending"])

    def undelivered(self, stream: str, group: str, ids: Sequence[str]) -> list[str]:
        check_name(stream, "stream")
        check_name(group, "group")
        parsed = parse_ids(ids)
        groups = self._call(lambda: self._redis.xinfo_groups(self._key(stream)), stream, group)
        info = next((g for g in groups if _text(g["name"]) == group), None)
        if info is None:
            raise no_group(stream, group)
        last = parse_ids([_text(info["last-delivered-id"])])[0]
        return [i for i, p in zip(ids, parsed) if p > last]

    def length(self, stream: str) -> int:
        check_name(stream, "stream")
        return int(self._call(lambda: self._redis.xlen(self._key(stream)), stream))

    def dead_letters(self, stream: str) -> list[DeadLetter]:
        check_name(stream, "stream")
        rows = self._call(lambda: self._redis.xrange(self._key(stream) + ":dead"))
        return [
            DeadLetter(
                stream, f[b"id"].decode(), f[b"k"].decode() if b"k" in f else None, f[b"p"], int(f[b"n"]),
                f[b"reason"].decode(),
            )
            for _, f in rows
        ]

    def mark_processed(self, stream: str, group: str, key: str, ttl_s: float) -> None:
        check_key(stream, group, key)
        check_seconds(ttl_s, "ttl_s", positive=True)
        ttl_ms = max(1, round(ttl_s * 1000))
        self._call(lambda: self._redis.set(self._done_key(stream, group, key), b"1", px=ttl_ms))

    def is_processed(self, stream: str, group: str, key: str) -> bool:
        check_key(stream, group, key)
        return bool(self._call(lambda: self._redis.exists(self._done_key(stream, group, key))))

    def close(self) -> None:
        self._closed = True
        self._redis.close()

    # -- internals --

    def _key(self, stream: str) -> str:
        return f"{self.cfg.namespace}:{stream}"

    def _done_key(self, stream: str, group: str, key: str) -> str:
        # One key per processed job (not one SET) so that each expires on its own TTL.
        return f"{self.cfg.namespace}:{stream}:done:{group}:{key}"

    @staticmethod
    def _delivery(stream: str, entry_id: bytes, deliveries: int, fields: list[bytes] | dict[bytes, bytes]) -> Delivery:
        f = fields if isinstance(fields, dict) else dict(zip(fields[::2], fields[1::2]))
        key = f.get(b"k")
        return Delivery(stream, entry_id.decode(), None if key is None else key.decode(), f[b"p"], int(deliveries))

    def _call(self, fn: Callable[[], T], stream: str | None = None, group: str | None = None) -> T:
        """Run one Redis operation, retrying connection errors with backoff until retry_give_up_s."""
        if self._closed:
            raise RuntimeError("the queue is closed")
        start = time.monotonic()

        def give_up_after(error: Exception, failures: int) -> None:
            waited = time.monotonic() - start
            if waited + self._backoff.compute(failures) > self.cfg.retry_give_up_s:
                raise QueueUnavailable(
                    f"Redis at {redact_url(self._url)} unreachable: {failures} attempts in {waited:.2f}s "
                    f"(retry_give_up_s={self.cfg.retry_give_up_s}): {error}"
                ) from error

        try:
            return self._retry.call_with_retry(
                fn, give_up_after, with_failure_count=True,
                is_retryable=lambda e: not isinstance(e, (AuthenticationError, AuthorizationError)),
            )
        except (AuthenticationError, AuthorizationError) as e:
            raise QueueAuthError(
                f"Redis at {redact_url(self._url)} refused user {self._user!r}: {e} (the user is the URL's; "
                f"its password comes from the URL or SOLRL_REDIS_PASSWORD)") from None
        except NoPermissionError as e:
            where = f"stream {stream!r} of namespace" if stream else "namespace"
            hint = " (no user in the URL: Redis' default user)" if self._user == "default" else ""
            raise QueueAuthError(
                f"Redis at {redact_url(self._url)}: user {self._user!r}{hint} may not do this on {where} "
                f"{self.cfg.namespace!r}: {e}") from None
        except ResponseError as e:
            if stream is not None and group is not None and "NOGROUP" in str(e):
                raise no_group(stream, group) from e
            raise
