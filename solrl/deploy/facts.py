"""Model facts: a model's work per forward (measured on one real forward where there is no formula), the share a
low-precision explorer quantizes, its parameter counts and those of the pieces beside it (text encoders, VAE, reward
models)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from solrl.config import RunConfig
from solrl.deploy.flops import Forward, denoiser_forward, text_tokens
from solrl.deploy.recipe import PlanError


@dataclass(frozen=True)
class Component:
    """A model piece beside the denoiser that a process holds: its parameters (exact, from its published config;
    tests/deploy/test_plan_memory.py instantiates each config on the meta device and counts) and bytes per parameter."""

    name: str
    params: int
    bytes_per_param: int = 2    # BF16, as the pipelines load on CUDA

    @property
    def gb(self) -> float:
        return self.params * self.bytes_per_param / 1e9


# Text encoders and VAE of each model (the diffusers pipeline's components), on the device of every role that
# loads the pipeline: the explorer, the regenerator and the trainer (`pipe.to(device)`; none is offloaded).
_CLIP_L_PROJ, _BIGG_PROJ = Component("CLIP-L text encoder", 123_650_304), Component("OpenCLIP bigG text encoder",
                                                                                     694_659_840)
_T5_XXL, _VAE16 = Component("T5-XXL encoder", 4_762_310_656), Component("VAE", 83_819_683)
COMPONENTS: dict[str, tuple[Component, ...]] = {
    "sd3.5-large": (_CLIP_L_PROJ, _BIGG_PROJ, _T5_XXL, _VAE16),
    "flux1-dev": (Component("CLIP-L text encoder", 123_060_480), _T5_XXL, _VAE16),
    "sana1.5-1.6b": (Component("Gemma-2 2B", 2_614_341_888), Component("DC-AE", 362_893_923)),
    # the Wan VAE in FP32, as diffusers' Wan examples load it (solrl/models/wan.py)
    "wan2.2-t2v-a14b": (Component("UMT5-XXL encoder", 5_680_910_336), Component("VAE (FP32)", 126_892_531, 4)),
    "shapes": (),
}
# Reward models (the scorer's weights; CLIP scorers load in FP32: solrl/rewards/clip.py, hps.py). hpsv2 and
# pickscore are CLIP ViT-H-14, clipscore CLIP ViT-L/14 (exact, from their configs); imagereward (BLIP) and hpsv3
# (Qwen2-VL 7B, BF16 in its YAML config) are the published sizes.
REWARD_MODELS: dict[str, Component] = {
    "hpsv2": Component("HPSv2 (CLIP ViT-H-14, FP32)", 986_109_441, 4),
    "pickscore": Component("PickScore (CLIP ViT-H-14, FP32)", 986_109_441, 4),
    "clipscore": Component("CLIPScore (CLIP ViT-L/14, FP32)", 427_616_513, 4),
    "imagereward": Component("ImageReward (BLIP, FP32)", 450_000_000, 4),
    "hpsv3": Component("HPSv3 (Qwen2-VL 7B, BF16)", 8_300_000_000, 2),
}

# Wan2.2 T2V-A14B's experts (`transformer/config.json` and `transformer_2/config.json` of
# Wan-AI/Wan2.2-T2V-A14B-Diffusers: the same architecture twice); one forward runs one expert at the family's
# default clip (81 frames at 480x832: 21 latent frames of 60x104, 2x2 patches).
WAN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "wan2.2-t2v-a14b": {"patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128,
                        "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824,
                        "num_layers": 40, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6,
                        "rope_max_seq_len": 1024},
}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    forward: Forward
    quantized_macs: int       # Linear MACs in the layers the explorer's precision quantizes
    params: int               # denoiser parameters (every expert)
    quantized_params: int     # in those layers
    lora_params: int          # of one adapter, on the targets the real selection picks (solrl.adapters.merge)
    resolution: int           # the side of a square with the decoded image's pixels
    measured_macs: tuple[int, int] = (0, 0)   # (Linear, Conv2d) MACs counted by layer hooks: the analytic check
    quantized_layers: int = 0
    target_params: int = 0    # weights of the LoRA target layers (the originals the explorer keeps to re-merge)
    largest_target: int = 0   # the largest target weight (merged one at a time in FP32 during a push)
    quantized_target_params: int = 0   # target weights in quantized layers
    prompt_bytes: int = 0     # one prompt's text embeddings in BF16 (what the prompt cache holds a prompt)

    @property
    def quantized_share(self) -> float:
        """Share of the forward's FLOPs (attention included) that runs in the low-precision format."""
        return 2.0 * self.quantized_macs / self.forward.flops

    @property
    def components(self) -> tuple[Component, ...]:
        return COMPONENTS.get(self.name, ())


def attention_macs(module, run) -> int:
    """Q K^T and A V multiply-accumulates of every diffusers Attention of `module` during `run()`:
    2 x batch x query tokens x key tokens x inner width each (torch's FlopCounterMode misses the CPU
    attention kernel, so they are counted from the calls' shapes)."""
    from diffusers.models.attention_processor import Attention

    from solrl.precision.base import run_hooked

    total = 0

    def hook(m, args, kwargs, output):
        nonlocal total
        q = args[0] if args else kwargs["hidden_states"]
        kv = kwargs.get("encoder_hidden_states")
        kv = q if kv is None else kv
        total += 2 * q.shape[0] * q.shape[1] * kv.shape[1] * m.inner_dim

    run_hooked([m.register_forward_hook(hook, with_kwargs=True) for m in module.modules() if isinstance(m, Attention)],
               run)
    return total


@dataclass(frozen=True)
class Denoiser:
    """A model's denoiser with one forward to count (real models: on the meta device, no weights)."""

    module: Any
    run: Callable[[], Any]
    layer_macs: dict[str, int]          # MACs of every Linear and Conv2d during `run()`, by module name
    linear_macs: int
    quant_skip: tuple[str, ...]
    quant_min_features: int
    lora_targets: tuple[str, ...]
    resolution: int


def wan_latent_shape(name: str) -> tuple[int, int, int, int]:
    """(C, F, H, W) of one latent clip of the family's default size (the Wan VAE: 4x in time, 8x in space)."""
    from solrl.models.wan import WAN_FAMILIES

    fam = WAN_FAMILIES[name]
    return WAN_ARCHITECTURES[name]["in_channels"], (fam.frames - 1) // 4 + 1, fam.height // 8, fam.width // 8


def wan_denoiser(name: str):
    """Wan2.2 A14B's two experts on the meta device (solrl.models.wan.WanExperts, as the model holds them) and one
    forward of the high-noise expert at the family's default clip."""
    import diffusers
    import torch

    from solrl.models.wan import WAN_FAMILIES, WanExperts

    fam, config = WAN_FAMILIES[name], WAN_ARCHITECTURES[name]
    with torch.device("meta"):
        module = WanExperts(*(diffusers.WanTransformer3DModel(**config) for _ in WanExperts.EXPERTS))
    shape = (1, *wan_latent_shape(name))

    def run():
        with torch.device("meta"):
            return module.transformer(hidden_states=torch.zeros(shape), timestep=torch.tensor([500.0]),
                                      encoder_hidden_states=torch.zeros(1, fam.max_sequence_length,
                                                                        config["text_dim"]))
    return module, run, fam


def wan_forward(name: str, linear_macs: int) -> Forward:
    """Wan's forward: the Linear MACs as layer hooks count them on the meta device, the Conv3d patch embedding
    (X C_in p_t p_h p_w D) and per block self-attention 2 X^2 D and cross-attention 2 X T D (T text tokens)."""
    from solrl.models.wan import WAN_FAMILIES

    c = WAN_ARCHITECTURES[name]
    pt, ph, pw = c["patch_size"]
    _, frames, h, w = wan_latent_shape(name)
    x = frames // pt * (h // ph) * (w // pw)
    d, t, layers = (c["num_attention_heads"] * c["attention_head_dim"], WAN_FAMILIES[name].max_sequence_length,
                    c["num_layers"])
    return Forward(linear_macs, x * c["in_channels"] * pt * ph * pw * d, layers * (2 * x * x * d + 2 * x * t * d),
                   x, d, layers)


@lru_cache(maxsize=8)
def denoiser(name: str) -> Denoiser:
    """The registered model's denoiser; shapes is loaded (its bundled weights) and counted on one real forward."""
    import torch

    from solrl.precision.base import layer_macs

    if name == "shapes":
        from solrl.models import load_model

        model = load_model("shapes")
        spec, module = model.spec, model.transformer
        x = torch.zeros(1, *spec.latent_shape)
        cond = model.encode(["a red circle"])

        def run():
            return model.velocity(module, x, torch.tensor([0.5]), cond)
        skip, min_features, targets, resolution = (spec.quant_skip, spec.quant_min_features, spec.lora_targets,
                                                   spec.latent_shape[-1])
    elif name in WAN_ARCHITECTURES:
        module, run, fam = wan_denoiser(name)
        skip, min_features, targets = fam.quant_skip, fam.quant_min_features, fam.lora_targets
        resolution = int(math.sqrt(fam.height * fam.width))
    else:
        from solrl.models.architectures import ARCHITECTURES, meta_denoiser
        from solrl.models.diffusers_t2i import FAMILIES

        if name not in ARCHITECTURES:
            raise PlanError(f"no architecture for {name!r} to plan; models: "
                            f"{sorted([*ARCHITECTURES, *WAN_ARCHITECTURES, 'shapes'])}")
        module, run = meta_denoiser(name)
        fam = FAMILIES[name]
        skip, min_features, targets, resolution = (fam.quant_skip, fam.quant_min_features, fam.lora_targets,
                                                   fam.resolution)
    macs = layer_macs(module, run)
    linear = sum(v for n, v in macs.items() if isinstance(module.get_submodule(n), torch.nn.Linear))
    return Denoiser(module, run, macs, linear, tuple(skip), min_features, tuple(targets), resolution)


def lora_param_count(module) -> int:
    """Parameters of one LoRA adapter on `module` (a LoRA target): A [r, in] and B [out, r] of a Linear; a
    convolution's A has its kernel, its B is 1x1 (peft's layers)."""
    import torch

    if isinstance(module, torch.nn.Conv2d):
        k = module.kernel_size[0] * module.kernel_size[1]
        return module.in_channels // module.groups * k + module.out_channels
    return module.in_features + module.out_features


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a denoiser that the memory model needs, from the real selections: the layers the
    explorer's precision backend quantizes and the LoRA targets of solrl.adapters.merge.lora_targets."""

    params: int                   # every parameter (every expert)
    quantized_params: int         # weights of the quantized layers
    quantized_layers: int
    lora_params: int              # one adapter
    target_params: int            # weights of the LoRA targets
    largest_target: int
    quantized_target_params: int  # target weights in quantized layers


def denoiser_sizes(module, precision, lora_targets: tuple[str, ...], lora_rank: int) -> Sizes:
    """`module`'s Sizes under a PrecisionConfig (with the model's skips applied) and LoRA targets / rank."""
    from solrl.precision import build_backend

    return _sizes(module, build_backend(precision).selected_layers(module), lora_targets, lora_rank)


def _sizes(module, selected: list[str], lora_targets: tuple[str, ...], lora_rank: int) -> Sizes:
    """`denoiser_sizes` given the layers the precision backend selects."""
    from solrl.adapters.lora import LoraSpec
    from solrl.adapters.merge import lora_targets as select_targets

    targets = select_targets(module, LoraSpec(rank=lora_rank, target_modules=tuple(lora_targets)))
    weights = {n: module.get_submodule(n).weight.numel() for n in selected}
    target = {n: m.weight.numel() for n, m in targets.items()}
    return Sizes(sum(p.numel() for p in module.parameters()), sum(weights.values()), len(weights),
                 lora_rank * sum(lora_param_count(m) for m in targets.values()), sum(target.values()),
                 max(target.values(), default=0), sum(v for n, v in weights.items() if n in target))


@lru_cache(maxsize=32)
def model_facts(name: str, precision_json: str, lora_targets: tuple[str, ...], lora_rank: int) -> ModelFacts:
    """Work and sizes of model `name` under an explorer precision (a PrecisionConfig as JSON, cached by it):
    the layers that precision quantizes under the model's skip rules, their MACs and parameters, and the LoRA
    targets the adapters' own selection picks."""
    from solrl.precision import PrecisionConfig, build_backend
    from solrl.precision.base import denoiser_blocks, with_model_skips

    d = denoiser(name)
    pc = PrecisionConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(precision_json).items()})
    pc = with_model_skips(pc, d.quant_skip, d.quant_min_features)
    module = d.module
    selected = build_backend(pc).selected_layers(module)
    sizes = _sizes(module, selected, lora_targets or d.lora_targets, lora_rank)
    conv = sum(d.layer_macs.values()) - d.linear_macs
    if name == "shapes":  # measured: the UNet's layer MACs and its attention products
        forward = Forward(d.linear_macs, conv, attention_macs(module, d.run), d.resolution ** 2,
                          max(module.config.block_out_channels), len(denoiser_blocks(module)))
    elif name in WAN_ARCHITECTURES:
        forward = wan_forward(name, d.linear_macs)
        conv = forward.conv_macs   # the Conv3d patch embedding (layer hooks count Linear and Conv2d)
    else:
        forward = denoiser_forward(name)
    quantized_macs = sum(d.layer_macs.get(n, 0) for n in selected)
    return ModelFacts(name, forward, quantized_macs, resolution=d.resolution, measured_macs=(d.linear_macs, conv),
                      prompt_bytes=prompt_bytes(name), **dataclasses.asdict(sizes))


def prompt_bytes(name: str) -> int:
    """BF16 bytes of one prompt's text embeddings: text tokens x the encoder width, plus a pooled vector."""
    if name == "shapes":
        return 0
    if name in WAN_ARCHITECTURES:
        return text_tokens(name) * WAN_ARCHITECTURES[name]["text_dim"] * 2
    from solrl.models.architectures import ARCHITECTURES

    c = ARCHITECTURES[name].config
    width = c.get("joint_attention_dim") or c["caption_channels"]
    return (text_tokens(name) * width + c.get("pooled_projection_dim", 0)) * 2


def _facts(cfg: RunConfig, pc) -> ModelFacts:
    return model_facts(cfg.model.name, json.dumps(dataclasses.asdict(pc), sort_keys=True),
                       tuple(cfg.lora.targets), cfg.lora.rank)
