"""Per-layer precision policies and the share of a forward's work each one quantizes.

A policy is the part of a `PrecisionConfig` that says which Linear layers stay in high precision: skip
patterns, the size threshold and the first / last blocks kept. `POLICIES` names the ones the precision
studies compare; every policy starts from the model's own skip list and threshold (the reference's rule,
from the model spec) and adds to it, except `no-threshold`, which drops the threshold. `extra_skip` patterns
name layer kinds and need not match in every model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from types import SimpleNamespace
from typing import Any

import torch

from solrl.precision.base import (
    PrecisionConfig,
    denoiser_blocks,
    layer_macs,
    with_model_skips,
)
from solrl.precision.config import kernel_backend
from solrl.precision.registry import build_backend

log = logging.getLogger(__name__)

POLICIES: dict[str, dict[str, Any]] = {
    "reference": {},
    "keep-first-block": {"keep_first_blocks": 1},
    "keep-last-block": {"keep_last_blocks": 1},
    "keep-first-and-last": {"keep_first_blocks": 1, "keep_last_blocks": 1},
    "no-threshold": {"min_features": 0},
    # the attention blocks' input / output projections: on the bundled UNet 2.6% of the forward's work and most
    # of the NVFP4 explorer's image error (benchmarks/results/sensitivity.md)
    "keep-projections": {"extra_skip": ("*proj_in", "*proj_out")},
}


def machine_backend(backend: str, device: torch.device | str | None = None) -> str:
    """`kernel_backend` for the GPU `device` (its capability, whether Transformer Engine is installed), logging the
    choice; `backend` unchanged for a CPU device. No device: where models load by default (CUDA when present)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return backend
    chosen, why = kernel_backend(backend, torch.cuda.get_device_capability(torch.device(device)),
                                 importlib.util.find_spec("transformer_engine") is not None)
    if chosen != backend:
        log.warning("precision: %s", why)
    return chosen


def policy_config(backend: str, policy: str, spec, device: torch.device | str | None = None) -> PrecisionConfig:
    """The explorer precision of `backend` under the named policy for a model with this spec: the adaptive proxy's
    candidates. On a CUDA `device` (the explorer's; default: CUDA when present) an emulation resolves to this GPU's
    kernel (`machine_backend`); an explicitly configured explore_precision is built as named, not through here."""
    if policy not in POLICIES:
        raise ValueError(f"unknown precision policy {policy!r}; available: {sorted(POLICIES)}")
    backend = machine_backend(backend, device)
    cfg = with_model_skips(PrecisionConfig(backend=backend), spec.quant_skip, spec.quant_min_features)
    settings = dict(POLICIES[policy])
    extra = tuple(settings.pop("extra_skip", ()))  # patterns of layer kinds: not every model has them
    return dataclasses.replace(cfg, model_skip=cfg.model_skip + extra, **settings)


def share_report(model, backend: str = "nvfp4-emu", policies: tuple[str, ...] = tuple(POLICIES)) -> dict[str, Any]:
    """For each policy: layers quantized, and the share of one forward's Linear multiply-accumulates (and of its
    Linear + Conv2d ones) that the backend quantizes. One forward of one sample at the model's latent size."""
    spec = model.spec
    x = torch.zeros(1, *spec.latent_shape)
    cond = model.encode(["a red circle"]) if spec.name == "shapes" else model.encode_uncond(1)
    return module_share_report(spec.name, model.transformer,
                               lambda: model.velocity(model.transformer, x, torch.tensor([0.5]), cond),
                               spec, backend, policies)


def architecture_share_report(name: str, backend: str = "nvfp4-emu",
                              policies: tuple[str, ...] = tuple(POLICIES)) -> dict[str, Any]:
    """share_report for a real model from its architecture alone (meta device: no weights needed)."""
    from solrl.models.architectures import meta_denoiser
    from solrl.models.diffusers_t2i import FAMILIES

    module, run = meta_denoiser(name)
    fam = FAMILIES[name]
    spec = SimpleNamespace(quant_skip=fam.quant_skip, quant_min_features=fam.quant_min_features)
    r = module_share_report(name, module, run, spec, backend, policies)
    r["resolution"] = fam.resolution
    return r


def module_share_report(name: str, module, run, spec, backend: str, policies: tuple[str, ...]) -> dict[str, Any]:
    macs = layer_macs(module, run)
    linear = {n: v for n, v in macs.items() if isinstance(module.get_submodule(n), torch.nn.Linear)}
    rows = []
    for policy in policies:
        cfg = policy_config(backend, policy, spec)
        selected = [n for n in build_backend(cfg).selected_layers(module) if n in macs]
        q = sum(macs[n] for n in selected)
        rows.append({"policy": policy, "layers": len(selected), "linear_layers": len(linear),
                     "linear_share": q / max(1, sum(linear.values())), "all_share": q / max(1, sum(macs.values())),
                     "settings": POLICIES[policy]})
    return {"model": name, "backend": backend, "blocks": len(denoiser_blocks(module)),
            "linear_macs": sum(linear.values()), "all_macs": sum(macs.values()), "policies": rows}


def format_report(r: dict[str, Any]) -> str:
    at = f" at {r['resolution']} px" if "resolution" in r else ""
    lines = [f"{r['model']} ({r['blocks']} blocks; one forward{at}: {r['linear_macs'] / 1e9:.3g} G Linear MACs of "
             f"{r['all_macs'] / 1e9:.3g} G Linear + Conv2d), backend {r['backend']}:",
             f"  {'policy':<22}{'layers':>12}{'Linear MACs quantized':>24}{'all MACs quantized':>21}"]
    for p in r["policies"]:
        lines.append(f"  {p['policy']:<22}{p['layers']:>5} of {p['linear_layers']:<5}{p['linear_share']:>23.2%}"
                     f"{p['all_share']:>21.2%}")
    return "\n".join(lines)
