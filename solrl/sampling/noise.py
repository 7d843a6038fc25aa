"""Seed -> initial noise, independent of batch composition and device."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

SEED_LIMIT = 2**63


def _check_seed(seed: object, index: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seeds[{index}] must be an int, got {type(seed).__name__}")
    if not 0 <= int(seed) < SEED_LIMIT:
        raise ValueError(f"seeds[{index}] must be in [0, 2**63), got {seed}")
    return int(seed)


def _check_shape(shape_CHW: tuple[int, ...]) -> tuple[int, ...]:
    if not isinstance(shape_CHW, (tuple, list)) or len(shape_CHW) == 0:
        raise ValueError(f"shape_CHW must be a non-empty tuple of ints, got {shape_CHW!r}")
    for dim in shape_CHW:
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim <= 0:
            raise ValueError(f"shape_CHW must hold positive ints, got {shape_CHW!r}")
    return tuple(int(d) for d in shape_CHW)


def noise_for_seeds(
    seeds: Sequence[int],
    shape_CHW: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Tensor:
    """Standard-normal noise [len(seeds), *shape_CHW], one CPU generator per seed.

    Each sample is drawn in float32 on the CPU from `torch.Generator().manual_seed(seed)`, then the
    batch is moved to `device` and cast to `dtype`, so a seed gives the same values in any batch,
    on any device.
    """
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise ValueError(f"seeds must be a sequence of ints, got {type(seeds).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    shape = _check_shape(shape_CHW)
    checked = [_check_seed(seed, i) for i, seed in enumerate(seeds)]
    if not checked:
        return torch.empty((0, *shape), dtype=dtype, device=device)
    samples = [
        torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(seed), dtype=torch.float32)
        for seed in checked
    ]
    return torch.stack(samples).to(device=device, dtype=dtype)
