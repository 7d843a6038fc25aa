"""Pipelined epochs (rollout.staleness): 0 is the on-policy loop; 1 samples epoch e+1's rollouts with the adapter
before epoch e's update (version e-1), embedded (same semantics, deterministic, exact resume) and over real Redis
(the driver publishes epoch e+1's jobs before it trains epoch e; every Rollout records the version it was sampled
with, explorer and regenerator), plus bad values refused naming the key.

The model is the seeded random shapes model of tests/engine/test_loop.py; the services tests use the tiny config and
real Redis (127.0.0.1:6379) of tests/services/test_distributed.py.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from services.common.metrics import ServiceMetrics, TrainingMetrics
from services.explorer.consumer import explorer_worker
from services.regenerator.consumer import regenerator_worker
from solrl.config import ConfigError, RunConfig, apply_overrides, get_preset
from solrl.engine.checkpoint import latest_checkpoint, load_adapters
from solrl.engine.loop import train
from solrl.engine.queue_loop import check_versions, run_distributed
from solrl.engine.session import Session, epoch_rng
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.telemetry import read_metrics, strip_timings
from tests.algo.test_flow_grpo import RATIO_TOL
from tests.engine.test_loop import random_model_dir, tiny_cfg  # noqa: F401  (a module-scoped fixture)
from tests.services.test_distributed import TINY as DIST_TINY
from tests.services.test_distributed import model_dir, planes, queue  # noqa: F401  (fixtures)

STALE = ["rollout.staleness=1"]
ROLLOUT_KEYS = ("explore.reward_mean", "explore.reward_std", "rollout.reward_mean", "rollout.reward_std", "proxy_gap",
                "proxy_kendall_tau")


def quiet(*_):
    return None


def epochs_of(path):
    return [r for r in read_metrics(path / "metrics.jsonl") if r["epoch"] > 0]


# ---------------------------------------------------------------- embedded


def test_staleness_zero_is_the_on_policy_loop_and_one_lags_by_a_version(random_model_dir, tmp_path):  # noqa: F811
    on, lag = tmp_path / "on", tmp_path / "lag"
    train(tiny_cfg(random_model_dir, epochs=2), on, progress=False, log=quiet)
    train(tiny_cfg(random_model_dir, epochs=2, extra=STALE), lag, progress=False, log=quiet)
    r_on, r_lag = epochs_of(on), epochs_of(lag)
    assert [r["adapter_version"] for r in r_on] == [0, 1] and "train.adapter_version" not in r_on[0]
    assert not list(on.glob("checkpoints/*/rollout_adapter.safetensors"))  # staleness 0 writes what it always did
    assert [r["adapter_version"] for r in r_lag] == [0, 0] and [r["train.adapter_version"] for r in r_lag] == [0, 1]
    # epoch 1 samples with version 0 either way: the same epoch, bit for bit; epoch 2 samples with another adapter
    same = {k: v for k, v in strip_timings(r_lag[0]).items() if k != "train.adapter_version"}
    assert same == strip_timings(r_on[0])
    # (the same trainer state after epoch 1, so the loss differs only through the rollouts' x0)
    assert r_lag[1]["train.loss"] != r_on[1]["train.loss"]


def test_staleness_one_samples_epoch_e_plus_1_with_version_e_minus_1(random_model_dir):  # noqa: F811
    """Epoch 3's rollouts under staleness 1 are those of the version-1 adapter, bit for bit, not version 2's."""
    cfg = tiny_cfg(random_model_dir, epochs=3, extra=STALE)
    lag = Session.build(cfg)
    recs = [lag.epoch(e) for e in range(2)]
    assert [r["adapter_version"] for r in recs] == [0, 0] and [r["train.adapter_version"] for r in recs] == [0, 1]
    assert lag.version == 2 and lag.rollout_version() == 1

    def epoch_3(sess, stale):
        with sess.sampling_adapter() if stale else contextlib.nullcontext():
            return sess.rollouts(*epoch_rng(cfg.seed, 2, 0), {})[0]

    x0_lag = epoch_3(lag, True)
    on = Session.build(tiny_cfg(random_model_dir, epochs=3))  # on-policy, one epoch: holds version 1
    on.epoch(0)
    assert on.version == 1
    assert torch.equal(x0_lag, epoch_3(on, False))
    assert not torch.equal(x0_lag, epoch_3(lag, False))  # version 2 (the trainer's) samples other rollouts
    # the trainer's own "old" adapter is put back bit for bit after sampling with the kept one
    before = [p.clone() for p in lag.adapters.parameters("old")]
    epoch_3(lag, True)
    assert all(torch.equal(a, b) for a, b in zip(before, lag.adapters.parameters("old"), strict=True))
    assert lag.epoch(2)["adapter_version"] == 1


def test_resume_with_staleness_one_is_bit_identical(random_model_dir, tmp_path):  # noqa: F811
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(random_model_dir, epochs=3, extra=STALE), full, progress=False, log=quiet)
    train(tiny_cfg(random_model_dir, epochs=2, extra=STALE), part, progress=False, log=quiet)
    assert (part / "checkpoints/epoch_0002/rollout_adapter.safetensors").exists()
    train(tiny_cfg(random_model_dir, epochs=3, extra=STALE), part, resume=True, progress=False, log=quiet)
    for name in ("adapters.safetensors", "optimizer.safetensors", "rollout_adapter.safetensors"):
        assert (full / "checkpoints/epoch_0003" / name).read_bytes() == (part / "checkpoints/epoch_0003" / name).read_bytes()
    assert (full / "adapter_ema.safetensors").read_bytes() == (part / "adapter_ema.safetensors").read_bytes()

    def train_only(path):
        return [{k: v for k, v in strip_timings(r).items() if not k.startswith("eval.")}
                for r in read_metrics(path / "metrics.jsonl")]

    assert train_only(full) == train_only(part) and len(train_only(part)) == 4
    assert train_only(part)[3]["adapter_version"] == 1


def test_flow_grpo_with_staleness_one_sees_the_behaviour_policy_ratio(random_model_dir):  # noqa: F811
    """The recorded log-probs are version e-1's: an epoch's first step has ratio 1 only while there was no update
    between sampling and training (epoch 1); afterwards the ratio is pi_e / pi_(e-1), and PPO clips around it."""
    sess = Session.build(tiny_cfg(random_model_dir, "shapes-sol-flow-grpo", extra=STALE))
    recs = [sess.epoch(e) for e in range(3)]
    assert [r["adapter_version"] for r in recs] == [0, 0, 1]
    assert recs[0]["train.ratio_max_dev_first_step"] <= RATIO_TOL
    for r in recs[1:]:
        assert r["train.ratio_max_dev_first_step"] > 100 * RATIO_TOL
    # the trainer's own "old" copy is the policy after the update; the next epoch samples with the one before it
    assert all(torch.equal(o, n) for o, n in zip(sess.adapters.parameters("old"), sess.adapters.trainable_parameters()))
    assert not all(torch.equal(o, n) for o, n in zip(sess.rollout_old, sess.adapters.trainable_parameters()))


@pytest.mark.parametrize("value, message", [
    ("2", r"rollout.staleness must be 0 \(on-policy\) or 1 .*, got 2$"),
    ("-1", r"rollout.staleness must be 0 \(on-policy\) or 1 .*, got -1$"),
    ("one", "rollout.staleness"),
])
def test_bad_staleness_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_preset("shapes-sol-rl"), [f"rollout.staleness={value}"]).validate()


def test_staleness_from_a_config_file_and_with_the_adaptive_proxy(tmp_path):
    d = get_preset("shapes-sol-rl").to_dict()
    d["rollout"]["staleness"] = True  # a bool is not a staleness
    path = tmp_path / "c.json"
    import json

    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="rollout.staleness"):
        RunConfig.load(path).validate()
    with pytest.raises(ConfigError, match=r"rollout.staleness=1 with rollout.explore_precision.backend=auto"):
        apply_overrides(get_preset("shapes-sol-rl"), STALE + ["rollout.explore_precision.backend=auto"]).validate()
    assert apply_overrides(get_preset("shapes-sol-flow-grpo"), STALE).validate().rollout.staleness == 1


# ---------------------------------------------------------------- services


def test_check_versions_names_the_versions_found():
    def roll(regen, explore=None):
        r = common_pb2.Rollout(job_id="j", seed=1, adapter_version=common_pb2.AdapterVersion(version=regen))
        if explore is not None:
            r.explore_adapter_version.CopyFrom(common_pb2.AdapterVersion(version=explore))
        return r

    check_versions([roll(3, 3), roll(3)], 3, 0)
    with pytest.raises(RuntimeError, match=r"epoch 5: rollouts sampled with adapter versions 4 \(regenerator\), its "
                                           r"jobs asked for exactly 3"):
        check_versions([roll(3, 3), roll(4, 3)], 3, 4)
    with pytest.raises(RuntimeError, match=r"2 \(explorer\)"):
        check_versions([roll(3, 2)], 3, 0)
    with pytest.raises(RuntimeError, match="explore_adapter_version"):
        check_versions([roll(3)], 3, 0, require_explorer=True)


def run_services(cfg, queue, out, run_id):  # noqa: F811
    """run_distributed with an explorer and a regenerator worker over `queue`; returns what the rollout services
    saw: each explore / regenerate call's (kind, version, start, end), the pushes, the trainer's update intervals
    and the versions recorded in the rollouts the driver collected."""
    explorer, regenerator = planes(cfg)
    calls, pushes, updates, recorded, published = [], [], [], [], []
    lock = threading.Lock()

    def timed(kind, fn):
        def call(*a, **kw):
            t0 = time.monotonic()
            out_ = fn(*a, **kw)
            with lock:
                calls.append((kind, out_.version, t0, time.monotonic()))
            return out_
        return call

    explorer.explore = timed("explore", explorer.explore)
    regenerator.regenerate = timed("regenerate", regenerator.regenerate)

    def push(data: bytes, version: int, sha256: str) -> None:
        for plane in (explorer, regenerator):
            plane.hot.load(data, version=version, sha256=sha256)
        pushes.append((version, time.monotonic()))

    def on_session(remote):
        update, collect, publish = remote.sess.trainer.update, remote.collect, remote.publish

        def timed_publish(epoch, version):
            published.append((epoch, version, time.monotonic()))
            return publish(epoch, version)

        def timed_update(*a, **kw):
            t0 = time.monotonic()
            out_ = update(*a, **kw)
            updates.append((t0, time.monotonic()))
            return out_

        def versions_collect(*a, **kw):
            got = collect(*a, **kw)
            recorded.append(sorted({(ro.adapter_version.version, ro.explore_adapter_version.version)
                                    for ro in got.values()}))
            return got

        remote.sess.trainer.update, remote.collect, remote.publish = timed_update, versions_collect, timed_publish

    workers = [explorer_worker(queue, explorer, block_ms=50), regenerator_worker(queue, regenerator, block_ms=50)]
    training = TrainingMetrics(ServiceMetrics("trainer"), run_id, cfg.epochs)  # the trainer service's gauges
    for w in workers:
        w.start()
    try:
        run_distributed(cfg, out, queue, push, run_id=run_id, rollout_timeout_s=120, log=quiet, on_session=on_session,
                        on_record=training.observe_epoch)
    finally:
        for w in workers:
            w.stop()
    assert training.adapter_version.labels(run_id)._value.get() == cfg.epochs  # the trainer's, not the rollouts'
    return calls, pushes, updates, recorded, published


@pytest.mark.parametrize("preset", ["shapes-sol-rl", "shapes-sol-flow-grpo"])
def test_services_mode_pipelines_and_matches_the_embedded_run(model_dir, queue, tmp_path, preset):  # noqa: F811
    """staleness 1 over real Redis: epoch e+1's jobs are sampled while the trainer trains epoch e, with the adapter
    before that update, and the run equals the embedded staleness-1 run (exactly for flow_grpo, whose regenerator
    LoRA arithmetic is the trainer's; to the merge rounding of the existing nft comparison otherwise)."""
    cfg = apply_overrides(get_preset(preset), DIST_TINY + [f"model.path={model_dir}", "epochs=3", *STALE]).validate()
    calls, pushes, updates, recorded, published = run_services(cfg, queue, tmp_path / "dist", "s1")
    dist = epochs_of(tmp_path / "dist")
    assert [r["adapter_version"] for r in dist] == [0, 0, 1] and [r["train.adapter_version"] for r in dist] == [0, 1, 2]
    # every rollout records one version, the same for explorer and regenerator, the one its epoch asked for
    assert recorded == [[(0, 0)], [(0, 0)], [(1, 1)]]
    assert [v for v, _ in pushes] == [1]  # version 0 is the base; version 2 would only sample a 4th epoch
    # the driver publishes epoch e+1's jobs (for the version before epoch e's update) before it trains epoch e
    assert [(e, v) for e, v, _ in published] == [(0, 0), (1, 0), (2, 1)]
    assert published[1][2] < updates[0][0] and published[2][2] < updates[1][0]
    # the overlap: epoch 2's jobs were explored and regenerated while the trainer trained epoch 1 (2 prompts a job
    # each, 2 per epoch), and epoch 3's while it trained epoch 2, each with the version before that update
    by_epoch = [calls[i:i + 4] for i in range(0, 12, 4)] if len(calls) == 12 else None
    assert by_epoch is not None, calls
    for e in (1, 2):
        t_start, t_end = updates[e - 1]
        started = [c for c in by_epoch[e] if c[0] == "explore"]
        assert started and min(c[2] for c in started) < t_end, (e, by_epoch[e], updates)
        assert {c[1] for c in by_epoch[e]} == {e - 1}
    push_time = pushes[0][1]
    assert all(c[3] <= push_time for c in calls if c[1] == 0)  # no push while version-0 calls ran

    emb = Session.build(cfg)
    emb_recs = [emb.epoch(e) for e in range(cfg.epochs)]
    exact = cfg.train.algo == "flow_grpo"
    for d, e in zip(dist, emb_recs, strict=True):
        assert d["adapter_version"] == e["adapter_version"] and d["train.adapter_version"] == e["train.adapter_version"]
        if exact:
            assert d["rollout.reward_mean"] == e["rollout.reward_mean"] and d["proxy_gap"] == e["proxy_gap"]
            for key in ("train.loss", "train.kl", "train.clip_frac", "train.grad_norm", "train.ratio_max_dev_first_step"):
                assert d[key] == e[key], key
        else:
            assert d["rollout.reward_mean"] == pytest.approx(e["rollout.reward_mean"], abs=1e-4)
            assert d["train.loss"] == pytest.approx(e["train.loss"], rel=1e-6)
            assert d["proxy_gap"] == pytest.approx(e["proxy_gap"], abs=1e-6)
    got = Session.build(cfg)
    load_adapters(latest_checkpoint(tmp_path / "dist"), got.adapters)
    base = Session.build(cfg).adapters.state_dict("default")
    for name in ("default", "old", "ema"):
        a, b = got.adapters.state_dict(name), emb.adapters.state_dict(name)
        moved = max((b[k] - base[k]).abs().max().item() for k in b)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert moved > 0 and (worst == 0.0 if exact else worst <= 1e-3 * moved), (name, worst, moved)
