"""Decay schedules for the "old" (rollout) adapter and the evaluation EMA, and the in-place blend."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch
from torch import Tensor

OLD_DECAY_RATE = 0.001  # reference decay_type 1: linear ramp 0.001 per step ...
OLD_DECAY_MAX = 0.5  # ... capped at 0.5


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return int(step)


def old_decay(step: int) -> float:
    """Decay d of the old adapter after optimizer step `step`: min(0.001 * step, 0.5)."""
    return min(OLD_DECAY_RATE * _check_step(step), OLD_DECAY_MAX)


def ema_decay(step: int, max_decay: float = 0.9) -> float:
    """Warmed-up EMA decay min((1 + step) / (10 + step), max_decay), as the reference EMA wrapper."""
    step = _check_step(step)
    if isinstance(max_decay, bool) or not isinstance(max_decay, numbers.Real) or not 0 <= max_decay <= 1:
        raise ValueError(f"max_decay must be in [0, 1], got {max_decay!r}")
    return min((1 + step) / (10 + step), float(max_decay))


def lerp_params_(target: Iterable[Tensor], source: Iterable[Tensor], decay: float) -> None:
    """In place, without autograd: target <- decay * target + (1 - decay) * source."""
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not math.isfinite(decay):
        raise ValueError(f"decay must be a finite float, got {decay!r}")
    if not 0 <= decay <= 1:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    targets, sources = list(target), list(source)
    if len(targets) != len(sources):
        raise ValueError(f"target and source must hold as many tensors, got {len(targets)} and {len(sources)}")
    for i, (t, s) in enumerate(zip(targets, sources)):
        if t.shape != s.shape:
            raise ValueError(f"target[{i}] and source[{i}] shapes differ: {tuple(t.shape)} vs {tuple(s.shape)}")
    with torch.no_grad():
        for t, s in zip(targets, sources):
            t.lerp_(s.detach().to(device=t.device, dtype=t.dtype), 1.0 - float(decay))
