"""The precision-backend interface and `BACKENDS`, the table each backend module adds itself to when imported
(`register_backend`); building a backend by name is `solrl/precision/registry.py`, which imports them all."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Mapping
from functools import partial
from typing import ClassVar

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from solrl.precision.config import PrecisionConfig


class QuantLinear(nn.Module):
    """Marker base for linear layers that hold a quantized weight.

    Subclasses expose `in_features`, `out_features`, `bias` (fp32 or None) and:
    `quantize_weight(w)` (returns the packed form of a new [out, in] weight without
    touching the layer), `load_packed(packed)`, `set_weight(w)` and `packed_weight_bytes()`.
    """

    in_features: int
    out_features: int

    def quantize_weight(self, weight_OI: torch.Tensor) -> torch.Tensor:
        """Return the packed form of `weight_OI` without changing the layer."""
        raise NotImplementedError

    def load_packed(self, packed: torch.Tensor) -> None:
        """Make `packed` (from `quantize_weight`) the resident weight."""
        raise NotImplementedError

    def set_weight(self, weight_OI: torch.Tensor) -> None:
        """Quantize a new high-precision weight [out, in] and keep it resident."""
        self.load_packed(self.quantize_weight(weight_OI))

    def packed_weight_bytes(self) -> int:
        """Bytes of the resident packed weight (values and all scales)."""
        raise NotImplementedError


BACKENDS: dict[str, type[PrecisionBackend]] = {}


def register_backend(cls: type[PrecisionBackend]) -> type[PrecisionBackend]:
    """Class decorator: add a backend to `BACKENDS` under its `name`."""
    if cls.name in BACKENDS:
        raise ValueError(f"precision backend {cls.name!r} is already registered")
    BACKENDS[cls.name] = cls
    return cls


def is_plain_linear(module: nn.Module) -> bool:
    """An nn.Linear that is called through its own forward.

    NonDynamicallyQuantizableLinear (nn.MultiheadAttention.out_proj) is excluded: its owner
    reads `.weight` directly, so replacing it would break the attention.
    """
    return isinstance(module, nn.Linear) and not isinstance(
        module, NonDynamicallyQuantizableLinear
    )


def allow_tf32(device: torch.device | str) -> bool:
    """On a CUDA `device`, let FP32 matmuls and convolutions use TF32 tensor cores (torch's "high" float32
    matmul precision): the FP32 LoRA branches (the trainer's, the regenerator's unmerged ones) and any FP32
    layer then run at tensor-core speed with a 10-bit mantissa in the products, as the reference trainers
    run. Called where the GPU roles build their models (the trainer, HotSwapModel). Nothing changes on
    the CPU (returns False there); the setting is process-wide."""
    if torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    return True


def round_to_bf16(t: torch.Tensor) -> torch.Tensor:
    """bf16 rounding chosen by device: on CUDA a real bf16 tensor; elsewhere the
    bf16-rounded values kept in `t`'s own dtype (this CPU has no fast bf16 compute)."""
    if t.is_cuda:
        return t.to(torch.bfloat16)
    return t.to(torch.bfloat16).to(t.dtype)


class PrecisionBackend:
    """One way of holding a model's weights and running its Linear layers.

    Subclasses set `name`, implement `prepare` and, if they quantize, `selected_layers`;
    `_store` says how a non-quantized tensor is kept (identity by default).
    """

    name: ClassVar[str]
    # True when selected Linears hold quantized weights (an adapter must be merged and re-quantized);
    # False for the reference backends, whose layers can carry an unmerged LoRA
    quantizes: ClassVar[bool] = False
    # an emulation: the kernel backend whose numbers it reproduces (a worker on either serves the same format)
    emulates: ClassVar[str | None] = None
    # another implementation of a kernel backend's format on other kernels (fp8-torchao: fp8 on torchao's GEMM)
    implements: ClassVar[str | None] = None
    # its kernels keep process-global state (Transformer Engine's autocast): a serving process runs one model call
    # at a time (services/explorer/dataplane.py)
    global_state: ClassVar[bool] = False
    # its kernels are the CPU's own (bf16-cpu): refused for a model on CUDA
    cpu_only: ClassVar[bool] = False

    def __init__(self, cfg: PrecisionConfig) -> None:
        if not isinstance(cfg, PrecisionConfig):
            raise TypeError(f"cfg must be a PrecisionConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.quantized_names: tuple[str, ...] = ()

    def environment(self) -> str:
        """What on this machine lets it run, for a run's note ("" when nothing is machine-specific)."""
        return ""

    def prepare(self, model: nn.Module) -> nn.Module:
        """Convert `model` in place and return it; sets `quantized_names`."""
        raise NotImplementedError

    def selected_layers(self, model: nn.Module) -> list[str]:
        """Names of the nn.Linear layers `prepare` would quantize (none by default)."""
        check_module(model)
        return []

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        """How this backend keeps a non-quantized floating tensor."""
        return t

    def requantize(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """Load new high-precision weights [out, in] (e.g. after a LoRA merge).

        Quantized layers re-quantize from them; plain nn.Linear layers get them copied in
        with this backend's rounding. Everything is validated and converted before the
        first layer changes, so a bad entry leaves the model as it was.
        """
        targets = _validate_weights(model, weights)
        updates: list[Callable[[], object]] = []
        with torch.no_grad():
            for name, module in targets.items():
                w = weights[name].detach()
                if isinstance(module, QuantLinear):
                    updates.append(partial(module.load_packed, module.quantize_weight(w)))
                else:
                    dest = module.weight
                    new = self._store(w.to(device=dest.device, dtype=torch.float32))
                    updates.append(partial(dest.copy_, new.to(dest.dtype)))
            for update in updates:
                update()

    def weight_bytes(self, model: nn.Module) -> dict[str, int]:
        """Resident weight bytes.

        "quantized": packed bytes of the quantized layers' weights (4-bit values and
        scales); "quantized_bf16": what those weights take in bf16; "other": every other
        parameter and buffer at its storage dtype (quantized layers' biases included;
        on CPU the bf16 backend stores fp32, so 4 bytes per value); "total": quantized + other.
        """
        check_module(model)
        quantized = quantized_bf16 = 0
        packed_ids: set[int] = set()
        for module in model.modules():
            if isinstance(module, QuantLinear):
                quantized += module.packed_weight_bytes()
                quantized_bf16 += 2 * module.in_features * module.out_features
                packed_ids.update(id(b) for b in module.buffers(recurse=False))
        other = sum(p.numel() * p.element_size() for p in model.parameters())
        other += sum(
            b.numel() * b.element_size() for b in model.buffers() if id(b) not in packed_ids
        )
        return {
            "quantized": quantized,
            "quantized_bf16": quantized_bf16,
            "other": other,
            "total": quantized + other,
        }


def with_model_skips(precision: PrecisionConfig, skip: tuple[str, ...], min_features: int) -> PrecisionConfig:
    """`precision` plus a model's own high-precision layers (its spec's skip patterns and size threshold)."""
    return dataclasses.replace(precision, model_skip=tuple(precision.model_skip) + tuple(skip),
                               min_features=max(precision.min_features, min_features))


def denoiser_blocks(model: nn.Module) -> list[str]:
    """The denoiser's blocks in order: the items of its top-level ModuleLists whose names end in "blocks"
    (`transformer_blocks`; FLUX's `transformer_blocks` then `single_transformer_blocks`; a UNet's
    `down_blocks` then `up_blocks`), in the order the model registers them. A module of several expert denoisers
    (`EXPERTS`, Wan2.2 A14B's `WanExperts`): each expert's blocks in turn, under the expert's name."""
    experts = getattr(model, "EXPERTS", None)
    if experts:
        return [f"{e}.{b}" for e in experts for b in denoiser_blocks(getattr(model, e))]
    out = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList) and name.endswith("blocks"):
            out.extend(f"{name}.{i}" for i in range(len(child)))
    return out


def policy_kept_blocks(model: nn.Module, cfg: PrecisionConfig) -> list[str]:
    """The blocks `keep_first_blocks` / `keep_last_blocks` keep in high precision (errors name the field)."""
    n_first, n_last = cfg.keep_first_blocks, cfg.keep_last_blocks
    if not n_first and not n_last:
        return []
    experts = getattr(model, "EXPERTS", None)
    if experts:   # each expert is a whole denoiser: its own first / last blocks
        return [f"{e}.{b}" for e in experts for b in policy_kept_blocks(getattr(model, e), cfg)]
    blocks = denoiser_blocks(model)
    if n_first + n_last > len(blocks):
        raise ValueError(f"keep_first_blocks={n_first} + keep_last_blocks={n_last} exceed the "
                         f"{len(blocks)} blocks of {type(model).__name__}")
    return blocks[:n_first] + (blocks[len(blocks) - n_last:] if n_last else [])


def select_linear_layers(model: nn.Module, cfg: PrecisionConfig, block_size: int) -> list[str]:
    """Names of plain nn.Linear layers the policy quantizes: not matched by `cfg.skip` or `cfg.model_skip`,
    not below `cfg.min_features`, not in a kept first / last block, with in_features a multiple of
    `block_size` (the root module is never selected). A `cfg.skip` pattern that matches no Linear of the
    model is an error (a typo would otherwise quantize what it meant to keep)."""
    check_module(model)
    linears = [(n, m) for n, m in model.named_modules() if n and is_plain_linear(m)]
    for pattern in cfg.skip:
        if not any(fnmatch.fnmatchcase(n, pattern) for n, _ in linears):
            examples = ", ".join(n for n, _ in linears[:3])
            raise ValueError(f"skip pattern {pattern!r} matches no Linear layer of {type(model).__name__} "
                             f"(its Linear layers are named like {examples})")
    kept = tuple(b + "." for b in policy_kept_blocks(model, cfg))
    names = []
    for name, module in linears:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in (*cfg.skip, *cfg.model_skip)):
            continue
        if max(module.in_features, module.out_features) < cfg.min_features:
            continue
        if kept and name.startswith(kept):
            continue
        if module.in_features % block_size != 0:
            continue
        names.append(name)
    return names


def select_gemm_layers(model: nn.Module, cfg: PrecisionConfig, block_size: int) -> list[str]:
    """`select_linear_layers` less the layers whose out_features is not a multiple of `block_size` either: what a
    real FP8 / FP4 GEMM (Transformer Engine's, `torch._scaled_mm`) takes, both dimensions in whole blocks."""
    return [n for n in select_linear_layers(model, cfg, block_size)
            if model.get_submodule(n).out_features % block_size == 0]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at dotted path `name` inside `model`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def check_module(model: nn.Module) -> None:
    """Raise TypeError unless `model` is an nn.Module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")


def _validate_weights(
    model: nn.Module, weights: Mapping[str, torch.Tensor]
) -> dict[str, nn.Module]:
    """Check every entry of `weights` against `model`; return name -> module."""
    check_module(model)
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a mapping name -> tensor, got {type(weights).__name__}")
    modules = dict(model.named_modules())
    targets: dict[str, nn.Module] = {}
    for name, w in weights.items():
        module = modules.get(name) if isinstance(name, str) else None
        if not (is_plain_linear(module) or isinstance(module, (QuantLinear, nn.Conv2d))):
            raise ValueError(f"weights: {name!r} is not a linear or conv layer of the model")
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            raise TypeError(f"weights[{name!r}] must be a floating tensor, got {w!r:.80}")
        # convolutions (LoRA on a UNet's ResNet blocks) stay in high precision: their weight is copied in
        expected = (tuple(module.weight.shape) if isinstance(module, nn.Conv2d)
                    else (module.out_features, module.in_features))
        if tuple(w.shape) != expected:
            raise ValueError(
                f"weights[{name!r}] has shape {tuple(w.shape)}, expected {expected}"
                + ("" if isinstance(module, nn.Conv2d) else " [out, in]")
            )
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"weights[{name!r}] contains NaN or inf")
        targets[name] = module
    return targets


def layer_macs(model: nn.Module, run: Callable[[], object]) -> dict[str, int]:
    """Multiply-accumulates of every nn.Linear and nn.Conv2d of `model` during one call of `run`, by module
    name (forward hooks count what the call really executes; torch has no per-module FLOP counter that keeps
    module names for both layer kinds, so this is written here)."""
    macs: dict[str, int] = {}

    def hook(name: str, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            per_out = (module.in_channels // module.groups) * module.kernel_size[0] * module.kernel_size[1]
            n = output.numel() * per_out
        else:
            n = inputs[0].numel() // module.in_features * module.in_features * module.out_features
        macs[name] = macs.get(name, 0) + n

    run_hooked([m.register_forward_hook(partial(hook, name)) for name, m in model.named_modules()
                if name and (is_plain_linear(m) or isinstance(m, nn.Conv2d))], run)
    return macs


def run_hooked(handles: list, run: Callable[[], object]) -> None:
    """Call `run()` without gradients, then remove the forward-hook `handles` (also when it raises)."""
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()


def quantized_mac_share(model: nn.Module, selected: list[str], run: Callable[[], object]) -> float:
    """Share of one forward's Linear + Conv2d multiply-accumulates that runs in the `selected` layers (what a
    backend quantizes): the part of the forward a low-precision kernel speeds up."""
    macs = layer_macs(model, run)
    total = sum(macs.values())
    missing = [n for n in selected if n not in macs]
    if missing:
        raise ValueError(f"selected layers not called by the forward: {missing[:3]}")
    return sum(macs[n] for n in selected) / total if total else 0.0
