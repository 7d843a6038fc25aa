"""The model interface every text-to-image (and text-to-video) model of the registry implements.

The loop, rollouts and trainer see a model only through this interface: a denoiser (`transformer`, a
diffusers model that gets the LoRA), prompt encoding, a velocity call, and decoding to images.
Conventions: rectified flow, t in [0, 1] with t = 1 pure noise, the denoiser predicts v = noise - x0.
Latents are [B, C, H, W] for an image model and [B, C, F, H, W] for a video model (F latent frames); the code
that handles latents (seed -> noise, samplers, the trainer's x_t) works on any number of non-batch dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class Cond:
    """Encoded prompts: token embeddings [B, L, D], a padding mask [B, L] (1 = token) and, for models
    that take one (SD3.5, FLUX), a pooled text embedding [B, P]."""

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def index(self, idx: torch.Tensor | list[int] | slice) -> Cond:
        return Cond(self.embeds[idx], self.mask[idx], None if self.pooled is None else self.pooled[idx])

    @staticmethod
    def cat(conds: list[Cond]) -> Cond:
        pooled = [c.pooled for c in conds]
        if any(p is None for p in pooled) and not all(p is None for p in pooled):
            raise ValueError("cannot concatenate Conds with and without a pooled embedding")
        return Cond(torch.cat([c.embeds for c in conds]), torch.cat([c.mask for c in conds]),
                    None if pooled[0] is None else torch.cat(pooled))


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the system needs to know about a model family."""

    name: str
    latent_shape: tuple[int, ...]           # C, H, W of the denoiser's input; C, F, H, W for a video model
    lora_targets: tuple[str, ...]           # peft target module names
    quant_skip: tuple[str, ...]             # fnmatch patterns of Linear layers kept in high precision
    quant_min_features: int                 # Linear layers whose larger dim is below this stay high precision
    default_solver: str                     # "euler" | "dpm2"
    default_shift: float = 1.0

    @property
    def is_video(self) -> bool:
        """Latents with a frame axis [C, F, H, W]: decode gives video frames [B, F, H, W, 3]."""
        return len(self.latent_shape) == 4


class T2IModel:
    """A loaded text-to-image model. Subclasses implement encode / velocity / decode."""

    spec: ModelSpec
    transformer: nn.Module

    def encode(self, prompts: list[str]) -> Cond:
        raise NotImplementedError

    def encode_uncond(self, n: int) -> Cond:
        """The unconditional (empty) prompt, for classifier-free guidance."""
        raise NotImplementedError

    def velocity(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, H, W] -> uint8 images [B, H, W, 3]. A video model: latents [B, C, F, H, W] -> uint8
        frames [B, F', H, W, 3], the frames its rewards score (solrl.rewards.frames)."""
        raise NotImplementedError

    def velocity_fn(self, transformer: nn.Module, cond: Cond) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        return lambda x, t: self.velocity(transformer, x, t, cond)
