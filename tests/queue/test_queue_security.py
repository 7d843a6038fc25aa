"""Hostile clients on the work queue (issue 44): Redis with one ACL user per role, and HMAC-signed messages.

A real redis-server per test module, started by k8s/base/redis-acl.sh (the script the compose files and the k8s
StatefulSet run) on a free port with the roles' passwords from the environment. The trainer's side is the real
`collect_rollouts` + `check_versions` of the distributed driver (what decides what an epoch trains on); the
workers' side is the real `StreamWorker` publishing path (`SignedQueue`). The CPU compose test in
tests/deploy/test_deploy.py runs the same with every service as a process.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import redis as redis_py

from services.common.metrics import ServiceMetrics
from solrl.engine.queue_loop import (
    GROUP_TRAINER,
    STREAM_EXPLORE,
    STREAM_ROLLOUTS,
    check_versions,
    collect_rollouts,
    ensure_pipeline,
    rollout_key,
)
from solrl.queue import (
    Deduplicator,
    InMemoryQueue,
    QueueAuthError,
    QueueConfig,
    SignedQueue,
    build_queue,
    message_tag,
)
from tests.deploy.test_deploy import _redis_server_or_skip, free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "k8s" / "base" / "redis-acl.sh"
ROLES = ("trainer", "explorer", "regenerator", "keda")
PASSWORDS = {r: f"{r}-redis-pw-{os.getpid()}-c0ffee" for r in ROLES}
KEY = "run-queue-key-5b1d9e0f3a7c2d48"
VERSION = 3   # the adapter version the epoch's jobs ask for


def script_env(namespace: str, **overrides: str) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "SOLRL_QUEUE_NAMESPACE": namespace,
           **{f"SOLRL_REDIS_{r.upper()}_PASSWORD": p for r, p in PASSWORDS.items()}}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.fixture()
def acl_redis(tmp_path):
    """(port, namespace): a fresh redis-server started by redis-acl.sh, no persistence."""
    _redis_server_or_skip()   # CI installs it (.ci/run) and fails rather than skips without it
    tmp = tmp_path
    port, namespace = free_port(), f"sec-test:{os.getpid()}"
    log = open(tmp / "redis.log", "w")
    proc = subprocess.Popen(["sh", str(SCRIPT), str(tmp / "users.acl"), "redis-server", "--port", str(port),
                             "--bind", "127.0.0.1", "--dir", str(tmp), "--save", "", "--appendonly", "no"],
                            env=script_env(namespace), stdout=log, stderr=subprocess.STDOUT)
    client, deadline = redis_py.Redis(port=port), time.monotonic() + 20
    while True:
        try:
            client.ping()   # `default` may PING, unauthenticated (the health checks)
            break
        except redis_py.ConnectionError:
            assert proc.poll() is None, (tmp / "redis.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
    try:
        yield port, namespace
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def url(port: int, role: str) -> str:
    return f"redis://{role}@127.0.0.1:{port}/0"


def queue(acl_redis, role: str, key: str | None = None, metrics: ServiceMetrics | None = None):
    port, namespace = acl_redis
    on_reject = (lambda d, reason: metrics.observe_rejected(d.stream, reason)) if metrics else None
    q = build_queue(url(port, role), QueueConfig(namespace=namespace, claim_idle_ms=60_000),
                    password=PASSWORDS[role], signing_key=key, on_reject=on_reject)
    ensure_pipeline(q)
    return q


def raw(acl_redis, role: str) -> redis_py.Redis:
    """A plain client as a role's ACL user: what someone holding that password can send."""
    return redis_py.Redis(port=acl_redis[0], username=role, password=PASSWORDS[role])


def rollout(job_id: str, seed: int, reward: float, version: int = VERSION) -> bytes:
    from services.common.tensors import numpy_to_tensor
    from solrl.pb.solrl.common.v1 import common_pb2

    x0 = np.full((3, 4, 4), float(seed), dtype=np.float32)
    return common_pb2.Rollout(job_id=job_id, prompt="a red circle", seed=seed, x0=numpy_to_tensor(x0), reward=reward,
                              adapter_version=common_pb2.AdapterVersion(version=version)).SerializeToString()


def rejected(metrics: ServiceMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("solrl_queue_rejected_messages_total",
                                              {"service": "trainer", "stream": STREAM_ROLLOUTS, "reason": reason})
    return value or 0.0


# ---------------------------------------------------------------- forged rollouts


@pytest.mark.parametrize("signed", [False, True], ids=["no-key-as-on-main", "with-key"])
def test_a_forged_rollout_with_the_right_adapter_version(acl_redis, signed):
    """Must show. Someone with write access to the rollouts stream (here: the regenerator's Redis password) XADDs a
    Rollout of the epoch's job with the adapter version the epoch asked for and a reward of 1e6.
    No key (the code as it is on main, where build_queue has no key): the trainer collects it and the version check
    passes, so the epoch trains on it. With the key: dropped before the driver sees it, counted in
    solrl_queue_rejected_messages, and the genuine signed rollout is the one collected."""
    metrics = ServiceMetrics("trainer")
    trainer = queue(acl_redis, "trainer", KEY if signed else None, metrics)
    regenerator = queue(acl_redis, "regenerator", KEY if signed else None)
    job = "run-a1-e000000-p00000"
    stream_key = f"{acl_redis[1]}:{STREAM_ROLLOUTS}"
    raw(acl_redis, "regenerator").xadd(stream_key, {"p": rollout(job, 666, 1e6), "k": rollout_key(job, 0)})
    regenerator.publish(STREAM_ROLLOUTS, rollout(job, 7, 0.5), key=rollout_key(job, 0))

    got = collect_rollouts(trainer, {job: 0}, kept=1, timeout_s=10, block_ms=100)
    (ro,) = got.values()
    check_versions([ro], VERSION, 0)   # passes either way: the version is what the epoch asked for
    if not signed:
        assert (ro.seed, ro.reward) == (666, 1e6)   # trained on: the forged one came first
        assert rejected(metrics, "bad_signature") == 0
    else:
        assert (ro.seed, ro.reward) == (7, 0.5)     # the genuine one
        # (a payload of a tag's length or more whose first 32 bytes are not its tag: bad_signature)
        assert rejected(metrics, "bad_signature") == 1
        assert b'solrl_queue_rejected_messages_total{reason="bad_signature",service="trainer",stream="rollouts"} 1.0' \
            in metrics.render()
        # forged with a key of its own: no better
        wrong = "forged-key-0000000000000000"
        payload = rollout(job, 666, 1e6)
        tag = message_tag(wrong.encode(), acl_redis[1], STREAM_ROLLOUTS, rollout_key(job, 0), payload)
        raw(acl_redis, "regenerator").xadd(stream_key, {"p": tag + payload, "k": rollout_key(job, 0)})
        with pytest.raises(TimeoutError):
            collect_rollouts(trainer, {job: 0}, kept=1, timeout_s=1.0, block_ms=100)
        assert rejected(metrics, "bad_signature") == 2
    assert trainer.length(STREAM_ROLLOUTS) == 0   # nothing left behind for a later epoch
    for q in (trainer, regenerator):
        q.close()


def test_a_rejected_message_is_logged_without_the_key(acl_redis, caplog):
    trainer = queue(acl_redis, "trainer", KEY)
    raw(acl_redis, "regenerator").xadd(f"{acl_redis[1]}:{STREAM_ROLLOUTS}", {"p": b"x" * 64, "k": "j:0"})
    with caplog.at_level("WARNING", logger="solrl.queue"):
        assert trainer.consume(STREAM_ROLLOUTS, GROUP_TRAINER, "c", count=10, block_ms=500) == []
    (rec,) = [r for r in caplog.records if "dropped message" in r.getMessage()]
    assert "'j:0'" in rec.getMessage() and "signature does not verify" in rec.getMessage()
    assert KEY not in rec.getMessage() and KEY not in repr(trainer)
    trainer.close()


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize("signed", [False, True], ids=["no-key-as-on-main", "with-key"])
def test_a_replayed_rollout_is_not_trained_on_twice(acl_redis, signed):
    """A captured valid Rollout (the bytes the regenerator put on the stream) XADDed again: as the job's other kept
    position, before the genuine one arrives, it would be trained on twice; with the key its tag binds it to its
    own position (its idempotency key), so it is dropped. Replayed under its own key, within the epoch or later,
    the driver keeps one rollout per (job, position) and drops other jobs' rollouts."""
    key = KEY if signed else None
    metrics = ServiceMetrics("trainer")
    trainer = queue(acl_redis, "trainer", key, metrics)
    regenerator = queue(acl_redis, "regenerator", key)
    attacker = raw(acl_redis, "regenerator")
    stream_key = f"{acl_redis[1]}:{STREAM_ROLLOUTS}"
    job = "run-a2-e000000-p00000"
    genuine = rollout(job, 11, 0.9)
    regenerator.publish(STREAM_ROLLOUTS, genuine, key=rollout_key(job, 0))
    # the bytes on the wire (what SignedQueue.publish wrote: test_the_tag_binds_namespace_stream_and_key)
    captured = (message_tag(KEY.encode(), acl_redis[1], STREAM_ROLLOUTS, rollout_key(job, 0), genuine)
                if signed else b"") + genuine
    attacker.xadd(stream_key, {"p": captured, "k": rollout_key(job, 1)})   # as position 1
    regenerator.publish(STREAM_ROLLOUTS, rollout(job, 12, 0.1), key=rollout_key(job, 1))
    attacker.xadd(stream_key, {"p": captured, "k": rollout_key(job, 0)})   # as itself, again

    got = collect_rollouts(trainer, {job: 0}, kept=2, timeout_s=10, block_ms=100)
    seeds = [got[(0, pos)].seed for pos in (0, 1)]
    if not signed:
        assert seeds == [11, 11]   # the same sample twice in one batch
    else:
        assert seeds == [11, 12]
        assert rejected(metrics, "bad_signature") == 1   # the copy moved to position 1
    # after the epoch: the replay of a collected rollout is not the next epoch's
    attacker.xadd(stream_key, {"p": captured, "k": rollout_key(job, 0)})
    nxt = "run-a2-e000001-p00000"
    regenerator.publish(STREAM_ROLLOUTS, rollout(nxt, 21, 0.3), key=rollout_key(nxt, 0))
    got = collect_rollouts(trainer, {nxt: 0}, kept=1, timeout_s=10, block_ms=100)
    assert [r.seed for r in got.values()] == [21]
    for q in (trainer, regenerator):
        q.close()


def test_a_replayed_job_is_skipped_by_the_worker_that_did_it(acl_redis):
    """The workers' side: an ExploreJob replayed after it was processed carries a valid tag, and the explorer's
    Deduplicator (processed job ids, in Redis) skips it."""
    trainer = queue(acl_redis, "trainer", KEY)
    explorer = queue(acl_redis, "explorer", KEY)
    dedup = Deduplicator(explorer, "explorers")
    trainer.publish(STREAM_EXPLORE, b"job bytes", key="run-a3-e000000-p00000")
    (d,) = explorer.consume(STREAM_EXPLORE, "explorers", "w", block_ms=1000)
    assert d.payload == b"job bytes" and not dedup.skip(d)
    dedup.done(d)
    payload = message_tag(KEY.encode(), acl_redis[1], STREAM_EXPLORE, d.key, d.payload) + d.payload
    raw(acl_redis, "trainer").xadd(f"{acl_redis[1]}:{STREAM_EXPLORE}", {"p": payload, "k": d.key})
    (again,) = explorer.consume(STREAM_EXPLORE, "explorers", "w", block_ms=1000)
    assert again.payload == b"job bytes" and dedup.skip(again)   # verified, then skipped: already done
    for q in (trainer, explorer):
        q.close()


def test_the_tag_binds_namespace_stream_and_key():
    inner = InMemoryQueue(QueueConfig(namespace="ns"))
    q = SignedQueue(inner, KEY, "ns")
    for s in ("a", "b"):
        q.ensure_group(s, "g")
    q.publish("a", b"payload", key="k1")
    (d,) = inner.consume("a", "g", "peek")
    tag = d.payload[:32]
    assert tag == message_tag(KEY.encode(), "ns", "a", "k1", b"payload")
    assert len({tag, message_tag(KEY.encode(), "ns2", "a", "k1", b"payload"),
                message_tag(KEY.encode(), "ns", "b", "k1", b"payload"),
                message_tag(KEY.encode(), "ns", "a", "k2", b"payload"),
                message_tag(KEY.encode(), "ns", "a", None, b"payload"),
                message_tag(KEY.encode(), "ns", "a", "k1", b"payloaD")}) == 6
    inner.publish("b", d.payload, key="k1")   # moved to another stream
    assert q.consume("b", "g", "c") == [] and q.rejected == {("b", "bad_signature"): 1}
    with pytest.raises(ValueError, match="key must be at least 16 bytes"):
        SignedQueue(inner, "short", "ns")


# ---------------------------------------------------------------- credentials and ACL users


def test_wrong_credentials_are_a_clear_error_naming_the_url_redacted(acl_redis):
    port = acl_redis[0]
    for u, pw in ((url(port, "trainer"), "not-the-password"), (f"redis://trainer:not-the-password@127.0.0.1:{port}/0",
                                                                 None)):
        q = build_queue(u, QueueConfig(namespace=acl_redis[1]), password=pw)
        with pytest.raises(QueueAuthError) as err:
            q.length(STREAM_ROLLOUTS)
        msg = str(err.value)
        assert f"@127.0.0.1:{port}/0" in msg and "refused user 'trainer'" in msg and "not-the-password" not in msg
        q.close()
    # no user: Redis' default user, which may only PING
    with pytest.raises(QueueAuthError, match="default user"):
        build_queue(f"redis://127.0.0.1:{port}/0", QueueConfig(namespace=acl_redis[1])).length(STREAM_ROLLOUTS)
    with pytest.raises(ValueError, match="give one"):
        build_queue(f"redis://trainer:a@127.0.0.1:{port}/0", password="b")


def test_each_role_may_touch_only_its_streams(acl_redis):
    ns = acl_redis[1]
    for role in ("trainer", "explorer", "regenerator"):
        queue(acl_redis, role).close()   # every role may create the pipeline's groups
    writes = {"trainer": "explore", "explorer": "regenerate", "regenerator": "rollouts"}
    for role, own in writes.items():
        client = raw(acl_redis, role)
        for stream in writes.values():
            if stream == own:
                continue
            with pytest.raises(redis_py.exceptions.NoPermissionError):
                client.xadd(f"{ns}:{stream}", {"p": b"x"})
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            client.keys("*")
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            client.delete(f"{ns}:rollouts")
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            client.flushall()
    # through the queue: a clear error naming the user and the stream
    explorer = queue(acl_redis, "explorer")
    with pytest.raises(QueueAuthError, match=r"user 'explorer' may not do this on stream 'rollouts'"):
        explorer.publish(STREAM_ROLLOUTS, b"x", key="j:0")
    with pytest.raises(QueueAuthError):
        explorer.consume(STREAM_ROLLOUTS, GROUP_TRAINER, "c")
    explorer.close()
    # KEDA's user reads the explore stream's length and pending entries, nothing else
    keda = raw(acl_redis, "keda")
    assert keda.xlen(f"{ns}:explore") == 0 and keda.xpending(f"{ns}:explore", "explorers")["pending"] == 0
    for call in (lambda: keda.xadd(f"{ns}:explore", {"p": b"x"}), lambda: keda.xlen(f"{ns}:rollouts"),
                 lambda: keda.xreadgroup("explorers", "k", {f"{ns}:explore": ">"})):
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            call()
    # unauthenticated: PING only
    anon = redis_py.Redis(port=acl_redis[0])
    assert anon.ping()
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        anon.xlen(f"{ns}:explore")


def test_the_acl_script_refuses_a_missing_password_or_a_bad_namespace(tmp_path):
    for missing in ("SOLRL_REDIS_TRAINER_PASSWORD", "SOLRL_REDIS_EXPLORER_PASSWORD", "SOLRL_REDIS_REGENERATOR_PASSWORD"):
        out = subprocess.run(["sh", str(SCRIPT), str(tmp_path / "users.acl"), "true"], capture_output=True, text=True,
                             env=script_env("ns", **{missing: None}), check=False)
        assert out.returncode == 2 and f"{missing} is not set" in out.stderr
    out = subprocess.run(["sh", str(SCRIPT), str(tmp_path / "users.acl"), "true"], capture_output=True, text=True,
                         env=script_env("ns:*"), check=False)
    assert out.returncode == 2 and "SOLRL_QUEUE_NAMESPACE" in out.stderr
    # written: hashes only, readable by its owner alone, the command run with it (and without the passwords)
    out = subprocess.run(["sh", str(SCRIPT), str(tmp_path / "users.acl"), "sh", "-c", 'echo "$@"; env', "sh"],
                         capture_output=True, text=True, env=script_env("ns"), check=True)
    acl = (tmp_path / "users.acl").read_text()
    assert f"--aclfile {tmp_path / 'users.acl'}" in out.stdout and oct((tmp_path / "users.acl").stat().st_mode)[-3:] \
        == "600"
    for pw in PASSWORDS.values():
        assert pw not in acl and pw not in out.stdout
    assert sorted(line.split()[1] for line in acl.splitlines()) == ["default", "explorer", "keda", "regenerator",
                                                                    "trainer"]
