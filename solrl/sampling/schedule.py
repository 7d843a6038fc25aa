"""Flow-matching sigma grids."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def flow_sigmas(num_steps: int, shift: float = 1.0) -> Tensor:
    """float64 sigmas linspace(1, 0, num_steps + 1), optionally SD3-shifted.

    The shift is the one diffusers' FlowMatchEulerDiscreteScheduler applies:
    sigma' = shift * sigma / (1 + (shift - 1) * sigma); it keeps 1 -> 1 and 0 -> 0.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a finite float > 0, got {shift!r}")
    sigmas = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float64)
    if shift != 1.0:
        sigmas = shift * sigmas / (1.0 + (shift - 1.0) * sigmas)
    return sigmas
