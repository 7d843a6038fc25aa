"""The shapes world: grammar, parser, split, renderer and the exact reward."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from solrl.rewards import available_rewards, build_reward
from solrl.shapes.detect import detect
from solrl.shapes.reward import ShapesReward, score_spec
from solrl.shapes.world import (
    COLORS,
    POSITIONS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    PromptError,
    Spec,
    all_specs,
    is_heldout,
    parse,
    random_spec,
    render,
    split_prompts,
)


def test_parser_round_trips_every_prompt_of_the_grammar():
    specs = all_specs()
    forms = {(s.form, s.position is not None) for s in specs}
    assert forms == {("single", False), ("single", True), ("count", False), ("relation", False)}
    assert len(specs) == len({s.caption() for s in specs}) == 1368
    for s in specs:
        assert parse(s.caption()) == s
    assert {s.relation for s in specs if s.relation} == set(RELATIONS)
    assert {s.position for s in specs if s.position} == set(POSITIONS)


def test_examples_read_naturally():
    assert parse("a blue square to the left of a yellow triangle") == Spec(
        "relation", (ObjectSpec("blue", "square"), ObjectSpec("yellow", "triangle")), relation="left of")
    assert parse("three green circles").count == 3
    assert parse("a red triangle in the centre").position == "centre"
    assert parse("  A Red Circle ").caption() == "a red circle"


@pytest.mark.parametrize("bad, word", [
    ("a pink circle", "pink"), ("a red hexagon", "hexagon"), ("a red circle near a blue square", "near"),
])
def test_unknown_word_is_named(bad, word):
    with pytest.raises(PromptError, match=repr(word)):
        parse(bad)


@pytest.mark.parametrize("bad", ["", "a red", "two red circle", "a red circle on the", "red a circle",
                                 "a red circle above a red circle"])
def test_ungrammatical_prompts_are_rejected(bad):
    with pytest.raises(PromptError):
        parse(bad)


def test_split_is_deterministic_and_heldout_combinations_are_unseen():
    train, held = split_prompts()
    assert (train, held) == split_prompts()
    assert not set(train) & set(held)
    assert 0.10 < len(held) / (len(train) + len(held)) < 0.20
    # every part of a held-out prompt is seen in training, the combination is not
    train_pairs = {o for c in train for o in parse(c).objects}
    for c in held:
        assert set(parse(c).objects) <= train_pairs
    for form in ("single", "count", "relation"):
        assert any(parse(c).form == form for c in held)
    assert all(is_heldout(parse(c)) for c in held)


def test_ground_truth_renders_score_full_marks():
    rng = np.random.default_rng(123)
    reward = ShapesReward()
    specs = [random_spec(rng) for _ in range(500)]
    images = np.stack([render(s, rng) for s in specs])
    scores = reward(images, [s.caption() for s in specs])
    assert scores.dtype == np.float32 and scores.shape == (500,)
    assert scores.mean() >= 0.95
    assert scores.min() >= 0.9


def _mutations(spec: Spec, rng: np.random.Generator) -> list[Spec]:
    """Specs that differ from `spec` in exactly one attribute."""
    out = []
    o = spec.objects[0]
    other_color = [c for c in COLORS if c != o.color]
    other_shape = [s for s in SHAPES if s != o.shape]
    objs = list(spec.objects)
    for new in (ObjectSpec(str(rng.choice(other_color)), o.shape), ObjectSpec(o.color, str(rng.choice(other_shape)))):
        if spec.form == "relation" and new == objs[1]:
            continue  # two identical objects in a relation are outside the grammar
        out.append(dataclasses.replace(spec, objects=tuple([new] + objs[1:])))
    if spec.form == "count":
        out.append(dataclasses.replace(spec, count=5 - spec.count))
    if spec.position is not None:
        out.append(dataclasses.replace(spec, position=str(rng.choice([p for p in POSITIONS if p != spec.position]))))
    if spec.relation is not None:
        out.append(dataclasses.replace(spec, relation=str(rng.choice([r for r in RELATIONS if r != spec.relation]))))
    return out


def test_changing_one_attribute_scores_lower():
    rng = np.random.default_rng(7)
    lower = total = 0
    for _ in range(300):
        spec = random_spec(rng)
        img = render(spec, rng)
        right = score_spec(img, spec)["total"]
        for m in _mutations(spec, rng):
            total += 1
            lower += score_spec(img, m)["total"] < right
    assert total > 600
    assert lower / total >= 0.95


def test_partial_credit_and_sub_scores():
    rng = np.random.default_rng(0)
    spec = parse("two red squares")
    img = render(spec, rng)
    three = score_spec(img, parse("three red squares"))
    assert three["count"] == pytest.approx(2 / 3)
    assert three["colour"] == pytest.approx(2 * 2 / (3 + 2))  # F1: recall 2/3, precision 1
    assert np.isnan(three["position"])
    blank = np.full_like(img, 245)
    s = score_spec(blank, parse("a red circle on the left"))
    assert s["total"] == 0.0
    wrong_shape = score_spec(render(parse("a red circle"), rng), parse("a red triangle"))
    assert wrong_shape["colour"] == 1.0 and wrong_shape["shape"] == 0.0
    assert 0 < wrong_shape["total"] < 1


def test_extra_fragments_cost_credit():
    """Flooding the canvas with patches of the prompted colour must not pay (the hack RL found)."""
    from solrl.shapes.world import COLORS as PALETTE

    rng = np.random.default_rng(5)
    worse = 0
    specs = [parse(c) for c in ("a red circle on the left", "a blue square above a green triangle",
                                "two yellow triangles", "a cyan circle")]
    for spec in specs:
        img = render(spec, rng)
        clean = score_spec(img, spec)["total"]
        flooded = img.copy()
        colour = PALETTE[spec.objects[0].color]
        for y, x in ((1, 1), (1, 27), (27, 1), (27, 27), (14, 1)):
            if (flooded[y:y + 4, x:x + 4] == 245).all():  # only on background
                flooded[y:y + 4, x:x + 4] = colour
        assert len(detect(flooded)) > len(detect(img))
        worse += score_spec(flooded, spec)["total"] < clean
    assert clean == 1.0 and worse == len(specs)


def test_detection_finds_objects_and_their_geometry():
    rng = np.random.default_rng(3)
    for shape in SHAPES:
        for color in COLORS:
            spec = Spec("single", (ObjectSpec(color, shape),), position="right")
            dets = detect(render(spec, rng))
            assert len(dets) == 1
            assert (dets[0].color, dets[0].shape) == (color, shape)
            assert dets[0].cx > 0.6


def test_bad_images_give_clear_errors():
    r = build_reward("shapes")
    good = np.zeros((2, 32, 32, 3), np.uint8)
    with pytest.raises(TypeError, match="uint8"):
        r(good.astype(np.float32), ["a red circle"] * 2)
    with pytest.raises(ValueError, match=r"\[B, H, W, 3\]"):
        r(np.zeros((2, 32, 32), np.uint8), ["a red circle"] * 2)
    with pytest.raises(ValueError, match="2 images but 3 prompts"):
        r(good, ["a red circle"] * 3)
    with pytest.raises(PromptError, match="'pink'"):
        r(good, ["a red circle", "a pink circle"])
    with pytest.raises(TypeError):
        r(good.tolist(), ["a red circle"] * 2)


def test_jpeg_compressibility_prefers_flat_images():
    r = build_reward("jpeg_compressibility")
    rng = np.random.default_rng(0)
    flat = np.full((1, 32, 32, 3), 200, np.uint8)
    noisy = rng.integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    sf, sn = r(flat, ["x"]), r(noisy, ["x"])
    assert sf[0] > sn[0]
    assert sn[0] < 0 and sf[0] < 0
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")
    assert {"shapes", "jpeg_compressibility"} <= set(available_rewards())
