"""Reward scorers, found by name. A scorer maps (uint8 images [B,H,W,3], prompts) -> float32 scores [B]."""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from solrl.rewards.jpeg import JpegCompressibility
from solrl.rewards.shapes import ShapesReward, check_images


class Scorer(Protocol):
    name: str

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray: ...


_REGISTRY: dict[str, Callable[[], Scorer]] = {
    "shapes": ShapesReward,
    "jpeg_compressibility": JpegCompressibility,
}


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def build_reward(name: str) -> Scorer:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; available: {available_rewards()}")
    return _REGISTRY[name]()


def register_reward(name: str, factory: Callable[[], Scorer]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    _REGISTRY[name] = factory


__all__ = ["Scorer", "available_rewards", "build_reward", "register_reward", "check_images"]
