"""Tiny seeded stand-ins of the real families, saved in the real diffusers layout (for CPU tests and smoke runs).

Same classes as the real checkpoints (`SanaTransformer2DModel` + `AutoencoderDC` + `Gemma2Model`,
`SD3Transformer2DModel` + `AutoencoderKL` + CLIP-L/G + T5, `FluxTransformer2DModel` + `AutoencoderKL` +
CLIP + T5), with random weights under `torch.manual_seed(seed)` and character-level tokenizers built
offline from a vocabulary (transformers 5 builds CLIP / T5 / Gemma tokenizers from vocab lists). The T5 and
Gemma tokenizers declare short maximum lengths (32, 16), which the loader honours as the text length. A directory
written by `save_tiny` loads through the same `DiffusersT2I.load` as the real weights.

Sizes are chosen so that each family has Linear layers on both sides of its minimum size (docs/method.md)
(SANA 2240, SD3.5 2432, FLUX 1000): the quantization skip rules select a non-trivial set.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

_CHARS = string.ascii_lowercase + string.digits + ".,'\"!?-:;()"


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in _CHARS] + [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=32)


def _gemma_tokenizer():
    from transformers import GemmaTokenizer

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    for c in _CHARS:
        vocab.setdefault(c, len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[], model_max_length=16)


def _clip_text(projection: bool, hidden: int = 32):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(_CHARS) * 2 + 2, hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
                         projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    return CLIPTextModelWithProjection(cfg) if projection else CLIPTextModel(cfg)


def _t5(d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=128, d_model=d_model, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                   relative_attention_num_buckets=8, decoder_start_token_id=0))


def _kl_vae(scaling_factor: float, shift_factor: float, sample_size: int, quant_conv: bool):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         layers_per_block=1, norm_num_groups=4, sample_size=sample_size,
                         scaling_factor=scaling_factor, shift_factor=shift_factor,
                         use_quant_conv=quant_conv, use_post_quant_conv=quant_conv)


def tiny_sana_pipeline(seed: int = 0):
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    # inner dim 2 x 1120 = 2240 (SANA-1.6B's width): the cross-attention and out projections reach the
    # 2240 threshold; everything else is as small as the classes allow (a 1-layer, 4x4-token denoiser).
    transformer = SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=1120, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=1120, cross_attention_dim=2240, caption_channels=32,
        mlp_ratio=0.05, sample_size=4, patch_size=1)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        # 4 levels: 8x compression, so the 4x4-token denoiser makes 32x32 images (SanaPipeline wants a
        # multiple of 32)
        encoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        encoder_qkv_multiscales=((), (), (), (5,)), decoder_qkv_multiscales=((), (), (), (5,)),
        encoder_layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        downsample_block_type="conv", upsample_block_type="interpolate", decoder_norm_types="rms_norm",
        decoder_act_fns="silu", scaling_factor=0.41407)
    text_encoder = Gemma2Model(Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0))
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction")
    return SanaPipeline(tokenizer=_gemma_tokenizer(), text_encoder=text_encoder, vae=vae, transformer=transformer,
                        scheduler=scheduler)


def tiny_sd3_pipeline(seed: int = 0):
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(seed)
    # inner dim 2 x 304 = 608: the feed-forward (608 -> 2432 -> 608) reaches SD3.5's 2432 threshold, the
    # attention projections stay below it.
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=304,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=608, pooled_projection_dim=64,
        pos_embed_max_size=16, qk_norm="rms_norm")
    te1, te2, te3 = _clip_text(True), _clip_text(True), _t5(64)
    vae = _kl_vae(1.5305, 0.0609, 32, True)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=te1, tokenizer=_clip_tokenizer(), text_encoder_2=te2, tokenizer_2=_clip_tokenizer(),
        text_encoder_3=te3, tokenizer_3=_t5_tokenizer())


def tiny_flux_pipeline(seed: int = 0):
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    torch.manual_seed(seed)
    # inner dim 2 x 128 = 256: feed-forwards (256 -> 1024) reach FLUX's 1000 threshold, attention does not.
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)
    return FluxPipeline(scheduler=scheduler, vae=_kl_vae(0.3611, 0.1159, 32, False), text_encoder=_clip_text(False),
                        tokenizer=_clip_tokenizer(), text_encoder_2=_t5(32), tokenizer_2=_t5_tokenizer(),
                        transformer=transformer)


TINY = {"sana1.5-1.6b": tiny_sana_pipeline, "sd3.5-large": tiny_sd3_pipeline, "flux1-dev": tiny_flux_pipeline}


def save_tiny(name: str, path: str | Path, seed: int = 0) -> Path:
    """Build the tiny pipeline of registry model `name` and save it (safetensors) in the diffusers layout."""
    if name not in TINY:
        raise ValueError(f"no tiny stand-in for model {name!r}; available: {sorted(TINY)}")
    path = Path(path)
    TINY[name](seed).save_pretrained(path, safe_serialization=True)
    return path


__all__ = ["TINY", "save_tiny", "tiny_flux_pipeline", "tiny_sana_pipeline", "tiny_sd3_pipeline"]
