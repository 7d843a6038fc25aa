"""`solrl plan`: a cost model of one training epoch and the GPU placement that makes it shortest.

Work comes from the model and the recipe; time from the GPU's peak throughput per format and three
efficiencies calibrated against the paper's timing table (docs/method.md, 8x B200).

- One denoiser forward (one sample): analytic multiply-accumulates (MACs) of every Linear, every
  convolution and the attention products, from the model's diffusers config (solrl/models/architectures.py)
  at its reference resolution and text length (`denoiser_forward`; the formulas sit beside each family).
  The bundled shapes UNet is measured instead on one real forward: layer hooks for its Linear and
  convolution MACs (torch's FlopCounterMode agrees, tests/test_plan.py) and the attention calls' shapes for
  the attention products (which FlopCounterMode does not see in the CPU attention kernel). The share
  that a low-precision explorer quantizes follows the run's precision policy on the model's own layer-skip
  rules (solrl.precision: the same selection `solrl models quantized` reports); attention products and
  unquantized layers stay BF16.
- The recipe (solrl.config: preset + overrides): explored seeds x explore steps in the explorer's format,
  regenerated seeds x full steps in BF16 (x2 under classifier-free guidance), and per kept sample
  `timestep_count(steps, timestep_fraction)` training timesteps of 5 forward-equivalents each (the trainable
  forward, its backward counted as 2, the old adapter's forward and the reference forward; 4 with
  kl_beta = 0), as solrl/bench/curve.py prices an epoch.
- Time of a stage on one GPU = compute FLOPs / (peak of its format x efficiency) + images x a per-image
  overhead (VAE decode, hand-off and scoring, proportional to pixels). The efficiencies (one for sampling,
  one for training) and the per-image overhead are fitted by least squares on the relative error of the
  paper's twelve cells (`fit_calibration`), and `CALIBRATION` holds the result.
- Placements: colocated (every role time-shares every GPU, as the paper: the stages run one after another,
  each over all N GPUs) or disaggregated (explorers, regenerators and trainer ranks on their own GPUs,
  plus one GPU for the reward service, as docker-compose.yml and k8s/overlays/b200 ship it). Explore and
  regenerate jobs are whole prompts, so a sampling stage on g GPUs takes ceil(prompts / g) prompts' time;
  the trainer splits every optimizer step's samples among its ranks (solrl/ddp.py), so training on g ranks
  takes the sum over steps of ceil(step samples / g) samples' time, and at most the fewest samples of any
  step can be ranks (`ddp.max_ranks`, the rule the trainer enforces). Disaggregated, the regenerators take
  each prompt as soon as it is explored (the queue streams them), so the rollout takes the slower of the two
  stages plus one prompt of the other; training needs the whole batch (advantages use the batch's std) and comes after.
- Memory per GPU, role by role, as each process holds it (`MemoryModel`): the BF16 denoiser (one copy per
  process: the regenerator's adapter versions share it), the explorer's Transformer Engine cache of its quantized
  layers and the LoRA targets' BF16 originals it re-merges from, the trainer's three FP32 adapters (trainable, old,
  EMA), gradients, AdamW moments and DDP / NCCL buffers, the text encoders and VAE on every model role's GPU, the
  reward's scorer; weights and states are exact parameter counts (tests/test_plan_memory.py holds them against the
  real objects). Activations are a model (the constants' comment gives the source): training per token x width x
  block, with and without gradient checkpointing; the plan turns checkpointing on where the trainer (or the
  colocated process) would not fit without it (`Layout.gradient_checkpointing`, the plan's `gradient_checkpointing`)
  and prices the recomputation (one more forward a trained row). A layout that does not fit names each role and by
  how much.

Not modelled: the sync (merging the LoRA and re-quantizing reads the weights once: well under a second),
network transfer and data-parallel communication time (a stage spread over g GPUs is g times faster, up to
its granularity), the LoRA layers' own FLOPs (about 1-3% of a forward at rank 32), eval (reported
amortized, outside the epoch), FSDP (each trainer rank holds the whole base model; DDP over the LoRA).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from solrl.config import PRESETS, ConfigError, RunConfig, apply_overrides, get_preset


class PlanError(ConfigError):
    """Bad input to the planner, or a recipe no layout can run."""


# -------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: dict[str, float | None]   # dense peak per format (no sparsity); None: no kernels for it
    hbm_gb: float


GPUS: dict[str, Gpu] = {
    "b200": Gpu("B200", {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}, 180.0),
    "h100": Gpu("H100 SXM", {"bf16": 989.0, "fp8": 1979.0, "fp4": None}, 80.0),
    "h200": Gpu("H200", {"bf16": 989.0, "fp8": 1979.0, "fp4": None}, 141.0),   # H100's compute, more memory
}
REFERENCE_GPU = "b200"        # the paper's machine: the per-image overhead is fitted there
USABLE_HBM = 0.95             # the rest: CUDA context, allocator fragmentation


def get_gpu(kind: str) -> Gpu:
    if kind not in GPUS:
        raise PlanError(f"unknown GPU kind {kind!r}; allowed: {', '.join(GPUS)}")
    return GPUS[kind]


def precision_format(backend: str) -> str:
    """The GEMM format a precision backend computes in: fp4, fp8 or bf16."""
    b = backend.lower()
    return "fp4" if "fp4" in b else "fp8" if "fp8" in b else "bf16"


# -------------------------------------------------------------------- one denoiser forward

@dataclass(frozen=True)
class Forward:
    """Multiply-accumulates of one denoiser forward of one sample, and the shape its activations take."""

    linear_macs: int        # every nn.Linear
    conv_macs: int          # every nn.Conv2d
    attention_macs: int     # Q K^T and A V products (not modules: no layer hook sees them)
    tokens: int             # tokens through the blocks (image + text)
    width: int              # hidden size
    blocks: int

    @property
    def flops(self) -> float:
        return 2.0 * (self.linear_macs + self.conv_macs + self.attention_macs)


def sd3_forward(c: dict[str, Any], image_tokens: int, text_tokens: int) -> Forward:
    """SD3Transformer2DModel (MMDiT). D = heads x head_dim, L = num_layers, image tokens X, text tokens T.
    Per sample (the timestep / pooled embedders and the AdaLN modulation, one row each):
        256 D + D^2 + P D + D^2  +  L 6D^2 (norm1)  +  (L-1) 6D^2 + 2D^2 (norm1_context)  +  2D^2 (norm_out)
    per text token: J D (context_embedder) + (L-1) 12D^2 + 3D^2 (the last block keeps only q, k, v of the text)
    per image token: L 12D^2 (q, k, v, out: 4D^2; feed-forward 4x: 8D^2) + D p^2 C_out (proj_out);
    the patch embedding is a convolution: X C_in p^2 D; joint attention: L 2 (X + T)^2 D."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    layers, p = c["num_layers"], c["patch_size"]
    out = c.get("out_channels") or c["in_channels"]
    per_sample = 256 * d + d * d + c["pooled_projection_dim"] * d + d * d + layers * 6 * d * d \
        + (layers - 1) * 6 * d * d + 2 * d * d + 2 * d * d
    per_text = c["joint_attention_dim"] * d + (layers - 1) * 12 * d * d + 3 * d * d
    per_image = layers * 12 * d * d + d * p * p * out
    n = image_tokens + text_tokens
    return Forward(per_sample + text_tokens * per_text + image_tokens * per_image,
                   image_tokens * c["in_channels"] * p * p * d, layers * 2 * n * n * d, n, d, layers)


def flux_forward(c: dict[str, Any], image_tokens: int, text_tokens: int) -> Forward:
    """FluxTransformer2DModel. D = heads x head_dim, L2 double-stream blocks, L1 single-stream blocks.
    Per sample: 3 (in D + D^2) embedders (timestep and guidance: in = 256; pooled text: in = P)
        + L2 2 6D^2 (norm1, norm1_context) + L1 3D^2 (norm) + 2D^2 (norm_out)
    per text token: J D (context_embedder) + L2 12D^2 + L1 12D^2
    per image token: C_in D (x_embedder) + L2 12D^2 + L1 12D^2 + D p^2 C_in (proj_out)
    (single block: q, k, v 3D^2 + proj_mlp 4D^2 + proj_out 5D^2); attention: (L2 + L1) 2 (X + T)^2 D."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    l2, l1, cin, p = c["num_layers"], c["num_single_layers"], c["in_channels"], c.get("patch_size", 1)
    embedders = (256 * d + d * d) * (2 if c.get("guidance_embeds") else 1) + c["pooled_projection_dim"] * d + d * d
    per_sample = embedders + l2 * 12 * d * d + l1 * 3 * d * d + 2 * d * d
    per_text = c["joint_attention_dim"] * d + (l2 + l1) * 12 * d * d
    per_image = cin * d + (l2 + l1) * 12 * d * d + d * p * p * (c.get("out_channels") or cin)
    n = image_tokens + text_tokens
    return Forward(per_sample + text_tokens * per_text + image_tokens * per_image, 0,
                   (l2 + l1) * 2 * n * n * d, n, d, l2 + l1)


def sana_forward(c: dict[str, Any], image_tokens: int, text_tokens: int) -> Forward:
    """SanaTransformer2DModel. D = heads x head_dim, d = head_dim, H = int(mlp_ratio D), L blocks,
    cross-attention width Dc = cross heads x cross head_dim.
    Per sample: 256 D + D^2 (timestep) + 6D^2 (AdaLN-single)
    per text token: F D + D^2 (caption projection) + L 2 Dc C (cross-attention k, v; C = cross_attention_dim)
    per image token, Linear: L (4D^2 linear self-attention q, k, v, out + 2 D Dc cross q, out) + D p^2 C_out
    per image token, convolutions: C_in p^2 D (patch) + L (D 2H + 2H 9 + H D) (Mix-FFN: 1x1 up, 3x3
    depthwise, 1x1 down); attention: ReLU linear self-attention L 2 X D (d + 1) (values padded with a ones
    column) + softmax cross-attention L 2 X T Dc."""
    d = c["num_attention_heads"] * c["attention_head_dim"]
    dc = c["num_cross_attention_heads"] * c["cross_attention_head_dim"]
    layers, p, hidden = c["num_layers"], c["patch_size"], int(c["mlp_ratio"] * d)
    out = c.get("out_channels") or c["in_channels"]
    per_sample = 256 * d + d * d + 6 * d * d
    per_text = c["caption_channels"] * d + d * d + layers * 2 * dc * c["cross_attention_dim"]
    per_image = layers * (4 * d * d + 2 * d * dc) + d * p * p * out
    conv = image_tokens * (c["in_channels"] * p * p * d + layers * (d * 2 * hidden + 2 * hidden * 9 + hidden * d))
    attention = layers * (2 * image_tokens * d * (c["attention_head_dim"] + 1) + 2 * image_tokens * text_tokens * dc)
    return Forward(per_sample + text_tokens * per_text + image_tokens * per_image, conv, attention,
                   image_tokens + text_tokens, d, layers)


# diffusers class -> analytic forward (a registry: a new family adds its function here)
ANALYTIC: dict[str, Callable[[dict[str, Any], int, int], Forward]] = {
    "SD3Transformer2DModel": sd3_forward,
    "FluxTransformer2DModel": flux_forward,
    "SanaTransformer2DModel": sana_forward,
}
# pixels per latent token side: the VAE's downsampling x the transformer's patch (FLUX packs 2x2 latents
# itself: patch_size 1 in its config)
PIXELS_PER_TOKEN = {"sana1.5-1.6b": 32, "sd3.5-large": 16, "flux1-dev": 16}


def text_tokens(name: str) -> int:
    """Text tokens the denoiser attends to: the pipeline's default length (SD3.5 adds CLIP's 77 to T5's)."""
    from solrl.models.diffusers_t2i import FAMILIES
    from solrl.models.wan import WAN_FAMILIES

    n = {**FAMILIES, **WAN_FAMILIES}[name].max_sequence_length
    return n + 77 if name == "sd3.5-large" else n


def denoiser_forward(name: str, resolution: int | None = None) -> Forward:
    """One forward of a registered real model at `resolution` (default: its reference resolution)."""
    from solrl.models.architectures import ARCHITECTURES
    from solrl.models.diffusers_t2i import FAMILIES

    if name not in ARCHITECTURES:
        raise PlanError(f"no analytic forward for {name!r}; real models: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    side = (resolution or FAMILIES[name].resolution) // PIXELS_PER_TOKEN[name]
    return ANALYTIC[arch.cls](arch.config, side * side, text_tokens(name))


# -------------------------------------------------------------------- model facts (work, quantized share, sizes)

@dataclass(frozen=True)
class Component:
    """A model piece beside the denoiser that a process holds: its parameters (exact, from its published config;
    tests/test_plan_memory.py instantiates each config on the meta device and counts) and bytes per parameter."""

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


# -------------------------------------------------------------------- the recipe

@dataclass(frozen=True)
class Recipe:
    """What one epoch does, read from a RunConfig (and the GPU: formats it has kernels for)."""

    preset: str
    model: str
    mode: str
    prompts: int
    explored: int             # seeds sampled by the explorer per prompt (0: no explore stage)
    explore_steps: int
    explore_format: str
    regenerated: int          # seeds sampled in BF16 at full steps per prompt (0: no regenerate stage)
    steps: int
    kept: int
    cfg_mult: int             # 2 with classifier-free guidance
    train_timesteps: int
    train_passes: int         # forward-equivalents per (sample, timestep)
    rollout_micro_batch: int
    train_micro_batch: int
    eval_every: int
    eval_forwards: int        # per evaluation (BF16)
    reward: str
    step_samples: tuple[int, ...] = ()   # samples of each optimizer step (ddp.step_samples)
    ranks_rule: str = ""                  # where the rank cap comes from (ddp.ranks_rule), for messages
    notes: tuple[str, ...] = ()

    @property
    def samples(self) -> int:
        return self.prompts * self.kept

    @property
    def max_trainer_ranks(self) -> int:
        """The trainer's rule (ddp.max_ranks): every rank needs a sample of every optimizer step."""
        return min(self.step_samples) if self.step_samples else self.samples

    @property
    def explorer_needed(self) -> bool:
        return self.explored > 0


def recipe_from_config(cfg: RunConfig, preset: str, gpu: Gpu) -> tuple[Recipe, Any]:
    """The epoch's recipe and the explorer's PrecisionConfig (for the quantized share)."""
    from solrl.algo.nft import timestep_count
    from solrl.engine import data_parallel as ddp

    r, notes = cfg.rollout, []
    explore_pc, explore_steps = r.explore_precision, r.explore_steps
    if r.explore_precision.backend == "auto":
        from solrl.rollout.candidates import check_proxy_config

        cands = check_proxy_config(r.proxy, r.steps)
        runnable = [c for c in cands if gpu.tflops.get(precision_format(c.backend))]
        c = (runnable or cands)[0]
        explore_pc, explore_steps = dataclasses.replace(r.explore_precision, backend=c.backend), c.steps
        notes.append(f"explorer 'auto' (the adaptive proxy): planned with its first candidate that runs on "
                     f"{gpu.name}, {c.name}; it may move to a dearer one during the run")
    fmt = precision_format(explore_pc.backend)
    if fmt != "bf16" and gpu.tflops.get(fmt) is None:
        to = "fp8" if gpu.tflops.get("fp8") else "bf16"
        why = " (FP4 needs Blackwell, sm_100+)" if fmt == "fp4" else ""
        notes.append(f"{gpu.name} has no {fmt.upper()} kernels{why}: the explorer is planned in {to.upper()}; run it "
                     f"with --set rollout.explore_precision.backend={to}")
        fmt = to
    if fmt != "bf16" and explore_pc.backend.endswith("-emu"):
        notes.append(f"explorer backend {explore_pc.backend!r} emulates {fmt.upper()} with BF16 GEMMs: planned at "
                     f"BF16 speed (nvfp4 / fp8 run Transformer Engine's kernels, fp8 torchao's without it)")
        fmt = "bf16"
    elif fmt != "bf16" and not explore_pc.quantize_activations:
        notes.append("weight-only quantization computes in BF16: the explorer is planned at BF16 speed")
        fmt = "bf16"
    if precision_format(r.precision.backend) != "bf16" or r.precision.backend == "fp32":
        notes.append(f"regenerator precision {r.precision.backend!r}: planned at BF16 speed")
    if cfg.model.name == "flux1-dev" and cfg.sampler.guidance == 1.0:
        notes.append("FLUX.1-dev: guidance is distilled into the model (an input), one forward per step")
    explored = r.pool if r.mode in ("sol_rl", "naive_quant") else 0
    regenerated = {"sol_rl": r.kept, "naive_scaling": r.pool, "diffusion_nft": r.kept}.get(r.mode, 0)
    if r.mode == "naive_quant":
        explore_steps = r.steps
    ev = cfg.eval
    recipe = Recipe(
        preset=preset, model=cfg.model.name, mode=r.mode, prompts=r.prompts_per_epoch, explored=explored,
        explore_steps=explore_steps, explore_format=fmt, regenerated=regenerated, steps=r.steps, kept=r.kept,
        cfg_mult=2 if cfg.sampler.guidance != 1.0 else 1,
        train_timesteps=timestep_count(r.steps, cfg.train.timestep_fraction),
        train_passes=5 if cfg.train.kl_beta > 0 else 4, rollout_micro_batch=r.micro_batch,
        train_micro_batch=cfg.train.micro_batch, eval_every=ev.every,
        eval_forwards=ev.prompts * ev.seeds_per_prompt * sum(ev.steps), reward=cfg.reward,
        step_samples=tuple(ddp.step_samples(r.prompts_per_epoch, r.kept, cfg.train.optimizer_steps_per_epoch)),
        ranks_rule=ddp.ranks_rule(cfg), notes=tuple(notes))
    # the layers it quantizes: the emulated backend of the planned format selects them by the same rules
    return recipe, dataclasses.replace(explore_pc, backend={"fp4": "nvfp4-emu", "fp8": "fp8-e4m3-emu"}.get(fmt, "bf16"))


# -------------------------------------------------------------------- calibration

@dataclass(frozen=True)
class Calibration:
    eta_rollout: float        # sampling: achieved / peak FLOPs (every format)
    eta_train: float          # training: achieved / peak BF16 FLOPs
    image_s: float            # seconds per 1024x1024 image on one B200: VAE decode, hand-off, scoring


# Fitted by `solrl plan --calibrate` (fit_calibration); tests/test_plan.py checks a fresh fit gives these.
CALIBRATION = Calibration(eta_rollout=0.21889, eta_train=0.22484, image_s=0.035611)

# docs/method.md: seconds per epoch on 8x B200, colocated: (naive 24-in-96 BF16 rollout, two-stage rollout,
# naive end to end, two-stage end to end)
PAPER_TABLE = {"flux1-dev": (184.0, 79.0, 274.0, 169.0), "sd3.5-large": (451.0, 187.0, 691.0, 427.0),
               "sana1.5-1.6b": (65.0, 46.0, 95.0, 76.0)}
PAPER_PRESETS = {"flux1-dev": "flux1", "sd3.5-large": "sd35l", "sana1.5-1.6b": "sana"}
PAPER_CELLS = ("naive rollout", "two-stage rollout", "naive end to end", "two-stage end to end")


# -------------------------------------------------------------------- stages

@dataclass(frozen=True)
class Stage:
    """One stage's whole-epoch work on one GPU: seconds = compute_s / efficiency + image_units x image_s."""

    name: str                 # explore | regenerate | train
    units: int                # prompts (sampling) or samples (training): the granularity it spreads over GPUs
    flops: float
    compute_s: float          # at 100% of peak on one GPU
    image_units: float        # images x pixels / 1024^2 x (B200 BF16 peak / this GPU's)
    parts: tuple[int, ...] = ()   # units that spread over the GPUs one part after another (training: each
                                  # optimizer step's samples); () = all units at once

    def share(self, gpus: int) -> float:
        """The share of the one-GPU time the stage takes on `gpus` GPUs: ceil(units / g) of its units, part by part."""
        return sum(math.ceil(p / gpus) for p in self.parts or (self.units,)) / self.units

    def seconds(self, cal: Calibration, gpus: int = 1) -> float:
        eff = cal.eta_train if self.name == "train" else cal.eta_rollout
        one = self.compute_s / eff + self.image_units * cal.image_s
        return one * self.share(gpus)


def stages(facts: ModelFacts, recipe: Recipe, gpu: Gpu) -> dict[str, Stage]:
    """The epoch's stages that have work, in order."""
    fwd, peak = facts.forward, {k: v * 1e12 for k, v in gpu.tflops.items() if v}
    bf16_s = fwd.flops / peak["bf16"]                       # one BF16 forward at peak
    q_flops = 2.0 * facts.quantized_macs
    explore_s = (fwd.flops - q_flops) / peak["bf16"] + q_flops / peak[recipe.explore_format]
    pixels = (facts.resolution / 1024) ** 2 * GPUS[REFERENCE_GPU].tflops["bf16"] / gpu.tflops["bf16"]
    out = {}
    if recipe.explored:
        images = recipe.prompts * recipe.explored
        n = images * recipe.explore_steps * recipe.cfg_mult
        out["explore"] = Stage("explore", recipe.prompts, n * fwd.flops, n * explore_s, images * pixels)
    if recipe.regenerated:
        images = recipe.prompts * recipe.regenerated
        n = images * recipe.steps * recipe.cfg_mult
        out["regenerate"] = Stage("regenerate", recipe.prompts, n * fwd.flops, n * bf16_s, images * pixels)
    n = recipe.samples * recipe.train_timesteps * recipe.train_passes
    out["train"] = Stage("train", recipe.samples, n * fwd.flops, n * bf16_s, 0.0, recipe.step_samples)
    return out


def _terms(st: dict[str, Stage], names: tuple[str, ...], gpus: int) -> list[float]:
    """The coefficients of (1 / eta_rollout, image_s, 1 / eta_train) in the time of the named stages, each
    spread over `gpus` GPUs: sampling compute seconds, image units, training compute seconds."""
    part = {k: s.share(gpus) for k, s in st.items() if k in names}
    return [sum(st[k].compute_s * f for k, f in part.items() if k != "train"),
            sum(st[k].image_units * f for k, f in part.items()),
            st["train"].compute_s * part["train"] if "train" in part else 0.0]


def fit_calibration() -> tuple[Calibration, list[dict[str, Any]]]:
    """Least squares on the relative error of the paper's 12 cells, colocated on 8x B200. Each cell is
    linear in (1 / eta_rollout, image_s, 1 / eta_train), so the fit is a non-negative linear one."""
    import numpy as np
    from scipy.optimize import nnls

    rollout, end_to_end = ("explore", "regenerate"), ("explore", "regenerate", "train")
    rows, a = [], []
    for model, paper in PAPER_TABLE.items():
        naive, two = (_preset_stages(f"{PAPER_PRESETS[model]}-{mode}", GPUS[REFERENCE_GPU])
                      for mode in ("naive-scaling", "sol-rl"))
        for cell, st, names, obs in zip(PAPER_CELLS, (naive, two, naive, two),
                                        (rollout, rollout, end_to_end, end_to_end), paper):
            a.append(_terms(st, names, 8))
            rows.append({"model": model, "cell": cell, "paper_s": obs})
    a_, y = np.asarray(a), np.asarray([r["paper_s"] for r in rows])
    x, _ = nnls(a_ / y[:, None], np.ones_like(y))
    if x[0] <= 0 or x[2] <= 0:
        raise RuntimeError(f"calibration failed: {x}")
    cal = Calibration(eta_rollout=float(1 / x[0]), eta_train=float(1 / x[2]), image_s=float(x[1]))
    for row, pred in zip(rows, a_ @ x):
        row["predicted_s"] = float(pred)
        row["error"] = float(pred / row["paper_s"] - 1)
    return cal, rows


def _preset_stages(preset: str, gpu: Gpu) -> dict[str, Stage]:
    cfg = get_preset(preset)
    recipe, pc = recipe_from_config(cfg, preset, gpu)
    return stages(_facts(cfg, pc), recipe, gpu)


def _facts(cfg: RunConfig, pc) -> ModelFacts:
    return model_facts(cfg.model.name, json.dumps(dataclasses.asdict(pc), sort_keys=True),
                       tuple(cfg.lora.targets), cfg.lora.rank)


# -------------------------------------------------------------------- memory

GB = 1e9
# Activations (models, not measured: no GPU here). Training, per token x width x block: 34 bytes (BF16 with flash
# attention, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", eq. 2 without
# the s^2 attention term); with gradient checkpointing (diffusers' per-block `gradient_checkpointing`) each block
# keeps only its BF16 input (2 bytes) and one block's 34 bytes live again during its recompute. Sampling: 16 bytes
# per token x width, the live tensors of one block under no_grad. VAE decode: about 1 KiB per decoded pixel of a
# decode batch (the decoder's last up block at full resolution: 128 channels x 4 live BF16 tensors).
ACTIVATION_BYTES_TRAIN = 34
CHECKPOINT_BYTES = 2
ACTIVATION_BYTES_SAMPLE = 16
VAE_DECODE_BYTES = 1024
# Per parameter of one LoRA adapter, in the trainer (solrl/trainer.py, solrl/adapters/lora.py): three FP32 adapters
# (the trainable "default", the sampling "old" policy DiffusionNFT's loss compares with, the evaluation "ema"), the
# FP32 gradient and AdamW's two FP32 moments. The reference policy (kl_beta) is the base with adapters disabled: no
# copy. With more than one rank DDP adds its FP32 gradient buckets and NCCL its buffers (about half a GB per rank:
# NCCL_BUFFSIZE 4 MiB x channels x peers, plus the communicator's own).
TRAINER_LORA_BYTES = {"LoRA adapters: trainable, old, EMA (FP32)": 12, "LoRA gradients (FP32)": 4,
                      "AdamW moments (FP32)": 8}
DDP_BUCKET_BYTES, NCCL_GB = 4, 0.5
# The quantized serving copy Transformer Engine caches per layer: NVFP4 = 4-bit values + an E4M3 scale per 16 + one
# FP32 tensor scale; FP8 = 1 byte + one FP32 scale (the layout of TE's and torchao's tensors; the test counts them).
QUANT_BYTES = {"fp4": (0.5625, 4), "fp8": (1.0, 4)}
ROLES = ("explorer", "regenerator", "trainer", "reward")


def reward_components(reward: str) -> tuple[Component, ...]:
    """The neural scorers of a reward spec ('hpsv2', 'pickscore:1.0+ocr:0.5'); rule-based ones hold no weights."""
    names = [part.split(":")[0].strip() for part in reward.split("+")]
    return tuple(REWARD_MODELS[n] for n in names if n in REWARD_MODELS)


@dataclass(frozen=True)
class MemoryModel:
    """What each role's process holds on its GPU, in GB (1e9 bytes), piece by piece (`parts`).

    explorer (a quantizing backend: Transformer Engine's nvfp4 / fp8): the denoiser in BF16 (the selected layers'
    BF16 weights live inside te.Linear, the others as they are), TE's cached quantized copy of the selected layers,
    the LoRA targets' BF16 originals it re-merges every push from (one target at a time in FP32: the push's
    workspace), in place, no second copy; a BF16 explorer serves the LoRA unmerged like the regenerator.
    regenerator: one BF16 denoiser shared by every adapter version, the LoRA unmerged in FP32 (two versions
    during a push). trainer: the frozen BF16 denoiser, the LoRA states (TRAINER_LORA_BYTES), DDP and NCCL buffers
    with more than one rank, and the training micro-batch's activations, with or without gradient checkpointing.
    Each of the three holds the text encoders and VAE on its GPU (the prompt cache keeps embeddings on the CPU:
    `prompt_mb` a prompt); reward: its scorers' weights. Activations: the module constants above."""

    denoiser: float               # BF16, every expert
    explorer_weights: dict[str, float]   # the explorer's own pieces beyond the BF16 denoiser
    components: dict[str, float]  # text encoders and VAE
    reward: dict[str, float]
    lora: float                   # one adapter in FP32
    sample_activations: float     # one sampling micro-batch (x2 under CFG)
    decode_activations: float     # one VAE decode batch
    train_per_sample: float       # training activations of one row, without checkpointing
    train_per_sample_checkpointed: float
    train_micro_batch: int
    train_passes: int             # forward-equivalents per trained row (recomputation adds one)
    colocated_explorer: float     # what the explorer adds to a process that already holds the BF16 denoiser
    prompt_mb: float = 0.0        # one prompt's text embeddings (host memory, in the prompt cache)
    checkpointing: bool = False

    def checkpointed(self) -> MemoryModel:
        return dataclasses.replace(self, checkpointing=True)

    @property
    def train_activations(self) -> float:
        per = self.train_per_sample_checkpointed if self.checkpointing else self.train_per_sample
        return self.train_micro_batch * per

    @property
    def train_time_factor(self) -> float:
        """Training time with checkpointing over without: every trainable forward runs again in the backward."""
        return (self.train_passes + 1) / self.train_passes if self.checkpointing else 1.0

    def _trainer_states(self, ranks: int) -> dict[str, float]:
        out = {k: self.lora * b / 4 for k, b in TRAINER_LORA_BYTES.items()}
        if ranks > 1:
            out["DDP gradient buckets + NCCL buffers"] = self.lora * DDP_BUCKET_BYTES / 4 + NCCL_GB
        return out

    def parts(self, role: str, ranks: int = 1) -> dict[str, float]:
        """GB by piece of one process of `role` (colocated: one process holding every role, as the paper runs)."""
        activations = "activations (sampling micro-batch, or a VAE decode batch)"
        sampling = {activations: max(self.sample_activations, self.decode_activations)}
        train = {f"training activations (micro-batch {self.train_micro_batch}, "
                 f"{'with' if self.checkpointing else 'no'} gradient checkpointing)": self.train_activations}
        base = {"denoiser BF16": self.denoiser}
        if role == "explorer":
            return {**base, **self.explorer_weights, **self.components, **sampling}
        if role == "regenerator":
            return {**base, "LoRA (FP32, unmerged; two versions during a push)": 2 * self.lora, **self.components,
                    **sampling}
        if role == "trainer":
            return {**base, **self._trainer_states(ranks), **self.components, **train}
        if role == "reward":
            return dict(self.reward)
        if role == "colocated":
            # one process: one BF16 denoiser for every role; the stages run one after another
            peak = max(self.sample_activations, self.decode_activations, self.train_activations)
            return {**base, "explorer's quantized layers and merged targets": self.colocated_explorer,
                    **self._trainer_states(ranks), **self.components, **self.reward, "activations (largest stage)": peak}
        raise ValueError(f"unknown role {role!r}")

    def role(self, role: str, ranks: int = 1) -> float:
        return sum(self.parts(role, ranks).values())

    def max_train_micro_batch(self, hbm_gb: float, colocated: bool) -> int:
        """The largest train.micro_batch whose activations fit beside the trainer's (or every role's) weights."""
        fixed = dataclasses.replace(self, train_micro_batch=0).role("colocated" if colocated else "trainer")
        if colocated:
            fixed -= max(self.sample_activations, self.decode_activations)
        per = dataclasses.replace(self, train_micro_batch=1).train_activations
        return max(0, int((hbm_gb * USABLE_HBM - fixed) // per))


def memory_model(facts: ModelFacts, recipe: Recipe) -> MemoryModel:
    """The memory model of a recipe (without gradient checkpointing; `MemoryModel.checkpointed()` turns it on)."""
    fwd = facts.forward
    explorer: dict[str, float] = {}
    colocated = 0.0
    if recipe.explorer_needed and recipe.explore_format in QUANT_BYTES:
        per, per_tensor = QUANT_BYTES[recipe.explore_format]
        cache = (facts.quantized_params * per + facts.quantized_layers * per_tensor) / GB
        fmt = recipe.explore_format.upper().replace("FP4", "NVFP4")
        explorer = {f"TE's cached {fmt} copy of the {facts.quantized_layers} quantized layers": cache,
                    "LoRA targets' BF16 originals (to re-merge)": facts.target_params * 2 / GB,
                    "push: one target merged in FP32": facts.largest_target * 8 / GB}
        # colocated, the shared base holds the targets' originals; the explorer's own: te.Linear's BF16 weights, the
        # merged copies of the targets it does not quantize, TE's cache
        colocated = (facts.quantized_params + facts.target_params - facts.quantized_target_params) * 2 / GB + cache
    elif recipe.explorer_needed:
        explorer = {"LoRA (FP32, unmerged; two versions during a push)": 2 * facts.lora_params * 4 / GB}
    from solrl.models.diffusers_t2i import DiffusersT2I
    from solrl.models.wan import WanModel

    decode_batch = WanModel.decode_batch if facts.name in WAN_ARCHITECTURES else DiffusersT2I.decode_batch
    return MemoryModel(
        denoiser=facts.params * 2 / GB, explorer_weights=explorer,
        components={c.name: c.gb for c in facts.components},
        reward={c.name: c.gb for c in reward_components(recipe.reward)},
        lora=facts.lora_params * 4 / GB,
        sample_activations=recipe.rollout_micro_batch * recipe.cfg_mult * fwd.tokens * fwd.width
        * ACTIVATION_BYTES_SAMPLE / GB,
        decode_activations=min(decode_batch, recipe.rollout_micro_batch) * facts.resolution ** 2 * VAE_DECODE_BYTES
        / GB,
        train_per_sample=fwd.tokens * fwd.width * fwd.blocks * ACTIVATION_BYTES_TRAIN / GB,
        train_per_sample_checkpointed=fwd.tokens * fwd.width * (fwd.blocks * CHECKPOINT_BYTES
                                                                + ACTIVATION_BYTES_TRAIN) / GB,
        train_micro_batch=recipe.train_micro_batch, train_passes=recipe.train_passes, colocated_explorer=colocated,
        prompt_mb=facts.prompt_bytes / 1e6)


def trainer_fits_without_checkpointing(cfg: RunConfig, hbm_gb: float, ranks: int = 1) -> bool:
    """Whether the trainer's process of `cfg`, as MemoryModel counts it, fits a GPU of `hbm_gb` (USABLE_HBM of it)
    without gradient checkpointing, with `ranks` data-parallel ranks: train.gradient_checkpointing=auto's answer
    (solrl.trainer.use_gradient_checkpointing). PlanError for a model the planner has no architecture for."""
    recipe, pc = recipe_from_config(cfg, "-", dataclasses.replace(GPUS[REFERENCE_GPU], hbm_gb=hbm_gb))
    return memory_model(_facts(cfg, pc), recipe).role("trainer", ranks) <= hbm_gb * USABLE_HBM


# -------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class Layout:
    kind: str                   # colocated | disaggregated
    gpus: int
    explorers: int              # GPUs (one explorer replica each); colocated: every GPU
    regenerators: int
    trainer_ranks: int
    reward: int
    stage_s: dict[str, float]   # explore, regenerate, rollout, train
    epoch_s: float
    pipelined_s: float          # with rollout.staleness = 1 (rollouts of e+1 beside training of e):
                                # the same as epoch_s when the stages share the GPUs
    memory_gb: dict[str, float]  # per GPU, by role (colocated: one entry)
    fits: bool
    unused: int = 0
    gradient_checkpointing: bool = False   # the trainer recomputes activations (only where it would not fit)
    over_gb: dict[str, float] = field(default_factory=dict)   # roles that do not fit: GB beyond the usable memory

    @property
    def label(self) -> str:
        if self.kind == "colocated":
            return f"colocated on {self.gpus} GPUs (trainer ranks {self.trainer_ranks})"
        return (f"disaggregated: explorers {self.explorers}, regenerators {self.regenerators}, trainer ranks "
                f"{self.trainer_ranks}, reward {self.reward}" + (f", {self.unused} unused" if self.unused else ""))


COLOCATED = "colocated, each GPU"
COLOCATED_SERVICES = "as services, a process per role (busiest GPU)"


def _over(memory: dict[str, float], hbm_gb: float, roles: tuple[str, ...]) -> dict[str, float]:
    return {k: v - hbm_gb * USABLE_HBM for k, v in memory.items() if k in roles and v > hbm_gb * USABLE_HBM}


def with_checkpointing_if_needed(make: Callable[[MemoryModel], Layout], mem: MemoryModel) -> Layout:
    """The layout without gradient checkpointing if it fits, else with it (the recomputation priced in)."""
    plain = make(mem)
    return plain if plain.fits else make(mem.checkpointed())


def colocated(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, gpus: int, hbm_gb: float,
              max_ranks: int) -> Layout:
    ranks = min(gpus, max_ranks)
    t = {k: s.seconds(cal, gpus if k != "train" else ranks) for k, s in st.items()}
    t["train"] *= mem.train_time_factor
    rollout = t.get("explore", 0.0) + t.get("regenerate", 0.0)
    used = mem.role("colocated", ranks)
    # as services (docker-compose.colocated.yml): a process per role on each GPU, each with its own weights, and the
    # reward service on one of them
    roles = ("explorer",) * ("explore" in st) + ("regenerator",) * ("regenerate" in st) + ("trainer", "reward")
    memory = {COLOCATED: used, COLOCATED_SERVICES: sum(mem.role(r, ranks) for r in roles)}
    over = _over(memory, hbm_gb, (COLOCATED,))
    return Layout("colocated", gpus, gpus if "explore" in st else 0, gpus if "regenerate" in st else 0, ranks, gpus,
                  {**t, "rollout": rollout}, rollout + t["train"], rollout + t["train"], memory, not over,
                  gradient_checkpointing=mem.checkpointing, over_gb=over)


def disaggregated(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, explorers: int, regenerators: int,
                  trainer_ranks: int, hbm_gb: float, unused: int = 0) -> Layout:
    t: dict[str, float] = {}
    if "explore" in st:
        t["explore"] = st["explore"].seconds(cal, explorers)
    if "regenerate" in st:
        t["regenerate"] = st["regenerate"].seconds(cal, regenerators)
    if len(t) == 2:  # streamed: the slower stage plus one prompt of the other (filling / draining the pipe)
        ex, rg = st["explore"], st["regenerate"]
        fill = rg.seconds(cal, rg.units) if t["explore"] >= t["regenerate"] else ex.seconds(cal, ex.units)
        rollout = max(t.values()) + fill
    else:
        rollout = sum(t.values())
    t["train"] = st["train"].seconds(cal, trainer_ranks) * mem.train_time_factor
    memory = {"explorer": mem.role("explorer")} if explorers else {}
    if regenerators:
        memory["regenerator"] = mem.role("regenerator")
    memory.update({"trainer": mem.role("trainer", trainer_ranks), "reward": mem.role("reward")})
    gpus = explorers + regenerators + trainer_ranks + 1 + unused
    over = _over(memory, hbm_gb, ROLES)
    return Layout("disaggregated", gpus, explorers, regenerators, trainer_ranks, 1, {**t, "rollout": rollout},
                  rollout + t["train"], max(rollout, t["train"]), memory, not over, unused,
                  gradient_checkpointing=mem.checkpointing, over_gb=over)


def disaggregated_layouts(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, gpus: int, hbm_gb: float,
                          max_ranks: int, explorers: int | None = None, regenerators: int | None = None,
                          trainer_ranks: int | None = None) -> list[Layout]:
    """Every split of `gpus` - 1 (one for the reward service) over the roles with work, at most `max_ranks`
    trainer ranks (ddp.max_ranks); pinned counts stay."""
    prompts = next(iter(s.units for k, s in st.items() if k != "train"), 0)
    free = gpus - 1
    e_range = [0] if "explore" not in st else [explorers] if explorers else range(1, min(prompts, free) + 1)
    r_range = [0] if "regenerate" not in st else [regenerators] if regenerators else range(1, min(prompts, free) + 1)
    out = []
    for e in e_range:
        for r in r_range:
            rest = free - e - r
            t = trainer_ranks or min(rest, max_ranks)
            if t < 1 or rest < t:
                continue
            out.append(with_checkpointing_if_needed(
                lambda m, e=e, r=r, t=t, rest=rest: disaggregated(st, cal, m, e, r, t, hbm_gb, unused=rest - t), mem))
    return out


# -------------------------------------------------------------------- the plan

@dataclass
class Plan:
    recipe: Recipe
    gpu: str
    gpus: int
    facts: ModelFacts
    calibration: Calibration
    stage_one_gpu_s: dict[str, float]
    memory: MemoryModel
    best: Layout
    colocated: Layout | None
    disaggregated: Layout | None
    eval_s: float
    notes: list[str] = field(default_factory=list)
    pipelined: Layout | None = None     # the disaggregated split that would be best with rollout.staleness = 1

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the trainer must checkpoint activations in the chosen layout (off wherever it fits without)."""
        return self.best.gradient_checkpointing

    def role_memory(self, x: Layout | None = None) -> dict[str, dict[str, float]]:
        """GB by piece of each role's process on its GPU in layout `x` (default: the best)."""
        x = x or self.best
        mem = self.memory.checkpointed() if x.gradient_checkpointing else self.memory
        if x.kind == "colocated":
            return {"colocated": mem.parts("colocated", x.trainer_ranks)}
        roles = [r for r, n in (("explorer", x.explorers), ("regenerator", x.regenerators)) if n]
        return {r: mem.parts(r, x.trainer_ranks if r == "trainer" else 1) for r in (*roles, "trainer", "reward")}


def default_preset(model: str) -> str:
    """The model's two-stage preset (shapes-sol-rl, sana-sol-rl, ...)."""
    for name, make in PRESETS.items():
        if name.endswith("-sol-rl") and make().model.name == model:
            return name
    raise PlanError(f"no preset for model {model!r}; models with presets: "
                    f"{sorted({make().model.name for make in PRESETS.values()})}")


def resolve_config(model: str | None, preset: str | None, overrides: list[str] | None) -> tuple[RunConfig, str]:
    """The run config to plan: a preset (default: the model's two-stage one), the model, overrides; checked
    like a run's, except that prompt files are not needed to plan."""
    from solrl.config import MODEL_NAMES

    if model is not None and model not in MODEL_NAMES:
        raise PlanError(f"unknown model {model!r}; available: {list(MODEL_NAMES)}")
    if preset is None:
        if model is None:
            raise PlanError("give --model or --preset")
        preset = default_preset(model)
    cfg = get_preset(preset)
    if model is not None:
        cfg.model.name = model
    cfg = apply_overrides(cfg, list(overrides or []))
    if cfg.model.name not in MODEL_NAMES:
        raise PlanError(f"unknown model {cfg.model.name!r}; available: {list(MODEL_NAMES)}")
    check = dataclasses.replace(cfg, prompts=dataclasses.replace(cfg.prompts, train=cfg.prompts.train or "-",
                                                                  eval=cfg.prompts.eval or "-"))
    check.validate()
    return cfg, preset


def make_plan(cfg: RunConfig, preset: str, gpu_kind: str, gpus: int, *, layout: str = "auto",
              explorers: int | None = None, regenerators: int | None = None, trainer_ranks: int | None = None,
              cal: Calibration | None = None) -> Plan:
    """Stage times per epoch and the layout with the shortest epoch (see the module doc)."""
    gpu = get_gpu(gpu_kind)
    cal = cal or CALIBRATION
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    if layout not in ("auto", "colocated", "disaggregated"):
        raise PlanError(f"layout must be auto, colocated or disaggregated, got {layout!r}")
    recipe, pc = recipe_from_config(cfg, preset, gpu)
    for name, value in (("explorers", explorers), ("regenerators", regenerators), ("trainer ranks", trainer_ranks)):
        if value is not None and value < 1:
            raise PlanError(f"{name} must be at least 1, got {value}")
    most = recipe.max_trainer_ranks
    if trainer_ranks is not None and trainer_ranks > most:
        raise PlanError(f"{trainer_ranks} trainer ranks, but an optimizer step can hold as few as {most} samples "
                        f"({recipe.ranks_rule}): every rank trains on at least one sample of every step "
                        f"(solrl/ddp.py); use at most {most} ranks, fewer optimizer steps or more kept samples")
    if trainer_ranks is not None and trainer_ranks > gpus:
        raise PlanError(f"{trainer_ranks} trainer ranks do not fit on {gpus} GPUs")
    if explorers and not recipe.explored:
        raise PlanError(f"mode {recipe.mode} has no explore stage: drop --explorers")
    pinned = any(v is not None for v in (explorers, regenerators))
    if pinned and layout == "colocated":
        raise PlanError("--explorers / --regenerators place roles on their own GPUs: use --layout disaggregated")
    facts = _facts(cfg, pc)
    st = stages(facts, recipe, gpu)
    mem = memory_model(facts, recipe)
    hbm = gpu.hbm_gb

    colo = None
    if layout in ("auto", "colocated") and not pinned:
        if trainer_ranks is not None and trainer_ranks != min(gpus, most):
            if layout == "colocated":
                raise PlanError(f"colocated, the trainer runs on every GPU ({min(gpus, most)} ranks), not "
                                f"{trainer_ranks}")
        else:
            colo = with_checkpointing_if_needed(lambda m: colocated(st, cal, m, gpus, hbm, most), mem)
    roles = 1 + ("explore" in st) + ("regenerate" in st) + 1
    dis = []
    if layout in ("auto", "disaggregated"):
        need = (explorers or ("explore" in st)) + (regenerators or ("regenerate" in st)) + (trainer_ranks or 1) + 1
        if gpus < need:
            if layout == "disaggregated":
                raise PlanError(f"a disaggregated layout needs at least {need} GPUs here (one per role with work, "
                                f"the pinned counts, one for the reward service), got {gpus}")
        else:
            dis = disaggregated_layouts(st, cal, mem, gpus, hbm, most, explorers, regenerators, trainer_ranks)
    candidates = [x for x in [colo, *dis] if x is not None]
    if not candidates:
        raise PlanError(f"no layout of {gpus} GPUs can run this recipe ({roles} roles disaggregated)")
    fitting = [x for x in candidates if x.fits]
    if not fitting:
        raise PlanError(_memory_error(mem, recipe, gpu, candidates))
    best = min(fitting, key=lambda x: (x.epoch_s, x.kind))
    best_dis = min((x for x in dis if x.fits), key=lambda x: x.epoch_s, default=None)
    notes = list(recipe.notes)
    if colo is not None and not colo.fits:
        notes.append("colocated does not fit, even with gradient checkpointing: " + _over_text(colo))
    if colo is not None and colo.fits and colo.memory_gb[COLOCATED_SERVICES] > hbm * USABLE_HBM:
        m = mem.checkpointed() if colo.gradient_checkpointing else mem
        per = m.train_activations / m.train_micro_batch
        mb = int((hbm * USABLE_HBM - colo.memory_gb[COLOCATED_SERVICES] + m.train_activations) // per)
        notes.append(f"colocated as services (docker-compose.colocated.yml: a process per role, each with its own "
                     f"weights) needs {colo.memory_gb[COLOCATED_SERVICES]:.0f} GB on the reward's GPU, "
                     f"{hbm * USABLE_HBM:.0f} usable: run it with --set train.micro_batch={mb}" if mb >= 1 else
                     "colocated as services (a process per role) does not fit even at train.micro_batch=1: it "
                     "needs one process holding every role, as the paper")
    if dis and best_dis is None:
        notes.append("no disaggregated split fits in memory, even with gradient checkpointing: " + _over_text(dis[0]))
    if best.gradient_checkpointing:
        plain = mem.role("colocated" if best.kind == "colocated" else "trainer", best.trainer_ranks)
        notes.append(f"gradient checkpointing on: without it the trainer's GPU needs {plain:.1f} GB, "
                     f"{plain - hbm * USABLE_HBM:.2g} GB beyond the {hbm * USABLE_HBM:.1f} usable; it recomputes every "
                     f"trainable forward (training x{mem.checkpointed().train_time_factor:.2f}, priced in)")
    if colo is not None and colo.trainer_ranks < gpus:
        notes.append(f"an optimizer step can hold as few as {most} samples ({recipe.ranks_rule}): the trainer "
                     f"uses {colo.trainer_ranks} of the {gpus} GPUs")
    ev = recipe.eval_forwards * recipe.cfg_mult * facts.forward.flops / (gpu.tflops["bf16"] * 1e12) / cal.eta_rollout
    pipelined = min((x for x in dis if x.fits), key=lambda x: x.pipelined_s, default=None)
    return Plan(recipe, gpu_kind, gpus, facts, cal, {k: s.seconds(cal) for k, s in st.items()}, mem, best,
                colo if colo is not None and colo.fits else None, best_dis, ev, notes, pipelined)


def _over_text(x: Layout) -> str:
    return ", ".join(f"{k} {x.memory_gb[k]:.0f} GB, {v:.0f} GB over" for k, v in x.over_gb.items())


def _memory_error(mem: MemoryModel, recipe: Recipe, gpu: Gpu, candidates: list[Layout]) -> str:
    """Why no layout fits: per role of the closest colocated and disaggregated candidates, by how much."""
    hbm = gpu.hbm_gb
    weights = mem.denoiser + sum(mem.components.values())
    head = (f"{recipe.model} does not fit on one {gpu.name} ({hbm:.0f} GB, {hbm * USABLE_HBM:.0f} usable) in any "
            f"layout, even with gradient checkpointing: ")
    if weights > hbm * USABLE_HBM:
        return head + (f"its BF16 weights and text encoders alone take {weights:.0f} GB (sharding the model, FSDP, "
                       f"is not modelled)")
    shown = [min((c for c in candidates if c.kind == kind), key=lambda c: sum(c.over_gb.values()), default=None)
             for kind in ("colocated", "disaggregated")]
    parts = [f"{c.kind}: {_over_text(c)}" for c in shown if c is not None]
    fix = []
    ckpt = mem.checkpointed()
    mb = max(ckpt.max_train_micro_batch(hbm, colocated=False), ckpt.max_train_micro_batch(hbm, colocated=True))
    if mb < recipe.train_micro_batch:
        fix.append(f"--set train.micro_batch={mb}" if mb >= 1 else "a GPU with more memory (not even one training "
                   "sample's activations fit beside the weights)")
    if mem.role("regenerator") > hbm * USABLE_HBM or mem.role("explorer") > hbm * USABLE_HBM:
        fix.append("a smaller rollout.micro_batch")
    return head + "; ".join(parts) + (". Try " + " and ".join(fix) if fix else "")


# -------------------------------------------------------------------- output

def plan_dict(p: Plan) -> dict[str, Any]:
    f, r = p.facts.forward, p.recipe
    return {
        "model": r.model, "preset": r.preset, "gpu": p.gpu, "gpus": p.gpus, "recipe": dataclasses.asdict(r),
        "forward": {**dataclasses.asdict(f), "tflops": f.flops / 1e12, "quantized_share": p.facts.quantized_share,
                    "params": p.facts.params},
        "calibration": dataclasses.asdict(p.calibration), "stage_one_gpu_s": p.stage_one_gpu_s,
        "memory_gb": dataclasses.asdict(p.memory), "gradient_checkpointing": p.gradient_checkpointing,
        "role_memory_gb": p.role_memory(), "best": dataclasses.asdict(p.best),
        "colocated": dataclasses.asdict(p.colocated) if p.colocated else None,
        "disaggregated": dataclasses.asdict(p.disaggregated) if p.disaggregated else None,
        "pipelined": dataclasses.asdict(p.pipelined) if p.pipelined else None, "eval_s": p.eval_s, "notes": p.notes,
    }


def _recipe_line(r: Recipe) -> str:
    parts = []
    if r.explored:
        parts.append(f"{r.prompts} prompts x {r.explored} seeds explored ({r.explore_steps} steps, "
                     f"{r.explore_format.upper()})")
    if r.regenerated:
        parts.append(f"{r.prompts} x {r.regenerated} sampled in BF16 ({r.steps} steps)")
    cfg = ", CFG x2" if r.cfg_mult == 2 else ""
    return (f"{r.mode}: " + " -> ".join(parts) + f"{cfg}; training {r.samples} samples x {r.train_timesteps} "
            f"timesteps x {r.train_passes} forward-equivalents")


def seconds_text(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _layout_row(x: Layout) -> str:
    t = x.stage_s
    cells = [t.get("explore"), t.get("regenerate"), t["rollout"], t["train"], x.epoch_s, x.pipelined_s]
    return f"{x.label:<82}" + "".join(f"{seconds_text(v):>9}" for v in cells)


def role_memory_lines(roles: dict[str, dict[str, float]]) -> list[str]:
    return [f"  {role:<12}{sum(parts.values()):6.1f} GB: " + ", ".join(f"{k} {v:.2f}" if v < 1 else f"{k} {v:.1f}"
                                                                     for k, v in parts.items() if v)
            for role, parts in roles.items()]


def format_plan(p: Plan) -> str:
    f, r, m, gpu = p.facts.forward, p.recipe, p.memory, GPUS[p.gpu]
    total = f.linear_macs + f.conv_macs + f.attention_macs
    lines = [
        f"solrl plan: {r.model} ({r.preset}) on {p.gpus}x {gpu.name}",
        f"recipe     {_recipe_line(r)}",
        f"forward    {f.flops / 1e12:.4g} TFLOPs per sample (Linear {f.linear_macs / total:.1%}, convolutions "
        f"{f.conv_macs / total:.1%}, attention {f.attention_macs / total:.1%}); "
        + (f"the explorer runs {p.facts.quantized_share:.1%} of it in {r.explore_format.upper()}"
           if r.explored and r.explore_format != "bf16" else "every stage computes in BF16"),
        "one GPU    " + ", ".join(f"{k} {seconds_text(v)} s" for k, v in p.stage_one_gpu_s.items())
        + f" per epoch (efficiency: sampling {p.calibration.eta_rollout:.3f}, training {p.calibration.eta_train:.3f}"
        f" of peak; {p.calibration.image_s * 1000:.0f} ms per 1024 px image on a B200)",
        f"memory     GB: denoiser BF16 {m.denoiser:.1f}, text encoders + VAE {sum(m.components.values()):.1f}, reward "
        f"{sum(m.reward.values()):.1f}, one LoRA adapter (FP32) {m.lora:.2f}; activations: sampling micro-batch "
        f"{m.sample_activations:.1f}, VAE decode batch {m.decode_activations:.1f}, training "
        f"{m.train_per_sample:.2f} a row ({m.train_per_sample_checkpointed:.2f} with gradient checkpointing; "
        f"micro-batch {m.train_micro_batch}); the prompt cache holds {m.prompt_mb:.1f} MB a prompt on the CPU",
        f"trainer    at most {r.max_trainer_ranks} data-parallel ranks: every rank trains a sample of every optimizer "
        f"step, and a step can hold as few as {r.max_trainer_ranks} samples ({r.ranks_rule})",
        "",
        f"{'layout (seconds per epoch)':<82}{'explore':>9}{'regen':>9}{'rollout':>9}{'train':>9}{'epoch':>9}"
        f"{'stale 1':>9}",
    ]
    for x in (p.colocated, p.disaggregated):
        if x is not None:
            lines.append(_layout_row(x))
    if p.best not in (p.colocated, p.disaggregated):
        lines.append(_layout_row(p.best))
    lines += ["", f"best: {p.best.label}: {seconds_text(p.best.epoch_s)} s per epoch; gradient checkpointing "
              f"{'on' if p.gradient_checkpointing else 'off'}; memory per GPU (usable {gpu.hbm_gb * USABLE_HBM:.0f} GB):"]
    lines += role_memory_lines(p.role_memory())
    if p.disaggregated is not None and p.disaggregated is not p.best:
        lines.append(f"{p.disaggregated.label} (the deployment files' kind): gradient checkpointing "
                     f"{'on' if p.disaggregated.gradient_checkpointing else 'off'}; memory per GPU:")
        lines += role_memory_lines(p.role_memory(p.disaggregated))
    if p.pipelined is not None:
        lines.append(f"with rollout.staleness = 1 the best split would be {p.pipelined.label}: "
                     f"{seconds_text(p.pipelined.pipelined_s)} s per epoch")
    if p.recipe.eval_every:
        lines.append(f"eval: {seconds_text(p.eval_s)} s on one GPU every {p.recipe.eval_every} epochs (not in the epoch)")
    lines.append("stale 1: the epoch if rollouts of epoch e+1 ran beside training of epoch e on other GPUs "
                 "(rollout.staleness = 1)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# -------------------------------------------------------------------- the calibration report

# the hand-set split docker-compose.yml and k8s/overlays/b200 shipped before they came from the plan: explorers,
# regenerators, trainer GPUs (+ reward); kept in the report as the reference the plan improves on
SHIPPED_B200 = (4, 2, 1)


def _try_plan(preset: str, gpu: str, gpus: int, **kw) -> Plan | str:
    try:
        cfg, preset = resolve_config(None, preset, [])
        return make_plan(cfg, preset, gpu, gpus, **kw)
    except PlanError as err:
        return str(err)


def calibration_report(out: Path) -> dict[str, Any]:
    """Fit the calibration, and write OUT/plan.json and OUT/plan.md: the fit against the paper's table, each
    model's forward, and the plans for 8 GPUs of each kind (the old hand-set B200 split beside them)."""
    from solrl.telemetry.machine import machine, machine_line

    cal, rows = fit_calibration()
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    speedups = []
    for model in PAPER_TABLE:
        cell = {r["cell"]: r for r in rows if r["model"] == model}
        speedups.append({"model": model, **{
            f"{k}_{w}": cell[f"naive {k}"][f"{w}_s"] / cell[f"two-stage {k}"][f"{w}_s"]
            for k in ("rollout", "end to end") for w in ("paper", "predicted")}})
    plans: dict[str, list[dict[str, Any]]] = {}
    forwards = []
    for gpu in GPUS:
        plans[gpu] = []
        for model, fam in PAPER_PRESETS.items():
            p = _try_plan(f"{fam}-sol-rl", gpu, 8, cal=cal)
            if isinstance(p, str):
                plans[gpu].append({"model": model, "error": p})
                continue
            e, r, t = SHIPPED_B200
            shipped = _try_plan(f"{fam}-sol-rl", gpu, 8, cal=cal, layout="disaggregated", explorers=e,
                                regenerators=r, trainer_ranks=t)
            plans[gpu].append({"model": model, "plan": plan_dict(p),
                               "shipped": dataclasses.asdict(shipped.best) if isinstance(shipped, Plan) else shipped})
            if gpu == REFERENCE_GPU:
                f = p.facts.forward
                forwards.append({"model": model, "tflops": f.flops / 1e12, "params": p.facts.params,
                                 "linear_macs": f.linear_macs, "conv_macs": f.conv_macs,
                                 "attention_macs": f.attention_macs, "explorer_fp4_share": p.facts.quantized_share})
    result = {"calibration": dataclasses.asdict(cal), "stored_calibration": dataclasses.asdict(CALIBRATION),
              "cells": rows, "rms_error": math.sqrt(sum(e * e for e in errors) / len(errors)),
              "max_error": max(errors), "speedups": speedups, "forwards": forwards, "plans": plans,
              "gpus": {k: dataclasses.asdict(v) for k, v in GPUS.items()}}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    m = machine()
    (out / "plan.json").write_text(json.dumps({"bench": "plan", "machine": m, **result}, indent=2) + "\n")
    (out / "plan.md").write_text(_report_md(result, machine_line(m), worst))
    return result


def _split(x: dict[str, Any] | None, key: str = "epoch_s") -> str:
    if not x:
        return "-"
    return f"{x['explorers']}/{x['regenerators']}/{x['trainer_ranks']} + 1: {x[key]:.0f} s"


def _report_md(res: dict[str, Any], machine_line: str, worst: dict[str, Any]) -> str:
    c = res["calibration"]
    lines = [
        "# solrl plan --calibrate", "",
        f"Machine: {machine_line} (a computation from configs and the paper's table: the same on any machine)", "",
        "`solrl plan` (solrl/plan.py) prices one epoch from the model's FLOPs per forward (analytic, from its diffusers "
        "config; the explorer's quantized share from the precision policy), the recipe (the run preset), and each "
        "GPU's dense peak per format, with three parameters fitted here by least squares on the relative error of the "
        "paper's twelve cells (docs/method.md: 8x B200, colocated; 9 of them independent, since end to end = rollout + "
        "the same training time):", "",
        f"- sampling efficiency (achieved / peak, every format): **{c['eta_rollout']:.3f}**",
        f"- training efficiency (achieved / peak BF16): **{c['eta_train']:.3f}**",
        f"- per-image overhead (VAE decode, hand-off, scoring): **{c['image_s'] * 1000:.1f} ms** per 1024x1024 image "
        "on one B200 (scaled by pixels, and by BF16 peak on other GPUs)", "",
        "| model | cell | paper (s) | predicted (s) | error |", "|---|---|---|---|---|",
    ]
    lines += [f"| {r['model']} | {r['cell']} | {r['paper_s']:.0f} | {r['predicted_s']:.0f} | {r['error']:+.1%} |"
              for r in res["cells"]]
    lines += ["", f"RMS relative error {res['rms_error']:.1%}; largest {res['max_error']:.1%} ({worst['model']}, "
              f"{worst['cell']}).", "",
              "| model | rollout speed-up, paper | predicted | end to end, paper | predicted |", "|---|---|---|---|---|"]
    lines += [f"| {s['model']} | {s['rollout_paper']:.2f}x | {s['rollout_predicted']:.2f}x | "
              f"{s['end to end_paper']:.2f}x | {s['end to end_predicted']:.2f}x |" for s in res["speedups"]]
    lines += ["", READ_CALIBRATION, "",
              "## One forward per sample (reference resolution)", "",
              "| model | TFLOPs | parameters | Linear | convolutions | attention | explorer's FP4 share |",
              "|---|---|---|---|---|---|---|"]
    for f in res["forwards"]:
        tot = f["linear_macs"] + f["conv_macs"] + f["attention_macs"]
        lines.append(f"| {f['model']} | {f['tflops']:.2f} | {f['params'] / 1e9:.2f} B | {f['linear_macs'] / tot:.1%} | "
                     f"{f['conv_macs'] / tot:.1%} | {f['attention_macs'] / tot:.1%} | {f['explorer_fp4_share']:.1%} |")
    for gpu, rows in res["plans"].items():
        lines += ["", f"## 8x {res['gpus'][gpu]['name']}: the two-stage presets", "",
                  "| model | best | epoch | colocated | best disaggregated split | old hand-set 4/2/1 + 1 "
                  "| stale 1, best split |",
                  "|---|---|---|---|---|---|---|"]
        for row in rows:
            if "error" in row:
                lines.append(f"| {row['model']} | does not fit | | | | | |")
                lines.append(f"| | {row['error']} | | | | | |")
                continue
            p, sh = row["plan"], row["shipped"]
            colo = f"{p['colocated']['epoch_s']:.0f} s" if p["colocated"] else "does not fit"
            shipped = f"{sh['epoch_s']:.0f} s" if isinstance(sh, dict) else sh
            lines.append(f"| {row['model']} | {p['best']['kind']} | {p['best']['epoch_s']:.0f} s | {colo} | "
                         f"{_split(p['disaggregated'])} | {shipped} | {_split(p['pipelined'], 'pipelined_s')} |")
            notes = [n for n in p["notes"] if "FLUX.1-dev" not in n]
            if notes:
                lines.append(f"| | note: {'; '.join(notes)} | | | | | |")
    lines += ["", "Splits: explorers / regenerators / trainer ranks + one GPU for the reward service. Stale 1: the "
              "epoch if the rollouts of epoch e+1 ran beside the training of epoch e (rollout.staleness = 1, not built "
              "yet): max(rollout, train) on a disaggregated split.", ""]
    return "\n".join(lines)


READ_CALIBRATION = (
    "Read: three parameters cannot follow every per-model difference in the paper. Per forward FLOP, SD3.5-L's "
    "BF16 sampling is about 1.7x slower than FLUX.1's there, which no shared efficiency reproduces (a separate "
    "attention efficiency, tried, did not earn its parameter); and the per-image overhead that SANA's small forward "
    "needs leaves its two-stage rollout barely faster than naive in the model (the paper: 1.41x). The ratios between "
    "a model's stages, which decide the placement, come out closer than the absolute times.")
