"""The model interface every text-to-image (and text-to-video) model of the registry implements.

The loop, rollouts and trainer see a model only through this interface: a denoiser (`transformer`, a
diffusers model that gets the LoRA), prompt encoding, a velocity call, and decoding to images.
Conventions: rectified flow, t in [0, 1] with t = 1 pure noise, the denoiser predicts v = noise - x0.
Latents are [B, C, H, W] for an image model and [B, C, F, H, W] for a video model (F latent frames); the code
that handles latents (seed -> noise, samplers, the trainer's x_t) works on any number of non-batch dims.
"""

from __future__ import annotations

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

    def to(self, device: torch.device | str, copy: bool = False) -> Cond:
        """The same rows on `device` (`copy`: new tensors even where they are there already)."""
        return Cond(self.embeds.to(device, copy=copy), self.mask.to(device, copy=copy),
                    None if self.pooled is None else self.pooled.to(device, copy=copy))

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


def compute_device(module: nn.Module) -> torch.device:
    """Where a denoiser computes: the device of its first floating parameter (CPU for a module without one)."""
    return next((p.device for p in module.parameters() if p.is_floating_point()), torch.device("cpu"))


class Velocity:
    """A denoiser seen as v = f(x_B..., t_B) for fixed encoded prompts (what `T2IModel.velocity_fn` returns).

    `device` is where the denoiser computes, so the sampler keeps its state there (solrl.sampling.sample);
    `paired(uncond)` is the one Velocity over uncond's rows then these, which classifier-free guidance runs as a
    single batched forward (solrl.sampling.cfg_velocity)."""

    def __init__(self, model: T2IModel, transformer: nn.Module, cond: Cond) -> None:
        self.model, self.transformer, self.cond = model, transformer, cond

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.model.velocity(self.model.denoiser(self.transformer), x, t, self.cond)

    @property
    def device(self) -> torch.device:
        return compute_device(self.transformer)

    def paired(self, uncond: object) -> Velocity | None:
        """`joined(uncond)` on a GPU; None on the CPU, which keeps its two forwards: batching both branches changes
        the CPU GEMMs' blocking and so the last bits (measured on the tiny SANA / SD3 / FLUX and shapes models:
        up to 1e-6 apart), and the CPU runs are the bit-for-bit references."""
        return None if self.device.type == "cpu" else self.joined(uncond)

    def joined(self, uncond: object) -> Velocity | None:
        """[uncond's rows; these rows] in one Velocity, or None where the two cannot share a forward: another model
        or denoiser, or text of another length or kind."""
        if not (isinstance(uncond, Velocity) and uncond.model is self.model and uncond.transformer is self.transformer):
            return None
        a, b = uncond.cond, self.cond
        if a.embeds.shape[1:] != b.embeds.shape[1:] or (a.pooled is None) != (b.pooled is None):
            return None
        # the prompts may be cached elsewhere
        return Velocity(self.model, self.transformer, Cond.cat([a.to(b.embeds.device), b]))


class T2IModel:
    """A loaded text-to-image model. Subclasses implement encode / velocity / decode."""

    spec: ModelSpec
    transformer: nn.Module

    def encode(self, prompts: list[str]) -> Cond:
        raise NotImplementedError

    def encode_uncond(self, n: int) -> Cond:
        """The unconditional (empty) prompt for classifier-free guidance, n rows: encoded once (`encode_empty`) and
        repeated, as the reference does (flow_grpo encodes its negative prompt once per run). Not kept while the
        text encoder trains (`uncond_cacheable`)."""
        one = getattr(self, "_uncond", None)
        if one is None:
            one = self.encode_empty()
            if self.uncond_cacheable():
                self._uncond = one
        return one.index([0] * n)

    def encode_empty(self) -> Cond:
        """The unconditional prompt, one row (the empty prompt by default)."""
        return self.encode([""])

    def uncond_cacheable(self) -> bool:
        """Whether `encode_empty`'s result may be kept for the run (True: the text encoders are frozen)."""
        return True

    compile_options: dict | None = None   # set by `compile_denoiser`: sampling runs torch.compile'd denoisers

    def compile_denoiser(self, **options) -> None:
        """Sample through `torch.compile(denoiser, **options)` from now on (`model.compile`; GPU roles): every
        denoiser a `Velocity` calls (the served copy, the base) is compiled on first use, where it computes."""
        device = compute_device(self.transformer)
        if device.type != "cuda":
            raise ValueError(f"model.compile: torch.compile of the denoiser is for GPU roles; this model computes on "
                             f"{device} (on the CPU it compiles for minutes and the CPU runs are the bit-for-bit "
                             f"references): leave model.compile off or set model.device=cuda")
        self.compile_options = dict(options)

    def denoiser(self, transformer: nn.Module) -> nn.Module:
        """`transformer` as sampling runs it: compiled once per module with `compile_denoiser`'s options (the
        wrapper is kept on the module: no cache outlives it; a deep copy compiles its own), else as is."""
        if self.compile_options is None or "_orig_mod" in transformer._modules or getattr(transformer, "EXPERTS", None):
            return transformer   # off, compiled already, or a container of experts (the model compiles each it calls)
        held = transformer.__dict__.get("_solrl_compiled")
        if held is None or held.module is None:
            held = transformer.__dict__["_solrl_compiled"] = _Compiled(torch.compile(transformer, **self.compile_options))
        return held.module

    def velocity(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, H, W] -> uint8 images [B, H, W, 3]. A video model: latents [B, C, F, H, W] -> uint8
        frames [B, F', H, W, 3], the frames its rewards score (solrl.rewards.frames)."""
        raise NotImplementedError

    def velocity_fn(self, transformer: nn.Module, cond: Cond) -> Velocity:
        return Velocity(self, transformer, cond)


class _Compiled:
    """A module's compiled wrapper, kept on the module; a deep copy of the module gets an empty one (and compiles
    its own on first use)."""

    def __init__(self, module: nn.Module | None) -> None:
        self.module = module

    def __deepcopy__(self, memo: dict) -> _Compiled:
        return _Compiled(None)
