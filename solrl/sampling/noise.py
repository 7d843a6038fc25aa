"""Seed -> initial noise, independent of batch composition and device.

Shapes are any latent shape: [C, H, W] for an image model, [C, F, H, W] for a video model (a seed's noise is
drawn in one call over the whole clip, so it is the same whatever the batch). The argument keeps its historical
name `shape_CHW`.
"""

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
    """Standard-normal noise [len(seeds), *shape_CHW], one CPU generator per seed (shape_CHW: the latent shape,
    [C, H, W] or a video's [C, F, H, W]).

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


class SeedNoise:
    """Per-seed noise streams for SDE sampling: one CPU generator per seed, seeded with it.

    The first draw of each stream is the seed's initial noise, the very values `noise_for_seeds` gives; every
    later `step()` draws the next standard-normal tensor of each stream (the noise of the next SDE step). So the
    noise of a seed at any step depends on the seed and the step alone: not on which other seeds share the
    batch, and not on the device (drawn in float32 on the CPU, then moved and cast, as `noise_for_seeds`).
    """

    def __init__(self, seeds: Sequence[int], shape_CHW: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
            raise ValueError(f"seeds must be a sequence of ints, got {type(seeds).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.shape = _check_shape(shape_CHW)
        self.dtype, self.device = dtype, device
        self._generators = [torch.Generator(device="cpu").manual_seed(_check_seed(s, i)) for i, s in enumerate(seeds)]
        self.draws = 0  # how many tensors each stream has given (1: the initial noise)

    def _draw(self) -> Tensor:
        self.draws += 1
        if not self._generators:
            return torch.empty((0, *self.shape), dtype=self.dtype, device=self.device)
        return torch.stack([torch.randn(self.shape, generator=g, dtype=torch.float32)
                            for g in self._generators]).to(device=self.device, dtype=self.dtype)

    def initial(self) -> Tensor:
        """[len(seeds), *shape_CHW]: the initial noise (must be the first draw)."""
        if self.draws:
            raise RuntimeError("initial() must be the first draw of the streams")
        return self._draw()

    def step(self) -> Tensor:
        """The next step's noise, [len(seeds), *shape_CHW] (after initial())."""
        if not self.draws:
            raise RuntimeError("draw initial() before the steps' noise")
        return self._draw()
