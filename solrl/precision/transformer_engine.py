"""Transformer Engine backends (`nvfp4`, `fp8`): real low-precision GEMMs on NVIDIA GPUs.

`nvfp4` runs the selected Linear layers through `te.Linear` under the `NVFP4BlockScaling` recipe
(Blackwell, compute capability >= 10.0); `fp8` under `Float8CurrentScaling` (Ada / Hopper, >= 8.9).
The requirement checks run anywhere. transformer_engine is never imported at module import time (it
is absent on CPU machines; install the `gpu` extra on GPU machines), only when a backend is prepared.
API names checked against TE 2.x: `transformer_engine.pytorch.autocast(enabled, recipe=...)` (older
releases: `fp8_autocast(fp8_recipe=...)`), `transformer_engine.common.recipe.NVFP4BlockScaling` /
`Float8CurrentScaling`, `te.Linear(..., params_dtype, device)` and `forward(inp, is_first_microbatch)`.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import ClassVar

import torch
from torch import nn

from solrl.precision.base import (
    QuantLinear,
    check_module,
    is_plain_linear,
    register_backend,
    replace_module,
    select_gemm_layers,
)
from solrl.precision.reference import Bf16Backend


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


def import_te():
    """transformer_engine.pytorch, imported on first use only (it is absent on CPU machines)."""
    import transformer_engine.pytorch as te

    return te


def make_recipe(name: str):
    """The Transformer Engine recipe object for a recipe class name of `transformer_engine.common.recipe`."""
    from transformer_engine.common import recipe as te_recipe

    cls = getattr(te_recipe, name, None)
    if cls is None:
        raise RuntimeError(f"this Transformer Engine has no recipe {name!r} (NVFP4BlockScaling needs TE >= 2.8)")
    return cls()


def te_autocast(te, recipe):
    """`te.autocast(recipe=...)` (TE >= 2.9), else the older `te.fp8_autocast(fp8_recipe=...)`."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


class ForwardScope:
    """A context entered once around each forward of the denoiser, not once per layer.

    Transformer Engine's docs wrap the model's whole forward in one `te.autocast` (entering it sets up the recipe's
    global state; per Linear that was ~500 entries per SD3.5 forward). `attach(module)` registers a forward
    pre-hook that enters `make_context()` and an always-called forward hook that leaves it (also when the forward
    raises); nested attached forwards (an expert inside a wrapper) enter it once. A layer asks `layer_context()`:
    nothing inside an attached forward, its own context when called on its own. The depth is per thread.
    """

    def __init__(self, make_context: Callable[[], AbstractContextManager]) -> None:
        self.make_context = make_context
        self._local = threading.local()

    @property
    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _enter(self, *_: object) -> None:
        if self.depth == 0:
            stack = ExitStack()
            stack.enter_context(self.make_context())
            self._local.stack = stack
        self._local.depth = self.depth + 1

    def _leave(self, *_: object) -> None:
        self._local.depth = self.depth - 1
        if self._local.depth == 0:
            self._local.stack.close()

    def attach(self, module: nn.Module) -> list:
        """Enter the context around every forward of `module`; returns the hook handles."""
        return [module.register_forward_pre_hook(self._enter),
                module.register_forward_hook(self._leave, always_call=True)]

    def __deepcopy__(self, memo: dict) -> ForwardScope:
        return self   # a copied model's hooks and layers share the scope (its depth is per thread, not per model)

    def layer_context(self) -> AbstractContextManager:
        return nullcontext() if self.depth else self.make_context()


def forward_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward is one denoiser forward: each expert of a several-expert container (`EXPERTS`,
    Wan2.2 A14B's, which has no forward of its own), else the model itself."""
    experts = getattr(model, "EXPERTS", None)
    return [getattr(model, e) for e in experts] if experts else [model]


class TEQuantLinear(QuantLinear):
    """An nn.Linear replaced by `te.Linear`, run under the backend's recipe (inference only).

    The resident weight is the high-precision copy inside te.Linear (bf16 on CUDA); Transformer
    Engine quantizes it with the recipe's weight quantizer (NVFP4: 16-element blocks with E4M3
    scales and an FP32 tensor scale; FP8: E4M3 with a current per-tensor scale) and quantizes the
    activations on every call. The quantized weight is computed on the first call after a
    (re)load and cached (`is_first_microbatch`), so an adapter merge re-quantizes exactly once.
    Rows are zero-padded to a multiple of 16, which TE's FP8/FP4 GEMMs need.
    """

    def __init__(self, linear: nn.Linear, recipe, scope: ForwardScope, te) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.recipe, self._scope = recipe, scope
        self._has_bias = linear.bias is not None
        w = linear.weight.detach()
        dtype = torch.bfloat16 if w.dtype == torch.float32 else w.dtype
        self.inner = te.Linear(self.in_features, self.out_features, bias=linear.bias is not None,
                               params_dtype=dtype, device=w.device)
        with torch.no_grad():
            self.inner.weight.copy_(w)
            if linear.bias is not None:
                self.inner.bias.copy_(linear.bias.detach())
        self.inner.eval().requires_grad_(False)
        self._stale = True

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias if self._has_bias else None

    def quantize_weight(self, weight_OI: torch.Tensor) -> torch.Tensor:
        """The new weight in the resident dtype / device (TE quantizes it on the next forward)."""
        expected = (self.out_features, self.in_features)
        if not isinstance(weight_OI, torch.Tensor) or tuple(weight_OI.shape) != expected:
            raise ValueError(f"weight_OI must have shape {expected} [out, in]")
        dest = self.inner.weight
        return weight_OI.detach().to(device=dest.device, dtype=dest.dtype)

    def load_packed(self, packed: torch.Tensor) -> None:
        dest = self.inner.weight
        if packed.shape != dest.shape or packed.dtype != dest.dtype:
            raise ValueError(f"packed must be {tuple(dest.shape)} {dest.dtype}, got {tuple(packed.shape)} {packed.dtype}")
        with torch.no_grad():
            dest.copy_(packed)
        self._stale = True  # the cached quantized weight is rebuilt on the next call

    def packed_weight_bytes(self) -> int:
        w = self.inner.weight
        return w.numel() * w.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has last dim {x.shape[-1]}, expected {self.in_features}")
        x_MK = x.reshape(-1, self.in_features).to(self.inner.weight.dtype)
        m = x_MK.shape[0]
        pad = -m % 16
        if pad:
            x_MK = torch.nn.functional.pad(x_MK, (0, 0, 0, pad))
        with torch.no_grad(), self._scope.layer_context():   # the denoiser's forward has entered te.autocast
            y = self.inner(x_MK, is_first_microbatch=self._stale)
        self._stale = False
        return y[:m].reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={type(self.recipe).__name__}"


class TransformerEngineBackend(Bf16Backend):
    """Base for backends that run selected nn.Linear layers as Transformer Engine GEMMs.

    `prepare` first checks the machine and raises RuntimeError naming what is missing (CUDA,
    compute capability, transformer_engine); then every selected layer (the shared
    `select_linear_layers` rule: skip patterns, minimum size, in_features a multiple of 16, plus
    out_features a multiple of 16) becomes a `TEQuantLinear` with its weights copied, and the rest of
    the model is rounded to bf16 like the `bf16` backend. `te.autocast` is entered once per denoiser forward
    (`ForwardScope`, hooked on `forward_modules(model)`), not per layer. `requantize` (after an adapter merge)
    loads the merged weights; TE re-quantizes them on the next call. The emulated backends (`nvfp4-emu`)
    are the CPU stand-ins with the same layer selection.
    """

    min_capability: ClassVar[tuple[int, int]]
    recipe: ClassVar[str]  # transformer_engine.common.recipe class the conversion uses
    block_size: ClassVar[int] = 16  # TE's FP8/FP4 GEMMs want dimensions that are multiples of 16
    quantizes = True
    global_state = True  # te.autocast's recipe and amax state are process-global

    def selected_layers(self, model: nn.Module) -> list[str]:
        """nn.Linear names kept by skip / min_features whose in and out features are multiples of 16."""
        return select_gemm_layers(model, self.cfg, self.block_size)

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
        """Check the machine, replace the selected layers by te.Linear, bf16-round the rest."""
        check_module(model)
        if is_plain_linear(model):
            raise TypeError("model is a bare nn.Linear, which cannot be replaced in place; wrap it in a container")
        self.check_environment()
        if not self.cfg.quantize_activations:
            raise ValueError(f"precision backend {self.name!r} quantizes activations too (W4A4 / W8A8); "
                             "quantize_activations=False is only available with the emulated backends")
        te = import_te()
        recipe = make_recipe(self.recipe)
        names = self.selected_layers(model)
        for name in names:
            linear = model.get_submodule(name)
            if not linear.weight.is_cuda:
                raise RuntimeError(f"precision backend {self.name!r}: layer {name!r} is on "
                                   f"{linear.weight.device}; move the model to CUDA before prepare()")
        scope = ForwardScope(lambda: te_autocast(te, recipe))
        with torch.no_grad():
            for name in names:
                replace_module(model, name, TEQuantLinear(model.get_submodule(name), recipe, scope, te))
        for module in forward_modules(model):
            scope.attach(module)
        self._round_unquantized(model)
        self.quantized_names = tuple(names)
        return model

    def weight_bytes(self, model: nn.Module) -> dict[str, int]:
        """As the base reports, without counting the te.Linear weights twice (they are parameters of the
        inner module and also the layers' "quantized" bytes)."""
        out = super().weight_bytes(model)
        dup = sum(m.packed_weight_bytes() for m in model.modules() if isinstance(m, TEQuantLinear))
        out["other"] -= dup
        out["total"] -= dup
        return out


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
