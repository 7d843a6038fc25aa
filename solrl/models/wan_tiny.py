"""Tiny seeded Wan2.2 pipelines of the real classes, saved in the diffusers layout (CPU tests and smoke runs).

`WanPipeline` with `WanTransformer3DModel` denoiser(s), `AutoencoderKLWan` and a `UMT5EncoderModel`, random
weights under `torch.manual_seed(seed)`, the character-level T5 tokenizer of solrl/models/diffusers_tiny.py.
Two variants, as the real checkpoints: TI2V-5B's (one transformer, 48-channel latents, the Wan2.2 VAE with its
2x2 patchify, 16x in space, `expand_timesteps`) and T2V-A14B's (a high-noise and a low-noise expert, seeded
differently, `boundary_ratio` 0.875, the Wan2.1 VAE, 8x in space). Schedulers as in the diffusers repos (UniPC on
flow sigmas, flow_shift 5.0 / 3.0). A directory written by `save_tiny_wan` loads through the same
`WanModel.load` as the real weights.

Sizes: inner width 128 (2 heads x 64) and a feed-forward as wide as the family's minimum quantized size (3072,
5120), so the explorer's skip rules quantize the feed-forwards and keep the attention projections (below the
threshold) in high precision, as the image families' tiny models straddle their thresholds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from solrl.models.diffusers_tiny import _t5_tokenizer


def _umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                       relative_attention_num_buckets=8, decoder_start_token_id=0))


def _transformer(in_channels: int, ffn_dim: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
                                 in_channels=in_channels, out_channels=in_channels, text_dim=32, freq_dim=32,
                                 ffn_dim=ffn_dim, num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32)


def _stats(n: int, seed: int) -> tuple[list[float], list[float]]:
    """Non-trivial latent mean / std (so the decode's un-normalisation is exercised), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.3).tolist(), (0.5 + torch.rand(n, generator=g)).tolist()


def tiny_wan_ti2v_pipeline(seed: int = 0):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(seed)
    transformer = _transformer(48, 3072)
    mean, std = _stats(48, seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           latents_mean=mean, latents_std=std, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    return WanPipeline(tokenizer=_t5_tokenizer(), text_encoder=_umt5(), vae=vae, scheduler=scheduler,
                       transformer=transformer, transformer_2=None, boundary_ratio=None, expand_timesteps=True)


def tiny_wan_a14b_pipeline(seed: int = 0):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(seed)
    high = _transformer(16, 5120)
    torch.manual_seed(seed + 1)   # the experts differ, as the real ones do
    low = _transformer(16, 5120)
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])   # the Wan2.1 VAE's latent statistics
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=_t5_tokenizer(), text_encoder=_umt5(), vae=vae, scheduler=scheduler,
                       transformer=high, transformer_2=low, boundary_ratio=0.875)


TINY_WAN = {"wan2.2-ti2v-5b": tiny_wan_ti2v_pipeline, "wan2.2-t2v-a14b": tiny_wan_a14b_pipeline}


def save_tiny_wan(name: str, path: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline of Wan registry model `name` and save it (safetensors) in the diffusers layout."""
    if name not in TINY_WAN:
        raise ValueError(f"no tiny Wan stand-in for model {name!r}; available: {sorted(TINY_WAN)}")
    path = Path(path)
    TINY_WAN[name](seed).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["TINY_WAN", "save_tiny_wan", "tiny_wan_a14b_pipeline", "tiny_wan_ti2v_pipeline"]
