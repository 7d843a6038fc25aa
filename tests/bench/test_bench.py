"""`solrl bench` at --small settings: the files, their structure and value ranges; the ranking metrics
on inputs whose answers are known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from solrl.bench import run_bench
from solrl.bench.ranking import aggregate, prompt_metrics
from solrl.cli.app import main


def test_ranking_metrics_on_known_orders():
    ref = np.arange(16, dtype=float)
    same = prompt_metrics(ref * 2 + 1, ref)
    assert same["kendall_tau"] == pytest.approx(1) and same["spearman"] == pytest.approx(1)
    assert same["top_4_match"] == 1 and same["bottom_4_false_inclusion"] == 0
    rev = prompt_metrics(-ref, ref)
    assert rev["kendall_tau"] == pytest.approx(-1) and rev["top_4_match"] == 0
    assert rev["bottom_4_false_inclusion"] == 1 and rev["bottom_half_8_false_inclusion"] == 1
    # ties in the reference: any of the tied best seeds is a match
    tied = np.array([1, 1, 1, 1, 1, 0, 0, 0], dtype=float)
    m = prompt_metrics(np.array([0, 1, 2, 3, 4, 5, 6, 7], dtype=float), tied, ks=(4,))
    assert m["top_4_match"] == pytest.approx(1 / 4)  # proxy's top-4 = seeds 7,6,5,4: only seed 4 is tied-best
    flat = aggregate(np.zeros((2, 8)), np.tile(np.arange(8.0), (2, 1)), ks=(4,))
    assert flat["kendall_tau"] is None and flat["prompts_with_correlation"] == 0  # constant proxy: no correlation


def test_ranking_small(tmp_path):
    r = run_bench("ranking", tmp_path, small=True)
    saved = json.loads((tmp_path / "ranking.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(r["rows"])) and "cpu" in saved["machine"]
    assert (tmp_path / "ranking.md").read_text().count("\n|") >= 4
    assert [(row["precision"], row["steps"]) for row in r["rows"]] == [("nvfp4-emu", 2), ("nvfp4-emu", 4),
                                                                     ("mxfp4-emu", 2), ("random", 0)]
    for row in r["rows"]:
        assert -1 <= row["kept_contrast"] <= 1 and (row["kendall_tau_ci95"] is None or row["kendall_tau_ci95"] >= 0)
    for row in r["rows"]:
        for key in ("kendall_tau", "spearman"):
            assert row[key] is None or -1 <= row[key] <= 1
        for key in ("top_k_match", "bottom_k_false_inclusion", "bottom_half_false_inclusion"):
            assert all(0 <= v <= 1 for v in row[key].values()) and set(row[key]) == {"4", "8"}
        if row["precision"] != "random":
            assert row["forwards"] == r["prompts"] * r["seeds_per_prompt"] * row["steps"] and row["sample_s"] > 0
    assert r["reference"]["forwards"] == r["prompts"] * r["seeds_per_prompt"] * r["reference"]["steps"]


@pytest.mark.slow
def test_ranking_with_policies_and_two_rewards(tmp_path, capsys):
    assert main(["bench", "ranking", "--small", "--precisions", "nvfp4-emu@2,bf16@2", "--policies",
                 "reference,keep-projections", "--reward", "shapes,shapes_dense", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "ranking.json").read_text())
    assert [(row["precision"], row["policy"]) for row in r["rows"]] == [
        ("nvfp4-emu", "reference"), ("nvfp4-emu", "keep-projections"), ("bf16", "reference"), ("random", "-")]
    assert r["rewards"] == ["shapes", "shapes_dense"]
    for row in r["rows"]:
        assert set(row["by_reward"]) == {"shapes", "shapes_dense"}
        assert row["by_reward"]["shapes"]["kendall_tau"] == row["kendall_tau"]
    # the two policies quantize different layers, so their images (and dense scores) differ
    dense = [row["by_reward"]["shapes_dense"]["reward_mean"] for row in r["rows"][:2]]
    assert dense[0] != dense[1]
    assert "scored with `shapes_dense`" in (tmp_path / "ranking.md").read_text()
    with pytest.raises(ValueError, match="unknown"):
        run_bench("ranking", tmp_path, small=True, policies=("keep-all",))


def test_rollout_small_through_the_cli(tmp_path, capsys):
    from solrl.precision import runnable_backends

    assert main(["bench", "rollout", "--small", "--seed", "0", "--out", str(tmp_path)]) == 0
    assert "measured rollout speed-up" in capsys.readouterr().out
    r = json.loads((tmp_path / "rollout.json").read_text())
    assert r["machine"]["cpu_flags"] is not None and list(r["by_pool"]) == ["n8"]
    pool = r["by_pool"]["n8"]
    m, p = pool["modes"], pool["prompts"]
    explorers = ["bf16-cpu", "nvfp4-emu"] if "bf16-cpu" in runnable_backends() else ["nvfp4-emu"]
    assert list(m) == ["naive_scaling", "diffusion_nft", *(f"sol_rl:{b}@2" for b in explorers)]
    naive, nft = m["naive_scaling"], m["diffusion_nft"]
    for b in explorers:
        sol = m[f"sol_rl:{b}@2"]
        assert sol["explore_precision"] == b and sol["explore_steps"] == 2
        assert sol["forwards_explore"] == p * sol["pool"] * sol["explore_steps"]
        assert sol["forwards_regenerate"] == nft["forwards_regenerate"] == p * sol["kept"] * sol["steps"]
        s = pool["speedup"][f"sol_rl:{b}@2"]
        assert s["forward_bound_half_cost"] > s["forward_bound_equal_cost"] > 0
        assert s["bound_measured_forwards"] > 0 and s["measured_rollout_cpu"] > 0 and s["hot_reload_share_of_explore_call"] > 0
        assert set(pool["forward_s"][f"sol_rl:{b}@2"]) == {"explore", "regenerate"}
    assert naive["forwards_regenerate"] == p * naive["pool"] * naive["steps"] and naive["forwards_explore"] == 0
    for v in m.values():
        assert v["time_rollout_s"] > 0 and v["time_epoch_s"] >= v["time_rollout_s"]
        assert 0 < v["cpu_rollout_s"] <= v["cpu_epoch_s"]
    with pytest.raises(ValueError, match="unknown backend 'fp3'"):
        run_bench("rollout", tmp_path, small=True, precisions=("fp3",))
    with pytest.raises(ValueError, match="larger than the 4 kept"):
        run_bench("rollout", tmp_path, small=True, pools=(4,))


def test_profile_small_marks_every_training_pass_and_skips_the_reference_without_kl(tmp_path, capsys):
    for kl_beta in ("1e-4", "0"):
        out = tmp_path / kl_beta
        assert main(["bench", "profile", "--small", "--out", str(out), "--set", f"train.kl_beta={kl_beta}"]) == 0
        r = json.loads((out / "profile.json").read_text())
        m, regions = r["median_s"], r["profiled"]["regions_s"]
        assert m["time_epoch_s"] == pytest.approx(sum(m[k] for k in ("time_sync_s", "time_explore_s",
                                                                      "time_regenerate_s", "time_train_s")))
        passes = {"solrl.train.forward_old", "solrl.train.forward", "solrl.train.backward", "solrl.train.optimizer"}
        assert passes <= set(regions) and {"solrl.explore", "solrl.regenerate", "solrl.train"} <= set(regions)
        # the passes lie inside the train region
        assert sum(regions[k] for k in passes) <= regions["solrl.train"]
        # the reference forward runs, and the KL is reported, only with a KL term
        assert ("solrl.train.forward_ref" in regions) == (kl_beta != "0")
        assert all(("train.kl" in t) == (kl_beta != "0") for t in r["train"])
        top = r["profiled"]["ops"]["train"]["top"]
        assert top and all(o["self_s"] >= 0 for o in top) and top[0]["self_s"] >= top[-1]["self_s"]
    assert "kl_beta x KL" in (tmp_path / "1e-4" / "profile.md").read_text()
    assert "kl_beta x KL" not in (tmp_path / "0" / "profile.md").read_text()


def test_bench_rejects_unknown_names_and_options(tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown bench"):
        run_bench("nope", tmp_path)
    with pytest.raises(ValueError, match="does not take seeds"):
        run_bench("rollout", tmp_path, small=True, seeds=4)
    with pytest.raises(ValueError, match="unknown backend 'fp3'"):
        run_bench("ranking", tmp_path, small=True, precisions=("fp3",))
    with pytest.raises(ValueError, match="not NAME or NAME@S1/S2"):
        run_bench("ranking", tmp_path, small=True, precisions=("nvfp4-emu@two",))
    with pytest.raises(ValueError, match="seeds >= 8"):
        run_bench("ranking", tmp_path, small=True, seeds=4)
    assert main(["bench", "ranking", "--small", "--precisions", "fp3", "--out", str(tmp_path)]) == 2
    assert "unknown backend 'fp3'" in capsys.readouterr().err


def test_the_quantized_share_counts_linear_and_conv_work():
    """layer_macs counts what a forward executes: a Linear of 8->4 on 3x5 tokens is 3*5*8*4 MACs, a 3x3 conv of
    2->6 channels on 7x7 (padding 1) is 7*7*6 outputs x 2*9 inputs; the share is the selected layers' part."""
    import torch

    from solrl.bench.curve import explore_share
    from solrl.config import get_preset
    from solrl.precision.base import layer_macs, quantized_mac_share

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
            self.conv = torch.nn.Conv2d(2, 6, 3, padding=1)

        def forward(self, x, img):
            return self.lin(x), self.conv(img)

    net = Net()
    run = lambda: net(torch.zeros(3, 5, 8), torch.zeros(1, 2, 7, 7))  # noqa: E731
    assert layer_macs(net, run) == {"lin": 3 * 5 * 8 * 4, "conv": 7 * 7 * 6 * 2 * 9}
    assert quantized_mac_share(net, ["lin"], run) == pytest.approx(480 / (480 + 5292))
    with pytest.raises(ValueError, match="not called"):
        quantized_mac_share(net, ["other"], run)
    # the bundled model's explorer quantizes its Linear layers, not its convolutions
    share = explore_share(get_preset("shapes-sol-rl"))
    assert 0.05 < share < 0.95


@pytest.mark.slow
def test_ablate_small(tmp_path):
    r = run_bench("ablate", tmp_path, small=True)
    assert [(x["axis"], x["value"]) for x in r["rows"]] == [("pool", 8), ("pool", 12), ("explore_steps", 2),
                                                            ("explore_steps", 4)]
    for x in r["rows"]:
        assert 0 <= x["reward_after"] <= 1 and x["rollout_s_per_epoch"] > 0 and x["kept_reward_std"] >= 0
        assert x["proxy_kendall_tau"] is None or -1 <= x["proxy_kendall_tau"] <= 1
        assert 0 <= x["worst_half_reward"] <= 1 and 0 <= x["best_half_reward"] <= 1
        # equal halves: the kept mean is the mean of the halves' means
        assert x["kept_reward_mean"] == pytest.approx((x["best_half_reward"] + x["worst_half_reward"]) / 2, abs=1e-6)
    assert len({x["reward_before"] for x in r["rows"]}) == 1
    assert "best half / worst half" in (tmp_path / "ablate.md").read_text()


def test_selection_contrast():
    from solrl.engine.session import selection_contrast

    kept = np.array([[0.9, 0.7, 0.1, 0.3], [0.5, 0.6, 0.2, 0.0]])  # per prompt: the proxy's best 2, then worst 2
    assert selection_contrast(kept, "best_worst") == pytest.approx(
        {"rollout.reward_best_half": 0.675, "rollout.reward_worst_half": 0.15})
    assert selection_contrast(kept, "random") == {}


def test_denoisers_small(tmp_path):
    r = run_bench("denoisers", tmp_path, small=True)
    rows = r["rows"]
    assert [x["class"] for x in rows.values()] == ["UNet2DConditionModel", "PixArtTransformer2DModel",
                                                   "SanaTransformer2DModel"]
    for x in rows.values():
        assert x["train_step_s"] > 0 and x["forward_s"] > 0 and 0 < x["nvfp4_quantized_mac_share"] <= 1
    # the PixArt transformer is nearly all Linear work; the UNet's convolutions stay out of the explorer's FP4
    assert rows["pixart patch 4, 6 x 128 (before)"]["nvfp4_quantized_mac_share"] > 0.9
    assert rows["unet 32/64/64 (bundled)"]["nvfp4_quantized_mac_share"] < 0.5
    assert "| unet 32/64/64 (bundled) |" in (tmp_path / "denoisers.md").read_text()


@pytest.mark.slow
def test_sensitivity_small(tmp_path):
    r = run_bench("sensitivity", tmp_path, small=True)
    rows = {(row["group"], row["name"]): row for row in r["rows"]}
    whole = rows[("all", "all")]
    assert whole["pixel_error"] > 0 and 0.2 < whole["mac_share"] < 0.3  # the UNet's Linear layers: 26% of the work
    blocks = [row for row in r["rows"] if row["group"] == "block"]
    kinds = [row for row in r["rows"] if row["group"] == "kind"]
    # every selected layer belongs to exactly one block or the mid block, and to exactly one kind
    assert sum(b["layers"] for b in blocks) == whole["layers"] == sum(k["layers"] for k in kinds)
    assert sum(b["mac_share"] for b in blocks) == pytest.approx(whole["mac_share"])
    assert all(row["pixel_error"] > 0 for row in r["rows"])  # each part alone moves the images
    for k in kinds:  # "all but" a kind quantizes the rest
        assert rows[("all but", f"all but {k['name']}")]["layers"] == whole["layers"] - k["layers"]
    assert "| all (all) | " in (tmp_path / "sensitivity.md").read_text()


def test_pretrain_sweep_small_trains_each_variant_tracks_cfg_and_reuses_finished_runs(tmp_path, monkeypatch):
    from solrl.bench import pretrain_sweep

    res = run_bench("pretrain_sweep", tmp_path, small=True, jobs=2)
    assert set(res["table"]) == {"base", "tw128"}
    for rows in res["table"].values():
        assert [r["step"] for r in rows] == [1, 2]
        assert all(0 <= r["mean"] <= 1 and 0 <= r["guided"] <= 1 for r in rows)
    card = json.loads((tmp_path / "runs" / "tw128_s0" / "step_00002" / "card.json").read_text())["config"]
    assert (card["text_width"], card["text_layers"], card["track_guidance"]) == (128, 4, 3.0)
    assert "| tw128 | 2 |" in (tmp_path / "pretrain_sweep.md").read_text()
    stamp = (tmp_path / "runs" / "base_s0" / "eval.jsonl").stat().st_mtime_ns
    run_bench("pretrain_sweep", tmp_path, small=True)   # finished runs are read again, not retrained
    assert (tmp_path / "runs" / "base_s0" / "eval.jsonl").stat().st_mtime_ns == stamp
    monkeypatch.setattr(pretrain_sweep, "VARIANTS", {"bad": ["--relation-share", "2"]})
    with pytest.raises(RuntimeError, match=r"\['bad_s0'\]"):
        run_bench("pretrain_sweep", tmp_path / "bad", small=True)


def test_relations_bench_pairs_each_prompt_with_its_opposite_on_the_same_seeds(tmp_path, capsys):
    """`bench relations`: the opposite relation of every form, the pair statistics on ground-truth renders (a
    model that reads the word: 1; the same image for both captions: 0), and a small run through the CLI on the
    bundled base that reproduces itself and writes a row per model."""
    from solrl.bench.relations import opposite, relation_prompts, right_both_ways
    from solrl.shapes.reward import ShapesReward
    from solrl.shapes.world import parse, render

    assert opposite("a red circle to the left of a blue square") == "a red circle to the right of a blue square"
    assert opposite("a red circle above a blue square") == "a red circle below a blue square"
    assert opposite(opposite("a cyan triangle below a green circle")) == "a cyan triangle below a green circle"
    with pytest.raises(ValueError, match="not a relation caption: 'a red circle on the left'"):
        opposite("a red circle on the left")
    with pytest.raises(ValueError, match=r"prompts must be in \[1, "):
        relation_prompts(0, 0)
    with pytest.raises(ValueError, match="seeds must be positive, got -1"):
        run_bench("relations", tmp_path, small=True, seeds=-1)
    assert main(["bench", "relations", "--small", "--models", f"{tmp_path / 'nope'}", "--out", str(tmp_path)]) != 0
    assert "shapes model weights not found" in capsys.readouterr().err
    prompts = relation_prompts(6, 3)
    assert prompts == relation_prompts(6, 3) and len(set(prompts)) == 6

    rng = np.random.default_rng(2)
    flips = [opposite(p) for p in prompts]
    a = np.stack([render(parse(p), rng) for p in prompts])
    b = np.stack([render(parse(p), rng) for p in flips])
    reward = ShapesReward()
    da, db = reward.score_detailed(a, prompts), reward.score_detailed(b, flips)
    assert right_both_ways(da, db) == (1.0, 6)
    assert right_both_ways(da, reward.score_detailed(a, flips)) == (0.0, 6)   # one drawing for both words
    blank = np.full_like(a, 250)
    assert right_both_ways(reward.score_detailed(blank, prompts), db) == (None, 0)

    out = tmp_path / "rel"
    assert main(["bench", "relations", "--small", "--out", str(out)]) == 0
    assert "pairs right both ways" in capsys.readouterr().out
    r = json.loads((out / "relations.json").read_text())
    (row,) = r["rows"]
    assert row["model"] == "bundled base" and row["images"] == 2 * 2 * 2
    assert 0 <= row["relation_order_n"] <= row["images"] and 0 <= row["pairs_n"] <= row["images"] // 2
    assert row["pixel_change"] > 0   # the relation word reaches the drawing, if only a little
    again = json.loads((tmp_path / "again" / "relations.json").read_text()) if main(
        ["bench", "relations", "--small", "--out", str(tmp_path / "again")]) == 0 else None
    assert again["rows"] == r["rows"] and again["loss_gap"] == r["loss_gap"]
    # the teacher-forced probe: the bundled base reads the colours (swapping them costs velocity error at high noise)
    # and not the relation word (reversing it costs a fraction of that)
    (probe,) = r["loss_gap"]
    assert probe["model"] == "bundled base" and probe["images"] == 199
    for t in ("t0.9", "t0.95"):
        assert probe[t]["colour_swap_gap"] > 0
        assert abs(probe[t]["reversed_gap"]) < probe[t]["colour_swap_gap"] / 2, probe
    assert "Teacher-forced probe" in (out / "relations.md").read_text()
