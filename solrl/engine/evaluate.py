"""Held-out evaluation: fixed prompts and seeds, the evaluation reward, sample grids.

The prompts are the run's `prompts.eval` set (the first `eval.prompts` of it, or its family's choice: for a
shapes-world set a fixed, form-stratified subset) and the reward is `eval.reward` (or the run's). A scorer
with metrics of its own gives them and says which of them sum the evaluation up (`score_with_metrics`: the shapes
bed's exact reward, per-attribute accuracies, exact matches and the reward per caption form, solrl/shapes/metrics.py);
the summary and a run's records copy those as they are. With a weighted multi-reward each step count's result holds
each component's mean. Whatever the reward, the summary gives `flat_share`, the share of images that are one flat
colour (a blank canvas): the cheapest exploit of rewards such as JPEG compressibility, counted so that a rising
reward bought by drawing nothing shows in the records, not only in the grids; and `mean_reward_not_flat`, the mean
reward of the other images (the reward without that exploit).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from solrl.algo.guards import is_flat
from solrl.models.base import T2IModel
from solrl.prompts import eval_subset
from solrl.rewards import Scorer, build_reward
from solrl.rewards.frames import first_frames, score_frames
from solrl.rollout.passes import PromptCache, SamplerSpec, generate
from solrl.telemetry import image_grid, save_png


def flat_share(images: np.ndarray) -> float:
    """The share of images that are flat (`is_flat`); 0 for none."""
    flat = is_flat(images)
    return float(flat.mean()) if len(flat) else 0.0


# what an evaluation summary says about itself (`evaluate`); its other fields are metrics
_FRAMING = ("n", "steps", "reward", "prompts", "seeds_per_prompt", "results")


def summary_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The metrics of an evaluation summary (`evaluate`): its mean reward and the fields its scorer sums the
    evaluation up with (the shapes bed's: per-attribute accuracies, exact matches, the reward of each caption form as
    `form_<form>`, ...), whatever they are named."""
    return {k: v for k, v in summary.items() if k not in _FRAMING}


def eval_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """An evaluation summary's fields of a metrics record: eval.<summary_metrics> (eval.mean_reward first), as the
    embedded loop and the services trainer both write them."""
    return {f"eval.{k}": v for k, v in summary_metrics(summary).items()}


def eval_prompt_set(name: str, n: int) -> list[str]:
    """`n` evaluation prompts of the set `name`: its first `n`, or its family's choice (a shapes-world set: its
    form-stratified subset; solrl.prompts.eval_subset)."""
    if n <= 0:
        raise ValueError(f"the number of evaluation prompts must be positive, got {n}")
    return eval_subset(name, n)


def eval_scorer(cfg: Any, run_scorer: Scorer | None = None) -> Scorer:
    """`cfg.eval.reward` (or the run's reward), reusing the run's scorer when they are the same."""
    name = cfg.eval.reward or cfg.reward
    if run_scorer is not None and name == cfg.reward:
        return run_scorer
    return build_reward(name)


def _score(scorer: Scorer, images: np.ndarray, prompts: list[str],
           seeds_per_prompt: int = 1) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
    """Total rewards, the extra result fields the scorer can give and the summary fields among them: its own where it
    has `score_with_metrics` (solrl.rewards.Scorer), a weighted multi-reward's component means (summed up as
    `reward_<component>`, so a run's records carry each term: eval.reward_shapes, eval.reward_jpeg_compressibility).
    A video model's frames [B, F, H, W, 3]: the per-clip mean of the frames' rewards (solrl/rewards/frames.py)."""
    if images.ndim == 5:
        return score_frames(scorer, images, prompts).astype(np.float64), {}, {}
    with_metrics = getattr(scorer, "score_with_metrics", None)
    if callable(with_metrics):
        return with_metrics(images, prompts, seeds_per_prompt)
    detailed = getattr(scorer, "score_detailed", None)
    if callable(detailed):   # a weighted multi-reward: {component: [N], "total": [N]}
        parts = detailed(images, prompts)
        components = {k: float(np.mean(v)) for k, v in parts.items() if k != "total"}
        return (np.asarray(parts["total"], dtype=np.float64), {"components": components},
                {f"reward_{k}": v for k, v in components.items()})
    return np.asarray(scorer(images, prompts), dtype=np.float64), {}, {}


def evaluate(model: T2IModel, transformer: nn.Module, steps: tuple[int, ...], prompts: list[str],
             seeds_per_prompt: int, seed: int, sampler: SamplerSpec, scorer: Scorer | None = None,
             micro_batch: int = 128, cache: PromptCache | None = None,
             references: dict[str, Scorer] | None = None) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
    """Returns (summary, {steps: grid image}). Seeds are fixed: seed + prompt index * S + j. `scorer`
    defaults to the registered `shapes` reward (the shapes world's exact one). Each step count's result also holds
    the reward-hacking monitors of its images (solrl/engine/monitors.py: `diversity` and `duplicate_share` across a
    prompt's seeds) and, as `ref.<name>`, the mean of each of `references` (rewards the run does not train on)."""
    from solrl.engine.monitors import seed_spread

    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    flat_p = [p for p in prompts for _ in range(seeds_per_prompt)]
    flat_s = [seed + i * seeds_per_prompt + j for i in range(len(prompts)) for j in range(seeds_per_prompt)]
    reward = scorer if scorer is not None else build_reward("shapes")
    results: dict[str, Any] = {}
    summaries: dict[str, dict[str, Any]] = {}   # the scorer's summary fields of each step count
    grids: dict[int, np.ndarray] = {}
    for n_steps in steps:
        t0 = time.time()
        gen = generate(model, transformer, flat_p, flat_s, n_steps, sampler, micro_batch, cache)
        totals, extra, summaries[str(n_steps)] = _score(reward, gen.images, flat_p, seeds_per_prompt)
        flat = is_flat(gen.images)
        drawn = totals[~flat]  # the reward without the blank-canvas exploit (None: every image flat)
        res: dict[str, Any] = {"mean_reward": float(totals.mean()), "n": len(totals), "flat_share": float(flat.mean()),
                               "mean_reward_not_flat": float(drawn.mean()) if len(drawn) else None,
                               "sample_time_s": round(time.time() - t0, 2), **extra,
                               **seed_spread(gen.images, seeds_per_prompt),
                               **{f"ref.{name}": float(_score(ref, gen.images, flat_p, seeds_per_prompt)[0].mean())
                                  for name, ref in (references or {}).items()}}
        results[str(n_steps)] = res
        pick = list(range(0, len(flat_p), seeds_per_prompt))[:32]
        grids[n_steps] = image_grid(first_frames(gen.images[pick]), [flat_p[i] for i in pick],
                                    scores=[float(totals[i]) for i in pick])
    first = results[str(steps[0])]
    summary = {"mean_reward": first["mean_reward"], "flat_share": first["flat_share"],
               "mean_reward_not_flat": first["mean_reward_not_flat"],
               **{k: v for k, v in first.items() if k in ("diversity", "duplicate_share") or k.startswith("ref.")},
               "n": first["n"], "steps": list(steps),
               "reward": getattr(reward, "name", type(reward).__name__),
               "prompts": len(prompts), "seeds_per_prompt": seeds_per_prompt,
               **summaries[str(steps[0])], "results": results}
    return summary, grids


def write_eval(out: Path, summary: dict[str, Any], grids: dict[int, np.ndarray], extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps({**extra, **summary}, indent=2) + "\n")
    for n_steps, g in grids.items():
        save_png(g, out / f"grid_{n_steps}steps.png")
