"""Group-relative advantages."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def compute_advantages(
    rewards_N: Sequence[float] | Tensor,
    group_ids_N: Sequence[Hashable] | Tensor,
    eps: float = 1e-4,
    std: str = "global",
) -> Tensor:
    """A = (r - mean of r's group) / (std + eps), float64 [N].

    std="global": the population std (ddof=0) over the whole batch: the reference tracker
    (NVlabs/DiffusionNFT `flow_grpo/stat_tracking.py`, `global_std=True`) uses `np.std`, whose
    default is ddof=0, not torch.std's unbiased ddof=1. std="prompt": each group's own population std,
    as that tracker with `global_std=False` (yifan123/flow_grpo's per-prompt stat tracking). Groups are
    usually prompts.
    """
    source = rewards_N.detach().cpu() if isinstance(rewards_N, Tensor) else rewards_N
    rewards = torch.as_tensor(source, dtype=torch.float64)
    if rewards.ndim != 1 or rewards.numel() == 0:
        raise ValueError(f"rewards_N must be a non-empty 1-D sequence, got shape {tuple(rewards.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards_N must be finite")
    groups = group_ids_N.detach().cpu().tolist() if isinstance(group_ids_N, Tensor) else list(group_ids_N)
    if len(groups) != rewards.numel():
        raise ValueError(f"group_ids_N must have {rewards.numel()} entries (one per reward), got {len(groups)}")
    if not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    if std not in ("global", "prompt"):
        raise ValueError(f"std must be 'global' or 'prompt', got {std!r}")

    index_of: dict[Hashable, int] = {}
    group_index = torch.tensor([index_of.setdefault(g, len(index_of)) for g in groups], dtype=torch.long)
    sums = torch.zeros(len(index_of), dtype=torch.float64).index_add_(0, group_index, rewards)
    counts = torch.bincount(group_index, minlength=len(index_of)).to(torch.float64)
    group_mean = (sums / counts)[group_index]
    if std == "global":
        return (rewards - group_mean) / (rewards.std(correction=0) + eps)
    sq = torch.zeros(len(index_of), dtype=torch.float64).index_add_(0, group_index, (rewards - group_mean) ** 2)
    return (rewards - group_mean) / ((sq / counts).sqrt()[group_index] + eps)


def threshold_groups(
    advantages_N: Tensor,
    rewards_N: Sequence[float] | Tensor,
    group_ids_N: Sequence[Hashable] | Tensor,
    threshold: float | None,
) -> tuple[Tensor, int]:
    """Zero the advantages of every group whose mean reward is below `threshold` (None: unchanged).

    The reward-threshold filter of the MMDanceGRPO design (shared/seeds, `_compute_grpo_advantages`: a group
    whose mean reward is below `reward_threshold` gets all-zero advantages, "filter low-quality samples").
    Returns the advantages and how many groups were zeroed."""
    if threshold is None:
        return advantages_N, 0
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite float or None, got {threshold!r}")
    rewards = torch.as_tensor(rewards_N.detach().cpu() if isinstance(rewards_N, Tensor) else rewards_N,
                              dtype=torch.float64)
    groups = group_ids_N.detach().cpu().tolist() if isinstance(group_ids_N, Tensor) else list(group_ids_N)
    if rewards.shape != advantages_N.shape or len(groups) != rewards.numel():
        raise ValueError(f"advantages_N, rewards_N and group_ids_N must have one entry per sample, got "
                         f"{tuple(advantages_N.shape)}, {tuple(rewards.shape)} and {len(groups)}")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    low = [idx for idx in members.values() if float(rewards[idx].mean()) < threshold]
    out = advantages_N.clone()
    for idx in low:
        out[idx] = 0.0
    return out, len(low)
