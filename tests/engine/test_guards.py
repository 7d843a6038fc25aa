"""Guards against reward hacking (`guard` and `train.adv_std` in the run config): the validity gate before ranking,
the constrained reward, per-prompt normalisation; their config checks and a run that records them (on the services:
tests/services/test_distributed.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solrl.algo import compute_advantages, select
from solrl.algo.guards import below_floor, demote
from solrl.config import ConfigError, apply_overrides, get_preset
from solrl.engine.loop import train
from solrl.engine.session import Session
from solrl.telemetry import read_metrics
from tests.engine.test_loop import random_model_dir, strip_timings, tiny_cfg  # noqa: F401  (a fixture)


def test_demote_scores_a_failing_sample_as_its_groups_lowest():
    rewards = np.array([[0.9, 0.1, 0.5, 0.4], [0.8, 0.7, 0.6, 0.3]])
    bad = np.array([[True, False, False, False], [False, False, True, True]])
    out, n = demote(rewards, bad)
    assert n == 3
    assert out.tolist() == [[0.1, 0.1, 0.5, 0.4], [0.8, 0.7, 0.3, 0.3]]
    assert rewards[0, 0] == 0.9   # a copy
    every, n = demote(rewards, np.ones_like(bad))
    assert n == 8 and (every == rewards.min(axis=1, keepdims=True)).all()   # the whole group fails: no contrast left
    adv = compute_advantages(torch.from_numpy(every.reshape(-1)), [0] * 4 + [1] * 4)
    assert torch.count_nonzero(adv) == 0
    with pytest.raises(ValueError, match="one shape"):
        demote(rewards, bad[:, :2])
    assert below_floor([0.0, 0.25, 0.3], 0.25).tolist() == [True, False, False]


def test_the_gate_keeps_failing_candidates_out_of_the_best_half():
    scores = [0.9, 0.8, 0.1, 0.5, 0.4, 0.3]
    valid = [False, True, True, True, True, False]   # the two failing: the highest and a low one
    assert select(scores, 4) == [0, 1, 2, 5]                         # no gate: the failing best is kept as best
    assert select(scores, 4, valid=valid) == [1, 3, 2, 4]            # gated: only the four valid, best first
    # fewer valid than k: the failing ones fill the worst half, lowest-scored first, never the best half
    few = [False, False, True, False, True, False]
    got = select(scores, 4, valid=few)
    assert got[:2] == [4, 2] and set(got[2:]) == {5, 3}
    assert select(scores, 2, mode="random", generator=torch.Generator().manual_seed(0), valid=valid)[0] in (1, 2, 3, 4)
    assert set(select(scores, 4, mode="random", generator=torch.Generator().manual_seed(0), valid=valid)) == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="valid must have one entry a score"):
        select(scores, 4, valid=valid[:3])


def test_per_prompt_normalisation_divides_by_each_groups_own_std():
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.1, 10.0, 14.0], dtype=torch.float64)
    groups = [0, 0, 1, 1, 2, 2]
    glob = compute_advantages(rewards, groups)
    per = compute_advantages(rewards, groups, std="prompt")
    assert torch.allclose(per, torch.tensor([-1.0, 1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64), atol=2e-3)
    assert abs(glob[5]) > 10 * abs(glob[3])    # globally, the widely spread group dominates; per prompt, none does
    with pytest.raises(ValueError, match="std must be 'global' or 'prompt'"):
        compute_advantages(rewards, groups, std="batch")


@pytest.mark.parametrize("override, message", [
    (["guard.gate=blank"], "guard.gate must be one of"),
    (["guard.gate=flat", "rollout.selection=random"], "needs rollout.selection=best_worst"),
    (["guard.reference=nope"], "guard.reference: unknown reward 'nope'"),
    (["guard.reference=shapes"], "a reward the run does not train on"),   # the preset trains the shapes reward
    (["guard.reference_floor=0.3"], "name the reward it holds"),
    (["train.adv_std=batch"], "train.adv_std must be one of"),
])
def test_guard_config_is_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_preset("shapes-sol-rl"), override).validate()


def test_session_guards_demote_blank_canvases_and_samples_under_the_reference_floor(random_model_dir):  # noqa: F811
    cfg = tiny_cfg(random_model_dir, extra=["guard.gate=flat", "guard.reference=shapes", "guard.reference_floor=0.25"])
    sess = Session.build(cfg)
    noise = np.random.default_rng(0).integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
    images = noise.copy()
    images[1] = 230                       # a blank canvas: fails the gate, and scores 0 on the shapes reward
    prompts = ["a red circle"] * 2 + ["a blue square"] * 2
    by_prompt = np.array([[0.2, 0.9], [0.5, 0.1]])
    rec: dict = {}
    out = sess.guard_rewards(images, prompts, by_prompt, rec)
    assert out[0].tolist() == [0.2, 0.2]   # the blank best of prompt 0 now scores as its group's worst
    assert rec["guard.gate_trained_share"] == 0.25
    ref = sess.untrained_scorer("shapes")(images, prompts)
    assert rec["guard.reference_mean"] == pytest.approx(float(np.mean(ref)))
    assert rec["guard.demoted_share"] == pytest.approx(float(((ref < 0.25) | [False, True, False, False]).mean()))
    gate = sess.gate_valid()
    assert gate(images).tolist() == [True, False, True, True]


def test_a_guarded_run_records_its_guards_and_is_reproducible(random_model_dir, tmp_path):  # noqa: F811
    extra = ["guard.gate=flat", "guard.reference=shapes", "guard.reference_floor=0.25", "train.adv_std=prompt"]
    recs = []
    for name in ("a", "b"):
        train(tiny_cfg(random_model_dir, epochs=1, extra=extra), tmp_path / name, progress=False, log=lambda *_: None)
        recs.append([strip_timings(r) for r in read_metrics(tmp_path / name / "metrics.jsonl")])
    assert recs[0] == recs[1]
    first = recs[0][1]
    for key in ("guard.failed_share", "guard.gate_trained_share", "guard.reference_mean",
                "guard.reference_below_share", "guard.demoted_share"):
        assert 0 <= first[key] <= (1 if key != "guard.reference_mean" else 1.0), key
    # the oracle arm gates its full-step pool the same way
    train(tiny_cfg(random_model_dir, epochs=1, extra=["rollout.mode=naive_scaling", "guard.gate=flat"]),
          tmp_path / "oracle", progress=False, log=lambda *_: None)
    assert "guard.failed_share" in read_metrics(tmp_path / "oracle" / "metrics.jsonl")[1]


def test_the_configs_gate_names_are_the_registered_checks():
    from solrl.algo.guards import GATE_CHECKS, gate_check
    from solrl.config.schema import GATES

    assert GATES == ("", *GATE_CHECKS)
    assert gate_check("") is None and gate_check("flat") is GATE_CHECKS["flat"]
    with pytest.raises(ValueError, match=r"job.gate: unknown validity gate 'blurry'"):
        gate_check("blurry", "job.gate")
