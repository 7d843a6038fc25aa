"""The bed's evaluation metrics: caption forms, per-attribute accuracies, the reward by form, relation order, what
RL has to rank within each prompt's seeds, and the form-stratified evaluation prompts.

`solrl.engine.evaluate` does not know them: it asks a scorer for its metrics and which of them sum an evaluation up
(`ShapesReward.score_with_metrics`, which calls `reward_metrics` here) and a prompt set for its evaluation subset
(`eval_prompts`, registered in `solrl.prompts`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from solrl.shapes.dense import ShapesDenseReward
from solrl.shapes.world import parse, split_prompts

ATTRIBUTES = ("colour", "shape", "count", "position")


def caption_form(caption: str) -> str:
    """A shapes-world caption's form as evaluation groups it: single, position (a single object placed), count
    or relation."""
    spec = parse(caption)
    return "position" if spec.position else spec.form


def relation_order(detail: list[dict[str, float]], prompts: list[str]) -> tuple[float | None, int]:
    """Whether a model reads a relation's word, apart from drawing its objects: over the relation images that hold
    exactly the two prompted colours (the colour sub-score is 1, so two detections, one of each), the share whose
    objects stand in the prompted relation; and how many such images there were. A model that places the two
    objects by its noise alone scores about 0.5 here (the world draws a relation's objects in two slots on one
    axis); ground truth scores 1. None when no image qualifies."""
    hits = [d["position"] for d, p in zip(detail, prompts)
            if caption_form(p) == "relation" and d["colour"] >= 0.999]
    return (float(np.mean(hits)) if hits else None), len(hits)


def group_stats(totals: np.ndarray, flat_prompts: list[str], seeds_per_prompt: int) -> dict[str, dict[str, float]]:
    """What RL has to rank within each prompt's group of seeds, per caption form: the share of prompts with at least
    one exactly right seed, the mean population std of a group's rewards, and the mean of (best - mean) over groups.
    `totals` holds each prompt's seeds consecutively, as `solrl.engine.evaluate.evaluate` samples them."""
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


def reward_metrics(detail: list[dict[str, float]], totals: np.ndarray, images: np.ndarray, prompts: list[str],
                   seeds_per_prompt: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """The exact reward's evaluation fields beside its mean: per-attribute accuracies, the exact-match rate, relation
    order, the dense reward on the same images and how it ranks them against the exact one, the reward by caption
    form, and (several seeds per prompt, consecutive) `group_stats` by form. Returns (metrics, summary): those
    fields, and the ones that sum the evaluation up (a run's records, eval.<field>): all but the two by-form tables,
    and the reward of each form as form_<form>."""
    flat: dict[str, Any] = {}
    for a in ATTRIBUTES:
        vals = [d[a] for d in detail if not math.isnan(d[a])]
        flat[f"{a}_accuracy"] = float(np.mean(vals)) if vals else None
    flat["exact_match"] = float(np.mean(totals >= 0.999))
    flat["relation_order_accuracy"], flat["relation_order_n"] = relation_order(detail, prompts)
    # the dense training reward on the same images, and how it ranks them against the exact one
    from scipy.stats import spearmanr

    dense = ShapesDenseReward()(images, prompts).astype(np.float64)
    flat["dense_mean"] = float(dense.mean())
    rho = spearmanr(dense, totals).statistic if len(totals) > 2 and np.ptp(totals) > 0 else float("nan")
    flat["dense_spearman"] = None if np.isnan(rho) else float(rho)
    forms: dict[str, list[float]] = {}
    for p, t in zip(prompts, totals):
        forms.setdefault(caption_form(p), []).append(float(t))
    by_form = {k: float(np.mean(v)) for k, v in sorted(forms.items())}
    metrics = {**flat, "by_form": by_form}
    if seeds_per_prompt > 1:
        metrics["groups_by_form"] = group_stats(totals, prompts, seeds_per_prompt)
    return metrics, {**flat, **{f"form_{k}": v for k, v in by_form.items()}}


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
