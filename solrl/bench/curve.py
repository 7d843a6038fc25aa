"""Held-out exact reward per epoch for sol_rl, diffusion_nft, naive_scaling and naive_quant, over several
training seeds per mode: mean and 95% interval per epoch, cost in BF16-forward equivalents beside CPU
wall-clock, and which of the paper's convergence claims held.

Each mode runs its preset `repeats` times (run seeds seed, seed+1, ...), the same epochs and prompts per
epoch, evaluated every few epochs on the same held-out prompts and seeds (evaluation time not counted).

Cost model (B200 bound, as the paper's hardware; solrl/hardware.py): a denoiser forward costs 1 in BF16 (or FP32), 1/2 in
FP8 and 1/4 in FP4 for the share of its multiply-accumulates that the low-precision backend quantizes
(measured per run: convolutions and layers kept in high precision stay at 1); a training (sample, timestep) pair
costs the old and reference forwards plus the
trainable forward and its backward (backward = 2 forwards), 5 in all (4 without the KL reference).
Wall-clock on CPU counts emulated low precision, which costs more than BF16 here.

`modes` picks the modes to train (default the paper's four); `sol_rl_auto` is sol_rl with the adaptive proxy
(rollout.explore_precision.backend=auto, its default rollout.proxy settings): each epoch's explore forwards are
priced at the format of the candidate it explored with, and each calibration's sampling (the BF16 reference at
full steps plus every candidate) is added to the cost. `compare` reads the modes of an earlier result with the
same settings, so a new mode is set beside runs that were already measured.

`reward` trains on another reward (results `curve-<reward>`); `eval_reward` defaults to the exact
`shapes` reward for shapes-world rewards (so a run trained on `shapes_dense` is still judged exactly).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from solrl.algo import timestep_count
from solrl.bench.common import SMALL_RUN, write_results
from solrl.config import apply_overrides, get_preset
from solrl.engine.loop import train
from solrl.hardware import forward_cost
from solrl.rewards.multi import is_spec

PAPER_MODES = ("sol_rl", "diffusion_nft", "naive_scaling", "naive_quant")
# mode -> (preset, settings added to the preset's)
MODES: dict[str, tuple[str, list[str]]] = {
    "sol_rl": ("shapes-sol-rl", []), "diffusion_nft": ("shapes-diffusion-nft", []),
    "naive_scaling": ("shapes-naive-scaling", []), "naive_quant": ("shapes-naive-quant", []),
    "sol_rl_auto": ("shapes-sol-rl", ["rollout.explore_precision.backend=auto"]),
    # FlowGRPO (train.algo=flow_grpo) one stage (SDE rollouts in BF16, pool = kept) and two stage (the explorer
    # ranks with the ODE in low precision, the kept seeds are regenerated with the SDE)
    "flow_grpo": ("shapes-flow-grpo", []), "sol_flow_grpo": ("shapes-sol-flow-grpo", []),
}


def explore_share(cfg) -> float:
    """Share of one explore forward's Linear + Conv2d multiply-accumulates in the layers the run's explore
    backend quantizes (1.0 for a backend that quantizes nothing, whose rate is 1 anyway)."""
    import torch

    from solrl.models import load_model
    from solrl.precision import build_backend
    from solrl.precision.base import quantized_mac_share, with_model_skips

    model = load_model(cfg.model.name, cfg.model.path)
    spec = model.spec
    backend = build_backend(with_model_skips(cfg.rollout.explore_precision, spec.quant_skip, spec.quant_min_features))
    selected = backend.selected_layers(model.transformer)
    if not selected:
        return 1.0
    x = torch.zeros(1, *spec.latent_shape)
    cond = model.encode(["a red circle"]) if cfg.model.name == "shapes" else model.encode_uncond(1)
    return quantized_mac_share(model.transformer, selected,
                               lambda: model.velocity(model.transformer, x, torch.tensor([0.5]), cond))


def epoch_cost(rec: dict[str, Any], cfg, share: float = 1.0, proxy_shares: dict[str, float] | None = None) -> float:
    """BF16-forward equivalents of one epoch's rollouts and training (see the module doc); `share`: the explore
    forward's quantized share (explore_share). An adaptive-proxy epoch (`explore.proxy` in its record) is priced at
    its candidate's format and quantized share (`proxy_shares`, from the run's calibrations)."""
    backend = cfg.rollout.explore_precision.backend
    if "explore.proxy" in rec:
        from solrl.rollout.candidates import parse_candidate

        backend, share = parse_candidate(rec["explore.proxy"]).backend, (proxy_shares or {})[rec["explore.proxy"]]
    explore = rec.get("forwards_explore", 0) * forward_cost(backend, share)
    regen = rec.get("forwards_regenerate", 0) * forward_cost(cfg.rollout.precision.backend)
    k = timestep_count(cfg.rollout.steps, cfg.train.timestep_fraction)
    return explore + regen + rec.get("train.samples", 0) * k * pair_cost(cfg)


def pair_cost(cfg) -> float:
    """BF16-forward equivalents of one trained (sample, timestep) pair (backward = 2 forwards). DiffusionNFT: the
    old and reference forwards (no grad) plus the trainable forward and backward, 5 (4 without the KL reference).
    FlowGRPO: the trainable forward and backward, 3, plus the reference forward for its KL; with classifier-free
    guidance each of those velocities adds the unconditional forward (no grad), as the trainer computes them."""
    kl = cfg.train.kl_beta > 0
    if cfg.train.algo == "flow_grpo":
        cfg_branch = 1.0 if cfg.sampler.guidance != 1.0 else 0.0
        return 3.0 + cfg_branch + (1.0 + cfg_branch if kl else 0.0)
    return 5.0 if kl else 4.0


def calibration_cost(cal: dict[str, Any]) -> float:
    """BF16-forward equivalents of one adaptive-proxy calibration: every calibration seed sampled by the BF16
    reference at full steps and by each candidate at its explore steps, priced as the module doc says."""
    from solrl.rollout.candidates import parse_candidate

    n = len(cal["prompts"]) * cal["seeds_per_prompt"]
    per_seed = cal["reference"]["steps"] + sum(
        row["steps"] * forward_cost(parse_candidate(row["candidate"]).backend, row["quantized_share"])
        for row in cal["candidates"])
    return n * per_seed


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval); half-width NaN for a single value."""
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2:
        return float(a.mean()), float("nan")
    return float(a.mean()), float(stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a)))


def reward_tag(reward: str) -> str:
    """`reward` as a file-name part: a weighted spec's separators become dashes (`shapes:1+jpeg_compressibility:0.5`
    -> `shapes-1-jpeg_compressibility-0.5`)."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", reward).strip("-")


def reward_settings(reward: str | None, eval_reward: str | None = None) -> list[str]:
    """The settings that train on `reward` ([] for the default `shapes`), judged by `eval_reward`, by default the exact
    `shapes` reward for a shapes-world reward and the reward itself otherwise."""
    if not reward or reward == "shapes":
        return []
    # a weighted spec is judged by itself (its records carry each term, eval.reward_<component>)
    judge = eval_reward or ("shapes" if reward.startswith("shapes") and not is_spec(reward) else reward)
    return [f"reward={reward}", f"eval.reward={judge}"]


def threads_per_run(jobs: int, threads: int) -> int:
    """Torch threads of each of `jobs` runs at once: `threads` if set, else the cores shared out (0 for one job: it
    keeps the process's own threads)."""
    import os

    return threads or (max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0)


def one_run(preset: str, sets: list[str], run_dir: Path) -> dict[str, Any]:
    """Train one run (or reuse it: a finished run of the same preset and settings is read back from
    `curve_run.json`, so an interrupted benchmark continues where it stopped)."""
    done = run_dir / "curve_run.json"
    if done.exists():
        saved = json.loads(done.read_text())
        if saved.get("preset") == preset and saved.get("settings") == sets:
            return saved["result"]
    cfg = apply_overrides(get_preset(preset), sets).validate()
    if run_dir.exists():  # an unfinished or differently-set run: start it again
        import shutil

        shutil.rmtree(run_dir)
    train(cfg, run_dir, progress=False, log=lambda *_: None)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    auto = cfg.rollout.explore_precision.backend == "auto"
    share = 1.0 if auto else explore_share(cfg)
    cals = json.loads((run_dir / "calibration.json").read_text()) if auto else []
    proxy_shares = {row["candidate"]: row["quantized_share"] for cal in cals for row in cal["candidates"]}
    cost = cal_cost = 0.0
    seconds = dict.fromkeys(("wall_rollout", "cpu_rollout", "wall_epoch", "cpu_epoch"), 0.0)
    points = []
    for r in recs:
        for kind, key in (("wall", "time"), ("cpu", "cpu")):  # measured seconds, evaluation excluded
            seconds[f"{kind}_rollout"] += r.get(f"{key}_explore_s", 0.0) + r.get(f"{key}_regenerate_s", 0.0)
            seconds[f"{kind}_epoch"] += r.get(f"{key}_epoch_s", 0.0)
        cost += epoch_cost(r, cfg, share, proxy_shares) if r["epoch"] > 0 else 0.0
        if "eval.mean_reward" in r:
            points.append({"epoch": r["epoch"], "wall_s": round(seconds["wall_epoch"], 2),
                           "cpu_s": round(seconds["cpu_epoch"], 2),
                           "cost_bf16_fwd": round(cost, 1),
                           "reward": r["eval.mean_reward"], "exact_match": r.get("eval.exact_match"),
                           "shape_accuracy": r.get("eval.shape_accuracy"), "flat_share": r.get("eval.flat_share"),
                           "reward_not_flat": r.get("eval.mean_reward_not_flat"),
                           "duplicate_share": r.get("eval.duplicate_share"),
                           "ref": {k[len("eval.ref."):]: v for k, v in r.items() if k.startswith("eval.ref.")},
                           "components": {k[len("eval.reward_"):]: v for k, v in r.items() if k.startswith("eval.reward_")},
                           "by_form": {k[len("eval.form_"):]: v for k, v in r.items() if k.startswith("eval.form_")}})
        for cal in cals:  # a calibration after epoch e is paid for by epoch e + 1
            if cal["epoch"] == r["epoch"]:
                c = calibration_cost(cal)
                cost, cal_cost = cost + c, cal_cost + c
    result = {"points": points, "train_wall_s": round(seconds["wall_epoch"], 2),
              "seconds": {k: round(v, 2) for k, v in seconds.items()},
              "cost_bf16_fwd": round(cost, 1),
              "explore_quantized_share": round(share, 4),
              "cost_per_epoch": round(cost / max(1, recs[-1]["epoch"]), 1)}
    if auto:
        result.update({"explore_proxies": [r["explore.proxy"] for r in recs if "explore.proxy" in r],
                       "calibrations": [{"epoch": c["epoch"], "chosen": c["chosen"], "met_target": c["met_target"],
                                         "taus": {row["candidate"]: round(row["kendall_tau"], 3)
                                                  for row in c["candidates"]}} for c in cals],
                       "switches": [r["proxy.switch"] for r in recs if "proxy.switch" in r],
                       "calibration_cost_bf16_fwd": round(cal_cost, 1)})
    done.write_text(json.dumps({"preset": preset, "settings": sets, "result": result}, indent=1))
    return result


def run_all(jobs: list[tuple[str, list[str], Path]], workers: int) -> list[dict[str, Any]]:
    """one_run over `jobs`, `workers` at a time in spawned processes (each run sets its own torch threads
    through `threads=`); results in the order of `jobs`. Runs are independent, so the order they finish in
    changes nothing."""
    if workers <= 1:
        return [one_run(*j) for j in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(one_run, *zip(*jobs)))


def eval_forms(preset: str, sets: list[str]) -> dict[str, int]:
    """How many of the run's evaluated prompts have each caption form (a shapes-world set; {} otherwise)."""
    from collections import Counter

    from solrl.config import apply_overrides, get_preset
    from solrl.engine.evaluate import eval_prompt_set
    from solrl.shapes.metrics import caption_form
    from solrl.shapes.prompts import is_shapes_set

    cfg = apply_overrides(get_preset(preset), list(sets))
    if not is_shapes_set(cfg.prompts.eval):
        return {}
    return dict(sorted(Counter(caption_form(c) for c in eval_prompt_set(cfg.prompts.eval, cfg.eval.prompts)).items()))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per evaluated epoch: mean and 95% interval of the reward (and exact match) over the runs."""
    epochs = [p["epoch"] for p in runs[0]["points"]]
    table = []
    for i, e in enumerate(epochs):
        rewards = [r["points"][i]["reward"] for r in runs]
        mean, half = interval(rewards)
        row = {"epoch": e, "reward_mean": round(mean, 4), "reward_ci95": round(half, 4) if not math.isnan(half) else None,
               "rewards": [round(x, 4) for x in rewards],
               "cost_bf16_fwd": float(np.mean([r["points"][i]["cost_bf16_fwd"] for r in runs])),
               "wall_s": float(np.mean([r["points"][i]["wall_s"] for r in runs]))}
        em = [r["points"][i]["exact_match"] for r in runs]
        if all(x is not None for x in em):
            m, h = interval(em)
            row.update({"exact_match_mean": round(m, 4), "exact_match_ci95": round(h, 4) if not math.isnan(h) else None})
        forms = [r["points"][i].get("by_form") or {} for r in runs]
        shared = sorted(set.intersection(*(set(f) for f in forms)))
        if shared:  # the shapes world's reward per caption form (single, position, count, relation)
            row["by_form"] = {}
            for name in shared:
                m, h = interval([f[name] for f in forms])
                row["by_form"][name] = {"mean": round(m, 4), "ci95": round(h, 4) if not math.isnan(h) else None}
        table.append(row)
    return {"epochs": table, "final": table[-1], "before": table[0],
            "cost_per_epoch": float(np.mean([r["cost_per_epoch"] for r in runs])),
            "train_wall_s": float(np.mean([r["train_wall_s"] for r in runs]))}


def run(out: Path, small: bool = False, epochs: int | None = None, seed: int = 0, reward: str | None = None,
        repeats: int | None = None, eval_reward: str | None = None, jobs: int = 1,
        threads: int = 0, modes: tuple[str, ...] | None = None, compare: str | None = None,
        device: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """`jobs` runs train at once, each on `threads` torch threads (0: the cores shared out between the jobs);
    runs already finished under `out` with the same settings are reused. `modes`: which to train (default the
    paper's four); `compare`: an earlier curve JSON whose modes (same settings) are set beside these. `device`:
    each run's model.device (e.g. cuda: the jobs share the GPU); `overrides`: config overrides for every run (a variant
    of the presets, recorded in the results' settings)."""
    chosen = tuple(modes or PAPER_MODES)
    unknown = [m for m in chosen if m not in MODES]
    if unknown or not chosen:
        raise ValueError(f"--modes: unknown mode(s) {unknown}; available: {sorted(MODES)}")
    n_epochs = epochs or (2 if small else 12)
    n_runs = repeats or (2 if small else 3)
    every = 1 if small else max(2, n_epochs // 6)
    sets = [f"epochs={n_epochs}", f"eval.every={every}", "tensorboard=false"]
    sets += reward_settings(reward, eval_reward)
    name = f"curve-{reward_tag(reward)}" if reward and reward != "shapes" else "curve"
    if small:
        sets += ["rollout.pool=6", "rollout.kept=4", *SMALL_RUN]
    per_run = threads_per_run(jobs, threads)
    if per_run:  # 0: a single job keeps the process's own torch threads
        sets.append(f"threads={per_run}")
    extra = list(overrides) + ([f"model.device={device}"] if device else [])
    if extra:  # checked now, not in a worker after the other runs have started
        for mode in chosen:
            apply_overrides(get_preset(MODES[mode][0]), sets + MODES[mode][1] + extra).validate()
        sets += extra
    # what the runs train and are judged on as configured, so a `--set reward=...` shows in the report too
    effective = apply_overrides(get_preset(MODES[chosen[0]][0]), sets + MODES[chosen[0]][1])
    trained_on, judge = effective.reward, effective.eval.reward or effective.reward
    earlier = _compared(Path(compare), sets, n_epochs, n_runs, seed, chosen) if compare else {}
    if set(chosen) != set(PAPER_MODES):
        name += "-" + "-".join(chosen)
    plan = [(mode, MODES[mode][0], sets + MODES[mode][1] + [f"seed={seed + i}"],
             out / f"{name}_runs" / f"{mode}_seed{seed + i}") for mode in chosen for i in range(n_runs)]
    results = run_all([p[1:] for p in plan], jobs)
    modes: dict[str, Any] = dict(earlier)
    for mode in chosen:
        runs = [r for p, r in zip(plan, results) if p[0] == mode]
        modes[mode] = {"runs": runs, **summarise(runs)}
    target = modes["diffusion_nft"]["final"]["reward_mean"] if "diffusion_nft" in modes else None
    for m in modes.values():
        hit = (next((row for row in m["epochs"] if row["epoch"] > 0 and row["reward_mean"] >= target), None)
               if target is not None else None)
        m["epochs_to_nft_final"] = hit["epoch"] if hit else None
        m["cost_to_nft_final"] = hit["cost_bf16_fwd"] if hit else None
    at_equal_cost(modes)
    result = {"eval_forms": eval_forms(MODES[chosen[0]][0], sets),
              "epochs": n_epochs, "eval_every": every, "repeats": n_runs, "seed": seed, "jobs": jobs,
              "threads_per_run": per_run, "reward": trained_on, "trained_modes": list(chosen),
              "compared_with": {"file": Path(compare).name, "modes": sorted(earlier)} if compare else None,
              "eval_reward": judge, "settings": sets, "nft_final_reward": target, "claims": claims(modes), "modes": modes}
    plot(modes, out / f"{name}.png", judge)
    return write_results(out, name, result, markdown(result, name))


def at_equal_cost(modes: dict[str, Any]) -> None:
    """Set each mode's `at_budget`: its held-out reward at the compute every mode reached (the smallest final cost
    over the modes, BF16-forward equivalents), read off each run's curve by linear interpolation between its
    evaluated epochs (epoch 0 at cost 0); mean and 95% interval over the run seeds. Modes whose cost per epoch
    differs are compared here at the same compute, as the epochs' columns cannot."""
    if not modes:
        return
    budget = min(m["final"]["cost_bf16_fwd"] for m in modes.values())
    for m in modes.values():
        rewards = []
        for run in m["runs"]:
            cost = [p["cost_bf16_fwd"] for p in run["points"]]
            rewards.append(float(np.interp(budget, cost, [p["reward"] for p in run["points"]])))
        mean, half = interval(rewards)
        m["at_budget"] = {"cost_bf16_fwd": round(budget, 1), "reward_mean": round(mean, 4),
                          "reward_ci95": None if math.isnan(half) else round(half, 4),
                          "rewards": [round(x, 4) for x in rewards],
                          "epochs": round(budget / m["cost_per_epoch"], 2) if m["cost_per_epoch"] else None}


def _compared(path: Path, sets: list[str], epochs: int, repeats: int, seed: int,
              chosen: tuple[str, ...]) -> dict[str, Any]:
    """The modes of an earlier curve result, if it was measured with the same settings (else a clear error:
    runs with other settings are not comparable); modes trained now are not taken from it."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--compare: cannot read {path}: {exc}") from None
    mine = {"settings": sets, "epochs": epochs, "repeats": repeats, "seed": seed}
    theirs = {k: old.get(k) for k in mine}
    if theirs != mine:
        raise ValueError(f"--compare: {path} was measured with other settings: {theirs} (now: {mine})")
    return {k: v for k, v in old["modes"].items() if k not in chosen}


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ha, hb = a["reward_ci95"] or 0.0, b["reward_ci95"] or 0.0
    return abs(a["reward_mean"] - b["reward_mean"]) <= ha + hb


def claims(modes: dict[str, Any]) -> list[str]:
    """The paper's convergence claims, checked on these runs (intervals: 95% Student-t over run seeds)."""
    out = []
    if "sol_rl" in modes and "sol_rl_auto" in modes:
        sol, auto = modes["sol_rl"], modes["sol_rl_auto"]
        ratio = auto["cost_per_epoch"] / sol["cost_per_epoch"]
        same = _overlap(sol["final"], auto["final"])
        out.append(f"the adaptive proxy (sol_rl_auto) ends at {auto['final']['reward_mean']:.3f} vs the fixed explorer's "
                   f"{sol['final']['reward_mean']:.3f} at {ratio:.2f}x its cost per epoch, calibrations included -> "
                   f"{'same reward within the intervals' if same else 'the intervals are apart'}")
    out += _grpo_claims(modes)
    if not all(m in modes for m in PAPER_MODES):
        return out
    sol, nft, naive, quant = (modes[k] for k in PAPER_MODES)
    s_cost, n_cost = sol["cost_to_nft_final"], nft["cost_to_nft_final"]
    if s_cost is not None and n_cost:
        ratio = s_cost / n_cost
        at = next(row for row in sol["epochs"] if row["cost_bf16_fwd"] == s_cost)
        twin = next(row for row in nft["epochs"] if row["epoch"] == at["epoch"])
        apart = not _overlap(at, twin)
        verdict = ("held" if ratio <= 0.22 and apart else
                   "faster, not by the paper's margin" if ratio < 1 and apart else
                   "not shown: the intervals of the two modes overlap at that epoch" if ratio < 1 else "did not hold")
        out.append(f"sol_rl reaches diffusion_nft's final mean reward at {ratio:.2f}x diffusion_nft's cost "
                   f"(paper: up to 4.64x faster convergence, i.e. <= 0.22x) -> {verdict}")
    else:
        out.append("sol_rl does not reach diffusion_nft's final mean reward in this budget -> did not hold")
    same = _overlap(sol["final"], naive["final"])
    out.append(f"sol_rl's final reward {sol['final']['reward_mean']:.3f} vs naive_scaling's "
               f"{naive['final']['reward_mean']:.3f} at {sol['cost_per_epoch'] / naive['cost_per_epoch']:.2f}x its cost "
               f"per epoch (paper: quality within ~1% of naive scaling) -> "
               f"{'held (intervals overlap)' if same else 'did not hold (intervals apart)'}")
    worse = quant["final"]["reward_mean"] < sol["final"]["reward_mean"] and not _overlap(quant["final"], sol["final"])
    out.append(f"naive_quant (training on low-precision samples) ends at {quant['final']['reward_mean']:.3f} vs sol_rl's "
               f"{sol['final']['reward_mean']:.3f} (paper: degrades) -> "
               f"{'held' if worse else 'not shown at this budget (intervals overlap or it is not lower)'}")
    return out


def difference(a: list[float], b: list[float]) -> tuple[float, float]:
    """(mean(a) - mean(b), half-width of its 95% Welch interval): the runs of two modes are independent samples
    with their own spread; NaN half-width with fewer than two runs on a side."""
    from scipy import stats

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = float(x.mean() - y.mean())
    if len(x) < 2 or len(y) < 2:
        return diff, float("nan")
    if x.var() + y.var() == 0:  # no spread on either side: scipy's interval is undefined (0 / 0)
        return diff, 0.0
    ci = stats.ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
    return diff, float(ci.high - ci.low) / 2


def _versus(modes: dict[str, Any], a: str, b: str, what: str) -> str:
    """`a` against `b` at the same compute (at_equal_cost): the difference of their means with its Welch interval."""
    x, y = modes[a]["at_budget"], modes[b]["at_budget"]
    diff, half = difference(x["rewards"], y["rewards"])
    verdict = ("undecided: the difference's interval holds 0" if math.isnan(half) or abs(diff) <= half else
               f"{a if diff > 0 else b} is higher")
    return (f"{what}: at {x['cost_bf16_fwd']:.0f} BF16-forward equivalents each, {a} {_ci(x['reward_mean'], x['reward_ci95'])} "
            f"vs {b} {_ci(y['reward_mean'], y['reward_ci95'])} ({x['epochs']} vs {y['epochs']} epochs' cost); "
            f"difference {diff:+.3f}" + ("" if math.isnan(half) else f" ± {half:.3f} (95%, Welch)") + f" -> {verdict}")


def _grpo_claims(modes: dict[str, Any]) -> list[str]:
    """FlowGRPO against DiffusionNFT and one stage against two, at the same compute, for the modes that ran."""
    pairs = [("sol_flow_grpo", "flow_grpo", "two-stage vs one-stage FlowGRPO"),
             ("sol_rl", "diffusion_nft", "two-stage vs one-stage DiffusionNFT"),
             ("flow_grpo", "diffusion_nft", "FlowGRPO vs DiffusionNFT, one stage"),
             ("sol_flow_grpo", "sol_rl", "FlowGRPO vs DiffusionNFT, two stages")]
    if not any(m in modes for m in ("flow_grpo", "sol_flow_grpo")):
        return []
    return [_versus(modes, a, b, what) for a, b, what in pairs if a in modes and b in modes]


def plot(modes: dict[str, Any], path: Path, reward: str = "shapes") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_e, ax_c) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=110, sharey=True)
    for i, (mode, m) in enumerate(modes.items()):
        rows = m["epochs"]
        mean = np.array([r["reward_mean"] for r in rows])
        half = np.array([r["reward_ci95"] or 0.0 for r in rows])
        for ax, x in ((ax_e, [r["epoch"] for r in rows]), (ax_c, [r["cost_bf16_fwd"] / 1e3 for r in rows])):
            ax.plot(x, mean, marker="o", color=f"C{i}", label=mode)
            ax.fill_between(x, mean - half, mean + half, color=f"C{i}", alpha=0.15)
    ax_e.set_xlabel("epoch")
    ax_c.set_xlabel("cost (thousand BF16-forward equivalents, B200 bound)")
    ax_e.set_ylabel(f"held-out {reward} (mean, 95% CI over seeds)")
    for a in (ax_e, ax_c):
        a.grid(alpha=0.3)
    ax_e.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _budget(m: dict[str, Any]) -> str:
    b = m.get("at_budget")
    return f"{_ci(b['reward_mean'], b['reward_ci95'])} ({b['epochs']} ep.)" if b else "-"


def _ci(mean: float, half: float | None) -> str:
    return f"{mean:.3f} ± {half:.3f}" if half is not None else f"{mean:.3f}"


def markdown(r: dict[str, Any], name: str = "curve") -> str:
    first = next(iter(r["modes"].values()))
    share = next((m["runs"][0]["explore_quantized_share"] for m in r["modes"].values()
                  if m["runs"][0].get("explore_quantized_share", 1.0) < 1.0), 1.0)
    lines = ["| mode | reward before | final reward (95% CI) | final exact match | cost / epoch (BF16 fwd eq.) | "
             "CPU wall s | epochs to diffusion_nft's final | cost to reach it | reward at equal cost |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        f = m["final"]
        em = _ci(f["exact_match_mean"], f.get("exact_match_ci95")) if "exact_match_mean" in f else "-"
        reach = m["epochs_to_nft_final"]
        cost = f"{m['cost_to_nft_final']:.0f}" if m["cost_to_nft_final"] is not None else "not reached"
        lines.append(f"| {mode} | {m['before']['reward_mean']:.3f} | {_ci(f['reward_mean'], f['reward_ci95'])} | {em} | "
                     f"{m['cost_per_epoch']:.0f} | {m['train_wall_s']:.0f} | {reach if reach is not None else '-'} | "
                     f"{cost} | {_budget(m)} |")
    auto = any("explore_proxies" in m["runs"][0] for m in r["modes"].values())
    if share < 1.0:
        held = f"here they hold {share:.0%}" + (" (the adaptive proxy: its candidate's share, measured in each run)"
                                                 if auto else "")
    else:
        held = "the adaptive proxy's candidates: each one's share, measured in each run" if auto else "here they hold 100%"
    epochs = [row["epoch"] for row in first["epochs"]]
    per_epoch = ["", "Per evaluated epoch, mean ± 95% interval over run seeds:", "",
                 "| mode | " + " | ".join(map(str, epochs)) + " |", "|---|" + "---|" * len(epochs)]
    for mode, m in r["modes"].items():
        per_epoch.append(f"| {mode} | " + " | ".join(_ci(row["reward_mean"], row["reward_ci95"]) for row in m["epochs"])
                         + " |")
    per_epoch += _form_lines(r)
    return (f"Trained on `{r['reward']}`, evaluated with `{r['eval_reward']}`, "
            f"{r['epochs']} epochs per run, {r['repeats']} run seeds per mode from seed {r['seed']}, held-out "
            f"reward every {r['eval_every']} epochs; plot `{name}.png`. Cost counts the quantized layers of an FP4 forward "
            f"at 1/4 and of an FP8 one at 1/2 of BF16 (the B200 bound; {held} of the explore "
            f"forward's multiply-accumulates, the rest counts at 1) and a trained (sample, timestep) pair at 5 forwards "
            f"for DiffusionNFT (old, reference, trainable forward and its backward) and 4 for FlowGRPO (trainable forward "
            f"and backward, reference; no CFG on this bed); 'reward at equal cost' reads every run at the smallest final "
            f"cost of the modes (interpolated between evaluated epochs; the epochs that cost buys in brackets). CPU wall-clock "
            f"counts emulated FP4, which is slower than BF16 here.\n\n" + "\n".join(lines) + "\n"
            + "\n".join(per_epoch) + "\n" + _auto_lines(r)
            + ("\nThe comparisons on these runs (the paper's claims where its four modes ran; FlowGRPO and DiffusionNFT, "
               "one and two stages, at equal compute where they ran):\n\n"
               + "\n".join(f"- {c}" for c in r["claims"]) + "\n" if r["claims"] else
               "\nNo claim of the paper is checked: it compares modes, and one ran here.\n"))


def _form_lines(r: dict[str, Any]) -> list[str]:
    """The held-out reward per caption form before and after training (shapes world), for the modes that
    recorded it: where a mode's gain comes from."""
    rows = [(mode, m["before"].get("by_form"), m["final"].get("by_form")) for mode, m in r["modes"].items()]
    rows = [(mode, b, f) for mode, b, f in rows if b and f]
    if not rows:
        return []
    forms = sorted({k for _, _, f in rows for k in f})
    held = r.get("eval_forms") or {}
    counts = f"; the evaluated prompts: {', '.join(f'{held[k]} {k}' for k in forms if k in held)}" if held else ""
    out = ["", f"Held-out reward by caption form, before -> final (mean ± 95% interval over run seeds{counts}):", "",
           "| mode | " + " | ".join(forms) + " |", "|---|" + "---|" * len(forms)]
    for mode, b, f in rows:
        out.append(f"| {mode} | " + " | ".join(f"{b[k]['mean']:.3f} -> {_ci(f[k]['mean'], f[k]['ci95'])}"
                                               if k in b and k in f else "-" for k in forms) + " |")
    return out


def _auto_lines(r: dict[str, Any]) -> str:
    """Where the compared modes come from, and what the adaptive proxy chose in each run that used it."""
    out = ""
    if r.get("compared_with"):
        out += (f"\nModes {', '.join(r['compared_with']['modes'])} are read from `{r['compared_with']['file']}` (the "
                f"same settings); {', '.join(r['trained_modes'])} trained now.\n")
    runs = []
    for mode, m in r["modes"].items():
        for i, run in enumerate(m["runs"]):
            if "explore_proxies" not in run:
                continue
            used = ", ".join(f"{c} x{run['explore_proxies'].count(c)}" for c in dict.fromkeys(run["explore_proxies"]))
            cals = "; ".join(f"after epoch {c['epoch']}: {c['chosen']}" + ("" if c["met_target"] else " (none met the target)")
                             for c in run["calibrations"])
            switches = "; ".join(f"epoch {s['epoch']}: {s['from']} -> {s['to']}" for s in run["switches"]) or "none"
            runs.append(f"- {mode}, run seed {r['seed'] + i}: calibrated {cals}; explored with {used} (epochs); "
                        f"switches: {switches}; calibration cost {run['calibration_cost_bf16_fwd']:.0f} BF16-fwd eq.")
    if runs:
        out += "\nThe adaptive proxy's choices:\n\n" + "\n".join(runs) + "\n"
    return out
