"""`shapes_dense`: a continuous training reward of the shapes world, on the exact reward's detections.

The exact reward (`solrl.shapes.reward`) gives credit in steps: a shape is right or wrong, a position
holds or not. A group of seeds that all miss a triangle then scores the same, and RL has no gradient
toward it. This reward measures how far each attribute is from right, on the same objects (the same
size bounds, so a flooded canvas or one huge blob is no object here either):

  colour   - per expected object exp(-d^2 / (2 * COLOUR_SIGMA^2)), d the RGB distance of the matched
             object's mean colour to the prompted palette colour
  shape    - the colour credit times a soft margin on mask overlap: the object's IoU with the ideal
             prompted shape drawn in its bounding box, minus its best IoU with another shape, mapped
             linearly from -SHAPE_MARGIN (0) to +SHAPE_MARGIN (1)
  count    - 1 - |detected - expected| / expected (floored at 0), as the exact reward
  position - 1 where the exact predicate holds, falling linearly to 0 over POSITION_SCALE (a share of
             the side) of centroid distance outside it; relations likewise on the centroid gap
Colour and shape are summed over expected objects and scaled as an F1 (2 * credit / (expected +
detected)), so extra detections cost credit as in the exact reward. Expected objects are matched to
distinct detections by the assignment that maximises colour + shape + position credit (brute force:
at most 3 objects and MAX_DETECTIONS candidates). The total is the mean of the applicable parts.

Ground-truth renders score exactly 1 (flat palette colours; the ideal shape drawn in the object's own
box matches a circle or square exactly and a triangle with a margin >= 0.19, above SHAPE_MARGIN).
Written by hand: no library scores this world.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from PIL import Image, ImageDraw

from solrl.rewards.inputs import check_images
from solrl.shapes.detect import MAX_DETECTIONS, REL_MARGIN, Component, components
from solrl.shapes.world import COLORS, SHAPES, Spec, parse

COLOUR_SIGMA = 60.0    # RGB distance at which colour credit falls to exp(-1/2)
SHAPE_MARGIN = 0.15    # IoU margin over the next-best shape that earns full shape credit
POSITION_SCALE = 0.25  # centroid distance (share of the side) past a predicate at which credit reaches 0

_PALETTE = {c: np.array(v, dtype=np.float64) for c, v in COLORS.items()}


def _ideal(shape: str, h: int, w: int) -> np.ndarray:
    """The world's drawing of `shape` filling an h x w box (bool mask)."""
    img = Image.new("1", (w, h), 0)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse([0, 0, w - 1, h - 1], fill=1)
    elif shape == "square":
        draw.rectangle([0, 0, w - 1, h - 1], fill=1)
    else:  # upward triangle, as solrl.shapes.world draws it
        draw.polygon([((w - 1) / 2, 0), (w - 1, h - 1), (0, h - 1)], fill=1)
    return np.asarray(img, dtype=bool)


def shape_ious(mask: np.ndarray) -> dict[str, float]:
    """IoU of a component's mask with each ideal shape drawn in its bounding box."""
    h, w = mask.shape
    out = {}
    for s in SHAPES:
        ideal = _ideal(s, h, w)
        out[s] = float((mask & ideal).sum() / max(1, (mask | ideal).sum()))
    return out


def colour_credit(comp: Component, colour: str) -> float:
    d2 = float(((comp.mean_rgb - _PALETTE[colour]) ** 2).sum())
    return math.exp(-d2 / (2 * COLOUR_SIGMA**2))


def shape_credit(ious: dict[str, float], shape: str) -> float:
    margin = ious[shape] - max(v for k, v in ious.items() if k != shape)
    return float(np.clip(0.5 + margin / (2 * SHAPE_MARGIN), 0.0, 1.0))


def _ramp(distance: float) -> float:
    return max(0.0, 1.0 - max(0.0, distance) / POSITION_SCALE)


def position_credit(position: str, cx: float, cy: float) -> float:
    """1 inside the exact reward's predicate (solrl.shapes.reward._position_ok), linear to 0 outside."""
    if position == "left":
        return _ramp(cx - 0.4)
    if position == "right":
        return _ramp(0.6 - cx)
    if position == "top":
        return _ramp(cy - 0.4)
    if position == "bottom":
        return _ramp(0.6 - cy)
    return _ramp(max(0.0, abs(cx - 0.5) - 0.17) + max(0.0, abs(cy - 0.5) - 0.17))  # centre


def relation_credit(relation: str, a: Component, b: Component) -> float:
    ad, bd = a.det, b.det
    if relation == "left of":
        return _ramp(ad.cx - (bd.cx - REL_MARGIN))
    if relation == "right of":
        return _ramp((bd.cx + REL_MARGIN) - ad.cx)
    if relation == "above":
        return _ramp(ad.cy - (bd.cy - REL_MARGIN))
    return _ramp((bd.cy + REL_MARGIN) - ad.cy)  # below


def score_dense(image: np.ndarray, spec: Spec) -> dict[str, float]:
    """Dense sub-scores and total for one image. Keys: total, colour, shape, count, position (NaN if n/a)."""
    comps = components(image)
    cands = comps[:MAX_DETECTIONS]
    expected = spec.expected
    m, n = len(expected), len(comps)
    ious = [shape_ious(c.mask) for c in cands]
    # per (expected object, candidate): colour credit and colour x shape credit
    col = [[colour_credit(c, o.color) for c in cands] for o in expected]
    shp = [[col[i][j] * shape_credit(ious[j], o.shape) for j in range(len(cands))] for i, o in enumerate(expected)]
    best = (-1.0, 0.0, 0.0, 0.0)
    slots: list[int | None] = [*range(len(cands)), None]
    for assign in itertools.product(slots, repeat=m):
        used = [j for j in assign if j is not None]
        if len(used) != len(set(used)):
            continue
        c = sum(col[i][j] for i, j in enumerate(assign) if j is not None)
        s = sum(shp[i][j] for i, j in enumerate(assign) if j is not None)
        if spec.position is not None:
            j = assign[0]
            p = 0.0 if j is None else position_credit(spec.position, cands[j].det.cx, cands[j].det.cy)
        elif spec.relation is not None:
            ja, jb = assign
            p = 0.0 if ja is None or jb is None else relation_credit(spec.relation, cands[ja], cands[jb])
        else:
            p = 0.0
        if c + s + p > best[0]:
            best = (c + s + p, c, s, p)
    has_pos = spec.relation is not None or spec.position is not None
    parts = {"colour": 2.0 * best[1] / (m + n), "shape": 2.0 * best[2] / (m + n),
             "count": max(0.0, 1.0 - abs(n - m) / m), "position": best[3] if has_pos else float("nan")}
    vals = [v for v in parts.values() if not math.isnan(v)]
    return {"total": float(np.mean(vals)), **{k: float(v) for k, v in parts.items()}}


class ShapesDenseReward:
    """Dense training reward of the shapes world. Images: uint8 [B, H, W, 3]; prompts: captions."""

    name = "shapes_dense"
    needs_weights = False

    def score_parts(self, images: np.ndarray, prompts: list[str]) -> list[dict[str, float]]:
        images = check_images(images, len(prompts))
        specs = [parse(p) for p in prompts]
        return [score_dense(img, s) for img, s in zip(images, specs)]

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        return np.array([d["total"] for d in self.score_parts(images, prompts)], dtype=np.float32)
