"""`solrl bench selection`: the paired arms at --small settings, the paired intervals, the power calculation and
the verdicts, and bad arguments refused before any run starts."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from scipy import stats

from solrl.bench.selection import paired, ratio, reach_share, reach_time, seeds_for, timed, timed_lines, verdict
from solrl.cli.app import main


def test_selection_small_pairs_its_arms(tmp_path):
    args = ["bench", "selection", "--small", "--epochs", "1", "--arms", "none,oracle,proxy_nvfp4"]
    # a one-seed study first, then extended to two seeds from its JSON alone (its run directories elsewhere)
    assert main([*args, "--repeats", "1", "--out", str(tmp_path / "first")]) == 0
    first = json.loads((tmp_path / "first" / "selection.json").read_text())
    assert main([*args, "--out", str(tmp_path), "--extend", str(tmp_path / "first" / "selection.json")]) == 0
    assert sorted(p.name for p in (tmp_path / "selection_runs").iterdir()) == [
        "none_n6_seed1", "oracle_n6_seed1", "proxy_nvfp4_n6_seed1"]  # seed 0 was not trained again
    r = json.loads((tmp_path / "selection.json").read_text())
    for arm, a in first["by_pool"]["n6"]["arms"].items():
        assert r["by_pool"]["n6"]["arms"][arm]["runs"][0] == a["runs"][0]
    assert r["extended_from"][0]["runs"] == ["none_n6_seed0", "oracle_n6_seed0", "proxy_nvfp4_n6_seed0"]
    assert "are read from an earlier `selection.json`" in (tmp_path / "selection.md").read_text()
    assert r["seeds"] == [0, 1] and r["pools"] == [6] and r["kept"] == 4 and r["primary_epochs"] == [1, 1]
    pool = r["by_pool"]["n6"]
    arms = pool["arms"]
    assert list(arms) == ["none", "oracle", "proxy_nvfp4"]
    befores = {run["points"][0]["reward"] for a in arms.values() for run in a["runs"]}
    assert len(befores) == 1  # the same base and held-out seeds before training in every arm and run seed
    for a in arms.values():
        assert [run["seed"] for run in a["runs"]] == [0, 1]
        for run in a["runs"]:
            assert run["primary"] == pytest.approx(run["points"][1]["reward"], abs=1e-4)
            assert len(run["mechanism"]["rollout.half_gap"]) == 1
            assert run["mechanism"]["train.grad_norm"][0] > 0 and run["mechanism"]["train.drift_old"][0] > 0
    # only a proxy has a Kendall tau to report; the oracle's chosen halves are the true extremes of a larger pool, so
    # their gap is at least the gap of the first k seeds (the same pool's noises, paired)
    assert arms["proxy_nvfp4"]["runs"][0]["mechanism"]["proxy_kendall_tau"][0] is not None
    assert arms["none"]["runs"][0]["mechanism"]["proxy_kendall_tau"] == [None]
    for o, n in zip(arms["oracle"]["runs"], arms["none"]["runs"]):
        assert o["mechanism"]["rollout.half_gap"][0] >= n["mechanism"]["rollout.half_gap"][0] - 1e-9
    links = {(x["a"], x["b"]): x for x in pool["links"]}
    assert set(links) == {("oracle", "none"), ("proxy_nvfp4", "oracle"), ("proxy_nvfp4", "none")}
    on = links[("oracle", "none")]
    assert on["diffs"] == pytest.approx([o["primary"] - n["primary"] for o, n in
                                         zip(arms["oracle"]["runs"], arms["none"]["runs"])], abs=2e-4)
    assert pool["power"]["seeds_run"] == 2 and pool["at_equal_cost"]["cost_bf16_fwd"] > 0
    md = (tmp_path / "selection.md").read_text()
    assert "| oracle - none |" in md and "Power:" in md and "paired seeds" in md
    assert (tmp_path / "selection.png").stat().st_size > 1000


def test_paired_interval_power_and_verdicts():
    d = paired([0.80, 0.83, 0.81], [0.78, 0.80, 0.80])
    diffs = np.array([0.02, 0.03, 0.01])
    assert d["mean"] == pytest.approx(0.02) and d["sd"] == pytest.approx(diffs.std(ddof=1), abs=1e-4)
    assert d["ci95"] == pytest.approx(stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / np.sqrt(3), abs=1e-4)
    assert verdict({**d, "a": "oracle", "b": "none"}).startswith("not resolved")  # [-0.005, +0.045]
    assert verdict({"a": "oracle", "b": "none", "mean": 0.02, "ci95": 0.01}).startswith("oracle is higher")
    assert verdict({"a": "x", "b": "y", "mean": 0.001, "ci95": 0.01}).startswith("not resolved")
    assert verdict({"a": "x", "b": "y", "mean": -0.02, "ci95": 0.01}).startswith("y is higher")
    # the pilot: paired sd 0.010 -> 7 seeds for a half-width of 0.01 (t(0.975, 6) 0.01 / sqrt 7 = 0.0092)
    assert seeds_for(0.010) == 7 and seeds_for(0.002) == 3 and seeds_for(0.001) == 2 and seeds_for(1.0, most=50) is None


def _earlier_result(tmp_path, settings: list[str]) -> str:
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"preset": "shapes-sol-rl", "settings": settings, "by_pool": {}}))
    return str(path)


@pytest.mark.parametrize("bad", [["--arms", "none,best"], ["--pools", "4"], ["--pools", "x"],
                                 ["--extend", "missing.json"], ["--extend", "OTHER"]])
def test_selection_refuses_bad_arguments_before_training(tmp_path, bad, capsys):
    if bad == ["--extend", "OTHER"]:  # a result measured with other settings (here: 8 epochs, not --small's)
        bad = ["--extend", _earlier_result(tmp_path, ["epochs=8", "eval.every=1"])]
    with pytest.raises(SystemExit) if bad == ["--pools", "x"] else contextlib.nullcontext():
        assert main(["bench", "selection", "--small", "--out", str(tmp_path), *bad]) == 2
    err = capsys.readouterr().err
    assert ("--arms" in err or "--pools" in err or "--extend" in err) and not (tmp_path / "selection_runs").exists()
    if "--extend" in bad:
        assert ("other settings" in err) != ("cannot read" in err)


def _run(seed: int, rewards: list[float], cost_per_epoch: float) -> dict:
    from solrl.bench.selection import MECHANISM

    pts = [{"epoch": e, "reward": r, "cost_bf16_fwd": e * cost_per_epoch} for e, r in enumerate(rewards)]
    return {"seed": seed, "points": pts, "cost_per_epoch": cost_per_epoch, "primary": float(np.mean(rewards[1:])),
            "mechanism": {k: [0.1] * (len(rewards) - 1) for k in MECHANISM}}


def test_arms_with_fewer_seeds_pair_over_the_seeds_both_ran():
    from solrl.bench.selection import parse_arms, summarise

    assert parse_arms(("none", "oracle", "proxy_nvfp4:2"), 3) == {"none": 3, "oracle": 3, "proxy_nvfp4": 2}
    for bad in (("best",), ("none:x",), ("none:4",), ("none:0",)):
        with pytest.raises(ValueError, match="--arms"):
            parse_arms(bad, 3)
    arms = {"none": {"runs": [_run(s, [0.7, 0.7 + 0.01 * s, 0.72], 100) for s in range(3)]},
            "oracle": {"runs": [_run(s, [0.7, 0.75, 0.76 + 0.01 * s], 120) for s in range(3)]},
            "proxy_nvfp4": {"runs": [_run(s, [0.7, 0.74, 0.75], 110) for s in range(2)]}}
    out = summarise(arms, 2)
    links = {(x["a"], x["b"]): x for x in out["links"]}
    assert links[("oracle", "none")]["seeds"] == [0, 1, 2] and len(links[("proxy_nvfp4", "oracle")]["diffs"]) == 2
    want = [np.mean([0.74, 0.75]) - np.mean([0.7 + 0.01 * s, 0.72]) for s in range(2)]
    assert links[("proxy_nvfp4", "none")]["diffs"] == pytest.approx(want, abs=1e-4)
    # at equal cost: every priced arm read at the smallest final cost (none's 200), oracle at 200 / 120 epochs
    eq = out["at_equal_cost"]
    assert eq["cost_bf16_fwd"] == 200 and eq["reward"]["none"]["mean"] == pytest.approx(0.72)
    oracle_at = [np.interp(200, [0, 120, 240], [0.7, 0.75, 0.76 + 0.01 * s]) for s in range(3)]
    assert eq["reward"]["oracle"]["mean"] == pytest.approx(np.mean(oracle_at), abs=1e-4)
    assert out["power"]["seeds_run"] == 3
    # oracle reaches none's final mean reward (0.72) at epoch 1, at 120 BF16-forward equivalents
    assert arms["oracle"]["epochs_to_none_final"] == 1 and arms["oracle"]["cost_to_none_final"] == 120


def test_a_weighted_rewards_terms_and_blank_canvases_are_paired_and_reported():
    from solrl.bench.curve import reward_settings, reward_tag
    from solrl.bench.selection import markdown, summarise

    spec = "shapes:1+jpeg_compressibility:0.5"
    # a spec is judged by itself (its records carry each term); a single shapes-world reward by the exact one
    assert reward_settings(spec) == [f"reward={spec}", f"eval.reward={spec}"]
    assert reward_settings("shapes_dense") == ["reward=shapes_dense", "eval.reward=shapes"]
    assert reward_tag(spec) == "shapes-1-jpeg_compressibility-0.5" and reward_tag("shapes_dense") == "shapes_dense"

    def run(seed, shapes, jpeg, flat):
        r = _run(seed, [s + 0.5 * j for s, j in zip(shapes, jpeg)], 100)
        for p, s, j, f in zip(r["points"], shapes, jpeg, flat):
            p.update(components={"shapes": s, "jpeg_compressibility": j}, flat_share=f)
        return r

    arms = {"none": {"runs": [run(s, [0.7, 0.71, 0.72], [-1.2, -1.19, -1.18], [0, 0, 0]) for s in range(3)]},
            "oracle": {"runs": [run(s, [0.7, 0.70 - 0.01 * s, 0.69], [-1.2, -1.1, -1.0], [0, 0.1, 0.2])
                                for s in range(3)]}}
    out = summarise(arms, 2)
    terms = {x["term"]: x for x in out["term_links"]}
    assert set(terms) == {"shapes", "jpeg_compressibility"} and terms["shapes"]["seeds"] == [0, 1, 2]
    assert terms["shapes"]["diffs"] == pytest.approx([np.mean([0.70 - 0.01 * s, 0.69]) - 0.715 for s in range(3)])
    assert terms["jpeg_compressibility"]["mean"] == pytest.approx(0.135)
    assert arms["oracle"]["flat_share_by_epoch"] == [0, 0.1, 0.2]
    assert arms["oracle"]["terms_by_epoch"]["jpeg_compressibility"] == [-1.2, -1.1, -1.0]
    md = markdown({"reward": spec, "eval_reward": spec, "preset": "p", "kept": 8, "pools": [16], "epochs": 2,
                   "seeds": [0, 1, 2], "primary_epochs": [1, 2], "arms": {"none": "", "oracle": ""},
                   "seeds_per_arm": {"none": 3, "oracle": 3}, "target_half": 0.01, "by_pool": {"n16": out}}, "x")
    assert "| oracle - none | `jpeg_compressibility` | +0.1350 ± 0.0000 |" in md
    assert "| oracle (0-2) | 0.000 | 0.100 | 0.200 |" in md
    # runs recorded before flat_share and terms were kept (an --extend of an older result) report neither
    old = summarise({"none": {"runs": [_run(s, [0.7, 0.71, 0.72], 100) for s in range(2)]}}, 2)
    assert "term_links" not in old and old["arms"]["none"]["flat_share_by_epoch"] == [None, None, None]
    # a study extended twice names each earlier file with the runs that were new in it
    md = markdown({"reward": spec, "eval_reward": spec, "preset": "p", "kept": 8, "pools": [16], "epochs": 2,
                   "seeds": [0, 1, 2], "primary_epochs": [1, 2], "arms": {"none": ""}, "seeds_per_arm": {"none": 3},
                   "target_half": 0.01, "by_pool": {"n16": old},
                   "extended_from": [{"file": "a.json", "machine": {"cpu": "A"}, "runs": ["none_n16_seed0"]},
                                     {"file": "b.json", "machine": {"cpu": "B"},
                                      "runs": ["none_n16_seed0", "none_n16_seed1"]}]}, "x")
    assert "Runs none_n16_seed0 are read from an earlier `a.json`" in md
    assert "Runs none_n16_seed1 are read from an earlier `b.json`" in md


def test_every_arm_is_the_preset_with_its_choice_changed(capsys):
    from solrl.bench.selection import ARMS, CONSTRAINT_FLOOR, GUARD_ARMS, LINKS, PRESET
    from solrl.config import apply_overrides, get_preset

    # the guards: the preset's proxy arm with one guard on, trained on a reward the constraint's reference is not
    jpeg = ["reward=jpeg_compressibility"]
    guarded = {a: apply_overrides(get_preset(PRESET), jpeg + ARMS[a][0]).validate() for a in GUARD_ARMS}
    plain = apply_overrides(get_preset(PRESET), jpeg).validate()
    assert guarded["proxy_gate"].guard.gate == "flat"
    assert (guarded["proxy_constrained"].guard.reference, guarded["proxy_constrained"].guard.reference_floor) == (
        "shapes", CONSTRAINT_FLOOR) and 0 < CONSTRAINT_FLOOR < 1
    assert guarded["proxy_prompt_std"].train.adv_std == "prompt" and guarded["proxy_kl"].train.kl_beta > 0
    for c in guarded.values():
        assert (c.rollout, c.eval) == (plain.rollout, plain.eval)
    assert {(a, "proxy_nvfp4") for a in GUARD_ARMS} <= {(a, b) for a, b, _ in LINKS}

    cfgs = {a: apply_overrides(get_preset(PRESET), sets).validate() for a, (sets, _) in ARMS.items()
            if a not in GUARD_ARMS}
    assert {a: c.rollout.mode for a, c in cfgs.items()} == {
        "none": "diffusion_nft", "random": "naive_scaling", "oracle": "naive_scaling", "proxy_bf16": "sol_rl",
        "proxy_nvfp4": "sol_rl", "proxy_fp8": "sol_rl", "proxy_bf16cpu": "sol_rl", "proxy_bf16cpu4": "sol_rl"}
    explorers = {a: (c.rollout.explore_precision.backend, c.rollout.explore_steps) for a, c in cfgs.items()
                 if c.rollout.mode == "sol_rl"}
    assert explorers == {"proxy_bf16": ("bf16", 6), "proxy_nvfp4": ("nvfp4-emu", 6), "proxy_fp8": ("fp8-e4m3-emu", 4),
                         "proxy_bf16cpu": ("bf16-cpu", 6), "proxy_bf16cpu4": ("bf16-cpu", 4)}
    # nothing else differs: the trainer, the pool, the regeneration and the evaluation are the preset's
    base = get_preset(PRESET)
    for c in cfgs.values():
        assert (c.train, c.rollout.kept, c.rollout.steps, c.eval) == (base.train, base.rollout.kept, base.rollout.steps,
                                                                       base.eval)
    assert all(a in ARMS and b in ARMS for a, b, _ in LINKS) and ("proxy_fp8", "oracle") in {(a, b) for a, b, _ in LINKS}
    # `solrl bench --help` names every arm
    from solrl.cli.app import main

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(a in help_text for a in ARMS)


def test_guards_are_judged_against_none_and_the_unguarded_proxy():
    from solrl.bench.selection import markdown, retained, summarise

    def run(seed, rewards, flat, ref):
        r = _run(seed, rewards, 100)
        for p, f, x in zip(r["points"], flat, ref):
            p.update(flat_share=f, ref={"shapes": x})
        return r

    seeds = range(4)
    arms = {"none": {"runs": [run(s, [-1.2, -1.18, -1.16], [0, 0, 0.01], [0.75, 0.75, 0.76]) for s in seeds]},
            "proxy_nvfp4": {"runs": [run(s, [-1.2, -1.14, -1.08 - 0.002 * s], [0, 0.02, 0.08], [0.75, 0.72, 0.68])
                                     for s in seeds]},
            # keeps 90% of the gain, the reference and the blanks at none's: the goal is met
            "proxy_gate": {"runs": [run(s, [-1.2, -1.144, -1.088 - 0.0018 * s], [0, 0, 0.01 + 0.001 * s],
                                        [0.75, 0.75, 0.76 + 0.001 * (s - 1.5)]) for s in seeds]},
            # keeps half the gain: missed on the gain alone
            "proxy_kl": {"runs": [run(s, [-1.2, -1.16, -1.12 - 0.001 * s], [0, 0, 0.01], [0.75, 0.75, 0.76])
                                  for s in seeds]}}
    out = summarise(arms, 2)
    g = out["guards"]
    assert g["reference"] == ["shapes"] and list(g["arms"]) == ["proxy_nvfp4", "proxy_gate", "proxy_kl"]
    gate, kl = g["arms"]["proxy_gate"], g["arms"]["proxy_kl"]
    assert gate["kept_share"]["share"] == pytest.approx(0.9, abs=0.01) and gate["goal"]["met"] is True
    assert kl["kept_share"]["share"] == pytest.approx(0.5, abs=0.02)
    assert kl["goal"] == {"gain_kept": False, "reference_held": True, "blank_within_1pt": True, "met": False}
    assert g["arms"]["proxy_nvfp4"]["goal"] is None    # the unguarded proxy is the yardstick, not a guard
    assert g["arms"]["proxy_nvfp4"]["ref_final"]["shapes"]["mean"] == pytest.approx(-0.08)
    assert g["arms"]["proxy_nvfp4"]["flat_final"]["value"] == pytest.approx(0.08)
    assert retained([1.0, 1.0], [0.0, 0.0], [0.0, 0.0]) == {"share": None}   # no gain to keep
    md = markdown({"reward": "jpeg_compressibility", "eval_reward": "jpeg_compressibility", "preset": "p", "kept": 8,
                   "pools": [32], "epochs": 2, "seeds": list(seeds), "primary_epochs": [1, 2],
                   "arms": dict.fromkeys(arms, ""), "seeds_per_arm": dict.fromkeys(arms, 4), "target_half": 0.01,
                   "by_pool": {"n32": out}}, "x")
    assert "| proxy_kl (0-3) | " in md and md.count("| no (gain) |") == 1 and "| yes |" in md
    assert "| proxy_nvfp4 | 0.750 | 0.720 | 0.680 |" in md     # the reference reward per epoch


def _timed_run(seed: int, rewards: list[float], cpu_per_epoch: float, rollout_share: float) -> dict:
    """A run record as `one_run` writes it: held-out reward per evaluated epoch (0..E) and measured seconds."""
    points = [{"epoch": e, "reward": w, "cpu_s": e * cpu_per_epoch, "wall_s": e * cpu_per_epoch * 1.1}
              for e, w in enumerate(rewards)]
    total = cpu_per_epoch * (len(rewards) - 1)
    return {"seed": seed, "points": points, "seconds": {"cpu_epoch": total, "wall_epoch": 1.1 * total,
                                                        "cpu_rollout": rollout_share * total,
                                                        "wall_rollout": 1.1 * rollout_share * total}}


def test_timed_speedups_time_to_reach_and_equal_seconds():
    pts = [{"reward": 0.0, "cpu_s": 0.0}, {"reward": 0.4, "cpu_s": 10.0}, {"reward": 0.8, "cpu_s": 20.0}]
    assert reach_time(pts, 0.6, "cpu_s") == pytest.approx(15.0)
    assert reach_time(pts, 0.0, "cpu_s") == 0.0 and reach_time(pts, 0.9, "cpu_s") is None
    r = ratio([2.0, 4.0, 8.0], [1.0, 2.0, 4.0])
    assert r["mean"] == pytest.approx(2.0) and r["ci95"] == pytest.approx([2.0, 2.0])
    # naive scaling: 10 CPU s an epoch; the proxy learns as fast per epoch but takes 6.5 s an epoch (its rollout
    # half the time): it reaches naive's final reward in 0.65 of naive's time, and is ahead at equal seconds
    curve = [0.50, 0.55, 0.60, 0.65, 0.70]
    oracle = [_timed_run(s, [w + 0.01 * s for w in curve], 10.0, 0.7) for s in range(4)]
    proxy = [_timed_run(s, [w + 0.01 * s + 0.001 * (1 + s % 3) for w in curve], 6.5, 0.7 * 0.5) for s in range(4)]
    arms = {"oracle": {"runs": oracle}, "proxy_bf16cpu": {"runs": proxy}, "none": {"runs": [dict(r) for r in oracle]}}
    arms["none"]["runs"] = [{k: v for k, v in r.items() if k != "seconds"} for r in oracle]  # untimed: left out
    t = timed(arms)
    assert list(t["arms"]) == ["proxy_bf16cpu"]
    row = t["arms"]["proxy_bf16cpu"]
    assert row["speedup_epoch_cpu"]["mean"] == pytest.approx(10 / 6.5, rel=1e-3)
    assert row["speedup_rollout_cpu"]["mean"] == pytest.approx(7 / (0.35 * 6.5), rel=1e-3)
    assert row["reach_cpu"]["share"] == pytest.approx(0.65, abs=0.01)
    lo, hi = row["reach_cpu"]["ci95"]
    assert 0.6 < lo <= row["reach_cpu"]["share"] <= hi < 0.66 and row["reach_cpu"]["unreached_resamples"] == 0
    assert row["at_equal_cpu"]["seconds"] == pytest.approx(26.0) and row["at_equal_cpu"]["mean"] > 0.03
    assert reach_share(proxy[:1], oracle[:1], "cpu_s") == {"share": pytest.approx(0.65, abs=0.01)}
    # a proxy that never gets there
    slow = [_timed_run(s, [0.5] * 5, 6.5, 0.35) for s in range(4)]
    t2 = timed({"oracle": {"runs": oracle}, "proxy_bf16cpu": {"runs": slow}})["arms"]["proxy_bf16cpu"]
    assert t2["reach_cpu"]["share"] is None and t2["reach_cpu"]["unreached_resamples"] == 1.0
    md = "\n".join(timed_lines(t, {"oracle": {"seconds_per_epoch": {"cpu_epoch": 10.0, "cpu_rollout": 7.0}},
                                   "proxy_bf16cpu": {"seconds_per_epoch": {"cpu_epoch": 6.5}}}, 4))
    assert "| proxy_bf16cpu (4) | 6.5 | 3.08x" in md and "0.64 [" in md and "proxy_bf16cpu is higher" in md
    assert row["reach_cpu_before_last"]["share"] == pytest.approx(0.65, abs=0.01)   # epoch 3's level, at 0.65x its time
    assert t2["reach_cpu_before_last"]["share"] is None
    # the reference's reward at each epoch: the proxy reaches each epoch's level at 0.65x naive's time to it
    by = row["reach_cpu_by_epoch"]
    assert list(by) == ["1", "2", "3", "4"] and by["4"] == row["reach_cpu"] and by["3"] == row["reach_cpu_before_last"]
    # (the proxy's head start of 0.00175 is 0.035 of an epoch's gain: it reaches epoch e's level at e - 0.035 epochs)
    assert [x["share"] for x in by.values()] == pytest.approx([(e - 0.035) * 0.65 / e for e in range(1, 5)], abs=1e-3)
    assert all(x["share"] is None for x in t2["reach_cpu_by_epoch"].values())
    assert "| ep. 1 | ep. 2 | ep. 3 | ep. 4 |" in md and "| proxy_bf16cpu | 0.6" in md
    assert timed({"proxy_bf16cpu": {"runs": proxy}}) is None   # no naive scaling arm: nothing to time against
