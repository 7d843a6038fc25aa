"""Precision backends: how the explorer, regenerator and trainer hold and run weights.

`build_backend(PrecisionConfig(backend=...))` returns one of the registered backends
(`available_backends()`); each prepares a model in place, re-quantizes it after an adapter
merge and reports its resident weight bytes.

The names below are imported on first use (PEP 562), so `PrecisionConfig` and the run config load
without torch: `solrl --help` and config validation stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from solrl.precision.config import BACKEND_NAMES, PrecisionConfig

_WHERE = {
    "PrecisionBackend": "base", "QuantLinear": "base", "register_backend": "base", "allow_tf32": "base",
    "BACKENDS": "registry", "available_backends": "registry", "runnable_backends": "registry",
    "build_backend": "registry", "cannot_run_here": "registry", "kernel_name": "registry", "same_format": "registry",
    "unavailable_backends": "registry",
    "EmuQuantLinear": "emulated", "MXFP4EmuBackend": "emulated", "MXFP4EmuLinear": "emulated",
    "NVFP4EmuBackend": "emulated", "NVFP4EmuLinear": "emulated",
    "FP8E4M3EmuBackend": "emulated_te", "FP8E5M2EmuBackend": "emulated_te", "FP8EmuLinear": "emulated_te",
    "NVFP4TEEmuBackend": "emulated_te", "NVFP4TEEmuLinear": "emulated_te",
    "Bf16Backend": "reference", "Bf16CpuBackend": "reference", "Fp32Backend": "reference",
    "cpu_flags": "reference", "native_bf16_error": "reference",
    "FP8TorchaoBackend": "torchao_fp8", "FP8TorchaoLinear": "torchao_fp8",
    "FP8TEBackend": "transformer_engine", "NVFP4TEBackend": "transformer_engine",
    "TransformerEngineBackend": "transformer_engine",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'solrl.precision' has no attribute {name!r}")
    return getattr(importlib.import_module(f"solrl.precision.{_WHERE[name]}"), name)


__all__ = ["BACKEND_NAMES", "PrecisionConfig", *_WHERE]
