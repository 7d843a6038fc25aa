"""Ranking fidelity of the explorer: does a low-precision, few-step proxy rank seeds as BF16 does?

For P held-out prompts x N seeds, the reference is the exact `shapes` reward of BF16 samples at the
full rollout steps (the loop's `regenerate` call on every seed); each candidate (precision x explore
steps) samples the SAME seeds (seed -> noise) through the loop's `explore` call, so forward batching
and the low-precision copy are the explorer's own, and is scored the same way. Per prompt: Kendall tau-b and Spearman
(scipy; prompts
where either side is constant have no correlation and are left out of those means, and counted),
and for k in (4, 8, 12):
  top_k_match               share of the candidate's top-k whose reference reward reaches the
                            reference's k-th best (ties in the discrete reward count as matches)
  bottom_k_false_inclusion  share of the candidate's top-k whose reference reward is at or below the
                            reference's k-th worst
  bottom_half_false_inclusion  share of the candidate's top-k in the reference's bottom half
                            (below its median), the definitions docs/method.md asks for
The candidate's own top-k breaks its ties by seed order. A `random` row (scores drawn at random)
gives the chance level of each number. Also per row: the 95% interval of the mean tau over prompts
(Student t), and the kept-set contrast: the reference reward of the candidate's best k/2 seeds minus its
worst k/2 (k = 8, as the shapes presets keep), what a best-worst selection hands the trainer.

`policies` adds rows for each quantizing precision under other per-layer policies (solrl.precision.policy);
`rewards` scores the same images with each reward (e.g. the exact `shapes` and the dense `shapes_dense`),
reference and candidates alike: one table per reward.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from solrl.algo import kept_contrast
from solrl.bench.common import write_results
from solrl.config import get_preset
from solrl.engine.session import Session
from solrl.precision import BACKENDS, available_backends
from solrl.rollout.passes import explore, regenerate
from solrl.rollout.workers import InferenceCopy
from solrl.shapes.metrics import eval_prompts

KS = (4, 8, 12)
DEFINITIONS = {
    "top_k_match": "share of the proxy's top-k whose BF16 reward reaches BF16's k-th best (ties count)",
    "bottom_k_false_inclusion": "share of the proxy's top-k whose BF16 reward is at or below BF16's k-th worst",
    "bottom_half_false_inclusion": "share of the proxy's top-k below the median BF16 reward of the prompt",
    "kendall_tau": "scipy tau-b per prompt, mean over prompts where both sides vary",
    "spearman": "scipy Spearman per prompt, mean over prompts where both sides vary",
}


def prompt_metrics(cand: np.ndarray, ref: np.ndarray, ks: tuple[int, ...] = KS) -> dict[str, float]:
    """Agreement of one prompt's candidate scores with its reference scores (both [N])."""
    out: dict[str, float] = {}
    if np.ptp(cand) > 0 and np.ptp(ref) > 0:
        out["kendall_tau"] = float(stats.kendalltau(cand, ref).statistic)  # tau-b: ties corrected
        out["spearman"] = float(stats.spearmanr(cand, ref).statistic)
    order = np.argsort(-cand, kind="stable")
    ref_sorted = np.sort(ref)
    median = float(np.median(ref))
    for k in ks:
        top = order[:k]
        out[f"top_{k}_match"] = float(np.mean(ref[top] >= ref_sorted[-k]))
        out[f"bottom_{k}_false_inclusion"] = float(np.mean(ref[top] <= ref_sorted[k - 1]))
        out[f"bottom_half_{k}_false_inclusion"] = float(np.mean(ref[top] < median))
    return out


def aggregate(cand: np.ndarray, ref: np.ndarray, ks: tuple[int, ...] = KS) -> dict[str, Any]:
    """Means over prompts of `prompt_metrics` ([P, N] arrays), in the JSON layout of the results."""
    per = [prompt_metrics(c, r, ks) for c, r in zip(cand, ref)]

    def mean(key: str) -> float | None:
        vals = [p[key] for p in per if key in p]
        return float(np.mean(vals)) if vals else None

    taus = [p["kendall_tau"] for p in per if "kendall_tau" in p]
    tau_ci = (float(stats.t.ppf(0.975, len(taus) - 1) * np.std(taus, ddof=1) / np.sqrt(len(taus)))
              if len(taus) >= 2 else None)
    return {
        "kendall_tau": mean("kendall_tau"),
        "kendall_tau_ci95": tau_ci,
        "kept_contrast": kept_contrast(cand, ref),
        "spearman": mean("spearman"),
        "prompts_with_correlation": sum("kendall_tau" in p for p in per),
        "top_k_match": {str(k): mean(f"top_{k}_match") for k in ks},
        "bottom_k_false_inclusion": {str(k): mean(f"bottom_{k}_false_inclusion") for k in ks},
        "bottom_half_false_inclusion": {str(k): mean(f"bottom_half_{k}_false_inclusion") for k in ks},
        "reward_mean": float(cand.mean()),
    }


def run(out: Path, small: bool = False, prompts: int | None = None, seeds: int | None = None,
        precisions: tuple[str, ...] | None = None, steps: tuple[int, ...] | None = None,
        seed: int = 0, micro_batch: int | None = None, policies: tuple[str, ...] = ("reference",),
        rewards: tuple[str, ...] | None = None) -> dict[str, Any]:
    n_prompts = prompts or (3 if small else 32)
    n_seeds = seeds or (16 if small else 96)
    precisions = precisions or (("nvfp4-emu", "mxfp4-emu@2") if small else ("nvfp4-emu", "mxfp4-emu", "bf16"))
    steps = steps or ((2, 4) if small else (2, 4, 6, 8))
    if n_prompts < 1 or n_seeds < 8:
        raise ValueError(f"prompts must be >= 1 and seeds >= 8 (top-4 needs 8), got {n_prompts}, {n_seeds}")
    plan = []  # (precision, its explore steps): "mxfp4-emu@4/6" limits one precision to those steps
    for entry in precisions:
        name, _, only = entry.partition("@")
        try:
            own = tuple(int(x) for x in only.split("/")) if only else tuple(steps)
        except ValueError:
            raise ValueError(f"precisions: {entry!r} is not NAME or NAME@S1/S2") from None
        if name not in available_backends():
            raise ValueError(f"precisions: unknown backend {name!r}; available: {available_backends()}")
        if not own or min(own) < 1:
            raise ValueError(f"steps: explore steps must be positive integers, got {own} for {name}")
        plan.append((name, own))
    from solrl.precision.policy import POLICIES, policy_config
    from solrl.rewards import build_reward

    unknown = [x for x in policies if x not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"policies: unknown {unknown or 'empty list'}; available: {sorted(POLICIES)}")
    ks = tuple(k for k in KS if k <= n_seeds // 2)
    cfg = get_preset("shapes-sol-rl")
    reward_names = tuple(rewards or (cfg.reward,))
    scorers = {name: build_reward(name) for name in reward_names}
    sess = Session.build(cfg, local_explorer=False)
    model, full_steps = sess.model, cfg.rollout.steps
    mb = micro_batch or cfg.rollout.micro_batch
    caps = eval_prompts(n_prompts)
    rng = np.random.default_rng(seed)
    seed_grid = rng.integers(0, 2**31 - 1, size=(len(caps), n_seeds)).tolist()

    flat_prompts = [c for c in caps for _ in range(n_seeds)]

    def all_rewards(images: np.ndarray) -> dict[str, np.ndarray]:
        return {name: np.asarray(sc(images, flat_prompts), dtype=np.float64).reshape(len(caps), n_seeds)
                for name, sc in scorers.items()}

    def scores(transformer: torch.nn.Module, n_steps: int) -> tuple[dict[str, np.ndarray], int]:
        ex = explore(model, transformer, caps, seed_grid, n_steps, sess.sampler, sess.scorer, ks[0],
                     micro_batch=mb, cache=sess.cache)  # (its seed selection is not used here)
        return all_rewards(ex.generated.images), ex.forwards

    t0 = time.perf_counter()
    with sess.adapters.use("old"):  # zero LoRA: the base model at the trainer's (regenerator's) precision
        rg = regenerate(model, model.transformer, caps, seed_grid, full_steps, sess.sampler, sess.scorer, mb,
                        sess.cache)
    refs, ref_fwd = all_rewards(rg.images), rg.forwards
    ref = refs[reward_names[0]]
    ref_time = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    spec = model.spec
    for prec, prec_steps in plan:
        quantizes = BACKENDS[prec].quantizes
        for policy in (policies if quantizes else ("reference",)):
            copy = InferenceCopy(sess.adapters, policy_config(prec, policy, spec))
            for n in prec_steps:
                t0 = time.perf_counter()
                cand, fwd = scores(copy.module, n)
                rows.append({"precision": prec, "policy": policy, "steps": n,
                             **aggregate(cand[reward_names[0]], ref, ks),
                             "by_reward": {name: aggregate(cand[name], refs[name], ks) for name in reward_names},
                             "sample_s": round(time.perf_counter() - t0, 2), "forwards": fwd})
    chance = np.random.default_rng(seed + 1).random(ref.shape)
    rows.append({"precision": "random", "policy": "-", "steps": 0, **aggregate(chance, ref, ks),
                 "by_reward": {name: aggregate(chance, refs[name], ks) for name in reward_names},
                 "sample_s": 0.0, "forwards": 0})
    result = {
        "prompts": len(caps), "seeds_per_prompt": n_seeds, "reference": {"precision": cfg.rollout.precision.backend,
                                                                        "steps": full_steps,
                                                                        "reward_mean": float(ref.mean()),
                                                                        "sample_s": round(ref_time, 2),
                                                                        "forwards": ref_fwd},
        "reward": reward_names[0], "rewards": list(reward_names), "policies": list(policies),
        "ks": list(ks), "micro_batch": mb, "rows": rows,
        "definitions": DEFINITIONS,
    }
    return write_results(out, "ranking", result, markdown(result))


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    return f"{100 * v:.1f}%" if pct else f"{v:.3f}"


def _tau(row: dict[str, Any]) -> str:
    ci = row.get("kendall_tau_ci95")
    return _fmt(row["kendall_tau"]) + (f" ± {ci:.3f}" if ci is not None else "")


def markdown(r: dict[str, Any]) -> str:
    ks = r["ks"]
    head = ["proxy", "policy", "steps", "Kendall tau (95% CI over prompts)", "kept contrast", "Spearman"] + \
        [f"top-{k} match" for k in ks] + [f"bottom-{k} false incl." for k in ks] + \
        [f"bottom-half false incl. (top-{ks[0]})", "reward mean", "time s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["rows"]:
        cells = [row["precision"], row.get("policy", "reference"), str(row["steps"] or "-"), _tau(row),
                 f"{row['kept_contrast']:.3f}", _fmt(row["spearman"])]
        cells += [_fmt(row["top_k_match"][str(k)], True) for k in ks]
        cells += [_fmt(row["bottom_k_false_inclusion"][str(k)], True) for k in ks]
        cells += [_fmt(row["bottom_half_false_inclusion"][str(ks[0])], True), f"{row['reward_mean']:.3f}",
                  f"{row['sample_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    for name in r.get("rewards", [])[1:]:
        lines += ["", f"The same images scored with `{name}` (reference and candidates alike):", "",
                  "| proxy | policy | steps | Kendall tau (95% CI) | kept contrast | Spearman |", "|---|---|---|---|---|---|"]
        for row in r["rows"]:
            b = row["by_reward"][name]
            lines.append(f"| {row['precision']} | {row.get('policy', 'reference')} | {row['steps'] or '-'} | {_tau(b)} | "
                         f"{b['kept_contrast']:.3f} | {_fmt(b['spearman'])} |")
    ref = r["reference"]
    return (f"{r['prompts']} held-out prompts x {r['seeds_per_prompt']} seeds, reward `{r['reward']}`. Reference: "
            f"{ref['precision']} at {ref['steps']} steps (reward mean {ref['reward_mean']:.3f}). Every row samples "
            f"the same seeds. Correlations are means over prompts where both sides vary "
            f"(see `prompts_with_correlation` in the JSON). Paper (docs/method.md), all four rewards: tau 0.798, "
            f"Spearman 0.927, top-4 match 96.9%, bottom-4 false inclusion 3.9%, top-12 match 93.3%.\n\n"
            + "\n".join(lines) + "\n\nDefinitions (tie-aware: the reward is discrete):\n\n"
            + "\n".join(f"- `{k}`: {v}" for k, v in r["definitions"].items()) + "\n")
