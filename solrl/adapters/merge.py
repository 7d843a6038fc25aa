"""Merging a LoRA into plain base weights without peft (what an inference copy does with a pushed adapter).

The trainer's `LoraAdapters` merges from its peft layers; a serving process holds only a plain base
model and an adapter's tensors (keys ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight``).
Which modules carry a LoRA is decided by peft's own target matching (`check_target_module_exists`),
so the layout here is the one `LoraAdapters.layout()` reports for the same model and spec.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from peft.tuners.tuners_utils import check_target_module_exists
from torch import Tensor, nn

from solrl.adapters.lora import PREFIX, LoraSpec, check_state, lora_delta


def _check_spec(spec: LoraSpec) -> None:
    if not isinstance(spec, LoraSpec):
        raise TypeError(f"spec must be a LoraSpec, got {type(spec).__name__}")


def lora_targets(model: nn.Module, spec: LoraSpec) -> dict[str, nn.Module]:
    """Module name -> nn.Linear / nn.Conv2d of every module peft would give a LoRA, in `named_modules` order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_spec(spec)
    config = spec.lora_config()
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not name or not check_target_module_exists(config, name):
            continue
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            raise TypeError(f"LoRA target {name!r} is {type(module).__name__}; only nn.Linear and nn.Conv2d can be "
                            "merged")
        out[name] = module
    if not out:
        raise ValueError(f"spec.target_modules {spec.target_modules} match no module of the model")
    return out


def _layout(weights: Mapping[str, tuple[int, ...]], rank: int) -> dict[str, tuple[int, ...]]:
    """Adapter key -> shape for modules with weight shapes [out, in]: A [rank, in], B [out, rank]; for
    convolutions [out, in, kh, kw] (peft's layout): A [rank, in, kh, kw], B [out, rank, 1, 1]."""
    layout: dict[str, tuple[int, ...]] = {}
    for module, (out_features, in_features, *kernel) in weights.items():
        layout[f"{PREFIX}.{module}.lora_A.weight"] = (rank, in_features, *kernel)
        layout[f"{PREFIX}.{module}.lora_B.weight"] = (out_features, rank, *(1 for _ in kernel))
    return layout


def lora_layout(model: nn.Module, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """Expected key -> shape of an adapter's state dict for a plain (peft-free) base model."""
    targets = lora_targets(model, spec)
    return _layout({name: tuple(m.weight.shape) for name, m in targets.items()}, spec.rank)


def target_weights(model: nn.Module, spec: LoraSpec) -> dict[str, Tensor]:
    """Module name -> the base weight [out, in] (convolutions [out, in, kh, kw]) of every LoRA target
    (detached, shares storage)."""
    return {name: m.weight.detach() for name, m in lora_targets(model, spec).items()}


@torch.no_grad()
def merge_lora(base_weights: Mapping[str, Tensor], state: Mapping[str, Tensor], spec: LoraSpec) -> dict[str, Tensor]:
    """Module name -> W + (alpha / rank) * B @ A in fp32, for every module of `base_weights` (for a convolution
    B is 1x1 and the delta is B applied to A's kernel).

    `state` must hold exactly the A/B pair of each of those modules with matching shapes (ValueError
    naming the key otherwise). The base weights are not modified.
    """
    _check_spec(spec)
    if not isinstance(base_weights, Mapping) or not base_weights:
        raise ValueError("base_weights must map at least one module name to its weight [out, in]")
    for name, weight in base_weights.items():
        if not isinstance(weight, Tensor) or weight.ndim not in (2, 4) or not weight.is_floating_point():
            raise ValueError(f"base_weights[{name!r}] must be a 2-D floating tensor [out, in] (or a 4-D conv kernel)")
    check_state(state, _layout({n: tuple(w.shape) for n, w in base_weights.items()}, spec.rank), "state")
    scale = spec.alpha / spec.rank
    out: dict[str, Tensor] = {}
    for name, weight in base_weights.items():
        a = state[f"{PREFIX}.{name}.lora_A.weight"].to(device=weight.device, dtype=torch.float32)
        b = state[f"{PREFIX}.{name}.lora_B.weight"].to(device=weight.device, dtype=torch.float32)
        out[name] = weight.float().clone().add_(lora_delta(a, b), alpha=scale)
    return out
