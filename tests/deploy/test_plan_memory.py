"""`solrl plan`'s memory per role against the bytes of the real objects each role's process holds.

Full size (SD3.5-Large, FLUX.1-dev, Wan2.2 T2V-A14B): the denoiser built from its config on the meta device (no
memory), cast to BF16; the explorer's quantized copy made by the project's Transformer Engine-format quantizers
(torchao NVFP4 / FP8 tensors: values, block scales, tensor scale) on each layer the real TE backend selects; the
LoRA targets' originals from the adapters' own selection; peft's LoRA layers (three FP32 adapters, as
solrl.adapters.lora injects them) and AdamW's state after a step; the text encoders, VAE and reward model built from
their published configs. Tiny models (real tensors on the CPU): the emulated TE backend's packed layers and the
real LoraAdapters. Weights and states must match exactly (bytes). Activations cannot be measured without a GPU: they
stay the model solrl/deploy/memory.py states with its source (Korthikanti et al. 2022 and the per-block checkpoint rule).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from solrl import hardware
from solrl.deploy import facts, flops, memory, recipe

PRESETS = {"sd3.5-large": "sd35l-sol-rl", "flux1-dev": "flux1-sol-rl", "wan2.2-t2v-a14b": "wan22-a14b-sol-rl"}
CLIP_L = {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 12, "max_position_embeddings": 77, "projection_dim": 768, "hidden_act": "quick_gelu"}
BIGG = {"vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
        "num_attention_heads": 20, "max_position_embeddings": 77, "projection_dim": 1280, "hidden_act": "gelu"}
T5_XXL = {"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
          "feed_forward_proj": "gated-gelu"}
VAE16 = {"down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
         "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 16,
         "use_quant_conv": False, "use_post_quant_conv": False}
# (planner's name, class, config class or None for diffusers, config, dtype): each checkpoint's config.json
COMPONENT_CONFIGS = {
    "sd3.5-large": [("CLIP-L text encoder", "CLIPTextModelWithProjection", "CLIPTextConfig", CLIP_L, torch.bfloat16),
                    ("OpenCLIP bigG text encoder", "CLIPTextModelWithProjection", "CLIPTextConfig", BIGG,
                     torch.bfloat16),
                    ("T5-XXL encoder", "T5EncoderModel", "T5Config", T5_XXL, torch.bfloat16),
                    ("VAE", "AutoencoderKL", None, VAE16, torch.bfloat16)],
    "flux1-dev": [("CLIP-L text encoder", "CLIPTextModel", "CLIPTextConfig", CLIP_L, torch.bfloat16),
                  ("T5-XXL encoder", "T5EncoderModel", "T5Config", T5_XXL, torch.bfloat16),
                  ("VAE", "AutoencoderKL", None, VAE16, torch.bfloat16)],
    "sana1.5-1.6b": [("Gemma-2 2B", "Gemma2Model", "Gemma2Config",
                      {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                       "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256}, torch.bfloat16),
                     ("DC-AE", "AutoencoderDC", None, {}, torch.bfloat16)],   # diffusers' defaults: f32c32
    "wan2.2-t2v-a14b": [("UMT5-XXL encoder", "UMT5EncoderModel", "UMT5Config", {**T5_XXL, "vocab_size": 256384},
                         torch.bfloat16),
                        ("VAE (FP32)", "AutoencoderKLWan", None, {}, torch.float32)],
}
CLIP_H = {"text_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "vocab_size": 49408, "max_position_embeddings": 77},
          "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
                            "num_attention_heads": 16, "patch_size": 14, "image_size": 224}, "projection_dim": 1024}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def gb_bytes(gb: float) -> int:
    return round(gb * memory.GB)


def build(cls: str, config_cls: str | None, config: dict, dtype: torch.dtype) -> torch.nn.Module:
    import diffusers
    import transformers

    with torch.device("meta"):
        if config_cls is None:
            return getattr(diffusers, cls)(**config).to(dtype)
        return getattr(transformers, cls)(getattr(transformers, config_cls)(**config)).to(dtype)


def inject_adapters(module: torch.nn.Module, spec) -> dict[str, list[torch.nn.Parameter]]:
    """The trainer's three peft adapters, injected as solrl.adapters.lora.LoraAdapters does (its copy between
    adapters needs data, which the meta device has not)."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    from solrl.adapters.lora import LoraAdapters

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")
        for name in LoraAdapters.ADAPTERS:
            inject_adapter_in_model(spec.lora_config(), module, adapter_name=name)
            cast_adapter_dtype(module, name)
    return {name: [p for n, p in module.named_parameters() if f".{name}." in n and "lora_" in n]
            for name in LoraAdapters.ADAPTERS}


def adam_state_bytes(params: list[torch.nn.Parameter]) -> int:
    """AdamW's moments after one step, as the trainer builds it (solrl/engine/update.py)."""
    for p in params:
        p.requires_grad_(True)
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=3e-4)
    opt.step()
    return nbytes(t for s in opt.state.values() for k, t in s.items() if k != "step")


def quantized_bytes(module: torch.nn.Module, layers: list[str], fmt: str) -> int:
    """The TE-format quantized tensor of each layer (torchao NVFP4Tensor / Float8Tensor, as the emulated TE
    backends hold them): values, block scales and the tensor scale."""
    from solrl.precision.emulated import packed_nbytes
    from solrl.precision.emulated_te import FP8E4M3EmuLinear, NVFP4TEEmuLinear

    quantize = {"fp4": NVFP4TEEmuLinear, "fp8": FP8E4M3EmuLinear}[fmt].quantize
    return sum(packed_nbytes(quantize(module.get_submodule(n).weight.float())) for n in layers)


@pytest.mark.parametrize("name", list(PRESETS))
def test_full_size_roles_match_the_real_objects(name):
    from solrl.adapters.lora import LoraSpec
    from solrl.adapters.merge import lora_targets
    from solrl.precision import PrecisionConfig, build_backend
    from solrl.precision.base import with_model_skips

    cfg, preset = recipe.resolve_config(None, PRESETS[name], [])
    mems = {}
    for gpu in ("b200", "h100"):   # NVFP4 / FP8 explorers (whether a layout fits is test_plan.py's)
        rec, pc = recipe.recipe_from_config(cfg, preset, hardware.GPUS[gpu])
        mems[gpu] = rec.explore_format, memory.memory_model(facts._facts(cfg, pc), rec)
    d = facts.denoiser(name)
    module = copy.deepcopy(d.module).to(torch.bfloat16)
    for gpu, (fmt, mem) in mems.items():
        assert fmt == {"b200": "fp4", "h100": "fp8"}[gpu]
        # every role's BF16 denoiser (the explorer's te.Linear weights included)
        assert gb_bytes(mem.denoiser) == nbytes(module.parameters())
        # the explorer's quantized copy: the layers the real TE backend selects, each quantized in TE's layout
        te = build_backend(with_model_skips(PrecisionConfig(backend={"fp4": "nvfp4", "fp8": "fp8"}[fmt]),
                                            d.quant_skip, d.quant_min_features))
        layers = te.selected_layers(module)
        parts = mem.parts("explorer")
        (cache,) = [v for k, v in parts.items() if k.startswith("TE's cached")]
        assert f"of the {len(layers)} quantized layers" in next(k for k in parts if k.startswith("TE's cached"))
        assert gb_bytes(cache) == quantized_bytes(module, layers, fmt)
        # the LoRA targets' BF16 originals it re-merges from (the adapters' own target selection)
        spec = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=tuple(d.lora_targets))
        targets = lora_targets(module, spec)
        assert gb_bytes(parts["LoRA targets' BF16 originals (to re-merge)"]) == nbytes(
            m.weight for m in targets.values())
        assert gb_bytes(parts["push: one target merged in FP32"]) == 8 * max(m.weight.numel() for m in targets.values())
    # trainer and regenerator: peft's FP32 LoRA layers (three adapters) and AdamW's moments
    adapters = inject_adapters(copy.deepcopy(module), spec)
    mem = mems["b200"][1]
    trainer = mem.parts("trainer", ranks=1)
    assert gb_bytes(mem.lora) == nbytes(adapters["default"]) and adapters["default"][0].dtype == torch.float32
    assert gb_bytes(trainer["LoRA adapters: trainable, old, EMA (FP32)"]) == nbytes(p for v in adapters.values() for p in v)
    assert gb_bytes(trainer["LoRA gradients (FP32)"]) == nbytes(adapters["default"])
    assert gb_bytes(trainer["AdamW moments (FP32)"]) == adam_state_bytes(adapters["default"])
    assert gb_bytes(mem.parts("regenerator")["LoRA (FP32, unmerged; two versions during a push)"]) == 2 * nbytes(
        adapters["default"])
    # text encoders and VAE, from their configs, held by each of the three model roles
    real = {n: nbytes(build(cls, ccls, c, dt).parameters()) for n, cls, ccls, c, dt in COMPONENT_CONFIGS[name]}
    assert {k: gb_bytes(v) for k, v in mem.components.items()} == real
    for role in ("explorer", "regenerator", "trainer"):
        assert all(mem.parts(role)[k] == v for k, v in mem.components.items())


def test_component_and_reward_sizes_match_their_configs():
    """Every model's text encoders and VAE (SANA too), and the CLIP ViT-H-14 of HPSv2 / PickScore in FP32."""
    for name, rows in COMPONENT_CONFIGS.items():
        real = {n: sum(p.numel() for p in build(cls, ccls, c, dt).parameters()) for n, cls, ccls, c, dt in rows}
        assert {c.name: c.params for c in facts.COMPONENTS[name]} == real, name
    import transformers

    with torch.device("meta"):
        clip_h = transformers.CLIPModel(transformers.CLIPConfig(**CLIP_H))
    for reward in ("hpsv2", "pickscore"):
        (c,) = memory.reward_components(reward)
        assert c.params * c.bytes_per_param == nbytes(clip_h.parameters())   # CLIPModel loads in FP32
    assert memory.reward_components("pickscore:1.0+ocr:0.5") == (facts.REWARD_MODELS["pickscore"],)


@pytest.mark.parametrize("name", ["sd3.5-large", "flux1-dev", "wan2.2-t2v-a14b"])
def test_tiny_models_roles_match_the_real_objects(name):
    """The same pieces on the tiny seeded models with real tensors: the emulated TE backend's packed layers and
    the real LoraAdapters (the trainer's three adapters) with AdamW."""
    from solrl.adapters.lora import LoraAdapters, LoraSpec
    from solrl.adapters.merge import target_weights
    from solrl.precision import PrecisionConfig, build_backend
    from solrl.precision.base import with_model_skips
    from solrl.precision.emulated import EmuQuantLinear

    if name == "wan2.2-t2v-a14b":
        from solrl.models.wan import WanExperts
        from solrl.models.wan_tiny import tiny_wan_a14b_pipeline

        pipe = tiny_wan_a14b_pipeline()
        module = WanExperts(pipe.transformer, pipe.transformer_2)
    else:
        from solrl.models import diffusers_tiny

        pipe = {"sd3.5-large": diffusers_tiny.tiny_sd3_pipeline, "flux1-dev": diffusers_tiny.tiny_flux_pipeline}[name]()
        module = pipe.transformer
    d = facts.denoiser(name)   # the real model's skip rules and LoRA targets
    module = module.to(torch.bfloat16)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=tuple(d.lora_targets))
    cfg, preset = recipe.resolve_config(None, PRESETS[name], [])
    rec, _ = recipe.recipe_from_config(cfg, preset, hardware.GPUS["b200"])
    for backend, fmt in (("nvfp4-te-emu", "fp4"), ("fp8-e4m3-emu", "fp8")):
        pc = with_model_skips(PrecisionConfig(backend=backend), d.quant_skip, d.quant_min_features)
        sizes = facts.denoiser_sizes(module, pc, spec.target_modules, spec.rank)
        mf = facts.ModelFacts("tiny", flops.Forward(0, 0, 0, 1, 1, 1), 0, resolution=16, **vars(sizes))
        mem = memory.memory_model(mf, dataclasses.replace(rec, explore_format=fmt))
        served = build_backend(pc).prepare(copy.deepcopy(module))
        packed = [m for m in served.modules() if isinstance(m, EmuQuantLinear)]
        assert packed and sizes.quantized_layers == len(packed)
        (cache,) = [v for k, v in mem.parts("explorer").items() if k.startswith("TE's cached")]
        assert gb_bytes(cache) == sum(m.packed_weight_bytes() for m in packed), backend
        assert gb_bytes(mem.denoiser) == nbytes(module.parameters())
        originals = target_weights(module, spec)   # what the explorer keeps to re-merge
        assert gb_bytes(mem.parts("explorer")["LoRA targets' BF16 originals (to re-merge)"]) == nbytes(
            originals.values())
    adapters = LoraAdapters(copy.deepcopy(module), spec, seed=0)
    trainer = mem.parts("trainer")
    assert gb_bytes(mem.lora) == nbytes(adapters.trainable_parameters())
    assert gb_bytes(trainer["LoRA adapters: trainable, old, EMA (FP32)"]) == nbytes(
        p for n in adapters.ADAPTERS for p in adapters.parameters(n))
    assert gb_bytes(trainer["AdamW moments (FP32)"]) == adam_state_bytes(adapters.trainable_parameters())
