"""`jpeg_compressibility`: the DDPO reward (smaller JPEG file = higher reward). Needs no weights."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from solrl.rewards.inputs import check_images


class JpegCompressibility:
    """score = -(JPEG size in KiB at quality 95); DDPO uses the same negative-size form."""

    name = "jpeg_compressibility"
    needs_weights = False

    def __init__(self, quality: int = 95) -> None:
        if not 1 <= quality <= 100:
            raise ValueError(f"quality must be in [1, 100], got {quality}")
        self.quality = quality

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        images = check_images(images, len(prompts))
        out = np.empty(len(images), dtype=np.float32)
        for i, img in enumerate(images):
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=self.quality)
            out[i] = -buf.tell() / 1024.0
        return out
