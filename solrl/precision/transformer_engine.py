"""Transformer Engine backends (`nvfp4`, `fp8`): real low-precision GEMMs on NVIDIA GPUs.

Only the requirement checks live here so far; they run anywhere. transformer_engine is
never imported at module import time (it is absent on CPU machines), only looked up with
importlib when a backend is prepared.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch
from torch import nn

from solrl.precision.base import (
    PrecisionBackend,
    check_module,
    register_backend,
    select_linear_layers,
)


def requirement_error(
    backend: str,
    *,
    cuda_available: bool,
    capability: tuple[int, int] | None,
    te_installed: bool,
    min_capability: tuple[int, int],
) -> str | None:
    """Why `backend` cannot run with these facts about the machine, or None if it can."""
    if not cuda_available:
        return f"precision backend {backend!r} needs a CUDA GPU, and CUDA is not available"
    if capability is None or tuple(capability) < tuple(min_capability):
        need = ".".join(map(str, min_capability))
        have = "unknown" if capability is None else ".".join(map(str, capability))
        return (
            f"precision backend {backend!r} needs compute capability >= {need}, "
            f"this GPU has {have}"
        )
    if not te_installed:
        return (
            f"precision backend {backend!r} needs NVIDIA Transformer Engine "
            "(the transformer_engine package), which is not installed"
        )
    return None


class TransformerEngineBackend(PrecisionBackend):
    """Base for backends that run selected nn.Linear layers as Transformer Engine GEMMs.

    `prepare` first checks the machine and raises RuntimeError naming what is missing
    (CUDA, compute capability, transformer_engine); the emulated backends are the
    CPU stand-ins with the same layer selection.
    """

    min_capability: ClassVar[tuple[int, int]]
    recipe: ClassVar[str]  # transformer_engine.common.recipe class the conversion will use
    block_size: ClassVar[int] = 16  # TE's FP8/FP4 GEMMs want dimensions that are multiples of 16

    def selected_layers(self, model: nn.Module) -> list[str]:
        """nn.Linear names kept by skip / min_features whose in_features is a multiple of 16."""
        return select_linear_layers(model, self.cfg, self.block_size)

    def check_environment(self) -> None:
        """Raise RuntimeError unless CUDA, the compute capability and TE are all there."""
        cuda = torch.cuda.is_available()
        error = requirement_error(
            self.name,
            cuda_available=cuda,
            capability=torch.cuda.get_device_capability() if cuda else None,
            te_installed=importlib.util.find_spec("transformer_engine") is not None,
            min_capability=self.min_capability,
        )
        if error is not None:
            raise RuntimeError(error)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check the machine; the te.Linear conversion itself is not written yet."""
        check_module(model)
        self.check_environment()
        raise NotImplementedError(
            f"precision backend {self.name!r}: the Transformer Engine conversion "
            f"({self.recipe} with te.Linear) is not implemented yet"
        )


@register_backend
class NVFP4TEBackend(TransformerEngineBackend):
    """NVFP4 W4A4 through Transformer Engine's NVFP4BlockScaling (Blackwell, sm_100+)."""

    name = "nvfp4"
    min_capability = (10, 0)
    recipe = "NVFP4BlockScaling"


@register_backend
class FP8TEBackend(TransformerEngineBackend):
    """FP8 (E4M3) through Transformer Engine on Ada / Hopper and later (sm_89+)."""

    name = "fp8"
    min_capability = (8, 9)
    recipe = "Float8CurrentScaling"
