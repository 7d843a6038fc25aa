"""Precision backends: how the explorer, regenerator and trainer hold and run weights.

`build_backend(PrecisionConfig(backend=...))` returns one of the registered backends
(`available_backends()`); each prepares a model in place, re-quantizes it after an adapter
merge and reports its resident weight bytes.
"""

from solrl.precision.base import (
    BACKENDS,
    PrecisionBackend,
    PrecisionConfig,
    QuantLinear,
    available_backends,
    build_backend,
    register_backend,
)
from solrl.precision.emulated import (
    EmuQuantLinear,
    MXFP4EmuBackend,
    MXFP4EmuLinear,
    NVFP4EmuBackend,
    NVFP4EmuLinear,
)
from solrl.precision.emulated_te import (
    FP8E4M3EmuBackend,
    FP8E5M2EmuBackend,
    FP8EmuLinear,
    NVFP4TEEmuBackend,
    NVFP4TEEmuLinear,
)
from solrl.precision.reference import Bf16Backend, Fp32Backend
from solrl.precision.transformer_engine import (
    FP8TEBackend,
    NVFP4TEBackend,
    TransformerEngineBackend,
)

__all__ = [
    "BACKENDS",
    "Bf16Backend",
    "EmuQuantLinear",
    "FP8E4M3EmuBackend",
    "FP8E5M2EmuBackend",
    "FP8EmuLinear",
    "FP8TEBackend",
    "Fp32Backend",
    "MXFP4EmuBackend",
    "MXFP4EmuLinear",
    "NVFP4EmuBackend",
    "NVFP4EmuLinear",
    "NVFP4TEEmuBackend",
    "NVFP4TEEmuLinear",
    "NVFP4TEBackend",
    "PrecisionBackend",
    "PrecisionConfig",
    "QuantLinear",
    "TransformerEngineBackend",
    "available_backends",
    "build_backend",
    "register_backend",
]
