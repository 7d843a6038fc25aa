"""Per-layer precision policies and the share of a forward's work each one quantizes.

A policy is the part of a `PrecisionConfig` that says which Linear layers stay in high precision: skip
patterns, the size threshold and the first / last blocks kept. `POLICIES` names the ones the precision
studies compare; every policy starts from the model's own skip list and threshold (the reference's rule,
from the model spec) and adds to it, except `no-threshold`, which drops the threshold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from solrl.precision.base import (
    PrecisionConfig,
    build_backend,
    denoiser_blocks,
    layer_macs,
    with_model_skips,
)

POLICIES: dict[str, dict[str, Any]] = {
    "reference": {},
    "keep-first-block": {"keep_first_blocks": 1},
    "keep-last-block": {"keep_last_blocks": 1},
    "keep-first-and-last": {"keep_first_blocks": 1, "keep_last_blocks": 1},
    "no-threshold": {"min_features": 0},
}


def policy_config(backend: str, policy: str, spec) -> PrecisionConfig:
    """The explorer precision of `backend` under the named policy for a model with this spec."""
    if policy not in POLICIES:
        raise ValueError(f"unknown precision policy {policy!r}; available: {sorted(POLICIES)}")
    cfg = with_model_skips(PrecisionConfig(backend=backend), spec.quant_skip, spec.quant_min_features)
    return dataclasses.replace(cfg, **POLICIES[policy])


def share_report(model, backend: str = "nvfp4-emu", policies: tuple[str, ...] = tuple(POLICIES)) -> dict[str, Any]:
    """For each policy: layers quantized, and the share of one forward's Linear multiply-accumulates (and of its
    Linear + Conv2d ones) that the backend quantizes. One forward of one sample at the model's latent size."""
    spec = model.spec
    x = torch.zeros(1, *spec.latent_shape)
    cond = model.encode(["a red circle"]) if spec.name == "shapes" else model.encode_uncond(1)
    macs = layer_macs(model.transformer,
                      lambda: model.velocity(model.transformer, x, torch.tensor([0.5]), cond))
    linear = {n: v for n, v in macs.items() if isinstance(model.transformer.get_submodule(n), torch.nn.Linear)}
    rows = []
    for policy in policies:
        cfg = policy_config(backend, policy, spec)
        selected = [n for n in build_backend(cfg).selected_layers(model.transformer) if n in macs]
        q = sum(macs[n] for n in selected)
        rows.append({"policy": policy, "layers": len(selected), "linear_layers": len(linear),
                     "linear_share": q / max(1, sum(linear.values())), "all_share": q / max(1, sum(macs.values())),
                     "settings": POLICIES[policy]})
    return {"model": spec.name, "backend": backend, "blocks": len(denoiser_blocks(model.transformer)),
            "linear_macs": sum(linear.values()), "all_macs": sum(macs.values()), "policies": rows}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{r['model']} ({r['blocks']} blocks; one forward: {r['linear_macs'] / 1e6:.1f}M Linear MACs of "
             f"{r['all_macs'] / 1e6:.1f}M Linear + Conv2d), backend {r['backend']}:",
             f"  {'policy':<22}{'layers':>12}{'Linear MACs quantized':>24}{'all MACs quantized':>21}"]
    for p in r["policies"]:
        lines.append(f"  {p['policy']:<22}{p['layers']:>5} of {p['linear_layers']:<5}{p['linear_share']:>23.2%}"
                     f"{p['all_share']:>21.2%}")
    return "\n".join(lines)
