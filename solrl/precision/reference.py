"""High-precision backends: `fp32` (the reference), `bf16`, and `bf16-cpu` (torch's native BF16 kernels on a CPU
that has BF16 instructions: the CPU bed's real-kernel explorer)."""

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
from solrl.telemetry.machine import cpu_flags


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
        """Store (`_store`: bf16-round) the parameters and buffers of every module that is not a QuantLinear."""
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, QuantLinear):
                    continue
                for param in module.parameters(recurse=False):
                    if param.is_floating_point():
                        param.data = self._store(param.data)
                for name, buf in module.named_buffers(recurse=False):
                    if buf.is_floating_point():
                        setattr(module, name, self._store(buf))


# The CPU flags (/proc/cpuinfo) of the instructions torch's oneDNN kernels compute BF16 with: AVX512-BF16 (AMD Zen 4+,
# Intel Cooper Lake+) and AMX-BF16 (Intel Sapphire Rapids+). Without either, oneDNN converts BF16 to FP32 around each
# FP32 kernel and a BF16 forward is slower than the FP32 one.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
EMULATED_ON_CPU = ("bf16", "nvfp4-emu", "fp8-e4m3-emu")


def native_bf16_error(flags: frozenset[str]) -> str | None:
    """Why `bf16-cpu` cannot run on a CPU with these flags (None: it can)."""
    if any(f in flags for f in CPU_BF16_FLAGS):
        return None
    has = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "neither AVX-512 nor AVX2"
    return (f"precision backend 'bf16-cpu' needs a CPU with BF16 instructions ({' or '.join(CPU_BF16_FLAGS)} in "
            f"/proc/cpuinfo); this one has {has} without them, where a BF16 forward is slower than FP32. Use an "
            f"emulated backend instead ({', '.join(map(repr, EMULATED_ON_CPU))}: FP32 kernels holding the format's values)")


@register_backend
class Bf16CpuBackend(Bf16Backend):
    """Real BF16 tensors computed by torch's native BF16 CPU kernels (oneDNN convolutions and matmuls, AVX512-BF16 /
    AMX): the bundled UNet's explore forward costs 0.60-0.68x the FP32 one at 16-32 rows on a 2-core AMD EPYC with
    AVX512-BF16 (benchmarks/results/rollout-bf16cpu.md). Every floating parameter and buffer becomes a bfloat16
    tensor; the model's `velocity` casts its inputs to the denoiser's dtype and answers in the caller's. An adapter
    sync copies the merged weights in with a cast (no re-quantization). The CPU must have BF16 instructions
    (`check_environment`, from /proc/cpuinfo); on CUDA use `bf16`, which already keeps real BF16 tensors there."""

    name = "bf16-cpu"
    implements = "bf16"
    cpu_only = True

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16)

    def environment(self) -> str:
        """What on this machine lets it run (for a run's note)."""
        have = sorted(f for f in CPU_BF16_FLAGS if f in cpu_flags())
        return f"BF16 instructions on this CPU: {', '.join(have)}" if have else "no BF16 instructions on this CPU"

    def check_environment(self) -> None:
        """Raise RuntimeError unless this CPU runs BF16 natively."""
        error = native_bf16_error(cpu_flags())
        if error is not None:
            raise RuntimeError(error)

    def prepare(self, model: nn.Module) -> nn.Module:
        """Check the CPU, then cast `model`'s floating tensors to bfloat16 in place."""
        check_module(model)
        elsewhere = {p.device.type for p in model.parameters()} - {"cpu"}
        if elsewhere:
            raise ValueError(f"precision backend 'bf16-cpu' runs on the CPU; the model is on {sorted(elsewhere)} "
                             "(use 'bf16' there: real BF16 tensors on CUDA)")
        self.check_environment()
        return super().prepare(model)
