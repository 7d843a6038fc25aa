"""Held-out evaluation: fixed prompts and seeds, the evaluation reward, sample grids.

The prompts are the run's `prompts.eval` set (the first `eval.prompts` of it; for a shapes-world set a
fixed, form-stratified subset) and the reward is `eval.reward` (or the run's). With the shapes reward
the summary also holds per-attribute accuracies, exact matches and the reward per caption form; with
a weighted multi-reward, each component's mean.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from solrl.models.base import T2IModel
from solrl.prompts import is_shapes_set, load_prompt_set
from solrl.rewards import Scorer, build_reward
from solrl.rewards.frames import first_frames, score_frames
from solrl.rewards.shapes import ShapesReward
from solrl.rollout import PromptCache, SamplerSpec, generate
from solrl.telemetry import image_grid, save_png
from solrl.world.shapes import parse, split_prompts

ATTRIBUTES = ("colour", "shape", "count", "position")
_SUMMARY_KEYS = ("exact_match", "dense_mean", "dense_spearman", "relation_order_n")


def summary_metrics(result: dict[str, Any]) -> dict[str, Any]:
    """The per-attribute accuracies, exact-match rate and dense-reward figures of one evaluation result, and
    the mean reward of each caption form as `form_<form>` (shapes world: single, position, count, relation)."""
    out = {k: v for k, v in result.items() if k.endswith("_accuracy") or k.startswith("form_") or k in _SUMMARY_KEYS}
    out.update({f"form_{k}": v for k, v in result.get("by_form", {}).items()})
    return out


def relation_order(detail: list[dict[str, float]], prompts: list[str]) -> tuple[float | None, int]:
    """Whether a model reads a relation's word, apart from drawing its objects: over the relation images that hold
    exactly the two prompted colours (the colour sub-score is 1, so two detections, one of each), the share whose
    objects stand in the prompted relation; and how many such images there were. A model that places the two
    objects by its noise alone scores about 0.5 here (the world draws a relation's objects in two slots on one
    axis); ground truth scores 1. None when no image qualifies."""
    hits = [d["position"] for d, p in zip(detail, prompts)
            if caption_form(p) == "relation" and d["colour"] >= 0.999]
    return (float(np.mean(hits)) if hits else None), len(hits)


def caption_form(caption: str) -> str:
    """A shapes-world caption's form as evaluation groups it: single, position (a single object placed), count
    or relation."""
    spec = parse(caption)
    return "position" if spec.position else spec.form


def eval_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """An evaluation summary's fields of a metrics record: eval.mean_reward and eval.<summary_metrics>, as the
    embedded loop and the services trainer both write them."""
    return {"eval.mean_reward": summary["mean_reward"],
            **{f"eval.{k}": v for k, v in summary_metrics(summary).items()}}


def eval_prompts(n: int, held: list[str] | None = None) -> list[str]:
    """A fixed, form-stratified subset of shapes-world captions `held` (default: the held-out split;
    round-robin over forms, hash order)."""
    if held is None:
        _, held = split_prompts()
    groups: dict[str, list[str]] = {}
    for c in sorted(held, key=lambda c: hashlib.sha256(c.encode()).hexdigest()):
        groups.setdefault(caption_form(c), []).append(c)
    order = [groups[k] for k in ("single", "position", "count", "relation") if k in groups]
    out: list[str] = []
    i = 0
    while len(out) < min(n, len(held)):
        g = order[i % len(order)]
        j = i // len(order)
        if j < len(g):
            out.append(g[j])
        elif all(i // len(order) >= len(x) for x in order):
            break
        i += 1
    return out


def eval_prompt_set(name: str, n: int) -> list[str]:
    """The first `n` prompts of the set `name` (a shapes-world set: its form-stratified subset)."""
    if n <= 0:
        raise ValueError(f"the number of evaluation prompts must be positive, got {n}")
    if is_shapes_set(name):
        return eval_prompts(n, load_prompt_set(name))
    return load_prompt_set(name)[:n]


def eval_scorer(cfg: Any, run_scorer: Scorer | None = None) -> Scorer:
    """`cfg.eval.reward` (or the run's reward), reusing the run's scorer when they are the same."""
    name = cfg.eval.reward or cfg.reward
    if run_scorer is not None and name == cfg.reward:
        return run_scorer
    return build_reward(name)


def _score(scorer: Scorer, images: np.ndarray, prompts: list[str]) -> tuple[np.ndarray, dict[str, Any]]:
    """Total rewards and the extra summary fields the scorer can give. A video model's frames [B, F, H, W, 3]:
    the per-clip mean of the frames' rewards (solrl/rewards/frames.py)."""
    extra: dict[str, Any] = {}
    if images.ndim == 5:
        return score_frames(scorer, images, prompts).astype(np.float64), extra
    if isinstance(scorer, ShapesReward):
        detail = scorer.score_detailed(images, prompts)
        totals = np.array([d["total"] for d in detail])
        for a in ATTRIBUTES:
            vals = [d[a] for d in detail if not math.isnan(d[a])]
            extra[f"{a}_accuracy"] = float(np.mean(vals)) if vals else None
        extra["exact_match"] = float(np.mean(totals >= 0.999))
        extra["relation_order_accuracy"], extra["relation_order_n"] = relation_order(detail, prompts)
        # the dense training reward on the same images, and how it ranks them against the exact one
        from scipy.stats import spearmanr

        from solrl.rewards.shapes_dense import ShapesDenseReward

        dense = ShapesDenseReward()(images, prompts).astype(np.float64)
        extra["dense_mean"] = float(dense.mean())
        rho = spearmanr(dense, totals).statistic if len(totals) > 2 and np.ptp(totals) > 0 else float("nan")
        extra["dense_spearman"] = None if np.isnan(rho) else float(rho)
        forms: dict[str, list[float]] = {}
        for p, t in zip(prompts, totals):
            forms.setdefault(caption_form(p), []).append(float(t))
        extra["by_form"] = {k: float(np.mean(v)) for k, v in sorted(forms.items())}
        return totals, extra
    detailed = getattr(scorer, "score_detailed", None)
    if callable(detailed):   # a weighted multi-reward: {component: [N], "total": [N]}
        parts = detailed(images, prompts)
        extra["components"] = {k: float(np.mean(v)) for k, v in parts.items() if k != "total"}
        return np.asarray(parts["total"], dtype=np.float64), extra
    return np.asarray(scorer(images, prompts), dtype=np.float64), extra


def group_stats(totals: np.ndarray, flat_prompts: list[str], seeds_per_prompt: int) -> dict[str, dict[str, float]]:
    """What RL has to rank within each prompt's group of seeds, per caption form (shapes world): the share of
    prompts with at least one exactly right seed, the mean population std of a group's rewards, and the mean
    of (best - mean) over groups. `totals` holds each prompt's seeds consecutively, as `evaluate` samples them."""
    groups = np.asarray(totals, dtype=np.float64).reshape(-1, seeds_per_prompt)
    forms: dict[str, list[int]] = {}
    for i in range(len(groups)):
        forms.setdefault(caption_form(flat_prompts[i * seeds_per_prompt]), []).append(i)
    out = {}
    for form, rows in sorted(forms.items()):
        g = groups[rows]
        out[form] = {"prompts": len(rows), "with_an_exact_seed": float((g >= 0.999).any(axis=1).mean()),
                     "group_std": float(g.std(axis=1).mean()), "best_minus_mean": float((g.max(1) - g.mean(1)).mean())}
    return out


def evaluate(model: T2IModel, transformer: nn.Module, steps: tuple[int, ...], prompts: list[str],
             seeds_per_prompt: int, seed: int, sampler: SamplerSpec, scorer: Scorer | None = None,
             micro_batch: int = 128, cache: PromptCache | None = None
             ) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """Returns (summary, {steps: grid image}). Seeds are fixed: seed + prompt index * S + j. `scorer`
    defaults to the shapes world's exact reward."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    flat_p = [p for p in prompts for _ in range(seeds_per_prompt)]
    flat_s = [seed + i * seeds_per_prompt + j for i in range(len(prompts)) for j in range(seeds_per_prompt)]
    reward = scorer if scorer is not None else ShapesReward()
    results: dict[str, Any] = {}
    grids: dict[int, np.ndarray] = {}
    for n_steps in steps:
        t0 = time.time()
        gen = generate(model, transformer, flat_p, flat_s, n_steps, sampler, micro_batch, cache)
        totals, extra = _score(reward, gen.images, flat_p)
        if seeds_per_prompt > 1 and "by_form" in extra:
            extra["groups_by_form"] = group_stats(totals, flat_p, seeds_per_prompt)
        res: dict[str, Any] = {"mean_reward": float(totals.mean()), "n": len(totals),
                               "sample_time_s": round(time.time() - t0, 2), **extra}
        results[str(n_steps)] = res
        pick = list(range(0, len(flat_p), seeds_per_prompt))[:32]
        grids[n_steps] = image_grid(first_frames(gen.images[pick]), [flat_p[i] for i in pick],
                                    scores=[float(totals[i]) for i in pick])
    first = results[str(steps[0])]
    summary = {"mean_reward": first["mean_reward"], "n": first["n"], "steps": list(steps),
               "reward": getattr(reward, "name", type(reward).__name__),
               "prompts": len(prompts), "seeds_per_prompt": seeds_per_prompt,
               **summary_metrics(first), "results": results}
    return summary, grids


def write_eval(out: Path, summary: dict[str, Any], grids: dict[int, np.ndarray], extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({**extra, **summary}, indent=2) + "\n")
    for n_steps, g in grids.items():
        save_png(g, out / f"grid_{n_steps}steps.png")
