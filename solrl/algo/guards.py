"""Guards against reward hacking that act on the rollouts (`guard` in the run config, docs/training.md).

The validity gate's checks (`GATE_CHECKS`, by `guard.gate` name): images -> whether each candidate passes. The embedded
loop's explore pass and the explorer service (the name travels in ExploreJob.gate) rank failing candidates out of the
kept best with the same check; the trainer, embedded or as a service, demotes the trained samples that fail it.

A guarded sample, one that fails the validity gate (a blank canvas) or whose reference reward is below its floor (the
constrained reward), is scored as the lowest trained reward of its prompt group: its advantage is then never positive,
whatever the trained reward would pay for it, and a group where every sample fails has no advantage at all. Written by
hand: a few lines of numpy, and no library does this to a rollout batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# an image is flat (one colour, a blank canvas) when its pixel values' standard deviation is below this, on 0..255:
# the shapes bed's blank held-out images measure 2.5-3.7 and nearly all its images of one small object 20 or more
# (runs trained on JPEG compressibility, docs/results.md)
FLAT_STD = 8.0


def is_flat(images: np.ndarray) -> np.ndarray:
    """Per image (uint8 [B, H, W, 3], or clips [B, F, H, W, 3]: all their frames), whether its pixel values have a
    standard deviation below FLAT_STD."""
    images = np.asarray(images)
    if len(images) == 0:
        return np.zeros(0, dtype=bool)
    return images.reshape(len(images), -1).astype(np.float32).std(axis=1) < FLAT_STD


def passes_flat(images: np.ndarray) -> np.ndarray:
    """The "flat" gate: a candidate passes unless it is a blank canvas (`is_flat`)."""
    return ~is_flat(images)


# guard.gate name -> the check (solrl.config.schema.GATES lists the same names, without importing numpy)
GATE_CHECKS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"flat": passes_flat}


def gate_check(name: str, field: str = "guard.gate") -> Callable[[np.ndarray], np.ndarray] | None:
    """The validity gate's check of `name` ("" = none: None); ValueError naming `field` for an unknown one."""
    if not name:
        return None
    try:
        return GATE_CHECKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: unknown validity gate {name!r}; gates: {sorted(GATE_CHECKS)} ('' = off)") from None


def demote(rewards: np.ndarray, bad: np.ndarray) -> tuple[np.ndarray, int]:
    """The rewards [P, k] with every `bad` ([P, k] bool) entry set to its row's lowest reward (of all k, the failing
    ones too), and how many were set. A copy; `rewards` is left as it is."""
    rewards = np.asarray(rewards)
    bad = np.asarray(bad, dtype=bool)
    if rewards.ndim != 2 or bad.shape != rewards.shape:
        raise ValueError(f"rewards and bad must be [P, k] arrays of one shape, got {rewards.shape} and {bad.shape}")
    out = rewards.copy()
    lowest = np.broadcast_to(rewards.min(axis=1, keepdims=True), rewards.shape)
    out[bad] = lowest[bad]
    return out, int(bad.sum())


def below_floor(scores: np.ndarray, floor: float) -> np.ndarray:
    """Which reference scores fall below the constrained reward's floor."""
    return np.asarray(scores, dtype=np.float64) < float(floor)
