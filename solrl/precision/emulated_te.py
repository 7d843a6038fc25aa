"""Transformer Engine recipes emulated on any device: `fp8-e4m3-emu`, `fp8-e5m2-emu` and `nvfp4-te-emu`.

These follow the arithmetic of Transformer Engine's own Python reference quantizers (TE 2.x,
`transformer_engine/pytorch/custom_recipes`), so a CPU study sees the numbers a TE explorer would:

- `fp8-e4m3-emu` / `fp8-e5m2-emu`: `Float8CurrentScaling`. One FP32 scale per tensor from the tensor's
  own amax on every call (weights once per quantization): scale = fp8_max / amax (amax 0 -> 1, an
  infinite scale -> FP32 max), values cast as `x * scale` to the FP8 format, dequantized as
  `q * (1 / scale)`. TE's forward uses E4M3 (its `HYBRID` format keeps E5M2 for gradients); E5M2 is
  what the reference code's "NVFP4" setting (`DelayedScaling(fp8_format=E2M1)`) ran as.
- `nvfp4-te-emu`: `NVFP4BlockScaling` as it runs a forward: activations in 1x16 blocks along K,
  weights in 2D 16x16 tiles (one E4M3 scale per tile, TE's default; 1x16 with
  `NVTE_NVFP4_DISABLE_2D_QUANTIZATION=1`), E2M1 values with round-half-to-even, and TE's scale
  arithmetic: global encode scale 448 * 6 / amax, block decode scale = block amax * (global / 6)
  cast to E4M3 with no lower clamp, so a block whose scale underflows E4M3 becomes zeros (torchao,
  behind `nvfp4-emu`, clamps small block scales up to E4M3's smallest subnormal instead). The random
  Hadamard transform and stochastic rounding of the recipe apply to gradients only and are absent here.

Written by hand (with torch's float8 casts): torchao's Float8Tensor divides by amax / fp8_max where
TE multiplies by fp8_max / amax, and torchao's NVFP4 has neither 2D tiles nor TE's small-scale rule.
The packed resident forms are torchao's `Float8Tensor` and `NVFP4Tensor`, built from these values.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.quantization import Float8Tensor

from solrl.precision.base import register_backend
from solrl.precision.emulated import EmuQuantLinear, _EmulatedBackend, round_e2m1

FP32_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------------------------------ FP8

def fp8_current_scaling(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, FP32 decode scale) of `t` with one scale for the whole tensor, as TE's
    Float8CurrentScaling quantizer computes them."""
    fp8_max = torch.finfo(dtype).max
    t = t.float()
    amax = t.abs().amax() if t.numel() else torch.zeros((), dtype=torch.float32, device=t.device)
    scale = torch.tensor(fp8_max, dtype=torch.float32, device=t.device) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    # x * scale lands in [-fp8_max, fp8_max] up to one rounding; the clamp keeps that rounding from turning
    # into E4M3's NaN (a GPU cast saturates)
    q = (t * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return q, torch.reciprocal(scale)


class FP8EmuLinear(EmuQuantLinear):
    """W8A8 FP8 fake quantization with per-tensor current scaling (TE `Float8CurrentScaling`)."""

    block_size = 1
    fp8_dtype: ClassVar[torch.dtype]

    @classmethod
    def quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        q, scale_inv = fp8_current_scaling(t_MK, cls.fp8_dtype)
        return Float8Tensor(q, scale_inv.reshape(1, 1), block_size=list(t_MK.shape), dtype=torch.float32)

    @classmethod
    def fake_quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        q, scale_inv = fp8_current_scaling(t_MK, cls.fp8_dtype)
        return q.float() * scale_inv


class FP8E4M3EmuLinear(FP8EmuLinear):
    fp8_dtype = torch.float8_e4m3fn


class FP8E5M2EmuLinear(FP8EmuLinear):
    fp8_dtype = torch.float8_e5m2


# ---------------------------------------------------------------------------------------------- NVFP4

def nvfp4_te_quantize(t_MK: torch.Tensor, tile_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE NVFP4 of a [M, K] matrix (K a multiple of 16): (E2M1 values as FP32 [M, K], E4M3 decode scales
    [M, K/16] (a 16x16 tile's scale repeated on its 16 rows, as TE lays them out), FP32 global decode
    scale). `tile_rows` 1 gives 1x16 blocks (activations), 16 gives 16x16 tiles (weights)."""
    if tile_rows not in (1, 16):
        raise ValueError(f"tile_rows must be 1 (1x16 blocks) or 16 (16x16 tiles), got {tile_rows}")
    x = t_MK.float()
    m, k = x.shape
    if k % 16:
        raise ValueError(f"NVFP4 needs K divisible by 16, got K={k}")
    amax = x.abs().amax() if x.numel() else torch.zeros((), device=x.device)
    g_enc = torch.clamp_max(torch.tensor(F8E4M3_MAX * F4_E2M1_MAX, device=x.device) / amax, FP32_MAX)
    g_enc = torch.where(g_enc == 0, torch.ones_like(g_enc), g_enc)
    g_dec = 1.0 / g_enc
    blocks = x.reshape(m, k // 16, 16)
    if tile_rows == 16:
        pad = (-m) % 16  # TE pads the rows of a tile with zeros, which do not change its amax
        padded = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
        tiles = padded.reshape((m + pad) // 16, 16, k // 16, 16).abs().amax(dim=(1, 3))
        vec_max = tiles.repeat_interleave(16, dim=0)[:m]
    else:
        vec_max = blocks.abs().amax(dim=-1)
    decode = torch.clamp_max(vec_max * (g_enc * (1.0 / F4_E2M1_MAX)), FP32_MAX)
    s8 = torch.clamp(decode, -F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn)
    # no lower clamp: a scale that underflows to 0 gives an encode scale of FP32 max and a block of zeros
    encode = torch.clamp_max(1.0 / (s8.float() * g_dec), FP32_MAX)
    scaled = torch.clamp(blocks * encode.unsqueeze(-1), -F4_E2M1_MAX, F4_E2M1_MAX)
    return round_e2m1(scaled).reshape(m, k), s8, g_dec


class NVFP4TEEmuLinear(EmuQuantLinear):
    """NVFP4 as Transformer Engine's `NVFP4BlockScaling` runs a forward: 16x16 weight tiles, 1x16
    activation blocks, TE's scale arithmetic (module doc)."""

    block_size = 16
    weight_tile_rows: ClassVar[int] = 16

    @classmethod
    def quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        """Packed resident weight: torchao's NVFP4Tensor holding TE's values and scales."""
        values, s8, g_dec = nvfp4_te_quantize(t_MK, cls.weight_tile_rows)
        qdata = pack_uint4(f32_to_f4_unpacked(values))
        return NVFP4Tensor(qdata, s8, 16, torch.float32, per_tensor_scale=g_dec)

    @classmethod
    def fake_quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        """Activations: 1x16 blocks, dequantized in the order NVFP4Tensor.dequantize uses (value times
        global-times-block scale)."""
        values, s8, g_dec = nvfp4_te_quantize(t_MK, 1)
        m, k = values.shape
        return (values.reshape(m, k // 16, 16) * (g_dec * s8.float()).unsqueeze(-1)).reshape(m, k)


@register_backend
class FP8E4M3EmuBackend(_EmulatedBackend):
    """W8A8 FP8 E4M3, per-tensor current scaling (TE `Float8CurrentScaling`, Hopper and later)."""

    name = "fp8-e4m3-emu"
    emulates = "fp8"  # TE's fp8 forward is E4M3
    layer_cls = FP8E4M3EmuLinear


@register_backend
class FP8E5M2EmuBackend(_EmulatedBackend):
    """W8A8 FP8 E5M2, per-tensor current scaling (what the reference code's "NVFP4" ran as)."""

    name = "fp8-e5m2-emu"
    layer_cls = FP8E5M2EmuLinear


@register_backend
class NVFP4TEEmuBackend(_EmulatedBackend):
    """W4A4 NVFP4 with Transformer Engine's recipe numerics (2D weight tiles, TE scale rule)."""

    name = "nvfp4-te-emu"
    emulates = "nvfp4"
    layer_cls = NVFP4TEEmuLinear
