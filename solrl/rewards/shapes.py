"""The exact `shapes` reward: checks an image against its prompt's spec (GenEval-style, but exact).

Detection (written by hand: no library does this for our world): every pixel is assigned to the
nearest palette colour or the background (pixels far from all of them count as background);
connected components per colour (scipy.ndimage.label) between a minimum and a maximum size are objects
(a flood of one colour, or one blob over most of the canvas, is no object); the shape
class comes from geometry (fill ratio of the bounding box, how the width changes from top to bottom),
the position from the centroid.

Score in [0, 1] with partial credit: the mean of the applicable sub-scores
  colour   - F1 of the detections against the expected objects, a match needing the colour
  shape    - the same F1, a match needing colour AND shape
  count    - 1 - |detected - expected| / expected (floored at 0)
  position - for positioned prompts and relations: 1 if the matched object(s) satisfy it
Expected objects are matched to detections by the assignment that maximises colour, shape and
position agreement. The F1 (2 * matched / (expected + detected)) makes every extra detection cost
credit: with recall alone, an image flooded with fragments of the prompted colour earns colour, shape
and position credit from its best fragments, and RL finds that in a few epochs (docs/shapes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from solrl.world.shapes import BACKGROUND, COLORS, Spec, parse

_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[c] for c in _NAMES] + [BACKGROUND], dtype=np.float32)  # [7, 3]
_BG = len(_NAMES)
MAX_COLOR_DIST = 90.0      # farther than this from every palette entry -> background
MIN_AREA_FRACTION = 0.008  # components smaller than this share of the image are noise (8 px at 32x32)
# An object is a thing on the background, bounded in size: a component larger than this share of the
# image, or wider or taller than MAX_SIDE_FRACTION of its side, is a flood or a smear, not an object
# (the world's largest object, a 0.44-side square, covers at most 0.24 of the image and 0.47 of a side).
MAX_AREA_FRACTION = 0.3
MAX_SIDE_FRACTION = 0.6
MAX_DETECTIONS = 6         # only the largest detections take part in matching (all of them are counted)
REL_MARGIN = 0.08          # relations need this much separation (fraction of the side)


@dataclass(frozen=True)
class Detection:
    color: str
    shape: str
    cx: float  # centroid, fraction of width
    cy: float  # centroid, fraction of height
    area: int


def classify_shape(mask: np.ndarray) -> str:
    """Shape class of one connected component (bool mask cropped to its bounding box)."""
    h, w = mask.shape
    fill = mask.sum() / float(h * w)
    rows = mask.sum(axis=1).astype(np.float32)
    third = max(1, h // 3)
    top, bottom = rows[:third].mean(), rows[-third:].mean()
    taper = top / max(bottom, 1e-6)  # upward triangle: narrow top, wide bottom
    if fill >= 0.86:
        return "square"
    if taper < 0.55 or fill < 0.62:
        return "triangle"
    return "circle"


@dataclass(frozen=True)
class Component:
    """A detection with its pixels: the bool mask cropped to its bounding box, where that box lies
    (top, left) and the mean RGB of its pixels in the image (what the dense reward measures)."""

    det: Detection
    mask: np.ndarray
    top: int
    left: int
    mean_rgb: np.ndarray


def components(image: np.ndarray) -> list[Component]:
    """Objects found in one uint8 HWC image with their masks, largest first.

    Pixels go to the nearest palette colour or the background; a connected component of one colour is
    an object when its size is within bounds: at least MIN_AREA_FRACTION of the image, at most
    MAX_AREA_FRACTION, and no wider or taller than MAX_SIDE_FRACTION of the side.
    """
    h, w, _ = image.shape
    px = image.reshape(-1, 1, 3).astype(np.float32)
    dist = np.linalg.norm(px - _PALETTE[None], axis=-1)  # [HW, 7]
    label = dist.argmin(axis=1)
    label[dist.min(axis=1) > MAX_COLOR_DIST] = _BG
    label = label.reshape(h, w)
    min_area = max(3, int(round(MIN_AREA_FRACTION * h * w)))
    max_area = MAX_AREA_FRACTION * h * w
    found: list[Component] = []
    for ci, name in enumerate(_NAMES):
        comps, n = ndimage.label(label == ci)
        if n == 0:
            continue
        for sl, idx in zip(ndimage.find_objects(comps), range(1, n + 1)):
            mask = comps[sl] == idx
            area = int(mask.sum())
            if area < min_area or area > max_area:
                continue
            if mask.shape[0] > MAX_SIDE_FRACTION * h or mask.shape[1] > MAX_SIDE_FRACTION * w:
                continue
            ys, xs = np.nonzero(mask)
            det = Detection(name, classify_shape(mask), (xs.mean() + sl[1].start + 0.5) / w,
                            (ys.mean() + sl[0].start + 0.5) / h, area)
            found.append(Component(det, mask, sl[0].start, sl[1].start,
                                   image[sl][mask].astype(np.float64).mean(axis=0)))
    found.sort(key=lambda c: -c.det.area)
    return found


def detect(image: np.ndarray) -> list[Detection]:
    """Objects found in one uint8 HWC image, largest first (see `components`)."""
    return [c.det for c in components(image)]


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


def check_images(images: np.ndarray, n_prompts: int | None = None) -> np.ndarray:
    """Validate a batch of images: numpy uint8, [B, H, W, 3], B matching the prompts."""
    if not isinstance(images, np.ndarray):
        raise TypeError(f"images must be a numpy array, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise TypeError(f"images must have dtype uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[-1] != 3 or images.shape[1] < 4 or images.shape[2] < 4:
        raise ValueError(f"images must have shape [B, H, W, 3] (H, W >= 4), got {list(images.shape)}")
    if n_prompts is not None and images.shape[0] != n_prompts:
        raise ValueError(f"got {images.shape[0]} images but {n_prompts} prompts")
    return images
