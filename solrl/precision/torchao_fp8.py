"""`fp8-torchao`: FP8 (E4M3) W8A8 on torchao's FP8 GEMM (`torch._scaled_mm`), Ada / Hopper and later.

The `fp8` format where Transformer Engine is absent: `build_backend` builds this backend for `fp8` when the
transformer_engine package is not installed (the hopper overlay runs with either), and `same_format` counts it as
`fp8`. Numerics are `fp8-e4m3-emu`'s (TE's `Float8CurrentScaling`) up to the GEMM's accumulation order:

- weights and activations get one FP32 scale per tensor from their own amax (weights once per quantization,
  activations on every call), computed by `fp8_current_scaling`, the function `fp8-e4m3-emu` uses. torchao's own
  quantizer (`Float8Tensor.from_hp`, behind `Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())`)
  divides by amax / 448 where TE multiplies by 448 / amax; the two scales can differ in the last bit and move a
  value across an FP8 rounding boundary, so the TE rule is kept and only its output is wrapped in torchao's
  `Float8Tensor`;
- the product runs through torchao's Float8Tensor linear (`addmm_float8_unwrapped_inference`, i.e.
  `torch._scaled_mm` with both per-tensor scales), without fast accumulation (`use_fast_accum=False`: Hopper's fast
  mode accumulates in reduced precision, more than an accumulation-order difference), FP32 output plus the FP32
  bias, cast back to the input's dtype.

The resident weight is the packed `Float8Tensor` (1 byte per value and one FP32 scale). An adapter push
(`requantize`) quantizes the merged weight and copies values and scale into the resident storage in place.
Layers need in / out features that are multiples of 16 (`_scaled_mm`'s rule, the same selection as TE's `fp8`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torchao.quantization import Float8MMConfig, Float8Tensor
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from solrl.precision.base import (
    QuantLinear,
    check_module,
    is_plain_linear,
    register_backend,
    replace_module,
    select_gemm_layers,
)
from solrl.precision.emulated import packed_nbytes
from solrl.precision.emulated_te import fp8_current_scaling
from solrl.precision.reference import Bf16Backend

FP8_DTYPE = torch.float8_e4m3fn
# torch's GEMM path of Float8Tensor (the mslk kernels take no per-tensor scales), no fast accumulation
MM_CONFIG = Float8MMConfig(use_fast_accum=False)
ALTERNATIVES = "use 'fp8-e4m3-emu' (the same numerics, emulated on any device) or 'bf16'"


def to_float8_tensor(t_MK: torch.Tensor) -> Float8Tensor:
    """`t_MK` [M, K] quantized with TE's per-tensor current scaling, as torchao's Float8Tensor (one scale)."""
    q, scale_inv = fp8_current_scaling(t_MK, FP8_DTYPE)
    return Float8Tensor(q, scale_inv.reshape(1, 1), block_size=list(t_MK.shape), mm_config=MM_CONFIG,
                        kernel_preference=KernelPreference.TORCH, dtype=torch.float32)


def torchao_fp8_requirement_error(backend: str, *, cuda_available: bool,
                                  capability: tuple[int, int] | None, scaled_mm: bool,
                                  min_capability: tuple[int, int] = (8, 9)) -> str | None:
    """Why torchao's FP8 GEMM cannot run as `backend` with these facts about the machine, or None if it can."""
    if not cuda_available:
        return (f"precision backend {backend!r} needs a CUDA GPU, and CUDA is not available "
                f"(torchao's FP8 GEMM runs on NVIDIA GPUs of compute capability >= 8.9); on this machine {ALTERNATIVES}")
    if capability is None or tuple(capability) < tuple(min_capability):
        need = ".".join(map(str, min_capability))
        have = "unknown" if capability is None else ".".join(map(str, capability))
        return (f"precision backend {backend!r} needs compute capability >= {need} (Ada / Hopper FP8 tensor cores), "
                f"this GPU has {have}; {ALTERNATIVES}")
    if not scaled_mm:
        return f"precision backend {backend!r} needs torch._scaled_mm, which this torch lacks; {ALTERNATIVES}"
    return None


class FP8TorchaoLinear(QuantLinear):
    """Inference-only W8A8 FP8 linear layer on torchao's Float8Tensor GEMM (module doc).

    Inputs of any leading shape [..., in_features] are flattened to [M, K], quantized per tensor and multiplied
    with the resident FP8 weight by `torch._scaled_mm` (FP32 output, FP32 bias); the result has the input's dtype.
    """

    block_size: ClassVar[int] = 16

    def __init__(self, weight_OI: torch.Tensor, bias_O: torch.Tensor | None = None) -> None:
        super().__init__()
        if not isinstance(weight_OI, torch.Tensor) or weight_OI.dim() != 2:
            raise ValueError(f"weight_OI must be a 2-D tensor [out, in], got {weight_OI!r:.80}")
        self.out_features, self.in_features = weight_OI.shape
        if self.in_features % self.block_size or self.out_features % self.block_size:
            raise ValueError(f"torch._scaled_mm needs in and out features that are multiples of {self.block_size}, "
                             f"got in_features={self.in_features}, out_features={self.out_features}")
        if bias_O is not None and tuple(bias_O.shape) != (self.out_features,):
            raise ValueError(f"bias_O has shape {tuple(bias_O.shape)}, expected ({self.out_features},)")
        with torch.no_grad():
            if bias_O is None:
                self.register_parameter("bias", None)
            else:
                self.bias = nn.Parameter(bias_O.detach().to(torch.float32).clone(), requires_grad=False)
            packed = to_float8_tensor(weight_OI.detach().to(torch.float32).contiguous())
        self.register_buffer("weight_q", packed, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8TorchaoLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias)

    def quantize_weight(self, weight_OI: torch.Tensor) -> Float8Tensor:
        """Packed form of a new weight [out, in] on this layer's device; the layer is unchanged."""
        expected = (self.out_features, self.in_features)
        if not isinstance(weight_OI, torch.Tensor) or tuple(weight_OI.shape) != expected:
            got = tuple(weight_OI.shape) if isinstance(weight_OI, torch.Tensor) else weight_OI
            raise ValueError(f"weight_OI must have shape {expected} [out, in], got {got!r:.80}")
        with torch.no_grad():
            return to_float8_tensor(weight_OI.detach().to(device=self.weight_q.device, dtype=torch.float32))

    def load_packed(self, packed: torch.Tensor) -> None:
        """Copy `packed` (a `quantize_weight` result) into the resident values and scale, in place (their storage,
        and so anything captured from it, stays)."""
        if not isinstance(packed, Float8Tensor) or packed.shape != self.weight_q.shape:
            raise ValueError(f"packed must be a Float8Tensor of shape {tuple(self.weight_q.shape)}, "
                             f"got {type(packed).__name__} {tuple(packed.shape)}")
        with torch.no_grad():
            self.weight_q.qdata.copy_(packed.qdata)
            self.weight_q.scale.copy_(packed.scale)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as the GEMM sees it: [out, in] FP32."""
        return self.weight_q.dequantize(torch.float32)

    def packed_weight_bytes(self) -> int:
        return packed_nbytes(self.weight_q)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has last dim {x.shape[-1]}, expected {self.in_features}")
        x_MK = x.reshape(-1, self.in_features)
        with torch.no_grad():
            if x_MK.shape[0] == 0:
                y_MN = x_MK.new_zeros((0, self.out_features), dtype=torch.float32)
            else:
                # both operands are Float8Tensors: torchao's linear calls torch._scaled_mm with their scales
                y_MN = F.linear(to_float8_tensor(x_MK.to(torch.float32).contiguous()), self.weight_q, self.bias)
        return y_MN.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@register_backend
class FP8TorchaoBackend(Bf16Backend):
    """FP8 E4M3 W8A8 with per-tensor current scaling on torchao's FP8 GEMM (sm_89+): `fp8` without Transformer
    Engine.

    `prepare` checks the machine (CUDA, compute capability >= 8.9) and raises RuntimeError naming what is missing
    and what to use instead; the selected layers (TE `fp8`'s rule: the shared policy, in and out features multiples
    of 16) become `FP8TorchaoLinear`, the rest is rounded to bf16 like the `bf16` backend.
    """

    name = "fp8-torchao"
    implements = "fp8"
    quantizes = True
    min_capability: ClassVar[tuple[int, int]] = (8, 9)
    block_size: ClassVar[int] = FP8TorchaoLinear.block_size

    @property
    def label(self) -> str:
        """The name the run asked for: `fp8` when `build_backend` chose this backend for it."""
        return self.cfg.backend

    def selected_layers(self, model: nn.Module) -> list[str]:
        """nn.Linear names kept by the policy whose in and out features are multiples of 16."""
        return select_gemm_layers(model, self.cfg, self.block_size)

    def check_environment(self) -> None:
        """Raise RuntimeError unless CUDA and an FP8-capable GPU are there."""
        cuda = torch.cuda.is_available()
        error = torchao_fp8_requirement_error(
            self.label, cuda_available=cuda, capability=torch.cuda.get_device_capability() if cuda else None,
            scaled_mm=hasattr(torch, "_scaled_mm"), min_capability=self.min_capability)
        if error is not None:
            if self.label != self.name:
                error += (f" (Transformer Engine is not installed, so {self.label!r} was built as {self.name!r}, "
                          "torchao's FP8 GEMM)")
            raise RuntimeError(error)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check the machine, replace the selected layers by FP8TorchaoLinear, bf16-round the rest."""
        check_module(model)
        if is_plain_linear(model):
            raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; wrap it in a container")
        if not self.cfg.quantize_activations:
            raise ValueError(f"precision backend {self.label!r} quantizes activations too (W8A8): "
                             "quantize_activations=False is only available with the emulated backends "
                             "(e.g. 'fp8-e4m3-emu')")
        self.check_environment()
        names = self.selected_layers(model)
        for name in names:
            linear = model.get_submodule(name)
            if not linear.weight.is_cuda:
                raise RuntimeError(f"precision backend {self.label!r}: layer {name!r} is on "
                                   f"{linear.weight.device}; move the model to CUDA before prepare()")
        with torch.no_grad():
            for name in names:
                replace_module(model, name, FP8TorchaoLinear.from_linear(model.get_submodule(name)))
        self._round_unquantized(model)
        self.quantized_names = tuple(names)
        return model
