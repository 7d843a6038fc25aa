"""Guards against reward hacking that act on the trained rewards (`guard` in the run config, docs/training.md).

A guarded sample, one that fails the validity gate (a blank canvas) or whose reference reward is below its floor (the
constrained reward), is scored as the lowest trained reward of its prompt group: its advantage is then never positive,
whatever the trained reward would pay for it, and a group where every sample fails has no advantage at all. Written by
hand: a few lines of numpy, and no library does this to a rollout batch.
"""

from __future__ import annotations

import numpy as np


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
