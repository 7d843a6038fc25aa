"""Reward-hacking monitors: what a run's images and a reward it does not train on say while it trains, and the
alarms the config sets on them (`monitor` in the run config).

Selection concentrates the update on a pool's extremes, which is where reward hacks live: on JPEG compressibility the
selecting runs of `solrl bench selection` drew 5-13% blank canvases by epoch 8 against 1-2% without selection
(docs/results.md). The monitors, per held-out evaluation (the EMA adapter's images, fixed prompts and seeds) and per
epoch (the trained rollouts):

- `flat_share`: images of one flat colour (`solrl.algo.guards.is_flat`: blank canvases);
- `duplicate_share`: images with a near-duplicate among the same prompt's other seeds (RMS pixel distance below
  DUPLICATE_RMS): the policy drawing one picture whatever the noise (mode collapse);
- `diversity`: the mean RMS pixel distance between a prompt's seeds, on 0..1 (a collapsing policy lowers it);
- the held-out mean of each `monitor.reference_rewards`: rewards scored on the same images and never trained on
  (the exact shapes reward while a run trains JPEG compressibility), with its drift from the evaluation before
  training (`eval.ref_drift.<name>`).

Written by hand: the measures are a few lines of numpy each and no library computes them on a run's image batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

# two images of one prompt are near-duplicates when their RMS pixel distance (0..255) is below this. Measured on the
# bundled base (24 held-out prompts x 4 seeds, 10 steps): a prompt's seeds lie 19.6-95.1 apart (median 62.0), an image
# and a canvas of its background colour 28.8 or more; the same seed sampled at 9 steps instead of 10 (the same
# picture, re-rendered) 1.1 (median) to 6.4
DUPLICATE_RMS = 10.0


def _pairwise_rms(group: np.ndarray) -> np.ndarray:
    """RMS pixel distances (0..255) between every two images of a group [S, ...] (S x S, zero diagonal)."""
    flat = group.reshape(len(group), -1).astype(np.float64)
    sq = (flat ** 2).sum(1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0) / flat.shape[1]
    np.fill_diagonal(d2, 0.0)
    return np.sqrt(d2)


def seed_spread(images: np.ndarray, seeds_per_prompt: int) -> dict[str, float | None]:
    """`diversity` and `duplicate_share` of images laid out prompt by prompt, `seeds_per_prompt` each (uint8
    [P*S, H, W, 3], or clips [P*S, F, H, W, 3]); None for both with one seed a prompt."""
    images = np.asarray(images)
    if seeds_per_prompt < 2 or len(images) < seeds_per_prompt:
        return {"diversity": None, "duplicate_share": None}
    if len(images) % seeds_per_prompt:
        raise ValueError(f"{len(images)} images do not make whole groups of {seeds_per_prompt} seeds")
    dists, dup = [], []
    for g in images.reshape(-1, seeds_per_prompt, *images.shape[1:]):
        d = _pairwise_rms(g)
        dists.append(d[np.triu_indices(seeds_per_prompt, 1)].mean())
        dup.extend((np.where(np.eye(seeds_per_prompt, dtype=bool), np.inf, d) < DUPLICATE_RMS).any(1))
    return {"diversity": float(np.mean(dists) / 255.0), "duplicate_share": float(np.mean(dup))}


def reference_drift(rec: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, float]:
    """`eval.ref_drift.<name>`: each reference reward of an evaluated record minus its value before training."""
    if not base:
        return {}
    return {f"eval.ref_drift.{k[len('eval.ref.'):]}": float(v) - float(base[k]) for k, v in rec.items()
            if k.startswith("eval.ref.") and isinstance(base.get(k), (int, float))}


def alarms(cfg: Any, rec: Mapping[str, Any]) -> list[str]:
    """The monitor thresholds (`cfg`: a MonitorConfig; 0 = off) that a record crosses, each as a line naming the
    monitor, its value and its threshold."""
    out = []

    def over(key: str, limit: float, what: str) -> None:
        v = rec.get(key)
        if limit and isinstance(v, (int, float)) and not math.isnan(v) and v > limit:
            out.append(f"{key} {v:.3f} > {limit:g} ({what})")

    over("eval.flat_share", cfg.flat_share_max, "monitor.flat_share_max: blank canvases")
    over("rollout.flat_share", cfg.flat_share_max, "monitor.flat_share_max: blank canvases among the trained rollouts")
    over("eval.duplicate_share", cfg.duplicate_share_max, "monitor.duplicate_share_max: one picture whatever the seed")
    div = rec.get("eval.diversity")
    if cfg.diversity_min and isinstance(div, (int, float)) and div < cfg.diversity_min:
        out.append(f"eval.diversity {div:.3f} < {cfg.diversity_min:g} (monitor.diversity_min: seeds drawn alike)")
    for k, v in rec.items():
        if k.startswith("eval.ref_drift.") and cfg.reference_drop_max and v < -cfg.reference_drop_max:
            out.append(f"{k} {v:+.3f} < -{cfg.reference_drop_max:g} (monitor.reference_drop_max: a reward the run "
                       "does not train on falls)")
    return out


__all__ = ["DUPLICATE_RMS", "alarms", "reference_drift", "seed_spread"]
