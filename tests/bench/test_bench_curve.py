"""`solrl bench curve` at --small settings (held-out reward against cost for the modes): the files, the intervals,
the cost model, other rewards, config overrides, parallel runs and their reuse. Apart from tests/bench/test_bench.py so
that the two, each several minutes, run on different test workers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from solrl.bench import run_bench
from solrl.cli.app import main


@pytest.mark.slow
def test_curve_small(tmp_path):
    r = run_bench("curve", tmp_path, small=True)
    assert set(r["modes"]) == {"sol_rl", "diffusion_nft", "naive_scaling", "naive_quant"} and r["repeats"] == 2
    befores = {run["points"][0]["reward"] for m in r["modes"].values() for run in m["runs"]}
    assert len(befores) == 1  # the same base model and eval seeds before training, whatever the mode or run seed
    for m in r["modes"].values():
        assert [row["epoch"] for row in m["epochs"]] == [0, 1, 2]
        assert m["before"]["reward_ci95"] == 0.0  # identical before training -> an interval of zero width
        for row in m["epochs"]:
            assert row["reward_mean"] == pytest.approx(np.mean(row["rewards"]), abs=1e-4)  # both rounded to 4 places
        costs = [row["cost_bf16_fwd"] for row in m["epochs"]]
        assert costs[0] == 0 and costs == sorted(costs) and costs[-1] > 0
        assert (m["epochs_to_nft_final"] is None) == (m["cost_to_nft_final"] is None)
    assert r["modes"]["diffusion_nft"]["epochs_to_nft_final"] is not None
    # FP4 exploration is costed at 1/4 for the quantized share of the forward, 1 for the rest
    share = r["modes"]["sol_rl"]["runs"][0]["explore_quantized_share"]
    assert 0 < share < 1 and f"hold {share:.0%} of the explore" in (tmp_path / "curve.md").read_text()
    assert len(r["claims"]) == 3 and all("->" in c for c in r["claims"])
    assert (tmp_path / "curve.png").stat().st_size > 1000
    assert "95%" in (tmp_path / "curve.md").read_text()
    # the reward per caption form: each run's points carry the evaluation's by-form means (their mean over the
    # evaluated images equals the reward), the summary their interval, the markdown a before -> final table
    assert sum(r["eval_forms"].values()) == 4   # --small evaluates 4 prompts
    for m in r["modes"].values():
        for run in m["runs"]:
            for p in run["points"]:
                assert set(p["by_form"]) == set(r["eval_forms"])
                weighted = sum(p["by_form"][k] * n for k, n in r["eval_forms"].items()) / 4
                assert weighted == pytest.approx(p["reward"], abs=1e-9)
        final = m["final"]["by_form"]
        for k in r["eval_forms"]:
            assert final[k]["mean"] == pytest.approx(np.mean([run["points"][-1]["by_form"][k] for run in m["runs"]]),
                                                     abs=1e-4)
    md = (tmp_path / "curve.md").read_text()
    assert "Held-out reward by caption form" in md and "| mode | " + " | ".join(sorted(r["eval_forms"])) + " |" in md


def test_curve_interval_and_cost_model():
    from solrl.bench.curve import interval
    from solrl.hardware import forward_cost

    mean, half = interval([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6) and half == pytest.approx(4.302653 * 0.1 / np.sqrt(3), rel=1e-5)
    assert np.isnan(interval([0.5])[1])
    assert (forward_cost("nvfp4-emu"), forward_cost("fp8-e4m3-emu"), forward_cost("bf16")) == (0.25, 0.5, 1.0)
    # only the quantized share of the forward runs at the low-precision rate
    assert forward_cost("nvfp4-emu", 0.4) == pytest.approx(0.6 + 0.4 * 0.25)
    assert forward_cost("bf16", 0.4) == 1.0


def test_curve_prices_flow_grpo_and_reads_modes_at_equal_cost():
    from solrl.bench.curve import MODES, at_equal_cost, claims, difference, markdown, pair_cost
    from solrl.config import apply_overrides, get_preset

    def cost(mode, *sets):  # apply_overrides sets the preset's fields in place: a fresh preset each time
        return pair_cost(apply_overrides(get_preset(MODES[mode][0]), list(sets)))

    grpo = get_preset(MODES["sol_flow_grpo"][0])
    assert grpo.train.algo == "flow_grpo" and get_preset(MODES["flow_grpo"][0]).rollout.pool == grpo.rollout.kept
    assert (cost("sol_rl", "train.kl_beta=1e-4"), cost("sol_rl")) == (5.0, 4.0)  # the shapes presets: no KL term
    # FlowGRPO: trainable forward + backward (3) and the KL reference (1); CFG adds an unconditional forward to each
    assert (cost("sol_flow_grpo"), cost("flow_grpo", "train.kl_beta=0")) == (4.0, 3.0)
    assert cost("sol_flow_grpo", "sampler.guidance=4.5") == 6.0

    def mode(costs, *rewards_per_run):
        runs = [{"points": [{"epoch": i, "cost_bf16_fwd": c, "reward": r} for i, (c, r) in enumerate(zip(costs, rs))]}
                for rs in rewards_per_run]
        final = {"cost_bf16_fwd": costs[-1], "reward_mean": float(np.mean([rs[-1] for rs in rewards_per_run])),
                 "reward_ci95": 0.0}
        return {"runs": runs, "final": final, "before": {"reward_mean": 0.5}, "epochs": [], "cost_per_epoch": costs[1],
                "train_wall_s": 1.0, "epochs_to_nft_final": None, "cost_to_nft_final": None}

    # flow_grpo's epochs cost 100, diffusion_nft's 200: both are read at 200 (nft's final point, flow_grpo's epoch 2)
    modes = {"flow_grpo": mode([0, 100, 200, 300], [0.5, 0.6, 0.70, 0.9], [0.5, 0.6, 0.71, 0.9], [0.5, 0.6, 0.72, 0.9]),
             "diffusion_nft": mode([0, 200], [0.5, 0.60], [0.5, 0.61], [0.5, 0.62])}
    modes["flow_grpo"]["runs"][2]["points"][2]["cost_bf16_fwd"] = 150  # interpolated at 200: 0.72 + (0.9 - 0.72) / 3
    at_equal_cost(modes)
    a, b = modes["flow_grpo"]["at_budget"], modes["diffusion_nft"]["at_budget"]
    assert a["cost_bf16_fwd"] == b["cost_bf16_fwd"] == 200 and (a["epochs"], b["epochs"]) == (2.0, 1.0)
    assert a["rewards"] == [0.7, 0.71, 0.78] and b["rewards"] == [0.6, 0.61, 0.62]
    assert b["reward_ci95"] == pytest.approx(4.302653 * 0.01 / np.sqrt(3), abs=1e-4)  # rounded to 4 places
    modes["flow_grpo"]["runs"][2]["points"][2]["cost_bf16_fwd"] = 200
    at_equal_cost(modes)
    assert modes["flow_grpo"]["at_budget"]["reward_mean"] == pytest.approx(0.71)
    (line,) = claims(modes)  # one pair of the four ran: FlowGRPO against DiffusionNFT in one stage
    assert line.startswith("FlowGRPO vs DiffusionNFT, one stage") and line.endswith("-> flow_grpo is higher")
    assert "difference +0.100 ± " in line  # Welch: sqrt(2 * 0.01^2 / 3) * t(4 dof) = 0.0227
    assert difference([0.7, 0.71, 0.72], [0.6, 0.61, 0.62])[1] == pytest.approx(2.776445 * 0.01 * np.sqrt(2 / 3), rel=1e-5)
    modes["diffusion_nft"]["runs"][0]["points"][1]["reward"] = 0.8  # a wide spread: the difference is not shown
    at_equal_cost(modes)
    assert claims(modes)[0].endswith("-> undecided: the difference's interval holds 0")
    md = markdown({"modes": {k: {**v, "epochs": [{"epoch": 0, "reward_mean": 0.5, "reward_ci95": 0.0}]}
                             for k, v in modes.items()}, "reward": "shapes", "eval_reward": "shapes", "epochs": 3,
                   "repeats": 3, "seed": 0, "eval_every": 1, "claims": claims(modes)})
    assert "| reward at equal cost |" in md and "0.710 ± " in md and "(2.0 ep.)" in md


def test_curve_on_another_reward(tmp_path):
    assert main(["bench", "curve", "--small", "--epochs", "1", "--repeats", "1", "--reward", "jpeg_compressibility",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "curve-jpeg_compressibility.json").read_text())
    assert r["reward"] == "jpeg_compressibility" and "eval.reward=jpeg_compressibility" in r["settings"]
    assert all(p["reward"] < 0 for m in r["modes"].values() for run in m["runs"] for p in run["points"])  # -(JPEG KiB)
    assert (tmp_path / "curve-jpeg_compressibility.png").exists()
    assert not (tmp_path / "curve.json").exists()


def test_curve_takes_config_overrides_and_refuses_bad_ones_before_training(tmp_path, capsys):
    assert main(["bench", "curve", "--small", "--epochs", "1", "--repeats", "1", "--modes", "sol_rl",
                 "--set", "train.beta=0.5", "--set", "reward=shapes_dense", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "curve-sol_rl.json").read_text())
    assert "train.beta=0.5" in r["settings"] and "model.device=cpu" in r["settings"]
    # the report names the reward the runs trained on (set by --set), judged by the preset's exact reward
    assert (r["reward"], r["eval_reward"]) == ("shapes_dense", "shapes")
    assert "Trained on `shapes_dense`, evaluated with `shapes`" in (tmp_path / "curve-sol_rl.md").read_text()
    saved = json.loads((tmp_path / "curve-sol_rl_runs" / "sol_rl_seed0" / "config.json").read_text())
    assert saved["train"]["beta"] == 0.5 and saved["model"]["device"] == "cpu" and saved["reward"] == "shapes_dense"
    for bad, field in ((["--set", "train.betta=1"], "train.betta"), (["--set", "train.beta=-1"], "train.beta"),
                       (["--device", "tpu"], "model.device")):
        capsys.readouterr()
        assert main(["bench", "curve", "--small", "--modes", "sol_rl", "--out", str(tmp_path / "bad"), *bad]) == 2
        assert field in capsys.readouterr().err
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_curve_runs_in_parallel_and_reuses_finished_runs(tmp_path):
    """Two spawned jobs of one thread each give the numbers a run in this process gives (the runs are
    independent); a second call reuses the finished runs; a run asked for with other settings trains again."""
    import torch

    from solrl.bench.curve import one_run

    args = ["bench", "curve", "--small", "--epochs", "1", "--repeats", "2", "--threads", "1", "--jobs", "2",
            "--modes", "sol_rl", "--out", str(tmp_path)]
    assert main(args) == 0
    par = json.loads((tmp_path / "curve-sol_rl.json").read_text())
    assert par["jobs"] == 2 and par["threads_per_run"] == 1 and "threads=1" in par["settings"]
    run_dir = tmp_path / "curve-sol_rl_runs" / "sol_rl_seed1"
    metrics = run_dir / "metrics.jsonl"
    stamp = metrics.stat().st_mtime_ns
    assert main(args) == 0
    assert metrics.stat().st_mtime_ns == stamp  # reused, not retrained
    assert json.loads((tmp_path / "curve-sol_rl.json").read_text())["modes"] == par["modes"]
    threads = torch.get_num_threads()
    try:
        here = one_run("shapes-sol-rl", par["settings"] + ["seed=1"], tmp_path / "here")
        again = one_run("shapes-sol-rl", par["settings"] + ["seed=1", "eval.prompts=3"], run_dir)  # other settings
    finally:
        torch.set_num_threads(threads)
    same = lambda run: [{k: v for k, v in p.items() if k not in ("wall_s", "cpu_s")} for p in run["points"]]  # noqa: E731
    assert same(here) == same(par["modes"]["sol_rl"]["runs"][1])
    assert metrics.stat().st_mtime_ns != stamp and same(again) != same(here)
