"""Held-out exact reward per epoch for sol_rl, diffusion_nft, naive_scaling and naive_quant, over several
training seeds per mode: mean and 95% interval per epoch, cost in BF16-forward equivalents beside CPU
wall-clock, and which of the paper's convergence claims held.

Each mode runs its preset `repeats` times (run seeds seed, seed+1, ...), the same epochs and prompts per
epoch, evaluated every few epochs on the same held-out prompts and seeds (evaluation time not counted).

Cost model (B200 bound, as the paper's hardware): a denoiser forward costs 1 in BF16 (or FP32), 1/2 in
FP8 and 1/4 in FP4 for the share of its multiply-accumulates that the low-precision backend quantizes
(measured per run: convolutions and layers kept in high precision stay at 1); a training (sample, timestep) pair costs the old and reference forwards plus the
trainable forward and its backward (backward = 2 forwards), 5 in all (4 without the KL reference).
Wall-clock on CPU counts emulated low precision, which costs more than BF16 here.

`reward` trains on another reward (results `curve-<reward>`); `eval_reward` defaults to the exact
`shapes` reward for shapes-world rewards (so a run trained on `shapes_dense` is still judged exactly).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from solrl.algo import timestep_count
from solrl.bench.common import write_results
from solrl.config import apply_overrides, get_preset
from solrl.loop import train

PRESETS = {"sol_rl": "shapes-sol-rl", "diffusion_nft": "shapes-diffusion-nft",
           "naive_scaling": "shapes-naive-scaling", "naive_quant": "shapes-naive-quant"}


def forward_cost(backend: str, quantized_share: float = 1.0) -> float:
    """Cost of one denoiser forward relative to BF16 on the B200 bound. Only the quantized layers' share of
    the forward's multiply-accumulates runs at the low-precision rate; the rest (convolutions, layers kept in
    high precision) costs what it costs in BF16."""
    b = backend.lower()
    rate = 0.25 if "fp4" in b else 0.5 if "fp8" in b else 1.0
    return (1.0 - quantized_share) + quantized_share * rate


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


def epoch_cost(rec: dict[str, Any], cfg, share: float = 1.0) -> float:
    """BF16-forward equivalents of one epoch's rollouts and training (see the module doc); `share`: the explore
    forward's quantized share (explore_share)."""
    explore = rec.get("forwards_explore", 0) * forward_cost(cfg.rollout.explore_precision.backend, share)
    regen = rec.get("forwards_regenerate", 0) * forward_cost(cfg.rollout.precision.backend)
    per_pair = 5.0 if cfg.train.kl_beta > 0 else 4.0
    k = timestep_count(cfg.rollout.steps, cfg.train.timestep_fraction)
    return explore + regen + rec.get("train.samples", 0) * k * per_pair


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of the 95% Student-t interval); half-width NaN for a single value."""
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    if len(a) < 2:
        return float(a.mean()), float("nan")
    return float(a.mean()), float(stats.t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a)))


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
    share = explore_share(cfg)
    clock = cost = 0.0
    points = []
    for r in recs:
        clock += r.get("time_epoch_s", 0.0)
        cost += epoch_cost(r, cfg, share) if r["epoch"] > 0 else 0.0
        if "eval.mean_reward" in r:
            points.append({"epoch": r["epoch"], "wall_s": round(clock, 2), "cost_bf16_fwd": round(cost, 1),
                           "reward": r["eval.mean_reward"], "exact_match": r.get("eval.exact_match"),
                           "shape_accuracy": r.get("eval.shape_accuracy")})
    result = {"points": points, "train_wall_s": round(clock, 2), "cost_bf16_fwd": round(cost, 1),
              "explore_quantized_share": round(share, 4),
              "cost_per_epoch": round(cost / max(1, recs[-1]["epoch"]), 1)}
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
        table.append(row)
    return {"epochs": table, "final": table[-1], "before": table[0],
            "cost_per_epoch": float(np.mean([r["cost_per_epoch"] for r in runs])),
            "train_wall_s": float(np.mean([r["train_wall_s"] for r in runs]))}


def run(out: Path, small: bool = False, epochs: int | None = None, seed: int = 0, reward: str | None = None,
        repeats: int | None = None, eval_reward: str | None = None, jobs: int = 1,
        threads: int = 0) -> dict[str, Any]:
    """`jobs` runs train at once, each on `threads` torch threads (0: the cores shared out between the jobs);
    runs already finished under `out` with the same settings are reused."""
    n_epochs = epochs or (2 if small else 12)
    n_runs = repeats or (2 if small else 3)
    every = 1 if small else max(2, n_epochs // 6)
    sets = [f"epochs={n_epochs}", f"eval.every={every}", "tensorboard=false"]
    name, judge = "curve", eval_reward or "shapes"
    if reward and reward != "shapes":
        judge = eval_reward or ("shapes" if reward.startswith("shapes") else reward)
        sets += [f"reward={reward}", f"eval.reward={judge}"]
        name = f"curve-{reward}"
    if small:
        sets += ["rollout.prompts_per_epoch=2", "rollout.pool=6", "rollout.kept=4", "eval.prompts=4",
                 "eval.seeds_per_prompt=1", "lora.rank=4", "lora.alpha=8", "train.micro_batch=8"]
    import os

    per_run = threads or (max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0)
    if per_run:  # 0: a single job keeps the process's own torch threads
        sets.append(f"threads={per_run}")
    plan = [(mode, preset, sets + [f"seed={seed + i}"], out / f"{name}_runs" / f"{mode}_seed{seed + i}")
            for mode, preset in PRESETS.items() for i in range(n_runs)]
    results = run_all([p[1:] for p in plan], jobs)
    modes: dict[str, Any] = {}
    for mode in PRESETS:
        runs = [r for p, r in zip(plan, results) if p[0] == mode]
        modes[mode] = {"runs": runs, **summarise(runs)}
    target = modes["diffusion_nft"]["final"]["reward_mean"]
    for m in modes.values():
        hit = next((row for row in m["epochs"] if row["epoch"] > 0 and row["reward_mean"] >= target), None)
        m["epochs_to_nft_final"] = hit["epoch"] if hit else None
        m["cost_to_nft_final"] = hit["cost_bf16_fwd"] if hit else None
    result = {"epochs": n_epochs, "eval_every": every, "repeats": n_runs, "seed": seed, "jobs": jobs,
              "threads_per_run": per_run, "reward": reward or "shapes",
              "eval_reward": judge, "settings": sets, "nft_final_reward": target, "claims": claims(modes), "modes": modes}
    plot(modes, out / f"{name}.png", judge)
    return write_results(out, name, result, markdown(result, name))


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    ha, hb = a["reward_ci95"] or 0.0, b["reward_ci95"] or 0.0
    return abs(a["reward_mean"] - b["reward_mean"]) <= ha + hb


def claims(modes: dict[str, Any]) -> list[str]:
    """The paper's convergence claims, checked on these runs (intervals: 95% Student-t over run seeds)."""
    sol, nft, naive, quant = (modes[k] for k in ("sol_rl", "diffusion_nft", "naive_scaling", "naive_quant"))
    out = []
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


def _ci(mean: float, half: float | None) -> str:
    return f"{mean:.3f} ± {half:.3f}" if half is not None else f"{mean:.3f}"


def markdown(r: dict[str, Any], name: str = "curve") -> str:
    share = r["modes"]["sol_rl"]["runs"][0].get("explore_quantized_share", 1.0)
    lines = ["| mode | reward before | final reward (95% CI) | final exact match | cost / epoch (BF16 fwd eq.) | "
             "CPU wall s | epochs to diffusion_nft's final | cost to reach it |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        f = m["final"]
        em = _ci(f["exact_match_mean"], f.get("exact_match_ci95")) if "exact_match_mean" in f else "-"
        reach = m["epochs_to_nft_final"]
        cost = f"{m['cost_to_nft_final']:.0f}" if m["cost_to_nft_final"] is not None else "not reached"
        lines.append(f"| {mode} | {m['before']['reward_mean']:.3f} | {_ci(f['reward_mean'], f['reward_ci95'])} | {em} | "
                     f"{m['cost_per_epoch']:.0f} | {m['train_wall_s']:.0f} | {reach if reach is not None else '-'} | "
                     f"{cost} |")
    epochs = [row["epoch"] for row in r["modes"]["sol_rl"]["epochs"]]
    per_epoch = ["", "Per evaluated epoch, mean ± 95% interval over run seeds:", "",
                 "| mode | " + " | ".join(map(str, epochs)) + " |", "|---|" + "---|" * len(epochs)]
    for mode, m in r["modes"].items():
        per_epoch.append(f"| {mode} | " + " | ".join(_ci(row["reward_mean"], row["reward_ci95"]) for row in m["epochs"])
                         + " |")
    return (f"Trained on `{r['reward']}`, evaluated with `{r['eval_reward']}`, "
            f"{r['epochs']} epochs per run, {r['repeats']} run seeds per mode from seed {r['seed']}, held-out "
            f"reward every {r['eval_every']} epochs; plot `{name}.png`. Cost counts the quantized layers of an FP4 forward "
            f"at 1/4 and of an FP8 one at 1/2 of BF16 (the B200 bound; here they hold {share:.0%} of the explore "
            f"forward's multiply-accumulates, the rest counts at 1) and a trained (sample, timestep) pair at 5 forwards; CPU wall-clock "
            f"counts emulated FP4, which is slower than BF16 here.\n\n" + "\n".join(lines) + "\n"
            + "\n".join(per_epoch) + "\n\nThe paper's convergence claims on these runs:\n\n"
            + "\n".join(f"- {c}" for c in r["claims"]) + "\n")
