"""The hardware table: each GPU kind's dense peak per format and memory, and what a format costs relative to BF16.

One table, read by the planner (solrl/deploy/), the adaptive proxy's device cost model (solrl/rollout/candidates.py), the
benchmarks' cost axis (solrl/bench/curve.py: the B200 bound) and the GPU check (solrl/gpu_check.py). A leaf: it
imports nothing of solrl, so every layer may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: dict[str, float | None]   # dense peak per format (no sparsity); None: no kernels for it
    hbm_gb: float


GPUS: dict[str, Gpu] = {
    "b200": Gpu("B200", {"bf16": 2250.0, "fp8": 4500.0, "fp4": 9000.0}, 180.0),
    "h100": Gpu("H100 SXM", {"bf16": 989.0, "fp8": 1979.0, "fp4": None}, 80.0),
    "h200": Gpu("H200", {"bf16": 989.0, "fp8": 1979.0, "fp4": None}, 141.0),   # H100's compute, more memory
}
REFERENCE_GPU = "b200"        # the paper's machine: the per-image overhead is fitted there
USABLE_HBM = 0.95             # the rest: CUDA context, allocator fragmentation

# A multiply-accumulate's cost in each format relative to BF16: BF16's dense peak over the format's (the B200's
# ratios exactly; Hopper's FP8 peak is 2.001x its BF16). FP4 1/4, FP8 1/2 of a BF16 forward.
FORMAT_COST = {"bf16": 1.0, "fp8": 0.5, "fp4": 0.25}


def precision_format(backend: str) -> str:
    """The GEMM format a precision backend computes in: fp4, fp8 or bf16."""
    b = backend.lower()
    return "fp4" if "fp4" in b else "fp8" if "fp8" in b else "bf16"


def format_cost(backend: str, gpu: str = REFERENCE_GPU) -> float | None:
    """Cost of a multiply-accumulate in `backend`'s format relative to BF16 on GPU kind `gpu`; None: the format has
    no kernels there (FP4 on Hopper)."""
    fmt = precision_format(backend)
    return FORMAT_COST[fmt] if GPUS[gpu].tflops.get(fmt) else None


def forward_cost(backend: str, quantized_share: float = 1.0, gpu: str = REFERENCE_GPU) -> float | None:
    """Cost of one denoiser forward relative to BF16 on `gpu` (default: the B200 bound). Only the quantized layers'
    share of the forward's multiply-accumulates runs at the low-precision rate; the rest (convolutions, layers kept
    in high precision) costs what it costs in BF16. None: the format has no kernels on `gpu`."""
    rate = format_cost(backend, gpu)
    return None if rate is None else (1.0 - quantized_share) + quantized_share * rate
