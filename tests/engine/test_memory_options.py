"""Bounded caches and the trainer's memory options: the LRU prompt cache (eviction, each entry its own storage,
outputs unchanged), gradient checkpointing on a tiny diffusers denoiser (same gradients, reported on; both Wan2.2
A14B experts), the "auto" rule, TF32 only on CUDA, and the config checks."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import PixArtTransformer2DModel
from transformers import CLIPTextModel

from solrl.adapters import LoraAdapters, LoraSpec
from solrl.config import ConfigError, TrainConfig, resolve
from solrl.engine.update import NFTTrainer, set_gradient_checkpointing, use_gradient_checkpointing
from solrl.precision import allow_tf32
from solrl.rollout.passes import PromptCache, SamplerSpec, generate
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config


class CountingShapes(ShapesModel):
    """The real shapes model, counting the prompts it encodes."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = {**transformer_config(), "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16,
                  "cross_attention_dim": 32}
        super().__init__(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))
        self.encoded: list[str] = []

    def encode(self, prompts):
        self.encoded += prompts
        return super().encode(prompts)


@pytest.fixture(scope="module")
def model() -> CountingShapes:
    return CountingShapes()


def test_the_prompt_cache_is_an_lru_of_its_bound_with_unchanged_outputs(model):
    cache = PromptCache(model, max_entries=2)
    model.encoded.clear()
    a, b, c = "a red circle", "a blue square", "a green triangle"
    first = cache([a, b])
    assert model.encoded == sorted([a, b]) and len(cache) == 2
    cache([a])                      # a is now the most recent
    cache([c])                      # evicts b, the least recently used
    assert a in cache and c in cache and b not in cache and len(cache) == 2
    again = cache([a, b])           # b is encoded again; c goes
    assert model.encoded == sorted([a, b]) + [c, b] and c not in cache
    for x, y in ((first.embeds, again.embeds), (first.mask, again.mask)):
        assert torch.equal(x, y)
    for entry in cache._cache.values():   # a row of its own, not a view keeping the encoded batch alive
        assert entry.embeds.untyped_storage().nbytes() == entry.embeds.numel() * entry.embeds.element_size()
    with pytest.raises(ValueError, match="prompt_cache_entries"):
        cache([a, b, c])


def test_a_small_prompt_cache_samples_what_a_large_one_does(model):
    prompts, seeds = ["a red circle", "a blue square", "a red circle", "a green triangle"], [1, 2, 3, 4]
    big = generate(model, model.transformer, prompts, seeds, 2, SamplerSpec(), micro_batch=2)
    small = generate(model, model.transformer, prompts, seeds, 2, SamplerSpec(), micro_batch=2,
                     cache=PromptCache(model, max_entries=2))
    assert torch.equal(big.x0, small.x0)


def lora_grads(model: ShapesModel, checkpointing: bool) -> tuple[dict[str, torch.Tensor], bool]:
    adapters = LoraAdapters(copy.deepcopy(model.transformer), LoraSpec(rank=2, alpha=4.0,
                                                                      target_modules=model.spec.lora_targets), seed=3)
    with torch.no_grad():   # a non-zero B, so every LoRA weight gets a gradient
        for p in adapters.parameters("default"):
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    on = set_gradient_checkpointing(adapters.model, checkpointing)
    adapters.model.train()
    x = torch.randn(2, *model.spec.latent_shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode(["a red circle", "a blue square"])
    model.velocity(adapters.model, x, torch.tensor([0.3, 0.7]), cond).square().mean().backward()
    return {n: p.grad.clone() for n, p in adapters.model.named_parameters() if p.grad is not None}, on


def test_gradient_checkpointing_gives_the_same_gradients_and_reports_on(model):
    plain, off = lora_grads(model, False)
    checked, on = lora_grads(model, True)
    assert on and not off and plain.keys() == checked.keys() and len(plain) > 4
    for name, grad in plain.items():
        assert grad.abs().sum() > 0
        torch.testing.assert_close(checked[name], grad, rtol=1e-5, atol=1e-7)


def test_both_wan22_a14b_experts_checkpoint():
    from solrl.models.wan import WanExperts
    from solrl.models.wan_tiny import tiny_wan_a14b_pipeline

    pipe = tiny_wan_a14b_pipeline()
    experts = WanExperts(pipe.transformer, pipe.transformer_2)
    assert set_gradient_checkpointing(experts, True)
    assert experts.transformer.is_gradient_checkpointing and experts.transformer_2.is_gradient_checkpointing
    assert not set_gradient_checkpointing(experts, False) and not experts.transformer_2.is_gradient_checkpointing


def test_the_auto_rule_and_the_trainer_setting(model):
    assert not use_gradient_checkpointing("auto", model)   # the shapes model on the CPU: off
    assert use_gradient_checkpointing("true", model) and not use_gradient_checkpointing("false", model)
    with pytest.raises(ValueError, match="auto, true or false"):
        use_gradient_checkpointing("yes", model)
    adapters = LoraAdapters(copy.deepcopy(model.transformer), LoraSpec(rank=2, alpha=4.0,
                                                                      target_modules=model.spec.lora_targets), seed=0)
    trainer = NFTTrainer(model, adapters, TrainConfig(gradient_checkpointing="true"), rollout_steps=2)
    assert trainer.gradient_checkpointing and adapters.model.is_gradient_checkpointing


def test_auto_asks_the_planner_whether_the_trainer_fits_without_it():
    """On CUDA, train.gradient_checkpointing=auto is the planner's answer for the run on the GPU's memory: the same
    choice the committed plans make (benchmarks/results/plan_*: on for SD3.5-L and FLUX.1 on an 80 GB H100, off on
    a 180 GB B200); the shapes trainer fits anything."""
    from solrl.config import get_preset
    from solrl.deploy import memory as plan

    for preset in ("sd35l-sol-rl", "flux1-sol-rl"):
        cfg = get_preset(preset)
        assert not plan.trainer_fits_without_checkpointing(cfg, 80.0)
        assert plan.trainer_fits_without_checkpointing(cfg, 180.0)
    assert plan.trainer_fits_without_checkpointing(get_preset("shapes-sol-rl"), 24.0)


def test_config_checks_the_new_settings():
    assert resolve("shapes-sol-rl").train.gradient_checkpointing == "auto"
    assert resolve("shapes-sol-rl").rollout.prompt_cache_entries == 1024
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        resolve("shapes-sol-rl", overrides=["train.gradient_checkpointing=maybe"]).validate()
    with pytest.raises(ConfigError, match="prompt_cache_entries"):
        resolve("shapes-sol-rl", overrides=["rollout.prompt_cache_entries=0"]).validate()


def test_tf32_is_left_alone_on_the_cpu():
    before = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    assert allow_tf32("cpu") is False
    assert (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32) == before


@pytest.mark.gpu
def test_tf32_on_cuda_and_large_prompt_encodings_kept_in_host_memory(model):
    assert allow_tf32("cuda") and torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32
    from solrl.rollout.passes import HOST_CACHE_MIN_BYTES

    cuda = copy.deepcopy(model)
    cuda.text_encoder.cuda()
    cache = PromptCache(cuda)
    out = cache(["a red circle"])
    entry = cache._cache["a red circle"]
    big = entry.embeds.numel() * entry.embeds.element_size() >= HOST_CACHE_MIN_BYTES
    assert out.embeds.is_cuda and entry.embeds.device.type == ("cpu" if big else "cuda")
