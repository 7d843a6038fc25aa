"""PPO-clipped GRPO objective on per-step transition log-probs (FlowGRPO), and FlowGRPO's KL term.

References (facts, not code): yifan123/flow_grpo `scripts/train_sd3.py` (the loss, its KL between the SDE
transition means) and `flow_grpo/diffusers_patch/sd3_sde_with_logprob.py` (the SDE step, solrl/sampling/steps.py).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, dict[str, float]]:
    """mean(max(-A * ratio, -A * clamp(ratio, 1 - c, 1 + c))), ratio = exp(log_prob - old_log_prob).

    A is clamped to [-adv_clip_max, adv_clip_max]; old_log_prob and advantages are constants.
    Same form as yifan123/flow_grpo's trainer. Stats: policy, clip_frac (|ratio - 1| > c),
    approx_kl (0.5 * mean((log_prob - old)^2)), ratio_mean.
    """
    for name, tensor in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(tensor).__name__}")
        if tensor.shape != log_prob.shape:
            raise ValueError(
                f"{name} must have the shape of log_prob {tuple(log_prob.shape)}, got {tuple(tensor.shape)}"
            )
    for name, value in (("clip_range", clip_range), ("adv_clip_max", adv_clip_max)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    adv = advantages.detach().clamp(-adv_clip_max, adv_clip_max)
    delta = log_prob - old_log_prob.detach()
    ratio = torch.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    stats = {
        "policy": float(loss.detach()),
        "clip_frac": float(((ratio.detach() - 1.0).abs() > clip_range).double().mean()),
        "approx_kl": float(0.5 * (delta.detach() ** 2).mean()),
        "ratio_mean": float(ratio.detach().mean()),
        "ratio_max_dev": float((ratio.detach().double() - 1.0).abs().max()) if ratio.numel() else 0.0,
    }
    return loss, stats


def mean_kl(mean: Tensor, mean_ref: Tensor, noise_scale: Tensor | float) -> Tensor:
    """FlowGRPO's KL to the reference model, per sample [B]: mean over latent elements of
    (mean - mean_ref)^2 / (2 g^2), g = eta * sqrt(s / (1 - s)) the step's noise scale (`SDEStep.noise_scale`).

    This is the form of yifan123/flow_grpo `scripts/train_sd3.py` (`kl_loss`), which divides by its `std_dev_t`,
    i.e. g, not by the transition's variance g^2 |dt|: the exact KL between N(mean, g^2|dt|) and
    N(mean_ref, g^2|dt|) is this times 1 / |dt|. mean_ref is a constant (no gradient flows into it)."""
    for name, tensor in (("mean", mean), ("mean_ref", mean_ref)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(tensor).__name__}")
    if mean_ref.shape != mean.shape or mean.ndim < 2:
        raise ValueError(f"mean and mean_ref must be [B, ...] of one shape, got {tuple(mean.shape)} and "
                         f"{tuple(mean_ref.shape)}")
    dims = tuple(range(1, mean.ndim))
    return ((mean - mean_ref.detach()) ** 2 / (2.0 * torch.as_tensor(noise_scale, dtype=mean.dtype) ** 2)).mean(dim=dims)


def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    mean_ref: Tensor | None,
    noise_scale: Tensor | float,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """FlowGRPO's loss for a batch of (sample, step) rows: grpo_loss + kl_beta * mean(mean_kl), as
    yifan123/flow_grpo `scripts/train_sd3.py` (its `train.beta` is kl_beta). mean_ref may be None when
    kl_beta is 0 (no reference forward). Stats: grpo_loss's, plus kl and loss."""
    if isinstance(kl_beta, bool) or not isinstance(kl_beta, numbers.Real) or not math.isfinite(kl_beta) or kl_beta < 0:
        raise ValueError(f"kl_beta must be a finite float >= 0, got {kl_beta!r}")
    policy, stats = grpo_loss(log_prob, old_log_prob, advantages, clip_range, adv_clip_max)
    if kl_beta > 0:
        if mean_ref is None:
            raise ValueError("mean_ref is required when kl_beta > 0")
        kl = mean_kl(mean, mean_ref, noise_scale).mean()
        loss = policy + kl_beta * kl
    else:
        kl, loss = torch.zeros((), dtype=policy.dtype), policy
    stats.update({"kl": float(kl.detach()), "loss": float(loss.detach())})
    return loss, stats
