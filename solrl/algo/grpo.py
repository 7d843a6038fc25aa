"""PPO-clipped GRPO objective on per-step transition log-probs (FlowGRPO)."""

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
    }
    return loss, stats
