"""The work queue: one suite run against a real Redis server and against the in-memory twin."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid

import pytest
import redis

from solrl.queue import (
    DeadLetter,
    Deduplicator,
    Delivery,
    InMemoryQueue,
    Queue,
    QueueConfig,
    QueueFull,
    QueueUnavailable,
    RedisStreamQueue,
    build_queue,
)

REDIS_URL = os.environ.get("SOLRL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not _redis_up(), reason=f"no Redis server at {REDIS_URL}")


@pytest.fixture
def namespace():
    """A fresh key namespace; every key under it is deleted afterwards."""
    ns = f"solrl-test-{uuid.uuid4().hex}"
    yield ns
    if _redis_up():
        admin = redis.Redis.from_url(REDIS_URL)
        keys = list(admin.scan_iter(match=f"{ns}:*"))
        if keys:
            admin.delete(*keys)
        assert not list(admin.scan_iter(match=f"{ns}:*"))
        admin.close()


@pytest.fixture(params=["redis", "memory"])
def make_queue(request, namespace):
    """make_queue(**QueueConfig fields) -> a queue of the parametrized kind, closed afterwards."""
    if request.param == "redis" and not _redis_up():
        pytest.skip(f"no Redis server at {REDIS_URL}")
    made: list[Queue] = []

    def make(**overrides) -> Queue:
        cfg = QueueConfig(namespace=namespace, **overrides)
        q = RedisStreamQueue(REDIS_URL, cfg) if request.param == "redis" else InMemoryQueue(cfg)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def _elapsed(t0: float) -> float:
    return time.monotonic() - t0


def test_round_trip_in_order(make_queue):
    q = make_queue()
    assert isinstance(q, Queue)
    q.ensure_group("jobs", "workers")
    q.ensure_group("jobs", "workers")  # idempotent
    sent = [(f"payload-{i}".encode(), f"job-{i}" if i % 2 else None) for i in range(5)]
    ids = [q.publish("jobs", p, key=k) for p, k in sent]
    assert len(set(ids)) == 5
    assert q.length("jobs") == 5

    got = q.consume("jobs", "workers", "w1", count=10)
    assert got == [Delivery("jobs", i, k, p, 1) for i, (p, k) in zip(ids, sent)]
    assert q.pending("jobs", "workers") == 5
    assert q.consume("jobs", "workers", "w1", count=10) == []  # nothing new, nothing idle yet

    assert q.ack("jobs", "workers", ids[:2]) == 2
    assert q.ack("jobs", "workers", ids[:2]) == 0  # already acked
    assert q.pending("jobs", "workers") == 3 and q.length("jobs") == 3
    assert q.ack("jobs", "workers", ids[2:]) == 3
    assert q.pending("jobs", "workers") == 0 and q.length("jobs") == 0
    assert q.ack("jobs", "workers", []) == 0


def test_undelivered_tells_which_messages_no_consumer_has_taken(make_queue):
    """What the trainer's pickup check reads: a message counts as taken once delivered, acked or not."""
    q = make_queue()
    q.ensure_group("jobs", "workers")
    ids = [q.publish("jobs", f"p{i}".encode(), key=f"k{i}") for i in range(4)]
    assert q.undelivered("jobs", "workers", ids) == ids
    q.consume("jobs", "workers", "w1", count=1)
    assert q.undelivered("jobs", "workers", ids) == ids[1:]
    q.consume("jobs", "workers", "w2", count=2)
    assert q.undelivered("jobs", "workers", ids) == ids[3:]
    q.ensure_group("jobs", "others")   # another group has its own cursor
    assert q.undelivered("jobs", "others", ids) == ids
    assert q.undelivered("jobs", "workers", []) == []
    with pytest.raises(ValueError):
        q.undelivered("jobs", "nobody", ids)


def test_messages_published_before_the_group_exists_are_delivered(make_queue):
    q = make_queue()
    first = q.publish("jobs", b"early")
    q.ensure_group("jobs", "workers")
    assert [d.id for d in q.consume("jobs", "workers", "w1")] == [first]


def test_two_consumers_in_one_group_never_share_a_message(make_queue):
    q = make_queue()
    q.ensure_group("jobs", "workers")
    ids = {q.publish("jobs", str(i).encode()) for i in range(40)}
    seen: dict[str, list[str]] = {"a": [], "b": []}
    start = threading.Barrier(2)

    def work(name: str) -> None:
        start.wait()
        while batch := q.consume("jobs", "workers", name, count=3):
            seen[name] += [d.id for d in batch]
            q.ack("jobs", "workers", [d.id for d in batch])

    threads = [threading.Thread(target=work, args=(n,)) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not set(seen["a"]) & set(seen["b"])
    assert sorted(seen["a"] + seen["b"]) == sorted(ids)
    assert q.length("jobs") == 0


def test_idle_message_of_a_dead_consumer_is_reclaimed(make_queue):
    q = make_queue(claim_idle_ms=200)
    q.ensure_group("jobs", "workers")
    mid = q.publish("jobs", b"job", key="k1")
    assert q.consume("jobs", "workers", "crashes")[0].deliveries == 1
    assert q.consume("jobs", "workers", "healthy") == []  # not idle long enough yet
    time.sleep(0.25)
    assert q.consume("jobs", "workers", "healthy") == [Delivery("jobs", mid, "k1", b"job", 2)]
    assert q.pending("jobs", "workers") == 1
    assert q.ack("jobs", "workers", [mid]) == 1
    assert q.pending("jobs", "workers") == 0 and q.length("jobs") == 0


def test_blocking_consume_reclaims_a_job_abandoned_while_it_waits(make_queue):
    q = make_queue(claim_idle_ms=200)
    q.ensure_group("jobs", "workers")
    mid = q.publish("jobs", b"job")
    q.consume("jobs", "workers", "crashes")
    t0 = time.monotonic()
    got = q.consume("jobs", "workers", "healthy", block_ms=3000)
    assert [(d.id, d.deliveries) for d in got] == [(mid, 2)]
    assert 0.15 < _elapsed(t0) < 2.0


def test_dead_letter_after_max_deliveries(make_queue):
    q = make_queue(claim_idle_ms=150, max_deliveries=2)
    q.ensure_group("jobs", "workers")
    poison = q.publish("jobs", b"poison", key="job-7")
    assert q.consume("jobs", "workers", "w1")[0].deliveries == 1
    time.sleep(0.2)
    assert q.consume("jobs", "workers", "w2")[0].deliveries == 2
    time.sleep(0.2)
    fine = q.publish("jobs", b"fine")
    # The third attempt dead-letters the poison message and hands out the next one instead.
    assert [d.id for d in q.consume("jobs", "workers", "w3")] == [fine]
    dead = q.dead_letters("jobs")
    assert len(dead) == 1 and isinstance(dead[0], DeadLetter)
    d = dead[0]
    assert (d.stream, d.id, d.key, d.payload, d.deliveries) == ("jobs", poison, "job-7", b"poison", 2)
    assert "max_deliveries=2" in d.reason
    assert q.pending("jobs", "workers") == 1  # only `fine`
    assert q.length("jobs") == 1  # the poison entry is gone from the stream
    q.ack("jobs", "workers", [fine])
    time.sleep(0.2)
    assert q.consume("jobs", "workers", "w4") == []
    assert len(q.dead_letters("jobs")) == 1


def test_back_pressure_raises_after_timeout_and_recovers_after_ack(make_queue):
    q = make_queue(maxlen=3)
    q.ensure_group("jobs", "workers")
    for i in range(3):
        q.publish("jobs", bytes([i]))
    t0 = time.monotonic()
    with pytest.raises(QueueFull, match="maxlen=3"):
        q.publish("jobs", b"x", timeout_s=0.3)
    assert 0.29 <= _elapsed(t0) < 2.0
    with pytest.raises(QueueFull):
        q.publish("jobs", b"x")  # timeout 0: fails at once
    taken = q.consume("jobs", "workers", "w1")
    with pytest.raises(QueueFull):
        q.publish("jobs", b"x")  # delivered but un-acked still counts
    q.ack("jobs", "workers", [taken[0].id])
    assert q.length("jobs") == 2
    q.publish("jobs", b"x")
    assert q.length("jobs") == 3


def test_blocked_publish_resumes_when_a_consumer_acks(make_queue):
    q = make_queue(maxlen=1)
    q.ensure_group("jobs", "workers")
    q.publish("jobs", b"first")

    def drain() -> None:
        time.sleep(0.3)
        q.ack("jobs", "workers", [d.id for d in q.consume("jobs", "workers", "w1")])

    t = threading.Thread(target=drain)
    t.start()
    t0 = time.monotonic()
    q.publish("jobs", b"second", timeout_s=5.0)
    waited = _elapsed(t0)
    t.join(5)
    assert 0.25 < waited < 4.0
    assert [d.payload for d in q.consume("jobs", "workers", "w1")] == [b"second"]


def test_two_groups_each_receive_every_message(make_queue):
    q = make_queue()
    for g in ("trainer", "telemetry"):
        q.ensure_group("rollouts", g)
    ids = [q.publish("rollouts", bytes([i])) for i in range(3)]
    a = q.consume("rollouts", "trainer", "t1", count=5)
    b = q.consume("rollouts", "telemetry", "m1", count=5)
    assert [d.id for d in a] == [d.id for d in b] == ids
    assert q.ack("rollouts", "trainer", ids) == 3
    assert q.length("rollouts") == 3  # telemetry has not acked
    q.ack("rollouts", "telemetry", ids[:2])
    assert q.length("rollouts") == 1
    q.ack("rollouts", "telemetry", ids[2:])
    assert q.length("rollouts") == 0
    # Acked by one group before the other even read it: kept until the other acks too.
    late = q.publish("rollouts", b"late")
    q.ack("rollouts", "trainer", [d.id for d in q.consume("rollouts", "trainer", "t1")])
    assert q.length("rollouts") == 1
    assert [d.id for d in q.consume("rollouts", "telemetry", "m1")] == [late]


def test_deduplicator_skips_a_repeated_key(make_queue):
    q = make_queue()
    q.ensure_group("jobs", "workers")
    dedup = Deduplicator(q, "workers")
    for payload, key in [(b"a", "job-1"), (b"a-again", "job-1"), (b"b", "job-2"), (b"c", None), (b"d", None)]:
        q.publish("jobs", payload, key=key)
    processed, skipped = [], []
    while batch := q.consume("jobs", "workers", "w1", count=2):
        for d in batch:
            if dedup.skip(d):
                skipped.append(d.payload)
                continue
            processed.append(d.payload)
            dedup.done(d)
    assert processed == [b"a", b"b", b"c", b"d"]
    assert skipped == [b"a-again"]
    assert q.pending("jobs", "workers") == 0 and q.length("jobs") == 0
    assert not q.is_processed("jobs", "other-group", "job-1")


def test_deduplicator_skips_a_redelivered_job_whose_result_was_published(make_queue):
    q = make_queue(claim_idle_ms=150)
    q.ensure_group("jobs", "workers")
    dedup = Deduplicator(q, "workers")
    q.publish("jobs", b"job", key="job-9")
    (d,) = q.consume("jobs", "workers", "crashes")
    assert not dedup.skip(d)
    q.publish("results", b"result of job-9")
    q.mark_processed("jobs", "workers", "job-9", ttl_s=60)  # ... and the worker dies before its ack
    time.sleep(0.2)
    (again,) = q.consume("jobs", "workers", "healthy")
    assert (again.id, again.deliveries) == (d.id, 2)
    assert dedup.skip(again)
    assert q.pending("jobs", "workers") == 0 and q.length("jobs") == 0
    assert q.length("results") == 1


def test_processed_keys_expire(make_queue):
    q = make_queue()
    q.mark_processed("jobs", "workers", "job-1", ttl_s=0.2)
    assert q.is_processed("jobs", "workers", "job-1")
    time.sleep(0.3)
    assert not q.is_processed("jobs", "workers", "job-1")


def test_blocking_consume_returns_when_a_message_arrives(make_queue):
    q = make_queue()
    q.ensure_group("jobs", "workers")
    t0 = time.monotonic()
    assert q.consume("jobs", "workers", "w1") == []
    assert _elapsed(t0) < 0.5  # block_ms=0 does not wait
    t0 = time.monotonic()
    assert q.consume("jobs", "workers", "w1", block_ms=300) == []
    assert 0.29 <= _elapsed(t0) < 2.0

    timer = threading.Timer(0.2, lambda: q.publish("jobs", b"late job"))
    timer.start()
    t0 = time.monotonic()
    got = q.consume("jobs", "workers", "w1", block_ms=5000)
    waited = _elapsed(t0)
    timer.join()
    assert [d.payload for d in got] == [b"late job"]
    assert 0.15 < waited < 4.0


def test_bad_input_raises_naming_the_argument(make_queue):
    q = make_queue()
    q.ensure_group("jobs", "workers")
    with pytest.raises(ValueError, match="stream"):
        q.publish("a:b", b"x")
    with pytest.raises(TypeError, match="payload"):
        q.publish("jobs", "text")
    with pytest.raises(ValueError, match="key"):
        q.publish("jobs", b"x", key="")
    with pytest.raises(ValueError, match="timeout_s"):
        q.publish("jobs", b"x", timeout_s=-1)
    with pytest.raises(ValueError, match="count"):
        q.consume("jobs", "workers", "w1", count=0)
    with pytest.raises(ValueError, match="block_ms"):
        q.consume("jobs", "workers", "w1", block_ms=-5)
    with pytest.raises(ValueError, match="consumer"):
        q.consume("jobs", "workers", "")
    with pytest.raises(ValueError, match="ids"):
        q.ack("jobs", "workers", ["not-an-id"])
    with pytest.raises(TypeError, match="ids"):
        q.ack("jobs", "workers", "1-0")
    with pytest.raises(ValueError, match="ensure_group"):
        q.consume("jobs", "nobody", "w1")
    with pytest.raises(ValueError, match="ensure_group"):
        q.pending("missing", "workers")
    with pytest.raises(ValueError, match="ensure_group"):
        q.ack("jobs", "nobody", ["1-0"])
    with pytest.raises(ValueError, match="ensure_group"):
        q.ack("missing", "workers", [])
    with pytest.raises(ValueError, match="ttl_s"):
        q.mark_processed("jobs", "workers", "k", ttl_s=0)
    with pytest.raises(ValueError, match="ttl_s"):
        Deduplicator(q, "workers", ttl_s=-1)
    assert q.length("never-used") == 0 and q.dead_letters("never-used") == []


def test_closed_queue_refuses_calls(make_queue):
    q = make_queue()
    q.close()
    with pytest.raises(RuntimeError, match="closed"):
        q.length("jobs")


def test_config_and_build_queue_validate():
    for bad in ({"maxlen": 0}, {"max_deliveries": 0}, {"claim_idle_ms": -1}, {"namespace": ""},
                {"retry_give_up_s": float("nan")}, {"maxlen": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QueueConfig(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        QueueConfig().maxlen = 5  # type: ignore[misc]
    assert isinstance(build_queue(None, QueueConfig()), InMemoryQueue)
    assert isinstance(build_queue("memory://", QueueConfig()), InMemoryQueue)
    assert isinstance(build_queue("redis://127.0.0.1:1/0", QueueConfig()), RedisStreamQueue)  # connects lazily
    with pytest.raises(ValueError, match="url"):
        build_queue("http://localhost:6379", QueueConfig())


def test_in_memory_idle_time_follows_the_injected_clock():
    now = [100.0]
    q = InMemoryQueue(QueueConfig(claim_idle_ms=10_000), clock=lambda: now[0])
    q.ensure_group("jobs", "workers")
    q.publish("jobs", b"job")
    q.consume("jobs", "workers", "crashes")
    now[0] += 9.999
    assert q.consume("jobs", "workers", "healthy") == []
    now[0] += 0.001
    assert [d.deliveries for d in q.consume("jobs", "workers", "healthy")] == [2]


@needs_redis
def test_redis_client_recovers_after_its_connection_is_killed(namespace):
    q = RedisStreamQueue(REDIS_URL, QueueConfig(namespace=namespace))
    admin = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    name = f"solrl-queue:{namespace}"
    q.ensure_group("jobs", "workers")

    def blocked_ids() -> list[int]:
        return [int(c["id"]) for c in admin.client_list() if c["name"] == name and c["cmd"] == "xreadgroup"]

    def wait_for(pred, timeout_s: float = 5.0):
        deadline = time.monotonic() + timeout_s
        while not (value := pred()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return value

    result: list[Delivery] = []
    consumer = threading.Thread(target=lambda: result.extend(q.consume("jobs", "workers", "w1", block_ms=8000)))
    consumer.start()
    (killed,) = wait_for(blocked_ids)
    assert admin.client_kill_filter(_id=killed) == 1  # the blocked XREADGROUP loses its socket ...
    reconnected = wait_for(lambda: [i for i in blocked_ids() if i != killed])
    assert reconnected  # ... and blocks again on a new connection
    q.publish("jobs", b"after the kill")
    consumer.join(10)
    assert [d.payload for d in result] == [b"after the kill"]

    for c in admin.client_list():  # now kill every idle connection of the queue
        if c["name"] == name:
            admin.client_kill_filter(_id=int(c["id"]))
    assert q.pending("jobs", "workers") == 1
    admin.close()
    q.close()


def test_redis_gives_up_after_the_retry_budget():
    cfg = QueueConfig(retry_backoff_s=0.02, retry_backoff_cap_s=0.1, retry_give_up_s=0.4)
    q = RedisStreamQueue("redis://127.0.0.1:1/0", cfg)  # nothing listens on port 1
    t0 = time.monotonic()
    with pytest.raises(QueueUnavailable, match="unreachable") as info:
        q.length("jobs")
    assert 0.2 < _elapsed(t0) < 2.0
    assert isinstance(info.value, ConnectionError)
    q.close()
