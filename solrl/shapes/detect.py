"""The shapes world's object detection, shared by the exact reward (`reward.py`) and the dense one (`dense.py`).

Written by hand (no library does this for our world): every pixel is assigned to the nearest palette colour or the
background (pixels far from all of them count as background); connected components per colour
(scipy.ndimage.label) between a minimum and a maximum size are objects (a flood of one colour, or one blob over
most of the canvas, is no object); the shape class comes from geometry (fill ratio of the bounding box, how the
width changes from top to bottom), the position from the centroid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from solrl.shapes.world import BACKGROUND, COLORS

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

