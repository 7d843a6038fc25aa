"""The adaptive proxy: candidates, cost models, the choice, the controller, and runs with backend "auto"."""

from __future__ import annotations

import json
import math

import pytest

from solrl.config import ConfigError, apply_overrides, get_preset
from solrl.engine.proxy import ProxyController, choose
from solrl.rollout.candidates import Candidate, model_cost, parse_candidate

SMALL = ["epochs=2", "eval.every=0", "tensorboard=false", "rollout.prompts_per_epoch=2", "rollout.pool=6",
         "rollout.kept=4", "eval.prompts=2", "eval.seeds_per_prompt=1", "lora.rank=4", "lora.alpha=8",
         "train.micro_batch=8", "threads=1", "rollout.explore_precision.backend=auto", "rollout.proxy.prompts=2",
         "rollout.proxy.seeds=8", "rollout.proxy.target=0.95", "rollout.proxy.patience=1"]


def small(*extra: str):
    return apply_overrides(get_preset("shapes-sol-rl"), SMALL + list(extra)).validate()


def test_candidates_parse_and_bad_input_fails_at_validation() -> None:
    assert parse_candidate("fp8-e4m3-emu@4/keep-first-block") == Candidate("fp8-e4m3-emu", 4, "keep-first-block")
    assert parse_candidate("nvfp4-emu@6").name == "nvfp4-emu@6"
    for bad, word in [('["fp3@4"]', "unknown format 'fp3'"), ('["nvfp4-emu"]', "FORMAT@STEPS"),
                      ('["nvfp4-emu@0"]', "FORMAT@STEPS"), ('["bf16@4/keep-all"]', "unknown policy 'keep-all'"),
                      ('["bf16@11"]', "more steps than the full rollout"), ("[]", "at least one")]:
        with pytest.raises(ConfigError, match=word):
            small(f"rollout.proxy.candidates={bad}")
    for bad, word in [("rollout.proxy.target=0", r"target must be in \(0, 1\]"),
                      ("rollout.proxy.target=1.5", r"target must be in \(0, 1\]"),
                      ("rollout.proxy.device=tpu", "device must be one of"),
                      ("rollout.proxy.seeds=2", "seeds >= 4")]:
        with pytest.raises(ConfigError, match=word):
            small(bad)
    with pytest.raises(ConfigError, match="no FP4 on Hopper"):
        small("rollout.proxy.device=h100", 'rollout.proxy.candidates=["nvfp4-emu@4"]')
    with pytest.raises(ConfigError, match="unknown precision backend 'int3'"):
        apply_overrides(get_preset("shapes-sol-rl"), ["rollout.explore_precision.backend=int3"]).validate()


def test_cost_models() -> None:
    c4, f8, b6 = Candidate("nvfp4-emu", 4), Candidate("fp8-e4m3-emu", 4), Candidate("bf16", 6)
    assert model_cost(c4, "b200", 1.0) == 1.0 and model_cost(f8, "b200", 1.0) == 2.0 and model_cost(b6, "b200", 1.0) == 6
    assert model_cost(c4, "b200", 0.4) == pytest.approx(4 * (0.6 + 0.4 * 0.25))  # only the quantized share is cheaper
    assert model_cost(c4, "h100", 1.0) is None and model_cost(f8, "h200", 1.0) == 2.0


def row(name, tau, cost, runs=True, target=0.6):
    return {"candidate": name, "kendall_tau": tau, "cost_per_seed": cost, "runs_on_device": runs,
            "meets_target": runs and not math.isnan(tau) and tau >= target}


def test_choice_is_the_cheapest_that_meets_the_target_else_the_best_tau() -> None:
    rows = [row("a@6", 0.9, 6.0), row("b@4", 0.7, 2.0), row("c@2", 0.4, 1.0), row("d@4", 0.95, 0.5, runs=False)]
    assert choose(rows) == ("b@4", ["c@2", "b@4", "a@6"], True)   # d cannot run on the device
    rows = [row("a@6", 0.5, 6.0), row("b@4", 0.55, 2.0), row("c@2", float("nan"), 1.0)]
    assert choose(rows) == ("b@4", ["c@2", "b@4", "a@6"], False)  # none meets: the best tau
    with pytest.raises(ValueError, match="none can run"):
        choose([row("d@4", 0.9, 1.0, runs=False)])


def test_controller_moves_up_after_patience_epochs_below_target() -> None:
    c = ProxyController(["c@2", "b@4", "a@6"], "c@2", target=0.6, patience=2)
    assert c.observe(1, 0.5) is None and c.below == 1
    assert c.observe(2, 0.7) is None and c.below == 0           # a good epoch resets the count
    assert c.observe(3, float("nan")) is None and c.below == 0  # no measurement: nothing changes
    assert c.observe(4, 0.5) is None
    d = c.observe(5, 0.4)
    assert d == {"epoch": 5, "from": "c@2", "to": "b@4", "reason": "kept-seed Kendall tau below 0.6 for 2 epochs"}
    assert c.state() == {"proxy.candidate": "b@4", "proxy.below_target_epochs": 0}
    c.observe(6, 0.1), c.observe(7, 0.1), c.observe(8, 0.1), c.observe(9, 0.1)
    assert c.current == "a@6" and c.observe(10, 0.1) is None  # the top of the ladder: stays


@pytest.mark.slow
def test_a_run_with_auto_calibrates_records_and_uses_its_choice(tmp_path) -> None:
    """Built so the answer is clear: at target 0.95 only BF16 at the full 10 steps ranks like the BF16
    reference (tau 1), so it wins over the cheaper 1-step NVFP4 and 2-step FP8 proxies; its explore
    forwards are 10 steps per seed. Resuming after epoch 1 continues the same records."""
    from solrl.engine.loop import train

    cfg = small('rollout.proxy.candidates=["nvfp4-emu@1", "bf16@10", "fp8-e4m3-emu@2"]')
    train(cfg, tmp_path / "a", progress=False, log=lambda *_: None)
    cal = json.loads((tmp_path / "a" / "calibration.json").read_text())
    assert len(cal) == 1 and cal[0]["chosen"] == "bf16@10" and cal[0]["met_target"]
    taus = {c["candidate"]: c["kendall_tau"] for c in cal[0]["candidates"]}
    assert taus["bf16@10"] == 1.0 and taus["nvfp4-emu@1"] < 0.95 and taus["fp8-e4m3-emu@2"] < 0.95
    assert cal[0]["ladder"][-1] == "bf16@10"  # the dearest
    recs = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["proxy.chosen"] == "bf16@10"
    assert all(r["proxy.candidate"] == "bf16@10" and r["forwards_explore"] == 2 * 6 * 10 for r in recs[1:])
    # resume: one epoch, then the second from its checkpoint
    cfg1 = small('rollout.proxy.candidates=["nvfp4-emu@1", "bf16@10", "fp8-e4m3-emu@2"]', "epochs=1")
    train(cfg1, tmp_path / "b", progress=False, log=lambda *_: None)
    train(cfg, tmp_path / "b", resume=True, progress=False, log=lambda *_: None)
    again = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    keys = ("proxy.candidate", "proxy.below_target_epochs", "rollout.reward_mean", "train.loss", "proxy_kendall_tau")
    assert [[r.get(k) for k in keys] for r in again] == [[r.get(k) for k in keys] for r in recs]


@pytest.mark.slow
def test_a_switch_rebuilds_the_explorer_one_rung_up(tmp_path) -> None:
    from solrl.engine.session import Session

    cfg = small('rollout.proxy.candidates=["bf16@10", "fp32@10"]')
    sess = Session.build(cfg)
    fields = sess.setup_proxy(tmp_path, 0, log=lambda *_: None)
    assert fields["proxy.chosen"] == "bf16@10" and sess.explorer.backend.name == "bf16"
    rec = {"proxy_kendall_tau": 0.2}
    sess.after_epoch(1, rec, tmp_path, log=lambda *_: None)  # patience 1: one epoch below the target moves up
    assert rec["proxy.switch"]["to"] == "fp32@10" and rec["proxy.candidate"] == "fp32@10"
    assert sess.explorer.backend.name == "fp32" and sess.explore_steps() == 10
    # the trainer service's session calibrates and decides the same way, but builds no explorer of its own
    remote = Session.build(cfg, local_explorer=False)
    (tmp_path / "remote").mkdir()
    assert remote.setup_proxy(tmp_path / "remote", 0, log=lambda *_: None)["proxy.chosen"] == "bf16@10"
    assert remote.explorer is None and remote.explore_steps() == 10


@pytest.mark.slow
def test_calibrate_command_on_hopper_costs_leaves_fp4_out(tmp_path, capsys) -> None:
    from solrl.cli.app import main

    assert main(["calibrate", "--out", str(tmp_path), "--set", "rollout.proxy.prompts=1", "--set",
                 "rollout.proxy.seeds=4", "--set", 'rollout.proxy.candidates=["nvfp4-emu@2", "fp8-e4m3-emu@10"]',
                 "--set", "rollout.proxy.device=h100", "--set", "rollout.proxy.target=0.01"]) == 0
    out = capsys.readouterr().out
    cal = json.loads((tmp_path / "calibration.json").read_text())
    rows = {c["candidate"]: c for c in cal["candidates"]}
    assert rows["nvfp4-emu@2"]["cost_per_seed"] is None and not rows["nvfp4-emu@2"]["runs_on_device"]
    assert cal["ladder"] == ["fp8-e4m3-emu@10"] and cal["chosen"] == "fp8-e4m3-emu@10"
    assert "n/a" in out and "chosen: fp8-e4m3-emu@10" in out
    # the same measurements under B200 costs: FP4 runs there and is cheaper, and tau 0.01 is met by any proxy
    # that ranks at all (else the best tau)
    b200 = cal["chosen_by_device"]["b200"]
    assert b200 in rows and cal["chosen_by_device"]["h100"] == "fp8-e4m3-emu@10"
    if rows["nvfp4-emu@2"]["meets_target"] or rows["nvfp4-emu@2"]["kendall_tau"] >= 0.01:
        assert b200 == "nvfp4-emu@2"
    assert rows["fp8-e4m3-emu@10"]["cost_per_seed"] == pytest.approx(10 * (1 - rows["fp8-e4m3-emu@10"]["quantized_share"] / 2),
                                                                    abs=1e-3)  # the share is rounded to 4 places
