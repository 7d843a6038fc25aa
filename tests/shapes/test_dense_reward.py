"""Reward fidelity: bounded object sizes (floods and huge blobs earn nothing) and the dense training reward."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from solrl.rewards import build_reward
from solrl.shapes.dense import score_dense
from solrl.shapes.reward import score_spec
from solrl.shapes.world import (
    BACKGROUND,
    COLORS,
    ObjectSpec,
    Spec,
    parse,
    random_spec,
    render,
)
from tests.shapes.test_world import _mutations


def _canvas() -> np.ndarray:
    return np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)


def _square(img: np.ndarray, colour: str, top: int, left: int, side: int) -> np.ndarray:
    img = img.copy()
    img[top:top + side, left:left + side] = COLORS[colour]
    return img


@pytest.mark.parametrize("score", [score_spec, score_dense], ids=["exact", "dense"])
def test_degenerate_images_earn_no_object_credit(score):
    spec = parse("a red square")
    flooded = np.broadcast_to(np.array(COLORS["red"], dtype=np.uint8), (32, 32, 3)).copy()
    blob = _square(_canvas(), "red", 3, 3, 26)          # one square blob over 66% of the canvas
    stripe = _square(_canvas(), "red", 12, 0, 8)[:, :, :]  # a full-width band is no object either
    stripe[12:20, :] = COLORS["red"]
    for img in (flooded, blob, stripe):
        s = score(img, spec)
        assert s["total"] == 0.0 and s["colour"] == 0.0 and s["count"] == 0.0
    # half the canvas flooded beside a correct object adds nothing: not a second object, no count credit
    good = render(parse("a red circle on the left"), np.random.default_rng(0))
    half = good.copy()
    half[:, 20:] = COLORS["red"]
    two = parse("two red circles")
    assert score(half, two)["total"] == score(good, two)["total"] and score(good, two)["count"] == 0.5


def test_dense_ground_truth_is_exactly_one_and_mutations_score_lower():
    rng = np.random.default_rng(11)
    lower = total = 0
    for _ in range(200):
        spec = random_spec(rng)
        img = render(spec, rng)
        right = score_dense(img, spec)
        assert right["total"] == 1.0, spec.caption()
        for m in _mutations(spec, rng):
            total += 1
            lower += score_dense(img, m)["total"] < 1.0
    assert total > 400 and lower / total >= 0.95


def test_dense_colour_falls_smoothly_with_distance():
    spec = parse("a red square")
    base = np.array(COLORS["red"], dtype=np.float64)
    toward = np.array(COLORS["purple"], dtype=np.float64)
    scores = []
    for f in np.linspace(0, 0.45, 6):  # stays nearer red than any other palette colour
        col = tuple(int(round(v)) for v in (1 - f) * base + f * toward)
        img = _canvas()
        img[10:22, 10:22] = col
        scores.append(score_dense(img, spec)["colour"])
    assert scores[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(scores))
    assert scores[-1] > 0.3  # partial credit, where the exact colour credit is still all or nothing


def test_dense_shape_credit_grades_between_square_and_circle():
    """Cutting a square's corners step by step moves it toward a circle: credit for 'square' falls
    steadily, credit for 'circle' rises, and the exact reward only flips once."""
    yy, xx = np.mgrid[0:14, 0:14]
    r = np.hypot(yy - 6.5, xx - 6.5)
    sq, circ, exact_sq = [], [], []
    for cut in (99, 9.5, 8.5, 8.0, 7.5, 7.0):
        img = _canvas()
        mask = r <= cut
        img[9:23, 9:23][mask] = COLORS["blue"]
        sq.append(score_dense(img, parse("a blue square"))["shape"])
        circ.append(score_dense(img, parse("a blue circle"))["shape"])
        exact_sq.append(score_spec(img, parse("a blue square"))["shape"])
    assert sq[0] == 1.0 and circ[-1] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(sq)) and sq[-1] == 0.0
    assert all(a <= b for a, b in itertools.pairwise(circ))
    assert len({round(v, 6) for v in sq}) >= 4   # graded, not a step
    assert set(exact_sq) == {0.0, 1.0}


def test_dense_position_falls_with_distance_past_the_predicate():
    spec = Spec("single", (ObjectSpec("green", "square"),), position="left")
    scores = []
    for left in (2, 5, 10, 13, 16, 20):
        scores.append(score_dense(_square(_canvas(), "green", 10, left, 10), spec)["position"])
    assert scores[0] == scores[1] == 1.0
    assert all(a >= b for a, b in itertools.pairwise(scores)) and scores[-1] < scores[2] < 1.0


def test_dense_extra_detections_cost_credit_and_registry_builds_it():
    spec = parse("a cyan circle")
    img = render(spec, np.random.default_rng(2))
    extra = img.copy()
    extra[1:5, 1:5] = COLORS["cyan"]
    assert score_dense(extra, spec)["total"] < score_dense(img, spec)["total"] == 1.0
    reward = build_reward("shapes_dense")
    out = reward(np.stack([img, extra]), [spec.caption()] * 2)
    assert out.dtype == np.float32 and out[0] == 1.0 and out[1] < 1.0
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        reward(np.stack([img, extra]), [spec.caption()])
