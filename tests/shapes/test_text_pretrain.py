"""`solrl shapes pretrain-text`: a contrastive text encoder that reads a relation's order, and a denoiser
pretrained on top of it (frozen)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from solrl.shapes.model import ShapesModel
from solrl.shapes.pretrain import PretrainConfig, pretrain
from solrl.shapes.pretrain_text import (
    TextPretrainConfig,
    _opposite,
    hard_negatives,
    late_interaction,
    pretrain_text,
)
from solrl.shapes.world import split_prompts


def test_late_interaction_takes_each_tokens_best_patch_and_averages_over_the_scored_tokens():
    patches = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])             # one image, two patches
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])  # one caption, three tokens
    mask = torch.tensor([[1, 1, 0]])                                 # the third token is not scored
    assert late_interaction(patches, tokens, mask).item() == pytest.approx(1.0)
    mask = torch.tensor([[1, 1, 1]])                                 # (1 + 1 + cos 45deg) / 3
    assert late_interaction(patches, tokens, mask).item() == pytest.approx((2 + 2 ** -0.5) / 3)


def test_opposite_reverses_only_relations():
    assert _opposite("a red circle to the left of a blue square") == "a red circle to the right of a blue square"
    assert _opposite("a red circle above a blue square") == "a red circle below a blue square"
    assert _opposite("a red circle on the left") is None


def test_hard_negatives_are_training_captions_only():
    train, held = split_prompts()
    allowed = set(train)
    rel_held = [c for c in held if _opposite(c) is not None]
    # a training relation whose reversal is held out, and one whose reversal is a training caption
    leak = next(c for c in train if _opposite(c) in set(held))
    ok = next(c for c in train if _opposite(c) in allowed)
    rows, negs = hard_negatives([leak, "a red circle", ok, rel_held[0]], allowed)
    assert negs == [_opposite(ok)] + ([_opposite(rel_held[0])] if _opposite(rel_held[0]) in allowed else [])
    assert rows == [2] + ([3] if len(negs) == 2 else [])
    assert not set(negs) & set(held)


@pytest.mark.slow
def test_hard_negatives_teach_the_order_and_a_frozen_encoder_carries_it_into_pretraining(tmp_path):
    torch.set_num_threads(2)
    cfg = TextPretrainConfig(steps=120, batch_size=64, eval_every=60, eval_prompts=64, seed=0)
    text = pretrain_text(cfg, tmp_path / "text", progress=False)
    log = [json.loads(x) for x in (tmp_path / "text" / "log.jsonl").read_text().splitlines()]
    held = [r["heldout_order_acc"] for r in log if "heldout_order_acc" in r]
    assert len(held) == 2
    # held-out relation images (never rendered here) prefer their caption to the reversed one; 0.5 is a blind encoder
    assert held[-1] >= 0.9, held
    # the denoiser pretrains on the frozen encoder: its weights come out unchanged
    out = tmp_path / "denoiser"
    pretrain(PretrainConfig(steps=2, batch_size=4, save_every=2, seed=0, denoiser="unet", heads=4, eval_every=0,
                            text_encoder_from=str(tmp_path / "text"), freeze_text=True), out, progress=False)
    model = ShapesModel.load(out / "step_00002")
    for (name, a), b in zip(model.text_encoder.state_dict().items(), text.state_dict().values()):
        assert torch.equal(a, b), name


def test_pretrain_refuses_a_missing_text_encoder(tmp_path):
    with pytest.raises(ValueError, match="text_encoder_from"):
        pretrain(PretrainConfig(steps=1, batch_size=2, denoiser="unet", heads=4, eval_every=0,
                                text_encoder_from=str(tmp_path)), tmp_path / "out", progress=False)


def test_cli_pretrain_text_rejects_a_batch_without_negatives(tmp_path):
    r = subprocess.run([sys.executable, "-m", "solrl.cli", "shapes", "pretrain-text", "--out", str(tmp_path),
                        "--batch-size", "1"], capture_output=True, text=True)
    assert r.returncode != 0 and "--batch-size" in r.stderr
