"""`make gpu-check` (`python -m solrl.gpu_check --out DIR`): what one GPU host does with the real denoisers.

One script, no network, within `--budget-s` seconds (`make gpu-check BUDGET=...`, default 400) on one H100 / H200,
writing OUT/gpu_check.json and OUT/gpu_check.md. Sections, each under its share of the budget, a hard limit (SIGALRM
at its share plus HARD_EXTRA_S; past that, stuck in C, faulthandler dumps the stacks and ends the process) and its
own try/except (an error is recorded in the json and the next section runs); both files are rewritten atomically
after every row of every section, so a run cut short keeps what it measured. The sections need only torch (and
diffusers to build a denoiser): a backend, LoRA or service whose package is missing is recorded where it is used.

- preflight: versions, the GPU, which optional imports fail, whether torch.compile (Inductor) and a Triton kernel
  run; printed line by line;
- environment: torch, CUDA, cuDNN, Transformer Engine and torchao (where installed), the GPU and its compute
  capability, the scaled-dot-product-attention backends that run a BF16 call, the precision backends runnable here
  and those whose module could not be imported (with its ImportError);
- gemm: BF16 matmul against torch._scaled_mm (E4M3, fast accumulation off and on) and the torchao explorer's Linear
  at each model's Linear shapes, timed with CUDA events (GPU only);
- explore: SD3.5-Large, FLUX.1-dev and SANA-1.5 1.6B denoisers built from their configs
  (solrl.models.architectures) with random weights directly on the GPU; one forward at the presets' explore
  micro-batch and resolution in BF16 and in each low-precision backend that runs here (found through the registry),
  eager and with the repeated blocks compiled (no compiled Transformer Engine row), with the presets' layer policy:
  time and peak memory, the GEMM kernels of one profiled forward per low-precision row (invalid on a GPU when none of
  its format ran), the measured speed-up over BF16 beside `solrl plan`'s estimate and the bound;
- reload: a preset-size LoRA (rank 32 on the family's targets) pushed into the explorer's served copy
  (services' HotSwapModel, else the same merge and the backend's re-quantization), as a share of one explore call;
- update: after one untimed warm-up, one LoRA update (forward, backward, AdamW step) on 1 and 2 rows, with and
  without gradient checkpointing: peak memory and memory per row, beside the planner's activation model;
- services: one epoch of the shapes preset through `solrl up` (reward, explorer, regenerator, trainer as processes)
  with model.device set to this device; skipped at once, naming what is missing, without the services' packages,
  matching generated stubs or a Redis (SOLRL_REDIS_URL, a `redis-server` on PATH, or one at 127.0.0.1:6379).

`--dry-run` runs the same code on the CPU with tiny configs of the same diffusers classes (a few layers, width 64),
one repeat, the emulated backends (`fp8-e4m3-emu`, `nvfp4-emu`) standing in for the kernels and torch.compile with
its "eager" backend (tracing only), plus one BF16 row compiled with Inductor where a C++ compiler is found; the json
names the backend that ran and what it stands in for. tests/gpu_check/test_gpu_check.py runs it inside
`make test-slow` (and CI), so the GPU path cannot rot. solrl/gpu_kit.py carries the packages the lent GPU image lacks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import gc
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MODELS = ("sd3.5-large", "flux1-dev", "sana1.5-1.6b")
PRESETS = {"sd3.5-large": "sd35l-sol-rl", "flux1-dev": "flux1-sol-rl", "sana1.5-1.6b": "sana-sol-rl"}
# the CPU stand-ins of the kernels (the dry run): emulation -> the kernel it stands in for
STAND_INS = {"fp8-e4m3-emu": "fp8", "nvfp4-emu": "nvfp4"}
ROOT = Path(__file__).resolve().parents[1]

# Tiny configs of the same classes for the dry run (width 64, two blocks; FLUX's rope axes sum to its head dim).
TINY: dict[str, dict[str, Any]] = {
    "sd3.5-large": {"sample_size": 16, "num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
                    "joint_attention_dim": 64, "caption_projection_dim": 64, "pooled_projection_dim": 32,
                    "pos_embed_max_size": 32},
    "flux1-dev": {"num_layers": 1, "num_single_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
                  "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": (8, 12, 12)},
    "sana1.5-1.6b": {"sample_size": 8, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 32,
                     "num_cross_attention_heads": 2, "cross_attention_head_dim": 32, "cross_attention_dim": 64,
                     "caption_channels": 64},
}
TINY_TOKENS_SIDE, TINY_TEXT, TINY_MIN_FEATURES = 8, 8, 64


# -------------------------------------------------------------------- helpers

class Budget:
    """Seconds left of the whole run and of one section."""

    def __init__(self, total_s: float) -> None:
        self.t0, self.total_s = time.monotonic(), float(total_s)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.t0)

    def section(self, share_s: float) -> float:
        """A deadline (monotonic) for a section: `share_s` seconds, never past the run's end."""
        return time.monotonic() + max(0.0, min(share_s, self.left()))


class SectionTimeout(BaseException):
    """Raised by SIGALRM at a section's hard limit. A BaseException, so no `except Exception` (ours, dynamo's or a
    backend's) swallows it: the row in progress is recorded as stopped and the section ends there."""


@contextlib.contextmanager
def hard_limit(seconds: float, grace_s: float):
    """A section's hard stop: SIGALRM raises SectionTimeout after `seconds` (Python code, an Inductor compile
    included, is interrupted between bytecodes); where the process is stuck in C past `seconds + grace_s` (a kernel,
    a lock), faulthandler dumps every thread's stack to stderr and exits the process (what was measured is already
    on disk: the files are written after every row). Yields how the limit is enforced."""
    seconds = max(1.0, seconds)
    faulthandler.dump_traceback_later(seconds + grace_s, exit=True)
    try:
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
    except ValueError:   # not the main thread: the soft deadlines and faulthandler only
        previous = None
    if previous is not None:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield "alarm+faulthandler" if previous is not None else "faulthandler"
    finally:
        if previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()


def _raise_timeout(signum: int, frame: Any) -> None:
    raise SectionTimeout("the section's hard time limit")


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if cuda():
        torch.cuda.empty_cache()


def reset_peak() -> int:
    """Reset the peak statistic; returns the bytes allocated now (0 on the CPU, which torch does not count)."""
    if not cuda():
        return 0
    sync()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib() -> float | None:
    """Peak bytes allocated since `reset_peak`, in GiB (None on the CPU)."""
    if not cuda():
        return None
    sync()
    return torch.cuda.max_memory_allocated() / 2**30


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:600]}"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_kind() -> str:
    """The planner's GPU kind nearest this device (h100 when there is none: the dry run's reference)."""
    name = torch.cuda.get_device_name(0).lower() if cuda() else ""
    return "b200" if "b200" in name else "h200" if "h200" in name else "h100"


# -------------------------------------------------------------------- environment

SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sdpa_backends(device: torch.device) -> dict[str, Any]:
    """Which scaled-dot-product-attention backends run one BF16 call here (each alone under sdpa_kernel), and
    torch's global enable flags."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(2, 4, 256, 64, device=device, dtype=dtype)
    runs = {}
    for name in SDPA:
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            runs[name.lower()] = "absent"
            continue
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
            runs[name.lower()] = "runs"
        except RuntimeError as err:
            runs[name.lower()] = f"does not run: {str(err).splitlines()[0][:100]}"
    flags = {}
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled"):
        fn = getattr(torch.backends.cuda, flag, None)
        flags[flag] = bool(fn()) if fn is not None else None
    # the one torch picks for this call: the first that runs in torch's priority order (flash, efficient, cudnn)
    chosen = next((n for n in ("flash_attention", "efficient_attention", "cudnn_attention", "math")
                   if runs.get(n) == "runs"), None) if device.type == "cuda" else "math (CPU)"
    return {"runs_bf16": runs, "enabled": flags, "likely_choice": chosen}


# the distributions the check reports (what the GPU image has, what the kit adds: solrl/gpu_kit.py)
VERSIONS = ("torch", "triton", "diffusers", "torchao", "peft", "transformers", "safetensors", "huggingface-hub",
            "numpy", "grpcio", "protobuf", "redis", "transformer-engine")


def c_compiler() -> str | None:
    """The C++ compiler Inductor's CPU backend would use, if any."""
    return next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def try_compile(device: torch.device) -> dict[str, Any]:
    """Whether torch.compile with Inductor compiles and runs a tiny function here (on the CPU: only with a C++
    compiler), its seconds and whether the result matches eager."""
    if device.type == "cpu" and c_compiler() is None:
        return {"works": None, "why": "no C++ compiler for Inductor's CPU code: not tried"}
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        fn = torch.compile(lambda x: torch.nn.functional.gelu(x @ x.T) + 1.0, backend="inductor")
        x = torch.randn(64, 64, device=device)
        ok = torch.allclose(fn(x), torch.nn.functional.gelu(x @ x.T) + 1.0, atol=1e-3, rtol=1e-3)
        sync()
        return {"works": bool(ok), "seconds": time.perf_counter() - t0}
    except Exception as err:
        return {"works": False, "seconds": time.perf_counter() - t0, "error": error_text(err)}
    finally:
        torch._dynamo.reset()


def try_triton() -> dict[str, Any]:
    """Whether a hand-written Triton kernel compiles and runs on this GPU."""
    if not cuda():
        return {"works": None, "why": "no CUDA device: not tried"}
    t0 = time.perf_counter()
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

        x = torch.zeros(1000, device="cuda")
        add_one[(triton.cdiv(1000, 256),)](x, 1000, BLOCK=256)
        sync()
        return {"works": bool((x == 1).all()), "seconds": time.perf_counter() - t0}
    except Exception as err:
        return {"works": False, "seconds": time.perf_counter() - t0, "error": error_text(err)}


def preflight(device: torch.device, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The run's first seconds: versions, the GPU, whether torch.compile (Inductor) and Triton work, and which
    optional imports fail; each line printed as soon as it is known. Needs only torch."""
    out: dict[str, Any] = {"python": sys.version.split()[0], "executable": sys.executable,
                           "versions": {d: version(d) for d in VERSIONS}}
    echo(f"preflight: python {out['python']} ({sys.executable})")
    echo("preflight: " + ", ".join(f"{d} {v or '-'}" for d, v in out["versions"].items()))
    if cuda():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
                      "cuda": torch.version.cuda}
    else:
        out["gpu"] = None
    echo(f"preflight: gpu {out['gpu']}")
    out["imports"] = {}
    # torchao logs (solrl/__init__.py quiets it) each compiled extension it cannot load, as with a torchao built
    # for another torch: caught here
    caught: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: caught.append(record.getMessage()[:300])   # type: ignore[method-assign]
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level
    torchao_log.addHandler(handler)
    torchao_log.setLevel(logging.WARNING)
    try:
        for mod in ("diffusers", "torchao", "peft.functional", "transformer_engine", "redis", "grpc"):
            if importlib.util.find_spec(mod.split(".")[0]) is None:
                out["imports"][mod] = "not installed"
                continue
            try:
                importlib.import_module(mod)
                out["imports"][mod] = "ok"
            except Exception as err:   # installed but broken (built for another torch, too old)
                out["imports"][mod] = error_text(err)
    finally:
        torchao_log.removeHandler(handler)
        torchao_log.setLevel(level)
    out["torchao_load_warnings"] = caught
    echo("preflight: imports " + ", ".join(f"{k}: {v}" for k, v in out["imports"].items()))
    if caught:
        echo(f"preflight: torchao could not load: {caught}")
    out["torch_compile"] = try_compile(device)
    echo(f"preflight: torch.compile (inductor) {out['torch_compile']}")
    out["triton"] = try_triton()
    echo(f"preflight: triton {out['triton']}")
    return out


def environment(device: torch.device) -> dict[str, Any]:
    """torch, CUDA, the GPU, SDPA (torch only); the precision backends registered and runnable here, and those whose
    module could not be imported (with its ImportError), recorded without failing the section."""
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "transformer_engine": version("transformer_engine") or version("transformer-engine")
        if importlib.util.find_spec("transformer_engine") else None,
        "torchao": version("torchao"), "diffusers": version("diffusers"), "peft": version("peft"),
        "device": str(device), "gpu": torch.cuda.get_device_name(0) if cuda() else None,
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda() else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda() else None,
    }
    env["sdpa"] = sdpa_backends(device)
    try:
        from solrl.precision import runnable_backends, unavailable_backends

        env["runnable_precision_backends"] = runnable_backends()
        env["unavailable_precision_backends"] = unavailable_backends()
    except Exception as err:
        env["runnable_precision_backends"] = []
        env["precision_error"] = error_text(err)
    return env


# -------------------------------------------------------------------- the denoisers

@dataclasses.dataclass
class Setup:
    """How a model is built and fed: full size on the GPU, tiny on the CPU."""

    tiny: bool
    device: torch.device
    dtype: torch.dtype
    micro_batch: int
    repeats: int
    compile_backend: str        # torch.compile backend: inductor on the GPU, eager (tracing only) on the CPU


def model_config(name: str, tiny: bool) -> tuple[str, dict[str, Any]]:
    from solrl.models.architectures import ARCHITECTURES

    arch = ARCHITECTURES[name]
    return arch.cls, {**arch.config, **(TINY[name] if tiny else {})}


def build_denoiser(name: str, setup: Setup, seed: int = 0) -> torch.nn.Module:
    """The named denoiser from its config with random weights, built directly on the device in its dtype."""
    import diffusers

    cls, cfg = model_config(name, setup.tiny)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(setup.dtype)
    try:
        with torch.device(setup.device):
            module = getattr(diffusers, cls)(**cfg)
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


def shape(name: str, tiny: bool) -> tuple[int, int]:
    """(latent tokens per side, text tokens) of one sample at the preset's resolution and text length."""
    if tiny:
        return TINY_TOKENS_SIDE, TINY_TEXT
    from solrl.deploy.flops import PIXELS_PER_TOKEN, text_tokens
    from solrl.models.diffusers_t2i import FAMILIES

    return FAMILIES[name].resolution // PIXELS_PER_TOKEN[name], text_tokens(name)


def inputs(name: str, setup: Setup, batch: int) -> dict[str, torch.Tensor]:
    """Forward kwargs of `batch` samples (random latents and text states; a mid-schedule timestep)."""
    cls, c = model_config(name, setup.tiny)
    side, text = shape(name, setup.tiny)
    g = torch.Generator(device="cpu").manual_seed(1)

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(setup.device, setup.dtype)

    t = torch.full((batch,), 0.5, device=setup.device)
    if cls == "FluxTransformer2DModel":
        return {"hidden_states": rand(batch, side * side, c["in_channels"]),
                "encoder_hidden_states": rand(batch, text, c["joint_attention_dim"]),
                "pooled_projections": rand(batch, c["pooled_projection_dim"]), "timestep": t,
                "img_ids": torch.zeros(side * side, 3, device=setup.device), "txt_ids":
                torch.zeros(text, 3, device=setup.device), "guidance": torch.full((batch,), 3.5, device=setup.device),
                "return_dict": False}
    p = c["patch_size"]
    out = {"hidden_states": rand(batch, c["in_channels"], side * p, side * p), "timestep": t * 1000.0,
           "return_dict": False}
    if cls == "SD3Transformer2DModel":
        out.update(encoder_hidden_states=rand(batch, text, c["joint_attention_dim"]),
                   pooled_projections=rand(batch, c["pooled_projection_dim"]))
    else:   # SanaTransformer2DModel
        out["encoder_hidden_states"] = rand(batch, text, c["caption_channels"])
    return out


def explore_precision(name: str, backend: str, tiny: bool):
    """The preset's explorer precision (its layer policy: the model's skip list and size threshold) with `backend`.
    Tiny: the threshold scaled to the tiny widths (64) so some layers are selected."""
    from solrl.config import get_preset
    from solrl.models.diffusers_t2i import FAMILIES
    from solrl.precision.base import with_model_skips

    fam = FAMILIES[name]
    pc = dataclasses.replace(get_preset(PRESETS[name]).rollout.explore_precision, backend=backend)
    return with_model_skips(pc, fam.quant_skip, TINY_MIN_FEATURES if tiny else fam.quant_min_features)


def is_kernel_backend(name: str) -> bool:
    """Whether registered backend `name` computes FP8 or FP4 with real kernels (not an emulation)."""
    from solrl.hardware import precision_format
    from solrl.precision import BACKENDS

    return (precision_format(name) in ("fp8", "fp4") and BACKENDS[name].emulates is None
            and not name.endswith("-emu"))


def lowp_backends(device: torch.device) -> list[dict[str, str]]:
    """The low-precision backends to measure: on a GPU every registered backend that runs here and computes FP8 or
    FP4 with real kernels (not an emulation), found through the registry so a new one is picked up; on the CPU
    the emulations standing in for FP8 and NVFP4."""
    from solrl.hardware import precision_format
    from solrl.precision import PrecisionConfig, available_backends, build_backend, runnable_backends

    if device.type != "cuda":
        return [{"backend": b, "stands_in_for": k, "format": precision_format(k)} for b, k in STAND_INS.items()]
    available_backends()   # loads the registry
    runnable = runnable_backends()
    out = []
    for b in runnable:
        if not is_kernel_backend(b):
            continue
        # a name the registry builds as another backend here (fp8 without Transformer Engine): measured once
        built = getattr(build_backend(PrecisionConfig(b)), "name", b)
        if built != b and built in runnable:
            continue
        out.append({"backend": b, "stands_in_for": None, "format": precision_format(b),
                    **({"built_as": built} if built != b else {})})
    return out


def kernels_not_run() -> dict[str, str]:
    """The registered FP8 / FP4 kernel backends (not emulations) that cannot run here, and why."""
    from solrl.precision import PrecisionConfig, available_backends, build_backend

    out = {}
    for b in available_backends():
        if not is_kernel_backend(b):
            continue
        try:
            getattr(build_backend(PrecisionConfig(b)), "check_environment", lambda: None)()
        except RuntimeError as err:
            out[b] = str(err)
    return out


def compile_blocks(module: torch.nn.Module, backend: str) -> int:
    """Regional compilation, as diffusers' `compile_repeated_blocks`: compile each repeated transformer block in place
    (the classes the model's `_repeated_blocks` names, else every block of its `*transformer_blocks` ModuleLists)
    instead of the whole model; blocks of one class share one compiled graph, so a 38-57-block model compiles about
    one block per class. Returns the number of blocks compiled."""
    names = set(getattr(module, "_repeated_blocks", None) or ())
    if names:
        blocks = [m for m in module.modules() if type(m).__name__ in names]
    else:
        blocks = [b for n, c in module.named_children() if n.endswith("transformer_blocks")
                  and isinstance(c, torch.nn.ModuleList) for b in c]
    if not blocks:
        raise ValueError(f"{type(module).__name__}: no repeated blocks to compile")
    for block in blocks:
        block.compile(backend=backend)
    return len(blocks)


def uses_transformer_engine(backend: Any) -> bool:
    """Whether a built backend computes through Transformer Engine's modules (excluded from dynamo: not compiled)."""
    return type(backend).__module__.endswith("precision.transformer_engine")


# GEMM kernels by name. A kernel is a GEMM when its name holds one of GEMM_TOKENS; an FP8 (FP4) GEMM when it also
# holds an FP8 (FP4) token: cuBLAS / CUTLASS names spell the input types (`e4m3`, `e5m2`, `f8`, `e2m1`); an
# Inductor-generated Triton GEMM names its template (`triton_tem_fused_mm`, `_scaled_mm`). Not yet read off a GPU.
GEMM_TOKENS = ("gemm", "xmma", "cutlass", "nvjet", "_mm", "matmul", "scaled_mm", "wgmma", "sgemm", "hgemm")
FP8_TOKENS = ("e4m3", "e5m2", "fp8", "f8f8", "float8", "scaled_mm", "_f8_")
FP4_TOKENS = ("e2m1", "fp4", "nvf4", "mxf4", "block_scaled")


def kernel_class(name: str) -> str | None:
    """'fp4', 'fp8' or 'gemm' for a GEMM kernel's name (the input format it shows), None for any other kernel."""
    n = name.lower()
    if not any(t in n for t in GEMM_TOKENS) and not re.search(r"\bmm\b|addmm|bmm", n):
        return None
    if any(t in n for t in FP4_TOKENS):
        return "fp4"
    if any(t in n for t in FP8_TOKENS):
        return "fp8"
    return "gemm"


def profile_gemms(call: Callable[[], Any], fmt: str) -> dict[str, Any]:
    """One forward under torch.profiler: the GEMM kernels that ran (CUDA kernel names on a GPU; the CPU's aten
    matmul ops on the CPU) and the aten ops that call them. On a GPU the row is `valid` when a GEMM kernel whose name
    shows its format (`fmt`: fp8 / fp4) ran, invalid when none did and no `aten::_scaled_mm` was called either, and
    undecided (None, saying why) when `aten::_scaled_mm` ran under kernel names the rules do not read as FP8; on the
    CPU no kernel of the format exists (an emulation stands in) and `valid` is None."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda() else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        call()
        sync()
    kernels: dict[str, int] = {}
    ops: dict[str, int] = {}
    for evt in prof.events():
        on_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        if on_device:
            kernels[evt.name] = kernels.get(evt.name, 0) + 1
        elif evt.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "aten::linear",
                          "aten::matmul", "aten::baddbmm"):
            ops[evt.name] = ops.get(evt.name, 0) + 1
    return gemm_verdict(kernels, ops, fmt, on_gpu=cuda())


def gemm_verdict(kernels: dict[str, int], ops: dict[str, int], fmt: str, on_gpu: bool) -> dict[str, Any]:
    """profile_gemms' record and verdict from the kernel names (name -> calls) and aten op counts of one forward."""
    gemms = {k: {"calls": v, "class": kernel_class(k)} for k, v in kernels.items() if kernel_class(k)}
    out: dict[str, Any] = {"gemm_kernels": gemms, "aten_ops": ops,
                           "format_kernels": sum(v["calls"] for v in gemms.values() if v["class"] == fmt)}
    if on_gpu:
        out["valid"] = out["format_kernels"] > 0
        if not out["valid"] and ops.get("aten::_scaled_mm") and fmt == "fp8":
            out["valid"] = None
            out["why_invalid"] = ("aten::_scaled_mm ran, but no kernel name shows FP8 to the rules (FP8_TOKENS): "
                                  "read gemm_kernels")
        elif not out["valid"]:
            out["why_invalid"] = f"no {fmt.upper()} GEMM kernel ran in one profiled forward"
    else:
        out["valid"], out["why_invalid"] = None, "CPU: an emulation stands in; no kernel of the format exists here"
    return out


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """(seconds of the first call, seconds of each of `repeats` calls after it)."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return first, times


def plan_numbers(name: str, fmt: str, kind: str) -> dict[str, Any]:
    """`solrl plan`'s estimate of the explorer's forward speed-up over BF16 on GPU `kind` (the preset's policy),
    and the bound where every Linear ran at the format's rate."""
    from solrl.config import get_preset
    from solrl.deploy.facts import _facts
    from solrl.deploy.recipe import recipe_from_config
    from solrl.hardware import GPUS

    gpu = GPUS[kind]
    cfg = get_preset(PRESETS[name])
    cfg.rollout.explore_precision = dataclasses.replace(cfg.rollout.explore_precision,
                                                        backend={"fp8": "fp8", "fp4": "nvfp4"}[fmt])
    _, pc = recipe_from_config(cfg, PRESETS[name], gpu)
    facts = _facts(cfg, pc)
    flops, linear = facts.forward.flops, 2.0 * facts.forward.linear_macs
    bf16 = gpu.tflops["bf16"]
    rate = gpu.tflops.get(fmt)
    out = {"gpu_kind": kind, "linear_share": linear / flops, "quantized_share": facts.quantized_share,
           "estimate": None, "bound": None}
    k = (rate or bf16) / bf16
    out["bound_at_rate"] = {"fp8": 2.0, "fp4": 4.0}[fmt]
    out["bound"] = 1.0 / ((1 - linear / flops) + linear / flops / out["bound_at_rate"])
    if rate:
        q = facts.quantized_share
        out["estimate"] = 1.0 / ((1 - q) + q / k)
    else:
        out["note"] = f"{gpu.name} has no {fmt.upper()} kernels in the planner"
    return out


# -------------------------------------------------------------------- sections

def explore_one(name: str, entry: dict[str, Any], compiled: bool, setup: Setup,
                compile_backend: str | None = None) -> dict[str, Any]:
    """Build, prepare through the backend, and time one explore forward (eager, or its repeated blocks compiled);
    a low-precision row then runs one profiled forward recording the GEMM kernels that ran."""
    from solrl.precision import build_backend

    free_memory()
    module = build_denoiser(name, setup)
    backend = build_backend(explore_precision(name, entry["backend"], setup.tiny))
    compile_backend = compile_backend or setup.compile_backend
    if compiled and uses_transformer_engine(backend):
        module = None
        return {"backend": entry["backend"], "stands_in_for": entry["stands_in_for"], "compiled": compiled,
                "skipped": "Transformer Engine's modules are excluded from dynamo (a graph break per layer): "
                           "no compiled TE row"}
    backend.prepare(module)
    kwargs = inputs(name, setup, setup.micro_batch)
    blocks = 0
    if compiled:
        torch._dynamo.reset()
        blocks = compile_blocks(module, compile_backend)
    call = functools.partial(module, **kwargs)
    base = reset_peak()
    try:
        with torch.no_grad():
            first, times = timed(call, setup.repeats)
        peak = peak_gib()
        out = {"backend": entry["backend"], "stands_in_for": entry["stands_in_for"], "compiled": compiled,
               "quantized_layers": len(backend.quantized_names), "micro_batch": setup.micro_batch,
               "first_call_s": first, "forward_s": min(times), "times_s": times,
               "peak_gib": peak, "weights_gib": base / 2**30 if cuda() else None,
               "weight_bytes": backend.weight_bytes(module)["total"], "built_as": getattr(backend, "name", None)}
        if compiled:
            out.update(compile_backend=compile_backend, compiled_blocks=blocks, compile="repeated blocks")
        if entry["backend"] != "bf16":
            out["kernels"] = profile_gemms(call, entry.get("format") or entry["backend"])
            if out["kernels"]["valid"] is False:
                out["invalid"] = out["kernels"]["why_invalid"]
    finally:
        call = module = kwargs = None
        if compiled:
            torch._dynamo.reset()
        free_memory()
    return out


COMPILE_MIN_S = 30.0   # seconds a compiled configuration needs left to start (GPU)
EAGER_SHARE = 0.35     # of the explore section, for the eager pass


def compiled_order(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The compiled pass's order within a model: BF16, then FP8, then the rest, so the compiled FP8 row follows the
    compiled BF16 row it is compared with."""
    return sorted(entries, key=lambda e: (e["backend"] != "bf16", e.get("format") != "fp8"))


def explore_section(setup: Setup, budget: Budget, share_s: float, models: tuple[str, ...],
                    save: Callable[[], None] = lambda: None, result: dict[str, Any] | None = None,
                    inductor_row: bool = False) -> dict[str, Any]:
    """BF16 and each low-precision backend per model: first every model eager (EAGER_SHARE of the section, each model
    an equal part of what is left when it starts), then every model with its repeated blocks compiled (the rest,
    shared the same way; a model's compiled FP8 row, after its compiled BF16 one, may run on to the section's end),
    so a slow compile never costs another model its eager numbers. Rows are added to `result`
    in place and `save()` runs after each, so a run stopped mid-section keeps what it measured. `inductor_row`: the
    dry run's extra row, the first model's BF16 forward compiled with Inductor (not the eager backend)."""
    deadline = budget.section(share_s)
    result = {} if result is None else result
    lowp = lowp_backends(setup.device)
    kind = gpu_kind()
    result.update({"low_precision_backends": lowp, "kernels_not_run": kernels_not_run(),
                   "plan_gpu_kind": kind, "models": {}})
    entries = [{"backend": "bf16", "stands_in_for": None, "format": "bf16"}, *lowp]
    for name in models:
        side, text = shape(name, setup.tiny)
        result["models"][name] = {"preset": PRESETS[name], "tiny": setup.tiny,
                                  "config": model_config(name, setup.tiny)[1],
                                  "tokens": {"image": side * side, "text": text}, "runs": []}
    save()
    eager_end = time.monotonic() + EAGER_SHARE * max(0.0, deadline - time.monotonic())
    for compiled, pass_end in ((False, eager_end), (True, deadline)):
        for i, name in enumerate(models):
            model_deadline = time.monotonic() + max(0.0, (pass_end - time.monotonic()) / (len(models) - i))
            rows = result["models"][name]["runs"]
            todo = [(e, None) for e in (compiled_order(entries) if compiled else entries)]
            if compiled and inductor_row and i == 0 and setup.compile_backend != "inductor":
                todo.append((entries[0], "inductor"))
            for entry, compile_backend in todo:
                # a compile is not interrupted by the soft deadline: start one only with COMPILE_MIN_S left (GPU)
                need = COMPILE_MIN_S if compiled and setup.device.type == "cuda" else 0.0
                head = {"backend": entry["backend"], "stands_in_for": entry["stands_in_for"], "compiled": compiled,
                        **({"compile_backend": compile_backend, "rehearsal": "Inductor on the CPU"}
                           if compile_backend else {})}
                # the compiled FP8 row right after its model's compiled BF16 row may run on to the section's
                # deadline: the pair is what the speed-up needs
                paired = compiled and entry.get("format") == "fp8" and any(
                    r["compiled"] and r["backend"] == "bf16" and "forward_s" in r for r in rows)
                if time.monotonic() + need >= (deadline if paired else model_deadline):
                    rows.append({**head, "skipped": "section time spent"})
                    continue
                try:
                    rows.append({**explore_one(name, entry, compiled, setup, compile_backend),
                                 **({"rehearsal": head["rehearsal"]} if compile_backend else {})})
                except SectionTimeout:
                    rows.append({**head, "error": "stopped at the section's hard time limit"})
                    raise
                except Exception as err:   # recorded; the next configuration runs
                    rows.append({**head, "error": error_text(err)})
                    free_memory()
                finally:
                    save()
    speedups(result, lowp, kind)
    return result


def speedups(result: dict[str, Any], lowp: list[dict[str, Any]], kind: str) -> None:
    """Each model's measured speed-ups over BF16 (same compile mode) beside the plan's estimate and the bound."""
    for name, r in result["models"].items():
        rows = [row for row in r["runs"] if not row.get("rehearsal")]
        bf16 = {row["compiled"]: row["forward_s"] for row in rows if row["backend"] == "bf16" and "forward_s" in row}
        ratios = []
        for row in rows:
            entry = next((e for e in lowp if e["backend"] == row["backend"]), None)
            if entry is None or "forward_s" not in row or row["compiled"] not in bf16:
                continue
            ratio = {"backend": row["backend"], "stands_in_for": entry["stands_in_for"], "compiled": row["compiled"],
                     "measured": bf16[row["compiled"]] / row["forward_s"]}
            try:
                ratio["plan"] = plan_numbers(name, entry["format"], kind)
            except Exception as err:
                ratio["plan"] = {"error": error_text(err)}
            if row.get("invalid"):
                ratio["invalid"] = row["invalid"]
            ratios.append(ratio)
        r["speedups"] = ratios


def reload_section(setup: Setup, budget: Budget, share_s: float, models: tuple[str, ...],
                   explore: dict[str, Any] | None, save: Callable[[], None] = lambda: None,
                   out: dict[str, Any] | None = None) -> dict[str, Any]:
    """A preset-size LoRA pushed into the explorer's served copy (HotSwapModel: merge + re-quantize in place), as
    a share of one explore call of the same backend (eager). Each model's row goes into `out` in place, then
    `save()`."""
    from solrl import plugins
    from solrl.adapters.lora import PREFIX, LoraSpec
    from solrl.adapters.merge import lora_layout, merge_lora, target_weights
    from solrl.adapters.wire import encode_adapter, sha256_hex
    from solrl.config import get_preset
    from solrl.models.diffusers_t2i import FAMILIES
    from solrl.precision import build_backend

    deadline = budget.section(share_s)
    lowp = lowp_backends(setup.device)
    backend = lowp[0]["backend"] if lowp else "bf16"
    out = {} if out is None else out
    out.update({"backend": backend, "models": {}})
    for name in models:
        save()
        if time.monotonic() >= deadline:
            out["models"][name] = {"skipped": "section time spent"}
            continue
        try:
            free_memory()
            lora = get_preset(PRESETS[name]).lora
            spec = LoraSpec(rank=lora.rank, alpha=lora.alpha, target_modules=tuple(FAMILIES[name].lora_targets))
            module = build_denoiser(name, setup)
            layout = lora_layout(module, spec)
            g = torch.Generator().manual_seed(2)
            state = {k: torch.randn(*s, generator=g) * 0.01 for k, s in layout.items()}
            assert all(k.startswith(PREFIX) for k in state)
            precision = explore_precision(name, backend, setup.tiny)
            try:   # the services' served model, by its entry point (solrl/plugins.py): the core does not import them
                HotSwapModel = plugins.load("hot-swap-model")
            except Exception as err:   # the services' dependencies are not installed (or their stubs refuse the
                # installed grpcio): the same merge + requantize
                HotSwapModel, via = None, f"backend.requantize of merge_lora ({error_text(err)})"
            else:
                via = "services.rollout.hot_swap.HotSwapModel.load"
            pushes = []
            kwargs = inputs(name, setup, setup.micro_batch)
            if HotSwapModel is not None:
                served = HotSwapModel(module, spec, precision)
                module = None
                for v in (1, 2):
                    data = encode_adapter(state, v, spec)
                    sync()
                    t0 = time.perf_counter()
                    res = served.load(data, version=v, sha256=sha256_hex(data))
                    sync()
                    pushes.append({"version": res.version, "swap_ms": res.swap_ms,
                                   "wall_ms": (time.perf_counter() - t0) * 1000.0})
                # one explore call on the reloaded copy (the first after a push: the quantized weights are rebuilt)
                with torch.no_grad(), served.serving() as held:
                    first, times = timed(functools.partial(held.module, **kwargs), setup.repeats)
            else:
                originals = {n: w.clone() for n, w in target_weights(module, spec).items()}
                served = build_backend(precision)
                served.prepare(module)
                for v in (1, 2):
                    data = encode_adapter(state, v, spec)
                    sync()
                    t0 = time.perf_counter()
                    served.requantize(module, merge_lora(originals, state, spec))
                    sync()
                    ms = (time.perf_counter() - t0) * 1000.0
                    pushes.append({"version": v, "swap_ms": ms, "wall_ms": ms})
                with torch.no_grad():
                    first, times = timed(functools.partial(module, **kwargs), setup.repeats)
                originals = module = None
            row = {"via": via, "lora_rank": spec.rank, "lora_targets": list(spec.target_modules),
                   "adapter_bytes": len(data), "pushes": pushes, "explore_first_call_s": first,
                   "explore_s": min(times)}
            measured = None
            if explore:
                measured = next((x["forward_s"] for x in explore.get("models", {}).get(name, {}).get("runs", [])
                                 if x.get("backend") == backend and not x.get("compiled") and "forward_s" in x), None)
            row["explore_s_from_explore_section"] = measured
            call_s = measured or row["explore_s"]
            row["share_of_explore_call"] = pushes[-1]["swap_ms"] / 1000.0 / call_s
            # a backend that quantizes lazily (Transformer Engine: on the first call after a load) pays the rest of
            # the re-quantization in that call: what the first call takes beyond a steady one
            row["first_call_extra_s"] = max(0.0, first - min(times))
            row["share_with_first_call"] = (pushes[-1]["swap_ms"] / 1000.0 + row["first_call_extra_s"]) / call_s
            out["models"][name] = row
            served = held = kwargs = None
        except SectionTimeout:
            out["models"][name] = {"error": "stopped at the section's hard time limit"}
            raise
        except Exception as err:
            out["models"][name] = {"error": error_text(err)}
        free_memory()
    save()
    return out


def update_model(name: str, setup: Setup) -> tuple[torch.nn.Module, Any]:
    """The denoiser with the trainer's three LoRA adapters (preset rank and alpha, the family's targets)."""
    from solrl.adapters.lora import LoraAdapters, LoraSpec
    from solrl.config import get_preset
    from solrl.models.diffusers_t2i import FAMILIES

    lora = get_preset(PRESETS[name]).lora
    module = build_denoiser(name, setup)
    adapters = LoraAdapters(module, LoraSpec(rank=lora.rank, alpha=lora.alpha,
                                             target_modules=tuple(FAMILIES[name].lora_targets)), seed=0)
    return module, adapters


def update_once(name: str, module: torch.nn.Module, adapters: Any, setup: Setup, rows: int,
                checkpointing: bool) -> dict[str, Any]:
    """One LoRA update (forward, MSE to a random target, backward, AdamW step) on `rows` rows: time, peak memory."""
    from solrl.engine.update import set_gradient_checkpointing

    free_memory()
    on = set_gradient_checkpointing(module, checkpointing)
    module.train()
    params = adapters.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-4)
    kwargs = inputs(name, setup, rows)
    base = reset_peak()
    try:
        sync()
        t0 = time.perf_counter()
        out = module(**kwargs)[0]
        loss = torch.nn.functional.mse_loss(out.float(), torch.randn_like(out, dtype=torch.float32))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        seconds = time.perf_counter() - t0
        return {"rows": rows, "gradient_checkpointing": on, "requested_checkpointing": checkpointing,
                "update_s": seconds, "peak_gib": peak_gib(), "before_gib": base / 2**30 if cuda() else None,
                "loss": float(loss.detach())}
    finally:
        out = loss = opt = kwargs = None
        module.eval()
        free_memory()


def update_section(setup: Setup, budget: Budget, share_s: float, models: tuple[str, ...],
                   save: Callable[[], None] = lambda: None, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per model: one untimed warm-up update (rows 1, no checkpointing: the first call's allocations and kernel
    selection), then the four timed ones; rows into `out` in place, `save()` after each."""
    from solrl.deploy.flops import denoiser_forward
    from solrl.deploy.memory import ACTIVATION_BYTES_TRAIN, CHECKPOINT_BYTES

    deadline = budget.section(share_s)
    out = {} if out is None else out
    out["models"] = {}
    for name in models:
        runs: list[dict[str, Any]] = []
        r: dict[str, Any] = {"runs": runs}
        out["models"][name] = r
        module = adapters = None
        for checkpointing in (False, True):
            for rows in (1, 2):
                if time.monotonic() >= deadline:
                    runs.append({"rows": rows, "requested_checkpointing": checkpointing,
                                 "skipped": "section time spent"})
                    continue
                try:
                    if module is None:
                        module, adapters = update_model(name, setup)
                        warm = update_once(name, module, adapters, setup, 1, False)
                        r["warmup_s"] = warm["update_s"]
                    runs.append(update_once(name, module, adapters, setup, rows, checkpointing))
                except SectionTimeout:
                    runs.append({"rows": rows, "requested_checkpointing": checkpointing,
                                 "error": "stopped at the section's hard time limit"})
                    raise
                except Exception as err:
                    runs.append({"rows": rows, "requested_checkpointing": checkpointing, "error": error_text(err)})
                    free_memory()
                finally:
                    save()
        module = adapters = None
        free_memory()
        per_row = {}
        for checkpointing in (False, True):
            peaks = {x["rows"]: x.get("peak_gib") for x in runs if x.get("requested_checkpointing") == checkpointing}
            if peaks.get(1) is not None and peaks.get(2) is not None:
                per_row["with" if checkpointing else "without"] = peaks[2] - peaks[1]
        r["memory_per_row_gib"] = per_row or None
        if not setup.tiny:
            f = denoiser_forward(name)
            r["plan_per_row_gib"] = {"without": ACTIVATION_BYTES_TRAIN * f.tokens * f.width * f.blocks / 2**30,
                                     "with": (CHECKPOINT_BYTES * f.tokens * f.width * f.blocks
                                              + ACTIVATION_BYTES_TRAIN * f.tokens * f.width) / 2**30}
    return out


def gemm_shapes(name: str, micro_batch: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of the model's main Linear shapes at the explore micro-batch: the attention projections (width to
    width) and the MLP's two (width to 4 x width and back); M = micro-batch x the tokens through the blocks."""
    from solrl.deploy.flops import denoiser_forward

    f = denoiser_forward(name)
    m = -(-micro_batch * f.tokens // 16) * 16   # rounded up to a multiple of 16 (torch._scaled_mm's rule)
    return [(m, f.width, f.width), (m, f.width, 4 * f.width), (m, 4 * f.width, f.width)]


def cuda_time(fn: Callable[[], Any], warmup: int = 3, repeats: int = 10) -> float:
    """Mean milliseconds of `fn` on the GPU between CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def wall_time(fn: Callable[[], Any], warmup: int = 1, repeats: int = 2) -> float:
    """Mean milliseconds of `fn` by the wall clock (the CPU test of gemm_one's code path)."""
    for _ in range(warmup):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) * 1000.0 / repeats


def gemm_one(m: int, k: int, n: int, device: torch.device | None = None,
             timer: Callable[[Callable[[], Any]], float] = cuda_time) -> dict[str, Any]:
    """One shape: BF16 matmul, torch._scaled_mm (E4M3, per-tensor scales, BF16 out) with fast accumulation off and
    on, and the torchao explorer's whole Linear (its per-call input copy to FP32, activation scale, FP32 output and
    bias, and cast back, around the same GEMM), each timed with CUDA events (`timer`); TFLOP/s, the explorer's
    overhead over the bare GEMM (fast accumulation off, as the explorer runs it), and that Linear's four steps timed
    apart (input copy to FP32, its quantization, the GEMM with FP32 output and bias, the cast back)."""
    dev = device or torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * m * k * n
    out: dict[str, Any] = {"m": m, "k": k, "n": n}
    out["bf16_ms"] = timer(lambda: x @ w.T)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev, dtype=torch.float32)
    for fast in (False, True):
        key = f"scaled_mm_fast_accum_{'on' if fast else 'off'}_ms"
        try:
            out[key] = timer(lambda fast=fast: torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one,
                                                                    out_dtype=torch.bfloat16, use_fast_accum=fast))
        except Exception as err:
            out[key] = None
            out[f"{key}_error"] = error_text(err)
    try:
        from solrl.precision import PrecisionConfig, build_backend

        layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=True, device=dev, dtype=torch.bfloat16))
        backend = build_backend(PrecisionConfig("fp8-torchao"))
        backend.prepare(layer)
        with torch.no_grad():
            out["torchao_linear_ms"] = timer(lambda: layer(x))
        bare = out.get("scaled_mm_fast_accum_off_ms")
        if bare:
            out["torchao_overhead_ms"] = out["torchao_linear_ms"] - bare
    except Exception as err:
        out["torchao_linear_ms"], out["torchao_error"] = None, error_text(err)
    try:   # the explorer's Linear step by step, each part timed alone (runs wherever torchao imports)
        import torch.nn.functional as F

        from solrl.precision.torchao_fp8 import to_float8_tensor

        x32 = x.to(torch.float32).contiguous()
        xq8, wq8 = to_float8_tensor(x32), to_float8_tensor(w.to(torch.float32))
        bias = torch.zeros(n, device=dev, dtype=torch.float32)
        y32 = F.linear(xq8, wq8, bias)
        out["torchao_parts_ms"] = {"input_copy_fp32": timer(lambda: x.to(torch.float32).contiguous()),
                                   "quantize_input": timer(lambda: to_float8_tensor(x32)),
                                   "gemm_fp32_out_and_bias": timer(lambda: F.linear(xq8, wq8, bias)),
                                   "output_cast": timer(lambda: y32.to(torch.bfloat16))}
        x32 = xq8 = wq8 = y32 = None
    except Exception as err:
        out["torchao_parts_error"] = error_text(err)
    for key in [x for x in out if x.endswith("_ms") and isinstance(out[x], float) and "overhead" not in x]:
        out[key.replace("_ms", "_tflops")] = flop / (out[key] * 1e-3) / 1e12
    return out


def gemm_section(setup: Setup, budget: Budget, share_s: float, models: tuple[str, ...],
                 save: Callable[[], None] = lambda: None, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """The GEMM microbenchmark beside the model rows: per model, its Linear shapes at the explore micro-batch
    (gemm_shapes), BF16 against FP8 (gemm_one). GPU only: on the CPU it says so and returns at once."""
    out = {} if out is None else out
    if not cuda() or setup.device.type != "cuda":
        out["skipped"] = "no CUDA device: CUDA events, torch._scaled_mm and FP8 GEMMs need one"
        return out
    deadline = budget.section(share_s)
    out["models"] = {}
    for name in models:
        rows: list[dict[str, Any]] = []
        out["models"][name] = rows
        for m, k, n in gemm_shapes(name, setup.micro_batch):
            if time.monotonic() >= deadline:
                rows.append({"m": m, "k": k, "n": n, "skipped": "section time spent"})
                continue
            try:
                rows.append(gemm_one(m, k, n))
            except SectionTimeout:
                rows.append({"m": m, "k": k, "n": n, "error": "stopped at the section's hard time limit"})
                raise
            except Exception as err:
                rows.append({"m": m, "k": k, "n": n, "error": error_text(err)})
            finally:
                free_memory()
                save()
    return out


def redis_url(stack: contextlib.ExitStack) -> tuple[str | None, str]:
    """A Redis for the services: SOLRL_REDIS_URL, else a `redis-server` started here on a free port (stopped at
    the end), else one at 127.0.0.1:6379; (None, why) when there is none."""
    import redis

    def answers(url: str) -> bool:
        try:
            return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
        except Exception:
            return False

    if os.environ.get("SOLRL_REDIS_URL"):
        return os.environ["SOLRL_REDIS_URL"], "SOLRL_REDIS_URL"
    server = shutil.which("redis-server")
    if server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(lambda: (proc.terminate(), proc.wait(10)))
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(50):
            if answers(url):
                return url, f"redis-server started on port {port}"
            time.sleep(0.1)
    if answers("redis://127.0.0.1:6379/0"):
        return "redis://127.0.0.1:6379/0", "the Redis at 127.0.0.1:6379"
    return None, "no Redis: set SOLRL_REDIS_URL, put redis-server on PATH or run one at 127.0.0.1:6379"


SERVICES_MIN_S = 45.0   # the services' epoch gets at least this long, even when the sections before overran
# what the services (services/, solrl up) import beyond the core: import name -> distribution
SERVICES_IMPORTS = {"redis": "redis", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                    "grpc_reflection": "grpcio-reflection", "google.protobuf": "protobuf", "fastapi": "fastapi",
                    "starlette": "starlette", "uvicorn": "uvicorn", "tritonclient": "tritonclient",
                    "prometheus_client": "prometheus-client", "peft.functional": "peft"}


def services_missing() -> list[str]:
    """Why the services cannot run here (empty when they can): a dependency that is not installed, and generated
    stubs that are absent or were built for a newer grpcio than the one installed (they refuse to load)."""
    why = [f"{dist} ({mod}) not installed" for mod, dist in SERVICES_IMPORTS.items()
           if importlib.util.find_spec(mod.split(".")[0]) is None]
    stubs = sorted((ROOT / "solrl" / "pb").rglob("*_pb2_grpc.py"))
    if not stubs:
        why.append("no generated stubs in solrl/pb (make protos)")
    elif importlib.util.find_spec("grpc") is not None:
        import grpc

        built = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", stubs[0].read_text())
        have = tuple(int(x) for x in re.findall(r"\d+", grpc.__version__)[:3])
        if built and have < tuple(int(x) for x in re.findall(r"\d+", built.group(1))[:3]):
            why.append(f"the stubs were generated for grpcio {built.group(1)}, grpcio {grpc.__version__} is installed")
    return why




def services_section(setup: Setup, budget: Budget, share_s: float, work: Path) -> dict[str, Any]:
    """One epoch of the shapes preset through `solrl up` with model.device set to this device."""
    import uuid

    missing = services_missing()
    if missing:
        return {"skipped": "the services' dependencies: " + "; ".join(missing)}
    # diffusers: imported only once the check passed
    from solrl.shapes.model import ShapesModel

    timeout = max(SERVICES_MIN_S, min(share_s, budget.left()))
    device = "cuda" if setup.device.type == "cuda" else "cpu"
    with contextlib.ExitStack() as stack:
        url, why = redis_url(stack)
        if url is None:
            return {"skipped": why}
        model_dir = work / "shapes-model"
        ShapesModel.random(seed=0, layers=6, heads=4).save(model_dir)
        ns = f"solrl-gpu-check-{uuid.uuid4().hex[:10]}"
        # BF16 roles on the GPU (the epoch checks the services on the device; the explore section measured the
        # low-precision backends), FP32 on the CPU (the bit-for-bit run of tests/deploy/test_up.py)
        explore = base = "bf16" if device == "cuda" else "fp32"
        sets = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2",
                "rollout.explore_steps=2", "rollout.steps=2", "train.micro_batch=4", "eval.prompts=2",
                "eval.seeds_per_prompt=1", "eval.every=0", "eval.steps=2", "tensorboard=false", "lora.rank=4",
                "lora.alpha=8", "epochs=1", f"rollout.precision.backend={base}",
                f"rollout.explore_precision.backend={explore}", f"model.path={model_dir}", f"model.device={device}"]
        cmd = [sys.executable, "-m", "solrl.deploy.up", "--redis-url", url, "--namespace", ns, "--threads", "1",
               "--grace-s", "10", "--out", str(work / "run"), *[a for s in sets for a in ("--set", s)]]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            log, _ = proc.communicate(timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)   # solrl up stops its services, then exits
            try:
                log, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                log, _ = proc.communicate()
            log, rc = (log or "") + f"\n(stopped after {timeout:.0f} s)", None
        finally:
            if proc.poll() is None:   # stopped at the section's hard limit
                proc.kill()
                proc.wait()
            with contextlib.suppress(Exception):
                import redis

                client = redis.Redis.from_url(url)
                keys = list(client.scan_iter(f"{ns}:*"))
                if keys:
                    client.delete(*keys)
        seconds = time.perf_counter() - t0
        metrics = work / "run" / "metrics.jsonl"
        records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        epoch = next((r for r in records if r.get("epoch") == 1), None)
        out = {"redis": why, "device": device, "explore_precision": explore, "returncode": rc, "wall_s": seconds,
               "ok": rc == 0 and "trainer finished" in log, "epochs_recorded": len(records)}
        if epoch:
            out["epoch"] = {k: v for k, v in epoch.items() if isinstance(v, (int, float)) and
                            any(k.startswith(p) for p in ("time_", "rollout.reward_mean", "train.loss", "epoch"))}
        if not out["ok"]:
            out["log_tail"] = log[-3000:]
        return out


def run_section(results: dict[str, Any], key: str, fn: Callable[[dict[str, Any]], dict[str, Any]],
                limit_s: float, save: Callable[[], None]) -> None:
    """Run one section into results[key] (which `fn` fills in place, saving after each row) under a hard limit of
    `limit_s` seconds: its result and seconds, or its error and traceback; a section stopped at its limit keeps its
    rows and says so."""
    t0 = time.monotonic()
    results[key] = {}
    try:
        with hard_limit(limit_s, HARD_GRACE_S) as how:
            results[key]["hard_limit"] = {"seconds": limit_s, "by": how}
            got = fn(results[key])
            if got is not results[key]:
                results[key].update(got)
    except SectionTimeout:
        results[key]["stopped"] = f"at its hard limit of {limit_s:.0f} s"
    except Exception as err:
        results[key].update(error=error_text(err), traceback=traceback.format_exc()[-3000:])
    results[key]["section_s"] = time.monotonic() - t0
    free_memory()
    save()


# -------------------------------------------------------------------- report

def fmt(x: Any, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec) if isinstance(x, (int, float)) else str(x)


def markdown(res: dict[str, Any]) -> str:
    env = res.get("environment", {})
    lines = [f"Mode: {'dry run (CPU, tiny configs, emulated backends)' if res['dry_run'] else 'GPU, full-size denoisers'}"
             f"; {res['elapsed_s']:.0f} s of a {res['budget_s']:.0f} s budget.", ""]
    pf = res.get("preflight", {})
    if pf and "error" not in pf:
        lines += [f"Preflight: {', '.join(f'{d} {v}' for d, v in pf.get('versions', {}).items() if v)}; imports "
                  f"{', '.join(f'{k}: {v}' for k, v in pf.get('imports', {}).items())}; torchao's extensions not "
                  f"loaded: {len(pf.get('torchao_load_warnings') or [])}; torch.compile (inductor) "
                  f"{(pf.get('torch_compile') or {}).get('works')}; triton {(pf.get('triton') or {}).get('works')}", ""]
    for key in SECTIONS:
        if isinstance(res.get(key), dict) and res[key].get("stopped"):
            lines += [f"Section {key} stopped {res[key]['stopped']} (its rows so far are kept).", ""]
    if "error" in env:
        lines += [f"Environment: error {env['error']}", ""]
    else:
        lines += ["## Environment", "", "| item | value |", "|---|---|"]
        for k in ("torch", "cuda", "cudnn", "transformer_engine", "torchao", "diffusers", "peft", "gpu",
                  "compute_capability", "gpu_memory_gib"):
            lines.append(f"| {k} | {fmt(env.get(k), '')} |")
        lines.append(f"| runnable precision backends | {', '.join(env.get('runnable_precision_backends', []))} |")
        for b, why in env.get("unavailable_precision_backends", {}).items():
            lines.append(f"| {b} unavailable | {why[:200]} |")
        sdpa = env.get("sdpa", {})
        lines.append(f"| SDPA (BF16 call) | {', '.join(f'{k}: {v}' for k, v in sdpa.get('runs_bf16', {}).items())};"
                     f" likely {sdpa.get('likely_choice')} |")
        lines.append("")
    gm = res.get("gemm", {})
    lines += ["## GEMM microbenchmark (CUDA events)", ""]
    if gm.get("skipped") or gm.get("error"):
        lines += [str(gm.get("skipped") or gm.get("error")), ""]
    else:
        lines += ["| model | M x K x N | BF16 TFLOP/s | FP8 _scaled_mm TFLOP/s (fast acc. off / on) | torchao Linear "
                  "TFLOP/s | its overhead ms | its steps ms (copy / quantize / GEMM / cast) |",
                  "|---|---|---|---|---|---|---|"]
        for name, rows in gm.get("models", {}).items():
            for x in rows:
                parts = " / ".join(fmt(v) for v in (x.get("torchao_parts_ms") or {}).values()) or "-"
                lines.append(f"| {name} | {x['m']} x {x['k']} x {x['n']} | {fmt(x.get('bf16_tflops'))} | "
                             f"{fmt(x.get('scaled_mm_fast_accum_off_tflops'))} / "
                             f"{fmt(x.get('scaled_mm_fast_accum_on_tflops'))} | {fmt(x.get('torchao_linear_tflops'))} | "
                             f"{fmt(x.get('torchao_overhead_ms'))} | {parts} |" if "bf16_ms" in x else
                             f"| {name} | {x['m']} x {x['k']} x {x['n']} | {x.get('error') or x.get('skipped')} | | | | |")
        lines.append("")
    ex = res.get("explore", {})
    lines += ["## Explore forward", ""]
    if "error" in ex:
        lines += [f"error: {ex['error']}", ""]
    for b, why in ex.get("kernels_not_run", {}).items():
        lines.append(f"- not run here: {b} ({why})")
    if ex.get("kernels_not_run"):
        lines.append("")
    for name, r in ex.get("models", {}).items():
        lines += [f"### {name} ({r['preset']}: micro-batch {res['micro_batch']}, {r['tokens']['image']} image + "
                  f"{r['tokens']['text']} text tokens{', tiny config' if r['tiny'] else ''})", "",
                  "| backend | stands in for | compiled | layers quantized | first call s | forward s | peak GiB |"
                  " GEMM kernels of the format |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in r["runs"]:
            compiled = f"{row['compiled']}{' (' + row['compile_backend'] + ')' if row.get('compile_backend') else ''}"
            if "forward_s" in row:
                k = row.get("kernels") or {}
                kern = "-" if not k else f"{k['format_kernels']}{' INVALID' if row.get('invalid') else ''}"
                lines.append(f"| {row['backend']} | {fmt(row.get('stands_in_for'))} | {compiled} | "
                             f"{row['quantized_layers']} | {fmt(row['first_call_s'])} | {fmt(row['forward_s'])} | "
                             f"{fmt(row['peak_gib'])} | {kern} |")
            else:
                lines.append(f"| {row['backend']} | | {compiled} | | | {row.get('error') or row.get('skipped')}"
                             " | | |")
        if r.get("speedups"):
            lines += ["", "| backend | compiled | measured x | plan estimate x | bound x (every Linear) | Linear share |",
                      "|---|---|---|---|---|---|"]
            for s in r["speedups"]:
                p = s["plan"]
                lines.append(f"| {s['backend']} | {s['compiled']} | {s['measured']:.2f} | {fmt(p.get('estimate'), '.2f')}"
                             f" | {fmt(p.get('bound'), '.2f')} | {fmt(p.get('linear_share'), '.1%')} |")
        lines.append("")
    rl = res.get("reload", {})
    lines += ["## Hot reload (merge + re-quantize)", ""]
    if "error" in rl:
        lines += [f"error: {rl['error']}", ""]
    for name, r in rl.get("models", {}).items():
        if "pushes" in r:
            lines.append(f"- {name} ({rl['backend']}, LoRA rank {r['lora_rank']}, {r['adapter_bytes'] / 2**20:.1f} MiB):"
                         f" push {r['pushes'][-1]['swap_ms']:.1f} ms = {r['share_of_explore_call']:.1%} of one explore"
                         f" call; {r['share_with_first_call']:.1%} with the first call's extra time after the push")
        else:
            lines.append(f"- {name}: {r.get('error') or r.get('skipped')}")
    lines.append("")
    up = res.get("update", {})
    lines += ["## One update (LoRA)", "", "| model | checkpointing | rows | update s | peak GiB |", "|---|---|---|---|---|"]
    if "error" in up:
        lines.insert(-3, f"error: {up['error']}")
    for name, r in up.get("models", {}).items():
        for x in r["runs"]:
            peak = x.get("error") or x.get("skipped") or fmt(x.get("peak_gib"))
            lines.append(f"| {name} | {x.get('requested_checkpointing')} | {x['rows']} | {fmt(x.get('update_s'))} | "
                         f"{peak} |")
    for name, r in up.get("models", {}).items():
        if r.get("memory_per_row_gib") or r.get("plan_per_row_gib"):
            lines.append(f"\n{name}: memory per row {json.dumps(r.get('memory_per_row_gib'))} GiB; plan's model "
                         f"{json.dumps(r.get('plan_per_row_gib'))} GiB")
    lines.append("")
    sv = res.get("services", {})
    lines += ["## One shapes epoch through the services", ""]
    if "ok" in sv:
        lines.append(f"{'ok' if sv['ok'] else 'FAILED'}: `solrl up` on {sv['device']} (explorer {sv['explore_precision']},"
                     f" Redis: {sv['redis']}) in {sv['wall_s']:.1f} s")
        if sv.get("epoch"):
            lines.append(f"\nepoch 1: {', '.join(f'{k} {v:.3g}' for k, v in sv['epoch'].items())}")
    else:
        lines.append(str(sv.get("skipped") or sv.get("error")))
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    """The benchmarks' machine description, or a short one with the error where it cannot be made."""
    try:
        from solrl.bench.common import machine

        return machine()
    except Exception as err:
        return {"error": error_text(err), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if cuda() else None}


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a reader (or a run killed
    mid-write) sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(out: Path, res: dict[str, Any], t0: float, machine: dict[str, Any] | None = None) -> None:
    """OUT/gpu_check.json and .md (the benchmarks' layout: bench name, machine, results; a title and machine line),
    each written atomically. The json keeps every number even where the report cannot be formatted."""
    res["elapsed_s"] = time.monotonic() - t0
    try:
        md = markdown(res)
    except Exception as err:
        md = f"The report could not be formatted ({error_text(err)}); gpu_check.json holds every number.\n"
    full = {"bench": "gpu_check", "machine": machine or machine_info(), **res}
    atomic_write(Path(out) / "gpu_check.json", json.dumps(full, indent=2, default=str) + "\n")
    try:
        from solrl.bench.common import machine_line

        line = machine_line(full["machine"])
    except Exception:
        line = str(full["machine"])
    atomic_write(Path(out) / "gpu_check.md", f"# solrl bench gpu_check\n\nMachine: {line}\n\n{md.strip()}\n")


# -------------------------------------------------------------------- main

SECTIONS = ("preflight", "environment", "gemm", "explore", "reload", "update", "services")
# shares of the budget (the explore section takes what the others leave; each model gets an equal part of it)
SHARES = {"gemm": 0.06, "reload": 0.08, "update": 0.15, "services": 0.12}
FIXED_S = {"preflight": 60.0, "environment": 30.0}   # hard limits of the two short sections
HARD_EXTRA_S = 20.0    # a section's hard limit: its share plus this (a compile started just before its deadline)
HARD_GRACE_S = 30.0    # past the hard limit, stuck in C: faulthandler dumps the stacks and ends the process
DEFAULT_BUDGET_S, DRY_RUN_BUDGET_S = 400.0, 240.0


def run(out: Path, *, dry_run: bool, budget_s: float, micro_batch: int | None = None, repeats: int | None = None,
        models: tuple[str, ...] = MODELS, sections: tuple[str, ...] = SECTIONS,
        echo: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict[str, Any]:
    """Every section in order, each under its share of `budget_s` and a hard limit; OUT's files rewritten after
    every row of every section."""
    t0 = time.monotonic()
    budget = Budget(budget_s)
    if not dry_run and not cuda():
        raise SystemExit("gpu-check: no CUDA device here; run with --dry-run for the CPU check")
    device = torch.device("cpu" if dry_run else "cuda")
    if device.type == "cuda":
        from solrl.precision.base import allow_tf32  # torch only (not the registry)

        allow_tf32(device)
    from solrl.config import get_preset

    mb = micro_batch or (2 if dry_run else get_preset(PRESETS[models[0]]).rollout.micro_batch)
    setup = Setup(tiny=dry_run, device=device, dtype=torch.float32 if dry_run else torch.bfloat16, micro_batch=mb,
                  repeats=repeats or (1 if dry_run else 3), compile_backend="eager" if dry_run else "inductor")
    res: dict[str, Any] = {"dry_run": dry_run, "budget_s": budget_s, "micro_batch": mb, "repeats": setup.repeats,
                           "compile_backend": setup.compile_backend, "compile": "repeated blocks",
                           "models": list(models)}
    out = Path(out)
    work = Path(tempfile.mkdtemp(prefix="solrl-gpu-check-"))
    machine = machine_info()

    def save() -> None:
        write(out, res, t0, machine)

    def share(key: str) -> float:
        return SHARES[key] * budget_s

    # what the sections after explore keep of the budget (the services' share only where they can run)
    later = [s for s in ("reload", "update", "services") if s in sections]
    if "services" in later and services_missing():
        later.remove("services")
    rest = sum(SHARES[s] for s in later) * budget_s
    plan: dict[str, tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[], float]]] = {
        "preflight": (lambda r: preflight(device, echo), lambda: FIXED_S["preflight"]),
        "environment": (lambda r: environment(device), lambda: FIXED_S["environment"]),
        "gemm": (lambda r: gemm_section(setup, budget, share("gemm"), models, save, r),
                 lambda: min(share("gemm"), budget.left()) + HARD_EXTRA_S),
        "explore": (lambda r: explore_section(setup, budget, budget.left() - rest, models, save, r,
                                              inductor_row=dry_run and c_compiler() is not None),
                    lambda: max(0.0, budget.left() - rest) + HARD_EXTRA_S),
        "reload": (lambda r: reload_section(setup, budget, share("reload"), models, res.get("explore"), save, r),
                   lambda: min(share("reload"), budget.left()) + HARD_EXTRA_S),
        "update": (lambda r: update_section(setup, budget, share("update"), models, save, r),
                   lambda: min(share("update"), budget.left()) + HARD_EXTRA_S),
        # the services' epoch gets at least SERVICES_MIN_S, and 30 s to stop its processes after that
        "services": (lambda r: services_section(setup, budget, budget.left(), work),
                     lambda: max(SERVICES_MIN_S, min(share("services"), budget.left())) + 30.0 + HARD_EXTRA_S),
    }
    try:
        for key in SECTIONS:
            if key in sections:
                fn, limit = plan[key]
                run_section(res, key, fn, limit(), save)
                echo(f"gpu-check: {key} done in {res[key]['section_s']:.1f} s"
                     f"{' (error)' if 'error' in res[key] else ''}; {budget.left():.0f} s of the budget left")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m solrl.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check",
                   help="directory for gpu_check.json / gpu_check.md (default: $OUT, else runs/gpu-check)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, emulated backends (what make test-slow runs)")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"whole-run time budget (default {DEFAULT_BUDGET_S:.0f}; dry run {DRY_RUN_BUDGET_S:.0f})")
    p.add_argument("--micro-batch", type=int, default=None, help="explore micro-batch (default: the presets', 24)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls after the first (default 3; dry run 1)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    a = p.parse_args(argv)
    models = tuple(m for m in a.models.split(",") if m)
    sections = tuple(s for s in a.sections.split(",") if s)
    bad = [m for m in models if m not in MODELS] + [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"unknown model or section: {bad}")
    budget = a.budget_s or (DRY_RUN_BUDGET_S if a.dry_run else DEFAULT_BUDGET_S)
    res = run(Path(a.out), dry_run=a.dry_run, budget_s=budget, micro_batch=a.micro_batch, repeats=a.repeats,
              models=models, sections=sections)
    print((Path(a.out) / "gpu_check.md").read_text())
    failed = [k for k in SECTIONS if isinstance(res.get(k), dict) and "error" in res[k]]
    print(f"gpu-check: wrote {Path(a.out) / 'gpu_check.json'}; sections with an error: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
