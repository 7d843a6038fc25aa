"""One denoiser forward's multiply-accumulates, analytic from a real model's diffusers config at its reference
resolution and text length (the formulas sit beside each family)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solrl.deploy.recipe import PlanError


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
