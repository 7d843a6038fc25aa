"""What every reward checks first: a batch of images as the scorers take it, and the error for a prompt a reward
cannot read."""

from __future__ import annotations

import numpy as np


class PromptError(ValueError):
    """A prompt a reward cannot read: a caption not in the shapes grammar (solrl/shapes/world.py), a prompt without
    the quoted text the OCR reward needs."""


def check_images(images: np.ndarray, n_prompts: int | None = None) -> np.ndarray:
    """Validate a batch of images: numpy uint8, [B, H, W, 3], B matching the prompts."""
    if not isinstance(images, np.ndarray):
        raise TypeError(f"images must be a numpy array, got {type(images).__name__}")
    if images.dtype != np.uint8:
        raise TypeError(f"images must have dtype uint8, got {images.dtype}")
    if images.ndim != 4 or images.shape[-1] != 3 or images.shape[1] < 4 or images.shape[2] < 4:
        raise ValueError(f"images must have shape [B, H, W, 3] (H, W >= 4), got {list(images.shape)}")
    if n_prompts is not None and images.shape[0] != n_prompts:
        raise ValueError(f"got {images.shape[0]} images but {n_prompts} prompts")
    return images
