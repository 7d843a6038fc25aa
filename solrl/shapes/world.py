"""The shapes world: a procedural text-to-image world with an exact ground truth.

Images hold 1-3 flat-coloured objects on a light background. A prompt is generated from a structured
`Spec` by a small grammar, and parsed back into the same `Spec`; the exact reward
(`solrl.shapes.reward`) checks a generated image against the spec. Everything is deterministic.

Grammar forms (every caption is lower case, words separated by single spaces):
  single     "a red circle"
  position   "a red circle on the left" | "... on the right" | "... at the top" | "... at the bottom"
             | "... in the centre"
  count      "two red circles" | "three red circles"
  relation   "a red circle to the left of a blue square" | "... to the right of ..." | "... above ..."
             | "... below ..."
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field, replace

import numpy as np
from PIL import Image, ImageDraw

from solrl.rewards.inputs import PromptError  # a caption that is not in the grammar

# Palette: well separated in RGB so that colour segmentation is exact on ground-truth renders.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 210, 40),
    "purple": (150, 60, 200),
    "cyan": (40, 210, 215),
}
BACKGROUND: tuple[int, int, int] = (245, 245, 245)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
POSITIONS: tuple[str, ...] = ("left", "right", "top", "bottom", "centre")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three"}

_POSITION_PHRASE = {
    "left": "on the left",
    "right": "on the right",
    "top": "at the top",
    "bottom": "at the bottom",
    "centre": "in the centre",
}
_RELATION_PHRASE = {
    "left of": "to the left of",
    "right of": "to the right of",
    "above": "above",
    "below": "below",
}

IMAGE_SIZE = 32



@dataclass(frozen=True)
class ObjectSpec:
    color: str
    shape: str

    def __post_init__(self) -> None:
        if self.color not in COLORS:
            raise PromptError(f"unknown colour {self.color!r}; known: {sorted(COLORS)}")
        if self.shape not in SHAPES:
            raise PromptError(f"unknown shape {self.shape!r}; known: {list(SHAPES)}")

    @property
    def words(self) -> str:
        return f"{self.color} {self.shape}"


@dataclass(frozen=True)
class Spec:
    """Structured content of a prompt.

    form: "single" (one object, optional `position`), "count" (`count` copies of objects[0]),
    "relation" (objects[0] is `relation` objects[1]).
    """

    form: str
    objects: tuple[ObjectSpec, ...]
    count: int = 1
    position: str | None = None
    relation: str | None = None

    def __post_init__(self) -> None:
        if self.form == "single":
            ok = len(self.objects) == 1 and self.count == 1 and self.relation is None
            ok = ok and (self.position is None or self.position in POSITIONS)
        elif self.form == "count":
            ok = len(self.objects) == 1 and self.count in COUNT_WORDS and self.position is None
            ok = ok and self.relation is None
        elif self.form == "relation":
            ok = len(self.objects) == 2 and self.count == 1 and self.position is None
            ok = ok and self.relation in RELATIONS and self.objects[0] != self.objects[1]
        else:
            raise PromptError(f"unknown spec form {self.form!r}")
        if not ok:
            raise PromptError(f"inconsistent spec: {self!r}")

    @property
    def expected(self) -> list[ObjectSpec]:
        """Every object the image must contain (count copies expanded)."""
        return [self.objects[0]] * self.count if self.form == "count" else list(self.objects)

    def caption(self) -> str:
        o = self.objects[0]
        if self.form == "count":
            return f"{COUNT_WORDS[self.count]} {o.words}s"
        if self.form == "relation":
            return f"a {o.words} {_RELATION_PHRASE[self.relation]} a {self.objects[1].words}"
        if self.position is not None:
            return f"a {o.words} {_POSITION_PHRASE[self.position]}"
        return f"a {o.words}"


# ---------------------------------------------------------------- vocabulary and parsing

VOCAB: tuple[str, ...] = tuple(
    sorted(
        set(COLORS)
        | set(SHAPES)
        | {s + "s" for s in SHAPES}
        | set(COUNT_WORDS.values())
        | {w for p in _POSITION_PHRASE.values() for w in p.split()}
        | {w for p in _RELATION_PHRASE.values() for w in p.split()}
        | {"a"}
    )
)


def tokenize(caption: str) -> list[str]:
    """Split a caption into words, rejecting any word outside the world's vocabulary."""
    if not isinstance(caption, str):
        raise PromptError(f"prompt must be a string, got {type(caption).__name__}")
    words = caption.strip().lower().split()
    if not words:
        raise PromptError("empty prompt")
    for w in words:
        if w not in VOCAB:
            raise PromptError(f"unknown word {w!r} in prompt {caption!r}")
    return words


def _parse_object(words: list[str], caption: str) -> ObjectSpec:
    if len(words) != 3 or words[0] != "a":
        raise PromptError(f"expected 'a <colour> <shape>' in {caption!r}, got {' '.join(words)!r}")
    return ObjectSpec(words[1], words[2])


def parse(caption: str) -> Spec:
    """Caption -> Spec. Raises PromptError naming the offending word or phrase."""
    words = tokenize(caption)
    if words[0] in ("two", "three"):
        count = 2 if words[0] == "two" else 3
        if len(words) != 3 or not words[2].endswith("s") or words[2][:-1] not in SHAPES:
            raise PromptError(f"expected '<two|three> <colour> <shape>s', got {caption!r}")
        return Spec("count", (ObjectSpec(words[1], words[2][:-1]),), count=count)
    head, rest = words[:3], words[3:]
    obj = _parse_object(head, caption)
    if not rest:
        return Spec("single", (obj,))
    phrase = " ".join(rest)
    for pos, p in _POSITION_PHRASE.items():
        if phrase == p:
            return Spec("single", (obj,), position=pos)
    for rel, p in _RELATION_PHRASE.items():
        n = len(p.split())
        if " ".join(rest[:n]) == p:
            return Spec("relation", (obj, _parse_object(rest[n:], caption)), relation=rel)
    raise PromptError(f"cannot parse {phrase!r} in prompt {caption!r}")


_OPPOSITE_RELATION = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def reverse_relation(caption: str) -> str:
    """A relation caption with its relation reversed, the objects keeping their places in the sentence ("a red
    circle to the left of a blue square" -> "... to the right of ..."): the same words, the other picture."""
    spec = parse(caption)
    if spec.form != "relation":
        raise PromptError(f"not a relation caption: {caption!r}")
    return replace(spec, relation=_OPPOSITE_RELATION[spec.relation]).caption()


# ---------------------------------------------------------------- all prompts and the split

def all_specs() -> list[Spec]:
    """Every spec of the grammar, in a fixed order (1,368 in all)."""
    objs = [ObjectSpec(c, s) for c in COLORS for s in SHAPES]
    specs: list[Spec] = []
    for o in objs:
        specs.append(Spec("single", (o,)))
        specs.extend(Spec("single", (o,), position=p) for p in POSITIONS)
        specs.extend(Spec("count", (o,), count=n) for n in COUNT_WORDS)
    for a, b in itertools.permutations(objs, 2):
        specs.extend(Spec("relation", (a, b), relation=r) for r in RELATIONS)
    return specs


HELDOUT_PERCENT = 15


def is_heldout(spec: Spec) -> bool:
    """Deterministic split by a hash of the caption: ~15% of all prompts are held out.

    A held-out prompt's full attribute combination (colour-shape-position, colour-shape-count, or
    object-relation-object) never appears in pretraining, while each of its parts does.
    """
    h = int(hashlib.sha256(spec.caption().encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_PERCENT


def split_prompts() -> tuple[list[str], list[str]]:
    """(train captions, held-out captions)."""
    train, held = [], []
    for s in all_specs():
        (held if is_heldout(s) else train).append(s.caption())
    return train, held


# ---------------------------------------------------------------- rendering

@dataclass
class Placed:
    """One rendered object: what it is and where (pixel centre, size in pixels)."""

    obj: ObjectSpec
    cx: float
    cy: float
    size: float
    extra: dict = field(default_factory=dict)


# Object sizes and position regions, as fractions of the image side. Objects are large (a single object
# spans 11-14 px at 32x32, i.e. three to four 4x4 patches of the bundled model) so that circle, square
# and triangle differ in many pixels: at 8-11 px the first bundled models never told them apart
# (docs/shapes.md). Region centres keep every object inside the canvas, and the reward's predicates
# (solrl.shapes.reward) are looser than these so that ground truth always satisfies them.
SIZE_SINGLE = (0.34, 0.44)
SIZE_POSITIONED = (0.34, 0.42)
SIZE_RELATION = (0.30, 0.38)
SIZE_COUNT = (0.26, 0.32)
_REGION = {
    "left": ((0.23, 0.30), (0.42, 0.58)),
    "right": ((0.70, 0.77), (0.42, 0.58)),
    "top": ((0.42, 0.58), (0.23, 0.30)),
    "bottom": ((0.42, 0.58), (0.70, 0.77)),
    "centre": ((0.44, 0.56), (0.42, 0.54)),
}


def _draw(draw: ImageDraw.ImageDraw, p: Placed) -> None:
    r = p.size / 2
    col = COLORS[p.obj.color]
    x0, y0, x1, y1 = p.cx - r, p.cy - r, p.cx + r, p.cy + r
    if p.obj.shape == "circle":
        draw.ellipse([x0, y0, x1, y1], fill=col)
    elif p.obj.shape == "square":
        draw.rectangle([x0, y0, x1, y1], fill=col)
    else:  # upward triangle filling its bounding box
        draw.polygon([(p.cx, y0), (x1, y1), (x0, y1)], fill=col)


def _overlaps(a: Placed, b: Placed, gap: float) -> bool:
    return abs(a.cx - b.cx) < (a.size + b.size) / 2 + gap and abs(a.cy - b.cy) < (a.size + b.size) / 2 + gap


def layout(spec: Spec, rng: np.random.Generator, size: int = IMAGE_SIZE) -> list[Placed]:
    """Random placement satisfying the spec (rejection sampling, deterministic given rng)."""
    def u(lo: float, hi: float) -> float:
        return float(rng.uniform(lo, hi)) * size

    for _ in range(1000):
        placed: list[Placed] = []
        if spec.form == "single" and spec.position is not None:
            (xa, xb), (ya, yb) = _REGION[spec.position]
            placed.append(Placed(spec.objects[0], u(xa, xb), u(ya, yb), u(*SIZE_POSITIONED)))
        elif spec.form == "relation":
            a, b = spec.objects
            axis_lo, axis_hi = u(0.21, 0.30), u(0.70, 0.79)
            # the two objects share a row (or column), so the relation is unambiguous
            other_a = u(0.30, 0.70)
            other_b = other_a + u(-0.04, 0.04)
            first, second = (axis_lo, axis_hi) if spec.relation in ("left of", "above") else (axis_hi, axis_lo)
            if spec.relation in ("left of", "right of"):
                pa, pb = (first, other_a), (second, other_b)
            else:
                pa, pb = (other_a, first), (other_b, second)
            placed = [Placed(a, *pa, u(*SIZE_RELATION)), Placed(b, *pb, u(*SIZE_RELATION))]
        else:
            lo, hi = SIZE_SINGLE if spec.form == "single" else SIZE_COUNT
            margin = hi * size / 2 + 1
            for o in spec.expected:
                s = u(lo, hi)
                placed.append(Placed(o, float(rng.uniform(margin, size - margin)),
                                     float(rng.uniform(margin, size - margin)), s))
        if all(not _overlaps(p, q, 2.5) for p, q in itertools.combinations(placed, 2)):
            return placed
    raise RuntimeError(f"could not lay out {spec.caption()!r}")  # pragma: no cover - never seen


def render(spec: Spec, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Ground-truth image, uint8 [size, size, 3]. Drawn without anti-aliasing (flat colours)."""
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for p in layout(spec, rng, size):
        _draw(draw, p)
    return np.asarray(img, dtype=np.uint8).copy()


def random_spec(rng: np.random.Generator, captions: list[str] | None = None) -> Spec:
    """A random spec: uniform over `captions` if given, else over the whole grammar."""
    if captions is None:
        captions = [s.caption() for s in all_specs()]
    return parse(captions[int(rng.integers(len(captions)))])
