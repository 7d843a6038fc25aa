"""Three peft LoRA adapters ("default", "old", "ema") on one diffusers transformer.

The trainer holds one transformer with the three adapters injected by peft; inference copies
(explorer / regenerator) hold a plain base model into which one adapter is merged. Keys use
diffusers' pipeline LoRA format: ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig
from peft.functional import (
    cast_adapter_dtype,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_adapter,
    set_peft_model_state_dict,
)
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

# Component name diffusers' LoRA pipelines prefix transformer keys with (SANA, SD3, FLUX, PixArt).
PREFIX = "transformer"
# peft's name for each supported LoRA init ("gaussian": A ~ N(0, 1/r), B = 0; "kaiming": A kaiming-uniform, B = 0).
_PEFT_INIT: dict[str, str | bool] = {"gaussian": "gaussian", "kaiming": True}


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters shared by all adapters of one run (scale = alpha / rank)."""

    rank: int = 32
    alpha: float = 64.0
    target_modules: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    init: str = "gaussian"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"alpha must be a number, got {type(self.alpha).__name__}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be finite and > 0, got {self.alpha!r}")
        if not isinstance(self.target_modules, tuple) or not self.target_modules:
            raise ValueError(f"target_modules must be a non-empty tuple of str, got {self.target_modules!r}")
        if not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"target_modules must hold non-empty strings, got {self.target_modules!r}")
        if self.init not in _PEFT_INIT:
            raise ValueError(f"init must be one of {sorted(_PEFT_INIT)}, got {self.init!r}")

    def peft_kwargs(self) -> dict[str, Any]:
        """JSON-able ``LoraConfig`` kwargs; also written as diffusers' LoRA metadata."""
        return {
            "r": self.rank,
            "lora_alpha": float(self.alpha),
            "target_modules": list(self.target_modules),
            "init_lora_weights": _PEFT_INIT[self.init],
            "lora_dropout": 0.0,
            "bias": "none",
        }

    def lora_config(self) -> LoraConfig:
        return LoraConfig(**self.peft_kwargs())


def _lora_layers(model: nn.Module) -> list[tuple[str, LoraLayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


class LoraAdapters:
    """The trainer's view of one transformer carrying the three adapters.

    Not thread-safe: ``use`` / ``disabled`` switch module state of the shared transformer.
    """

    ADAPTERS = ("default", "old", "ema")
    TRAINABLE = "default"

    def __init__(self, transformer: nn.Module, spec: LoraSpec, seed: int) -> None:
        if not isinstance(transformer, nn.Module):
            raise TypeError(f"transformer must be an nn.Module, got {type(transformer).__name__}")
        if not isinstance(spec, LoraSpec):
            raise TypeError(f"spec must be a LoraSpec, got {type(spec).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if _lora_layers(transformer):
            raise ValueError("transformer already carries peft LoRA layers; pass a plain base model")
        self.model = transformer
        self.spec = spec
        transformer.requires_grad_(False)
        config = spec.lora_config()
        # peft initialises each LoRA layer on the CPU before moving it to the base layer's
        # device, so seeding the CPU generator makes the init device-independent.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            torch.manual_seed(seed)
            for name in self.ADAPTERS:
                inject_adapter_in_model(config, transformer, adapter_name=name)
                cast_adapter_dtype(transformer, name)  # fp32 LoRA on a bf16/fp16 base
        self._layers = _lora_layers(transformer)
        self._keys = [f"{PREFIX}.{module}.{part}.weight" for module, _ in self._layers for part in ("lora_A", "lora_B")]
        self._params = {
            name: [p for _, layer in self._layers for p in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
            for name in self.ADAPTERS
        }
        self._active = self.TRAINABLE
        self._disabled = False
        self.copy_("old", self.TRAINABLE)
        self.copy_("ema", self.TRAINABLE)
        self._apply_state()

    # ----- switching -------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if name not in self.ADAPTERS:
            raise ValueError(f"adapter name must be one of {self.ADAPTERS}, got {name!r}")

    def _apply_state(self) -> None:
        set_adapter(self.model, self._active)
        for _, layer in self._layers:
            layer.enable_adapters(not self._disabled)
        # peft's set_adapter / enable_adapters toggle requires_grad; keep the invariant that
        # exactly the trainable adapter requires grad whatever adapter is active.
        for name, params in self._params.items():
            for p in params:
                p.requires_grad_(name == self.TRAINABLE)

    @contextmanager
    def _state(self, active: str, disabled: bool) -> Iterator[None]:
        previous = (self._active, self._disabled)
        self._active, self._disabled = active, disabled
        self._apply_state()
        try:
            yield
        finally:
            self._active, self._disabled = previous
            self._apply_state()

    def use(self, name: str) -> AbstractContextManager[None]:
        """Context manager: forward passes inside use adapter ``name``."""
        self._check_name(name)
        return self._state(name, False)

    def disabled(self) -> AbstractContextManager[None]:
        """Context manager: forward passes inside use the base model only (the reference)."""
        return self._state(self._active, True)

    # ----- tensors -----------------------------------------------------------------------------
    def parameters(self, name: str) -> list[nn.Parameter]:
        """LoRA tensors of one adapter in ``layout()`` order (A then B per module)."""
        self._check_name(name)
        return list(self._params[name])

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The tensors of "default", the only ones that require grad."""
        return self.parameters(self.TRAINABLE)

    def conv_parameters(self, name: str) -> list[nn.Parameter]:
        """The tensors of adapter ``name`` on convolution layers (targets such as a UNet's ``conv1`` / ``conv2``),
        a subset of ``parameters(name)`` in the same order; empty when every target is a Linear."""
        self._check_name(name)
        return [p for _, layer in self._layers if isinstance(layer.get_base_layer(), nn.modules.conv._ConvNd)
                for p in (layer.lora_A[name].weight, layer.lora_B[name].weight)]

    @torch.no_grad()
    def copy_(self, dst: str, src: str) -> None:
        """Copy adapter ``src`` into ``dst`` in place (parameter objects are kept)."""
        self._check_name(dst)
        self._check_name(src)
        for p_dst, p_src in zip(self._params[dst], self._params[src], strict=True):
            p_dst.copy_(p_src)

    def layout(self) -> dict[str, tuple[int, ...]]:
        """Expected key -> shape of any adapter's state dict."""
        return {key: tuple(p.shape) for key, p in zip(self._keys, self._params[self.TRAINABLE], strict=True)}

    def state_dict(self, name: str) -> dict[str, Tensor]:
        """A detached copy of adapter ``name`` in diffusers' pipeline LoRA key format."""
        self._check_name(name)
        peft_sd = get_peft_model_state_dict(self.model, adapter_name=name)
        return {f"{PREFIX}.{k}": v.detach().clone() for k, v in peft_sd.items()}

    def load_state_dict(self, name: str, state: Mapping[str, Tensor]) -> None:
        """Strictly load ``state`` (keys, shapes, float dtype checked) into adapter ``name``."""
        self._check_name(name)
        check_state(state, self.layout(), "state")
        prefix = f"{PREFIX}."
        peft_sd = {k.removeprefix(prefix): v for k, v in state.items()}
        result = set_peft_model_state_dict(self.model, peft_sd, adapter_name=name)
        if result.unexpected_keys:  # the layout check above makes this a peft key-format drift
            raise ValueError(f"peft did not place state keys: {sorted(result.unexpected_keys)[:5]}")

    def base_state_dict(self) -> dict[str, Tensor]:
        """Frozen base weights under the original module names (no ``.base_layer``, no LoRA keys).

        Values share storage with the trainer's model; clone before modifying them.
        """
        lora_modules = [f"{name}." for name, _ in self._layers]
        out: dict[str, Tensor] = {}
        for key, value in self.model.state_dict().items():
            owner = next((m for m in lora_modules if key.startswith(m)), None)
            if owner is None:
                out[key] = value
            elif key.startswith(f"{owner}base_layer."):
                out[owner + key.removeprefix(f"{owner}base_layer.")] = value
        return out

    @torch.no_grad()
    def merged_weights(self, name: str | None) -> dict[str, Tensor]:
        """Module name -> W_base + (alpha/rank) * B @ A for adapter ``name`` (fp32, detached).

        ``name=None`` gives the plain base weights (restore). Computed by hand rather than with
        peft's ``get_delta_weight``, which returns the delta in the base dtype.
        """
        if name is not None:
            self._check_name(name)
        out: dict[str, Tensor] = {}
        for module, layer in self._layers:
            base = layer.get_base_layer()
            if not isinstance(base, (nn.Linear, nn.Conv2d)):
                raise TypeError(f"LoRA target {module!r} is {type(base).__name__}, only nn.Linear and nn.Conv2d "
                                "can be merged")
            weight = base.weight.detach().float().clone()
            if name is not None:
                a = layer.lora_A[name].weight.float()
                b = layer.lora_B[name].weight.float()
                weight.add_(lora_delta(a, b), alpha=layer.scaling[name])
            out[module] = weight
        return out


def lora_delta(a: Tensor, b: Tensor) -> Tensor:
    """B @ A, the unscaled LoRA update of a weight: [out, in] for a Linear; for a Conv2d (peft's layout: A a
    [r, in, kh, kw] conv, B a 1x1 [out, r] conv) B applied to A's kernel, [out, in, kh, kw]."""
    return b @ a if a.ndim == 2 else torch.einsum("or,rikl->oikl", b[:, :, 0, 0], a)


def make_inference_copy(adapters: LoraAdapters, model_cls: type[nn.Module], config: Mapping[str, Any]) -> nn.Module:
    """A fresh base model (no peft layers) holding a copy of the trainer's base weights.

    The copy takes the device and dtype of the trainer's first floating base weight, is in eval
    mode and requires no grad.
    """
    if not isinstance(adapters, LoraAdapters):
        raise TypeError(f"adapters must be LoraAdapters, got {type(adapters).__name__}")
    if not (isinstance(model_cls, type) and issubclass(model_cls, nn.Module)):
        raise TypeError(f"model_cls must be an nn.Module subclass, got {model_cls!r}")
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    from_config = getattr(model_cls, "from_config", None)
    copy = from_config(config) if from_config is not None else model_cls(**config)
    base = adapters.base_state_dict()
    ref = next((v for v in base.values() if v.is_floating_point()), None)
    first = next((p for p in copy.parameters() if p.is_floating_point()), None)
    if ref is not None and first is not None and (first.device, first.dtype) != (ref.device, ref.dtype):
        copy.to(device=ref.device, dtype=ref.dtype)
    try:
        copy.load_state_dict(base, strict=True)
    except RuntimeError as err:
        raise ValueError(f"model_cls/config do not match the trainer's base model: {err}") from err
    copy.eval().requires_grad_(False)
    return copy


@torch.no_grad()
def apply_merged(copy: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Copy merged (or restored) weights into the ``nn.Linear`` / ``nn.Conv2d`` modules of a plain inference copy."""
    if not isinstance(copy, nn.Module):
        raise TypeError(f"copy must be an nn.Module, got {type(copy).__name__}")
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping, got {type(weights).__name__}")
    targets: list[tuple[nn.Module, Tensor]] = []
    for name, weight in weights.items():
        try:
            module = copy.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"weights: copy has no module {name!r}") from err
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            raise TypeError(f"weights: module {name!r} is {type(module).__name__}, expected a plain nn.Linear or "
                            "nn.Conv2d")
        if not isinstance(weight, Tensor) or tuple(weight.shape) != tuple(module.weight.shape):
            got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"weights[{name!r}]: expected shape {tuple(module.weight.shape)}, got {got}")
        targets.append((module, weight))
    for module, weight in targets:  # validate everything first: no half-applied update
        module.weight.copy_(weight)


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_state(state: Mapping[str, Tensor], layout: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Raise ValueError unless ``state`` has exactly ``layout``'s keys and shapes, float dtypes, finite values."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{what} must be a mapping of str to Tensor, got {type(state).__name__}")
    missing = sorted(set(layout) - set(state))
    unexpected = sorted(set(state) - set(layout))
    if missing:
        raise ValueError(f"{what}: {len(missing)} missing key(s), e.g. {missing[:3]}")
    if unexpected:
        raise ValueError(f"{what}: {len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}")
    for key, expected in layout.items():
        tensor = state[key]
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{what}[{key!r}] must be a Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != tuple(expected):
            raise ValueError(f"{what}[{key!r}]: expected shape {tuple(expected)}, got {tuple(tensor.shape)}")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{what}[{key!r}]: dtype {tensor.dtype} is not a float dtype")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what}[{key!r}]: contains NaN or Inf")
