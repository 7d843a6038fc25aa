"""Held-out evaluation: fixed prompts and seeds, exact reward, per-attribute accuracy, sample grids."""

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
from solrl.rewards.shapes import ShapesReward
from solrl.rollout import PromptCache, SamplerSpec, generate
from solrl.telemetry import image_grid, save_png
from solrl.world.shapes import parse, split_prompts

ATTRIBUTES = ("colour", "shape", "count", "position")


def eval_prompts(n: int) -> list[str]:
    """A fixed, form-stratified subset of the held-out prompts (round-robin over forms, hash order)."""
    _, held = split_prompts()
    groups: dict[str, list[str]] = {}
    for c in sorted(held, key=lambda c: hashlib.sha256(c.encode()).hexdigest()):
        s = parse(c)
        key = "position" if s.position else s.form
        groups.setdefault(key, []).append(c)
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


def evaluate(model: T2IModel, transformer: nn.Module, steps: tuple[int, ...], n_prompts: int,
             seeds_per_prompt: int, seed: int, sampler: SamplerSpec, micro_batch: int = 128,
             cache: PromptCache | None = None) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """Returns (summary, {steps: grid image}). Seeds are fixed: seed + prompt index * S + j."""
    prompts = eval_prompts(n_prompts)
    flat_p = [p for p in prompts for _ in range(seeds_per_prompt)]
    flat_s = [seed + i * seeds_per_prompt + j for i in range(len(prompts)) for j in range(seeds_per_prompt)]
    reward = ShapesReward()
    results: dict[str, Any] = {}
    grids: dict[int, np.ndarray] = {}
    for n_steps in steps:
        t0 = time.time()
        gen = generate(model, transformer, flat_p, flat_s, n_steps, sampler, micro_batch, cache)
        detail = reward.score_detailed(gen.images, flat_p)
        totals = np.array([d["total"] for d in detail])
        res: dict[str, Any] = {"mean_reward": float(totals.mean()), "n": len(totals),
                               "sample_time_s": round(time.time() - t0, 2)}
        for a in ATTRIBUTES:
            vals = [d[a] for d in detail if not math.isnan(d[a])]
            res[f"{a}_accuracy"] = float(np.mean(vals)) if vals else None
        res["exact_match"] = float(np.mean(totals >= 0.999))
        forms: dict[str, list[float]] = {}
        for p, t in zip(flat_p, totals):
            s = parse(p)
            forms.setdefault("position" if s.position else s.form, []).append(float(t))
        res["by_form"] = {k: float(np.mean(v)) for k, v in sorted(forms.items())}
        results[str(n_steps)] = res
        pick = list(range(0, len(flat_p), seeds_per_prompt))[:32]
        grids[n_steps] = image_grid(gen.images[pick], [flat_p[i] for i in pick],
                                    scores=[float(totals[i]) for i in pick])
    first = results[str(steps[0])]
    summary = {"mean_reward": first["mean_reward"], "n": first["n"], "steps": list(steps),
               "prompts": len(prompts), "seeds_per_prompt": seeds_per_prompt,
               **{k: v for k, v in first.items() if k.endswith("_accuracy")}, "results": results}
    return summary, grids


def write_eval(out: Path, summary: dict[str, Any], grids: dict[int, np.ndarray], extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({**extra, **summary}, indent=2) + "\n")
    for n_steps, g in grids.items():
        save_png(g, out / f"grid_{n_steps}steps.png")
