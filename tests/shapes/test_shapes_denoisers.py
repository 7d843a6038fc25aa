"""The shapes model's denoiser families (PixArt, SANA, UNet): each pretrains, saves, loads by its own
class, keeps its embedders out of the low-precision explorer, and runs an RL epoch through the loop."""

from __future__ import annotations

import json

import pytest
import torch

from solrl.config import apply_overrides, get_preset
from solrl.engine.loop import train
from solrl.models import load_model
from solrl.precision import PrecisionConfig, build_backend
from solrl.shapes.model import SPEC, ShapesModel, denoiser_kind, transformer_config
from solrl.shapes.pretrain import PretrainConfig, pretrain

CLASSES = {"pixart": "PixArtTransformer2DModel", "sana": "SanaTransformer2DModel", "unet": "UNet2DConditionModel"}


@pytest.mark.parametrize("denoiser", ["pixart", "sana", "unet"])
def test_each_family_builds_and_predicts_a_velocity_of_the_image_shape(denoiser):
    torch.manual_seed(0)
    model = ShapesModel.random(seed=0, denoiser=denoiser, layers=1, heads=2, patch=2)
    assert type(model.transformer).__name__ == CLASSES[denoiser] and denoiser_kind(model.transformer) == denoiser
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        v = model.velocity(model.transformer, x, torch.tensor([0.2, 0.5, 0.9]), model.encode(["a red circle"] * 3))
    assert v.shape == x.shape and torch.isfinite(v).all()
    # the same seed builds the same weights
    again = ShapesModel.random(seed=0, denoiser=denoiser, layers=1, heads=2, patch=2)
    for a, b in zip(model.transformer.parameters(), again.transformer.parameters()):
        assert torch.equal(a, b)


def test_an_unknown_family_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="denoiser must be one of"):
        transformer_config(denoiser="vit")
    model = ShapesModel.random(seed=0, denoiser="sana", layers=1, heads=2, patch=2)
    model.save(tmp_path)
    cfg = json.loads((tmp_path / "transformer" / "config.json").read_text())
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**cfg, "_class_name": "FooModel"}))
    with pytest.raises(ValueError, match="FooModel"):
        ShapesModel.load(tmp_path)


@pytest.mark.parametrize("denoiser", ["sana", "unet"])
def test_the_explorer_quantizes_attention_and_keeps_the_embedders(denoiser):
    model = ShapesModel.random(seed=0, denoiser=denoiser, layers=2, heads=2, patch=2)
    backend = build_backend(PrecisionConfig(backend="nvfp4-emu", model_skip=SPEC.quant_skip))
    names = backend.selected_layers(model.transformer)
    assert any(n.endswith("attn1.to_q") for n in names) and any(n.endswith("attn2.to_out.0") for n in names)
    assert not [n for n in names if n.startswith(("time_embed", "caption_projection", "proj_out"))]


@pytest.mark.slow
@pytest.mark.parametrize("denoiser", ["sana", "unet"])
def test_a_pretrained_family_loads_through_the_registry_and_trains_an_rl_epoch(tmp_path, denoiser):
    torch.set_num_threads(1)
    pretrain(PretrainConfig(steps=2, batch_size=4, save_every=2, seed=0, denoiser=denoiser, layers=1, heads=2,
                            patch=2, eval_every=0), tmp_path / "pre", progress=False)
    weights = tmp_path / "pre" / "step_00002"
    model = load_model("shapes", weights)
    assert type(model.transformer).__name__ == CLASSES[denoiser]
    cfg = apply_overrides(get_preset("shapes-sol-rl"), [
        f"model.path={weights}", "epochs=1", "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2",
        "eval.every=0", "eval.prompts=2", "eval.seeds_per_prompt=1", "tensorboard=false", "train.micro_batch=4",
    ]).validate()
    train(cfg, tmp_path / "run", progress=False, log=lambda *_: None)
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in recs if "train.loss" in r]
    assert len(trained) == 1 and all(map(lambda v: v == v, trained[0].values()))  # no NaN
    assert (tmp_path / "run" / "adapter_ema.safetensors").stat().st_size > 0
