"""`PrecisionConfig`: which backend and which layers, importable without torch (the config and the CLI use it)."""

from __future__ import annotations

from dataclasses import dataclass

# The built-in backends' names (solrl.precision.available_backends(), sorted), here without torch for
# command-line choices; tests/cli/test_cli_fast.py keeps the two equal.
BACKEND_NAMES = ("bf16", "bf16-cpu", "fp32", "fp8", "fp8-e4m3-emu", "fp8-e5m2-emu", "fp8-torchao", "mxfp4-emu", "nvfp4",
                 "nvfp4-emu", "nvfp4-te-emu")


@dataclass
class PrecisionConfig:
    """Which backend to build and which nn.Linear layers it may quantize.

    The per-layer policy: `skip` holds fnmatch patterns matched against each Linear's full module
    name (e.g. "*proj_out*", "caption_projection.*"; each must match a Linear of the model);
    `min_features` skips any Linear whose larger dimension max(in, out) is below it (the reference's
    size threshold); `keep_first_blocks` / `keep_last_blocks` keep every Linear of the denoiser's first
    / last N blocks (`denoiser_blocks`) in high precision. `quantize_activations` picks W4A4 (True) or
    weight-only quantization (False). `model_skip` holds the model's own patterns (set by
    `with_model_skips` from the model spec; not checked for matches, since one list serves a family).

    `fallback` names the backend to run where `backend` cannot run on this machine and device: a config that
    travels between machines (explore in `bf16-cpu` where the CPU has BF16 instructions, else in `nvfp4-emu`). The
    run's config resolves it once, when it is validated (`RunConfig.validate`): `backend`
    becomes what runs, `fallback` is emptied and `note` says what was chosen and why, so a run directory's
    config.json names the backend that ran. Setting `backend` (`--set ...backend=...`) drops the fallback, so
    name the fallback after it; a backend named without one that cannot run fails with its error.
    """

    backend: str = "bf16"
    skip: tuple[str, ...] = ()
    min_features: int = 0
    quantize_activations: bool = True
    keep_first_blocks: int = 0
    keep_last_blocks: int = 0
    model_skip: tuple[str, ...] = ()
    fallback: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("backend", "fallback", "note"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        if isinstance(self.skip, str) or not isinstance(self.skip, (tuple, list)):
            raise TypeError(f"skip must be a tuple of str patterns, got {self.skip!r}")
        if not all(isinstance(p, str) for p in self.skip):
            raise TypeError(f"skip must hold only str patterns, got {self.skip!r}")
        self.skip = tuple(self.skip)
        if isinstance(self.model_skip, str) or not all(isinstance(p, str) for p in self.model_skip):
            raise TypeError(f"model_skip must be a tuple of str patterns, got {self.model_skip!r}")
        self.model_skip = tuple(self.model_skip)
        for name in ("min_features", "keep_first_blocks", "keep_last_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not isinstance(self.quantize_activations, bool):
            raise TypeError(
                f"quantize_activations must be a bool, got {self.quantize_activations!r}"
            )


# The Transformer Engine kernel each emulation reproduces (the backends' `emulates`; tests/precision/test_forward_cost.py
# keeps the two equal) and the compute capability each kernel needs (solrl.precision.transformer_engine; `fp8`
# without Transformer Engine: solrl.precision.torchao_fp8).
EMULATES = {"fp8-e4m3-emu": "fp8", "nvfp4-emu": "nvfp4", "nvfp4-te-emu": "nvfp4"}
KERNEL_CAPABILITY = {"nvfp4": (10, 0), "fp8": (8, 9)}


def kernel_backend(backend: str, capability: tuple[int, int] | None, te_installed: bool) -> tuple[str, str]:
    """The backend a run that did not name one explicitly (the adaptive proxy's candidates) uses on a CUDA GPU of
    `capability`, and why. An emulation keeps a dequantized FP32 weight and multiplies in FP32: on a GPU slower than
    BF16, so it becomes the kernel it emulates where this GPU runs it (NVFP4 on sm_100+ with Transformer Engine; FP8
    on sm_89+, with Transformer Engine or else on torchao's FP8 GEMM, which `fp8` is then built as), NVFP4 becomes
    FP8 where only FP8 runs (Hopper, Ada, or no Transformer Engine), and BF16 otherwise. Kernels and the reference
    backends stay as they are. (Without a GPU nothing changes: the emulations are the CPU's formats.)"""
    kernel = EMULATES.get(backend)
    if kernel is None:
        if backend.endswith("-emu"):
            return "bf16", f"{backend!r} has no GPU kernel: running BF16 on this GPU (name it explicitly to emulate it)"
        return backend, f"{backend!r} as configured"

    def runs(k: str) -> bool:
        # FP8 also runs without Transformer Engine: torchao's FP8 GEMM (fp8-torchao) is a core dependency
        return ((te_installed or k == "fp8") and capability is not None
                and tuple(capability) >= KERNEL_CAPABILITY[k])

    have = "unknown" if capability is None else ".".join(map(str, capability))
    lib = "Transformer Engine" if te_installed else "torchao (Transformer Engine is not installed)"
    if runs(kernel):
        return kernel, f"{backend!r} -> {kernel!r}: the kernel it emulates, on {lib} (sm_{have.replace('.', '')})"
    if kernel == "nvfp4" and runs("fp8"):
        why = (f"NVFP4 needs compute capability >= 10.0 (this GPU has {have})" if te_installed
               else "NVFP4 needs Transformer Engine, which is not installed")
        return "fp8", f"{backend!r} -> 'fp8': {why}; FP8 runs here on {lib}"
    return "bf16", (f"{backend!r} -> 'bf16': compute capability {have} runs no FP8/FP4 kernel; the emulation would be "
                    "slower than BF16 on a GPU")
