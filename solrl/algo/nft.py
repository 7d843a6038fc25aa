"""The DiffusionNFT objective, as the reference trainer implements it.

Reference: NVlabs/DiffusionNFT `scripts/train_nft_sd3.py` (same loss in NVlabs/Sana
`train_scripts/sol_rl/train_sana.py`); summary in docs/method.md.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

WEIGHT_FLOOR = 1e-5  # the reference's minimum for the adaptive per-sample weight


@dataclass(frozen=True)
class NFTConfig:
    """beta: guidance strength of the implicit policies; adv_clip_max: advantage clip (also the
    loss scale); kl_beta: weight of the velocity-space KL to the reference model;
    timestep_fraction: share of the rollout grid trained on per sample."""

    beta: float = 1.0
    adv_clip_max: float = 5.0
    kl_beta: float = 1e-4
    timestep_fraction: float = 0.6

    def __post_init__(self) -> None:
        for name, low_ok in (("beta", False), ("adv_clip_max", False), ("kl_beta", True)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite float, got {value!r}")
            if value < 0 or (value == 0 and not low_ok):
                raise ValueError(f"{name} must be {'>= 0' if low_ok else '> 0'}, got {value!r}")
        _check_fraction(self.timestep_fraction, "timestep_fraction")


def _check_fraction(fraction: float, name: str) -> None:
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {fraction!r}")


def _branch_loss(v_branch: Tensor, x0: Tensor, x_t: Tensor, t: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Per-sample squared x0 error of one implicit policy, over its detached mean |error| (float64)."""
    x0_hat = x_t - t * v_branch
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    x0: Tensor,
    x_t: Tensor,
    t_B: Tensor,
    v: Tensor,
    v_old: Tensor,
    v_ref: Tensor | None,
    advantages_B: Tensor,
    cfg: NFTConfig = NFTConfig(),
) -> tuple[Tensor, dict[str, float]]:
    """DiffusionNFT loss for one timestep of a micro-batch; returns (scalar loss, stats).

    x0: clean rollout latents; x_t = (1 - t) x0 + t noise; v: trainable velocity; v_old / v_ref:
    the old-adapter and adapter-free velocities (used as constants); v_ref None: no KL term, and no reference
    forward needed (cfg.kl_beta must be 0; the stats then carry no "kl"). r = clamp(clamp(A)/M/2 + 1/2, 0, 1),
    v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v, each compared in x0 space with an
    adaptive weight; loss = M * mean((r L+ + (1 - r) L-) / beta) + kl_beta * mean((v - v_ref)^2).
    A non-finite loss becomes an exact zero that is still connected to v (backward gives zero grads,
    where the reference's `loss * 0.0` would give NaN grads). The loss is float64, as the
    reference's float64 weight makes it.
    """
    if not isinstance(cfg, NFTConfig):
        raise TypeError(f"cfg must be an NFTConfig, got {type(cfg).__name__}")
    if v_ref is None and cfg.kl_beta > 0:
        raise ValueError(f"v_ref is None but kl_beta={cfg.kl_beta}: the KL term needs the reference velocity")
    tensors = (("x0", x0), ("x_t", x_t), ("v", v), ("v_old", v_old)) + ((("v_ref", v_ref),) if v_ref is not None else ())
    for name, tensor in tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(tensor).__name__}")
        if tensor.shape != x0.shape:
            raise ValueError(f"{name} must have the shape of x0 {tuple(x0.shape)}, got {tuple(tensor.shape)}")
    if x0.ndim < 2:
        raise ValueError(f"x0 must be [B, ...] with at least one non-batch dim, got shape {tuple(x0.shape)}")
    batch = x0.shape[0]
    for name, tensor in (("t_B", t_B), ("advantages_B", advantages_B)):
        if not isinstance(tensor, Tensor) or tensor.shape != (batch,):
            got = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a Tensor of shape ({batch},), got {got}")

    dims = tuple(range(1, x0.ndim))
    beta, clip = cfg.beta, cfg.adv_clip_max
    t = t_B.reshape(-1, *([1] * (x0.ndim - 1)))
    v_old = v_old.detach()
    advantages = advantages_B.detach()
    adv_clipped = advantages.clamp(-clip, clip)
    r = (adv_clipped / clip / 2.0 + 0.5).clamp(0.0, 1.0)

    positive_loss = _branch_loss(beta * v + (1.0 - beta) * v_old, x0, x_t, t, dims)
    negative_loss = _branch_loss((1.0 + beta) * v_old - beta * v, x0, x_t, t, dims)
    per_sample = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    policy = (per_sample * clip).mean()
    kl = ((v - v_ref.detach()) ** 2).mean(dim=dims).mean() if v_ref is not None else None
    loss = policy + cfg.kl_beta * kl if kl is not None else policy
    finite = bool(torch.isfinite(loss))
    if not finite:
        loss = v.reshape(-1)[:0].sum().to(loss.dtype)  # exact zero, grad_fn into v, zero grads
    stats = {
        "policy": float(policy.detach()),
        "loss": float(loss.detach()),
        "adv_clip_frac": float((advantages.abs() > clip).double().mean()),
        "r_mean": float(r.double().mean()),
        "nonfinite": 0.0 if finite else 1.0,
        # how far the trained velocity has moved from the old adapter's (mean squared difference): the drift one
        # optimizer step buys, measured without the reference forward the KL term needs
        "drift_old": float(((v.detach() - v_old) ** 2).mean()),
    }
    if kl is not None:
        stats["kl"] = float(kl.detach())
    return loss, stats


def timestep_count(num_steps: int, fraction: float) -> int:
    """How many grid timesteps each sample trains on: max(1, int(num_steps * fraction))."""
    return max(1, int(num_steps * fraction))


def timestep_indices(num_steps: int, fraction: float, generator: torch.Generator | None) -> list[int]:
    """A random subset of the rollout grid's step indices, of size max(1, int(num_steps * fraction)).

    The reference trains each sample on the first int(num_steps * timestep_fraction) entries of a
    fresh permutation of its grid (truncating, e.g. 10 * 0.6 -> 6, 10 * 0.4 -> 4); the floor of 1 is ours.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    _check_fraction(fraction, "fraction")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return torch.randperm(int(num_steps), generator=generator).tolist()[:timestep_count(num_steps, fraction)]
