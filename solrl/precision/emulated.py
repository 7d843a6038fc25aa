"""FP4 fake quantization on any device: `nvfp4-emu` and `mxfp4-emu`.

Weights are quantized once (prepare / requantize) and stay resident in torchao's packed
form; activations are quantized on every forward (W4A4) unless the config asks for
weight-only. Both operands are dequantized and multiplied in fp32 with `F.linear`: the
quantization error, not the GEMM kernel, is what a real FP4 kernel adds, so this
reproduces its numerics closely on a CPU.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.constants import F4_E2M1_MAX, F8E4M3_MAX
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import (
    E4M3_EPS,
    NVFP4Tensor,
    per_tensor_amax_to_scale,
)

from solrl.precision.base import (
    QuantLinear,
    is_plain_linear,
    register_backend,
    replace_module,
    select_linear_layers,
)
from solrl.precision.reference import Bf16Backend


def packed_nbytes(packed: torch.Tensor) -> int:
    """Bytes of a torchao quantized tensor's components (values, block scales and any
    per-tensor scale), read from the component names torchao declares."""
    names = [*packed.tensor_data_names, *getattr(packed, "optional_tensor_data_names", [])]
    parts = [getattr(packed, n) for n in names]
    return sum(p.numel() * p.element_size() for p in parts if p is not None)


class EmuQuantLinear(QuantLinear):
    """Inference-only linear layer with a packed FP4 weight (fake-quant emulation).

    Subclasses choose the format through `block_size` and `quantize`. Inputs of any
    leading shape [..., in_features] are flattened to 2-D, (optionally) quantized and
    dequantized, multiplied in fp32 with the dequantized weight and the fp32 bias, and
    returned in the input's dtype. Runs under no_grad: outputs carry no gradient.
    """

    block_size: ClassVar[int]

    def __init__(
        self,
        weight_OI: torch.Tensor,
        bias_O: torch.Tensor | None = None,
        *,
        quantize_activations: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(weight_OI, torch.Tensor) or weight_OI.dim() != 2:
            raise ValueError(f"weight_OI must be a 2-D tensor [out, in], got {weight_OI!r:.80}")
        self.out_features, self.in_features = weight_OI.shape
        if self.in_features % self.block_size != 0:
            raise ValueError(
                f"in_features={self.in_features} is not a multiple of the block size "
                f"{self.block_size} of {type(self).__name__}"
            )
        if bias_O is not None and tuple(bias_O.shape) != (self.out_features,):
            raise ValueError(
                f"bias_O has shape {tuple(bias_O.shape)}, expected ({self.out_features},)"
            )
        self.quantize_activations = bool(quantize_activations)
        with torch.no_grad():
            if bias_O is None:
                self.register_parameter("bias", None)
            else:
                bias = bias_O.detach().to(torch.float32).clone()
                self.bias = nn.Parameter(bias, requires_grad=False)
            packed = self._quantize_on(weight_OI, weight_OI.device)
        self.register_buffer("weight_q", packed, persistent=False)
        # The packed weight is the resident form (what weight_bytes reports); its fp32 dequantized
        # image is cached once per (re)quantization so the CPU emulation does not unpack it on
        # every forward. Numerics are unchanged: it is exactly `weight_q.dequantize(float32)`.
        self.register_buffer("_weight_dq", packed.dequantize(torch.float32), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, quantize_activations: bool = True) -> EmuQuantLinear:
        """Quantize an existing nn.Linear (its weight and bias are read, not kept)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias, quantize_activations=quantize_activations)

    @classmethod
    def quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        """Quantize a contiguous fp32 matrix [M, K] along K into the packed format."""
        raise NotImplementedError

    def _quantize_on(self, weight_OI: torch.Tensor, device: torch.device) -> torch.Tensor:
        w = weight_OI.detach().to(device=device, dtype=torch.float32).contiguous()
        return self.quantize(w)

    def quantize_weight(self, weight_OI: torch.Tensor) -> torch.Tensor:
        """Packed form of a new weight [out, in], on this layer's device; the layer is unchanged."""
        expected = (self.out_features, self.in_features)
        if not isinstance(weight_OI, torch.Tensor) or tuple(weight_OI.shape) != expected:
            got = tuple(weight_OI.shape) if isinstance(weight_OI, torch.Tensor) else weight_OI
            raise ValueError(f"weight_OI must have shape {expected} [out, in], got {got!r:.80}")
        with torch.no_grad():
            return self._quantize_on(weight_OI, self.weight_q.device)

    def load_packed(self, packed: torch.Tensor) -> None:
        """Make `packed` (a `quantize_weight` result) the resident weight."""
        if type(packed) is not type(self.weight_q) or packed.shape != self.weight_q.shape:
            raise ValueError(
                f"packed must be a {type(self.weight_q).__name__} of shape "
                f"{tuple(self.weight_q.shape)}, got {type(packed).__name__} {tuple(packed.shape)}"
            )
        self.weight_q = packed
        self._weight_dq = packed.dequantize(torch.float32)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the layer uses it: [out, in] fp32."""
        return self._weight_dq

    @classmethod
    def fake_quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        """quantize -> dequantize of a fp32 matrix along K, as one fp32 tensor (activations)."""
        return cls.quantize(t_MK).dequantize(torch.float32)

    def packed_weight_bytes(self) -> int:
        """Bytes of the resident packed weight (4-bit values and all scales)."""
        return packed_nbytes(self.weight_q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has last dim {x.shape[-1]}, expected {self.in_features}")
        with torch.no_grad():
            x_MK = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
            if self.quantize_activations and x_MK.numel() > 0:
                x_MK = self.fake_quantize(x_MK)
            y_MN = F.linear(x_MK, self.dequantized_weight(), self.bias)
        return y_MN.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quantize_activations={self.quantize_activations}"
        )


def round_e2m1_magnitude_(a: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values in [0, 6] to the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} in place, ties to the
    even encoding, as a hardware cast does.

    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4. Adding M = 2^22, 2^23 or 2^24 (the float whose
    spacing is that step) and subtracting it again rounds a to a multiple of the step, half to even, by fp32's own
    rounding: the same results as round(a / step) * step, in five passes over the tensor instead of ten (the
    emulated explorer runs this on every activation of every forward; each pass is time on a CPU). M is built from
    the exponent bits of max(a, 1): exponent e (a in [2^e, 2^(e+1)), e = 0 below 2) gives M = 2^(e + 22).
    Written by hand: torchao packs nibbles (f32_to_f4_unpacked), several times slower here;
    tests/precision/test_precision.py checks the two agree bit for bit."""
    m = a.clamp_min(1.0).view(torch.int32).bitwise_and_(0x7F800000).add_(22 << 23).view(torch.float32)
    return a.add_(m).sub_(m)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round values in [-6, 6] to the E2M1 grid (round_e2m1_magnitude_ on |x|, x's sign kept)."""
    return torch.copysign(round_e2m1_magnitude_(x.abs()), x)


class NVFP4EmuLinear(EmuQuantLinear):
    """NVFP4: E2M1 values, one E4M3 scale per 16 elements along K, one fp32 scale per tensor.

    The per-tensor scale is amax / (448 * 6) (torchao's `per_tensor_amax_to_scale`), so the
    largest block scale lands on E4M3's maximum; activations get theirs from their own
    amax on every call (dynamic, whole-tensor, as the real recipe does).

    Kept whole-tensor on purpose (not per sample): Transformer Engine's NVFP4 recipe takes one
    amax over the GEMM's whole input, so a row's quantization depends on the other rows of its
    batch, and emulating that is the point. Rollouts get batch-independent proxy scores by
    batching one prompt's seeds at a time instead (`solrl.rollout.passes.generate_by_prompt`).
    """

    block_size = 16

    @classmethod
    def quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        amax = t_MK.abs().amax()
        # An all-zero tensor would give scale 0 and NaNs (0 / 0); any scale encodes zeros.
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        return NVFP4Tensor.to_nvfp4(
            t_MK, block_size=cls.block_size, per_tensor_scale=per_tensor_amax_to_scale(amax)
        )

    @classmethod
    def fake_quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        """NVFP4 quantize -> dequantize without packing (written by hand for CPU speed: torchao's
        path packs and unpacks nibbles, ~5x slower here). It does torchao's float operations
        (`nvfp4_quantize`, then `dequantize`) in their order, except that |x| is taken once and the
        sign put back at the end (max and sign are exact), so the result is bit-identical to
        `to_nvfp4(...).dequantize(float32)`; tests/precision/test_precision.py checks that."""
        m, k = t_MK.shape
        blocks = t_MK.float().reshape(m, k // cls.block_size, cls.block_size)
        mag = blocks.abs()  # |x| once: the block maxima, their maximum (the tensor's amax), and the values' magnitudes
        block_amax = mag.amax(dim=-1)
        amax = block_amax.amax()
        amax = torch.where(amax > 0, amax, torch.ones_like(amax))
        pts = per_tensor_amax_to_scale(amax)
        block_scale = block_amax / F4_E2M1_MAX
        s8 = torch.clamp(block_scale / pts, min=E4M3_EPS, max=F8E4M3_MAX).to(torch.float8_e4m3fn).float()
        # |x * s| = |x| * s for the positive scale s, and clamping to [-6, 6] then taking |.| is min(|.|, 6): the
        # magnitudes are scaled, clamped and rounded in place, and x's signs put back at the end
        mag.mul_(((1.0 / pts) / s8).unsqueeze(-1)).clamp_(max=F4_E2M1_MAX)
        return round_e2m1_magnitude_(mag).copysign_(blocks).mul_((pts * s8).unsqueeze(-1)).reshape(m, k)


class MXFP4EmuLinear(EmuQuantLinear):
    """MXFP4 (OCP MX): E2M1 values, one power-of-two E8M0 scale per 32 elements along K.

    Scales use RCEIL, 2**ceil(log2(amax_block / 6)): the rule NVIDIA's hardware and cuBLAS
    use (see torchao's `ScaleCalculationMode`), which never saturates a block's maximum.
    """

    block_size = 32

    @classmethod
    def quantize(cls, t_MK: torch.Tensor) -> torch.Tensor:
        return MXTensor.to_mx(
            t_MK,
            torch.float4_e2m1fn_x2,
            block_size=cls.block_size,
            scaling_mode=ScaleCalculationMode.RCEIL,
        )


class _EmulatedBackend(Bf16Backend):
    """bf16 model whose selected nn.Linear layers become `layer_cls` (FP4 fake-quant).

    The selected layers are quantized from their weights as given; everything else is
    rounded to bf16 as the `bf16` backend does, the quantized layers' biases stay fp32.
    """

    layer_cls: ClassVar[type[EmuQuantLinear]]
    quantizes = True

    def selected_layers(self, model: nn.Module) -> list[str]:
        """nn.Linear names kept by skip / min_features whose in_features fits the block."""
        return select_linear_layers(model, self.cfg, self.layer_cls.block_size)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Quantize the selected layers in place, bf16-round the rest, return `model`."""
        if is_plain_linear(model):
            raise TypeError(
                "model is a bare nn.Linear, which cannot be replaced in place; "
                "wrap it in a container (e.g. nn.Sequential(linear))"
            )
        names = self.selected_layers(model)
        with torch.no_grad():
            for name in names:
                layer = self.layer_cls.from_linear(
                    model.get_submodule(name),
                    quantize_activations=self.cfg.quantize_activations,
                )
                replace_module(model, name, layer)
        self._round_unquantized(model)
        self.quantized_names = tuple(names)
        return model


@register_backend
class NVFP4EmuBackend(_EmulatedBackend):
    """W4A4 (or W4A16) NVFP4 fake quantization; runs anywhere torch does."""

    name = "nvfp4-emu"
    emulates = "nvfp4"
    layer_cls = NVFP4EmuLinear


@register_backend
class MXFP4EmuBackend(_EmulatedBackend):
    """W4A4 (or W4A16) MXFP4 fake quantization; runs anywhere torch does."""

    name = "mxfp4-emu"
    layer_cls = MXFP4EmuLinear
