"""Precision backends by name: `build_backend(PrecisionConfig(...))` and what is registered and runnable here.

The registry sits above the backends it lists: importing it imports every built-in backend module, each of
which adds its classes to `BACKENDS` (solrl/precision/base.py) with `register_backend`. The backends import
only the interface (and each other's shared pieces), never this module, so the package has no import circle.

Each module is imported on its own: one whose optional dependency is missing or broken (torchao for the emulations
and the torchao FP8 GEMM) registers nothing, and `UNAVAILABLE` records why, so BF16 and FP32 (and Transformer
Engine, which imports its package only when used) stay buildable on a machine without torchao; building a backend
of a module that failed raises that module's ImportError text.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging

from solrl.models import ENV_CUDA_STANDIN, cuda_stood_in
from solrl.precision.base import BACKENDS, PrecisionBackend
from solrl.precision.config import PrecisionConfig

# the built-in backend modules, imported for their registrations (each adds its backends to BACKENDS), and the
# backend names each would register (solrl.precision.config.BACKEND_NAMES lists them all)
MODULES = {
    "reference": ("bf16", "bf16-cpu", "fp32"),
    "transformer_engine": ("fp8", "nvfp4"),
    "emulated": ("mxfp4-emu", "nvfp4-emu"),
    "emulated_te": ("fp8-e4m3-emu", "fp8-e5m2-emu", "nvfp4-te-emu"),
    "torchao_fp8": ("fp8-torchao",),
}
# module -> why it could not be imported (its ImportError), for the modules that registered nothing
UNAVAILABLE: dict[str, str] = {}


def _import_modules() -> None:
    for module in MODULES:
        try:
            importlib.import_module(f"solrl.precision.{module}")
        except ImportError as err:   # an optional dependency missing or built for another torch
            UNAVAILABLE[module] = f"{type(err).__name__}: {err}"


_import_modules()


def unavailable_backends() -> dict[str, str]:
    """Built-in backend names not registered here, each with its module's ImportError."""
    return {name: f"solrl.precision.{module}: {UNAVAILABLE[module]}"
            for module, names in MODULES.items() if module in UNAVAILABLE for name in names if name not in BACKENDS}


def same_format(a: str, b: str) -> bool:
    """Whether two backend names compute the same format: equal, or an emulation and the kernel it emulates
    (nvfp4-emu / nvfp4-te-emu and nvfp4, fp8-e4m3-emu and fp8), or another implementation of a kernel's format
    (fp8-torchao and fp8)."""
    return kernel_name(a) == kernel_name(b)


def kernel_name(name: str) -> str:
    """The kernel backend whose format `name` computes: what it emulates or implements, else `name` itself."""
    cls = BACKENDS.get(name)
    return ((cls.emulates or cls.implements) if cls is not None else None) or name


def available_backends() -> list[str]:
    """Names of the registered backends, sorted."""
    return sorted(BACKENDS)


def runnable_backends() -> list[str]:
    """The registered backends this machine can run: those without a machine check (`check_environment`, the
    Transformer Engine ones: CUDA, compute capability, the package) or whose check passes."""
    return [name for name in available_backends() if cannot_run_here(name, "") is None]


def cannot_run_here(name: str, device: str) -> str | None:
    """Why backend `name` cannot run on this machine for a model on `device` ("cpu", "cuda", "cuda:1"); None where it
    can: registered, not a CPU-only backend on CUDA, and its machine check (`check_environment`) passing."""
    if name not in BACKENDS:
        return unavailable_backends().get(name) or f"no precision backend {name!r} is registered here"
    cls = BACKENDS[name]
    if cls.cpu_only and device.startswith("cuda"):
        return f"{name!r} runs on the CPU and the model is on {device}"
    try:
        getattr(cls(PrecisionConfig(name)), "check_environment", lambda: None)()
    except RuntimeError as exc:
        return str(exc)
    return None


# Backends built for a Transformer Engine name where the transformer_engine package is not installed
TE_FALLBACK = {"fp8": "fp8-torchao"}


def build_backend(cfg: PrecisionConfig) -> PrecisionBackend:
    """Instantiate the backend that `cfg.backend` names. `fp8` without Transformer Engine installed is built as
    `fp8-torchao` (torchao's FP8 GEMM, the same format; its `cfg.backend` stays `fp8`)."""
    if not isinstance(cfg, PrecisionConfig):
        raise TypeError(f"cfg must be a PrecisionConfig, got {type(cfg).__name__}")
    if cfg.fallback:
        raise ValueError(f"precision backend {cfg.backend!r} with fallback {cfg.fallback!r} is a choice still to make "
                         "on the machine that runs it: validate the run's config first (RunConfig.validate resolves it)")
    if cfg.backend not in BACKENDS:
        missing = unavailable_backends().get(cfg.backend)
        if missing is not None:
            raise ImportError(f"precision backend {cfg.backend!r} cannot be built here: {missing}")
        raise ValueError(
            f"unknown precision backend {cfg.backend!r}; available: {available_backends()}"
        )
    if cuda_stood_in():  # tests only (solrl.models.ENV_CUDA_STANDIN)
        kernel = kernel_name(cfg.backend)
        emulation = sorted((n for n, c in BACKENDS.items() if c.emulates == kernel),
                           key=lambda n: "te-emu" not in n)
        if emulation:
            logging.getLogger(__name__).warning("%s=1: precision %s built as its CPU emulation %s (a test stand-in)",
                                                ENV_CUDA_STANDIN, cfg.backend, emulation[0])
            return BACKENDS[emulation[0]](dataclasses.replace(cfg, backend=emulation[0]))
    fallback = TE_FALLBACK.get(cfg.backend)
    if (fallback is not None and fallback in BACKENDS
            and importlib.util.find_spec("transformer_engine") is None):
        return BACKENDS[fallback](cfg)
    return BACKENDS[cfg.backend](cfg)
