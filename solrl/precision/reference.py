"""High-precision backends: `fp32` (the reference) and `bf16`."""

from __future__ import annotations

import torch
from torch import nn

from solrl.precision.base import (
    PrecisionBackend,
    QuantLinear,
    check_module,
    register_backend,
    round_to_bf16,
)


@register_backend
class Fp32Backend(PrecisionBackend):
    """Leaves the model exactly as it is (the reference numerics)."""

    name = "fp32"

    def prepare(self, model: nn.Module) -> nn.Module:
        """Return `model` unchanged."""
        check_module(model)
        self.quantized_names = ()
        return model


@register_backend
class Bf16Backend(PrecisionBackend):
    """Rounds every floating parameter and buffer to bf16.

    On CUDA the tensors become real bf16 tensors (`.to(torch.bfloat16)`). Elsewhere they
    stay fp32 tensors holding bf16-representable values and compute stays fp32: this CPU
    has no native bf16 and a bf16 matmul would be ~100x slower. The branch is chosen per
    tensor from the device it lives on. Layers already quantized by another backend
    (QuantLinear) are left alone.
    """

    name = "bf16"

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        return round_to_bf16(t)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Round `model`'s floating tensors to bf16 in place and return it."""
        check_module(model)
        self._round_unquantized(model)
        self.quantized_names = ()
        return model

    def _round_unquantized(self, model: nn.Module) -> None:
        """bf16-round the parameters and buffers of every module that is not a QuantLinear."""
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, QuantLinear):
                    continue
                for param in module.parameters(recurse=False):
                    if param.is_floating_point():
                        param.data = round_to_bf16(param.data)
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(module, name, round_to_bf16(buf))
