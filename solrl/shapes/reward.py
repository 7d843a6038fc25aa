"""The exact `shapes` reward: checks an image against its prompt's spec (GenEval-style, but exact), on the objects
`detect.py` finds.

Score in [0, 1] with partial credit: the mean of the applicable sub-scores
  colour   - F1 of the detections against the expected objects, a match needing the colour
  shape    - the same F1, a match needing colour AND shape
  count    - 1 - |detected - expected| / expected (floored at 0)
  position - for positioned prompts and relations: 1 if the matched object(s) satisfy it
Expected objects are matched to detections by the assignment that maximises colour, shape and
position agreement. The F1 (2 * matched / (expected + detected)) makes every extra detection cost
credit: with recall alone, an image flooded with fragments of the prompted colour earns colour, shape
and position credit from its best fragments, and RL finds that in a few epochs (docs/notes/shapes.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from solrl.rewards.inputs import check_images
from solrl.shapes.detect import MAX_DETECTIONS, REL_MARGIN, Detection, detect
from solrl.shapes.metrics import reward_metrics
from solrl.shapes.world import Spec, parse


def _position_ok(position: str, d: Detection) -> bool:
    if position == "left":
        return d.cx < 0.4
    if position == "right":
        return d.cx > 0.6
    if position == "top":
        return d.cy < 0.4
    if position == "bottom":
        return d.cy > 0.6
    return abs(d.cx - 0.5) < 0.17 and abs(d.cy - 0.5) < 0.17  # centre


def _relation_ok(relation: str, a: Detection, b: Detection) -> bool:
    if relation == "left of":
        return a.cx < b.cx - REL_MARGIN
    if relation == "right of":
        return a.cx > b.cx + REL_MARGIN
    if relation == "above":
        return a.cy < b.cy - REL_MARGIN
    return a.cy > b.cy + REL_MARGIN  # below


def _agree(d: Detection | None, color: str, shape: str) -> tuple[int, int]:
    if d is None or d.color != color:
        return 0, 0
    return 1, int(d.shape == shape)


def _best_match(dets: list[Detection], spec: Spec) -> tuple[float, float, float]:
    """(colour, shape, position) of the assignment of expected objects to distinct detections that
    maximises colour + shape + position agreement (None = an expected object left unmatched)."""
    if spec.form == "count":  # identical expected objects: the optimum has a closed form
        o, m = spec.objects[0], spec.count
        col = min(m, sum(d.color == o.color for d in dets))
        shp = min(m, sum(d.color == o.color and d.shape == o.shape for d in dets))
        return col / m, shp / m, 0.0
    cands: list[Detection | None] = [*dets, None]
    if spec.form == "single":
        o, best = spec.objects[0], (-1.0, 0.0, 0.0, 0.0)
        for d in cands:
            col, shp = _agree(d, o.color, o.shape)
            pos = float(d is not None and spec.position is not None and _position_ok(spec.position, d))
            if col + shp + pos > best[0]:
                best = (col + shp + pos, col, shp, pos)
        return best[1], best[2], best[3]
    a, b = spec.objects
    best = (-1.0, 0.0, 0.0, 0.0)
    for da in cands:
        for db in cands:
            if da is not None and da is db:
                continue
            ca, sa = _agree(da, a.color, a.shape)
            cb, sb = _agree(db, b.color, b.shape)
            pos = float(da is not None and db is not None and _relation_ok(spec.relation, da, db))
            key = ca + cb + sa + sb + pos
            if key > best[0]:
                best = (key, (ca + cb) / 2, (sa + sb) / 2, pos)
    return best[1], best[2], best[3]


def score_spec(image: np.ndarray, spec: Spec) -> dict[str, float]:
    """Sub-scores and total for one image. Keys: total, colour, shape, count, position (NaN if n/a)."""
    dets = detect(image)
    m, n = len(spec.expected), len(dets)
    has_pos = spec.relation is not None or spec.position is not None
    best = _best_match(dets[:MAX_DETECTIONS], spec)  # recall: shares of the expected objects matched
    f1 = 2.0 * m / (m + n)  # matched = recall * m, so F1 = 2 * matched / (m + n) = recall * f1
    count = max(0.0, 1.0 - abs(n - m) / m)
    parts = {"colour": float(best[0] * f1), "shape": float(best[1] * f1), "count": float(count),
             "position": float(best[2]) if has_pos else float("nan")}
    vals = [v for v in parts.values() if not np.isnan(v)]
    return {"total": float(np.mean(vals)), **parts}


class ShapesReward:
    """Exact reward of the shapes world. Images: uint8 [B, H, W, 3]; prompts: captions of the grammar."""

    name = "shapes"
    needs_weights = False

    def score_detailed(self, images: np.ndarray, prompts: list[str]) -> list[dict[str, float]]:
        images = check_images(images, len(prompts))
        specs = [parse(p) for p in prompts]  # fails before any work on an unknown word
        return [score_spec(img, s) for img, s in zip(images, specs)]

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        return np.array([d["total"] for d in self.score_detailed(images, prompts)], dtype=np.float32)

    def score_with_metrics(self, images: np.ndarray, prompts: list[str],
                           seeds_per_prompt: int = 1) -> tuple[np.ndarray, dict[str, Any], dict[str, Any]]:
        """The totals (float64), the bed's evaluation metrics on them and the summary fields among them
        (`solrl.shapes.metrics.reward_metrics`): what `solrl.engine.evaluate` asks a scorer for. `seeds_per_prompt`:
        consecutive images that are one prompt's seeds."""
        detail = self.score_detailed(images, prompts)
        totals = np.array([d["total"] for d in detail])
        metrics, summary = reward_metrics(detail, totals, images, prompts, seeds_per_prompt)
        return totals, metrics, summary

