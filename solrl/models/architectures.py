"""The real denoisers' architectures, built on PyTorch's meta device (no weights, no memory) to count the work
of one forward: what `solrl models quantized` reports for SANA, SD3.5 and FLUX without their weights.

Configs are the published `transformer/config.json` values of each checkpoint (the repos named in
`solrl.models.diffusers_t2i`); inputs are one sample at the reference resolution (docs/method.md) with the
family's text length (`Family.max_sequence_length`, as the reference encodes prompts): SANA 1024 px (DC-AE f32:
32x32 latent tokens; Gemma-2 text, 300 tokens), SD3.5-Large 1024 px (128x128 latent, 2x2 patches; CLIP 77 + T5
128 tokens), FLUX.1-dev 512 px (64x64 latent packed 2x2; T5 128 tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Architecture:
    cls: str                       # diffusers class name
    config: dict[str, Any]
    inputs: Callable[[], dict[str, torch.Tensor]]   # forward kwargs (built on the current device)


def _text(name: str) -> int:
    from solrl.models.diffusers_t2i import FAMILIES

    return FAMILIES[name].max_sequence_length


def _sana_inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.zeros(1, 32, 32, 32), "encoder_hidden_states": torch.zeros(1, _text("sana1.5-1.6b"), 2304),
            "timestep": torch.tensor([500.0])}


def _sd35_inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.zeros(1, 16, 128, 128),
            "encoder_hidden_states": torch.zeros(1, 77 + _text("sd3.5-large"), 4096),
            "pooled_projections": torch.zeros(1, 2048), "timestep": torch.tensor([500.0])}


def _flux_inputs() -> dict[str, torch.Tensor]:
    n = _text("flux1-dev")
    return {"hidden_states": torch.zeros(1, 32 * 32, 64), "encoder_hidden_states": torch.zeros(1, n, 4096),
            "pooled_projections": torch.zeros(1, 768), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(32 * 32, 3), "txt_ids": torch.zeros(n, 3), "guidance": torch.tensor([3.5])}


ARCHITECTURES: dict[str, Architecture] = {
    "sana1.5-1.6b": Architecture("SanaTransformer2DModel", {
        "sample_size": 32, "patch_size": 1, "num_layers": 20, "num_attention_heads": 70, "attention_head_dim": 32,
        "num_cross_attention_heads": 20, "cross_attention_head_dim": 112, "cross_attention_dim": 2240,
        "caption_channels": 2304, "in_channels": 32, "out_channels": 32, "attention_bias": False,
        "qk_norm": "rms_norm_across_heads", "mlp_ratio": 2.5, "norm_elementwise_affine": False, "norm_eps": 1e-6},
        _sana_inputs),
    "sd3.5-large": Architecture("SD3Transformer2DModel", {
        "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38, "attention_head_dim": 64,
        "num_attention_heads": 38, "joint_attention_dim": 4096, "caption_projection_dim": 2432,
        "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
        _sd35_inputs),
    "flux1-dev": Architecture("FluxTransformer2DModel", {
        "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
        "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
        "axes_dims_rope": (16, 56, 56)}, _flux_inputs),
}


def meta_denoiser(name: str) -> tuple[nn.Module, Callable[[], Any]]:
    """The named real denoiser on the meta device and a function running one forward of it."""
    import diffusers

    if name not in ARCHITECTURES:
        raise ValueError(f"no architecture for {name!r}; available: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[name]
    with torch.device("meta"):
        module = getattr(diffusers, arch.cls)(**arch.config)

    def run() -> Any:
        with torch.device("meta"):
            return module(**arch.inputs())

    return module, run
