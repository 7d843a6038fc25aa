"""Wan2.2 text-to-video on diffusers' `WanPipeline`: the single-transformer TI2V-5B and the two-expert T2V-A14B.

Components (diffusers layout, `Wan-AI/Wan2.2-TI2V-5B-Diffusers`, `Wan-AI/Wan2.2-T2V-A14B-Diffusers`):
`WanTransformer3DModel` denoiser(s), `AutoencoderKLWan` (a causal 3-D VAE: 4x in time, 8x (A14B, Wan2.1 VAE)
or 16x (TI2V-5B, Wan2.2 VAE) in space), the UMT5-XXL text encoder and its tokenizer. Only the denoising loop is
ours (solrl.sampling), as for the image families (solrl/models/diffusers_t2i.py), and the same offline rules
hold: a local directory or the Hugging Face cache, never the network; a clear error naming what is missing.

Latents are [B, C, F, H, W] with F = (frames - 1) / 4 + 1 latent frames, so a clip has frames = 4k + 1.
Convention mapping (diffusers `pipeline_wan.py`): timestep = 1000 t (the scheduler's num_train_timesteps);
TI2V-5B (`expand_timesteps`) takes one timestep per latent token, [B, F * H/2 * W/2], all equal to the row's
timestep in text-to-video. A14B's `transformer` is the high-noise expert, used at timesteps
>= boundary_ratio * 1000, and `transformer_2` the low-noise expert below that; here both live in one module
(`WanExperts`) so that the LoRA, the inference copies, the precision backends and the adapter wire format treat
them as one denoiser, and `velocity` sends each row of a batch to the expert of its own timestep (the trainer's
rows carry different timesteps).

Decoding: `decode` gives the frames the run's rewards score (`reward_frames`, solrl/rewards/frames.py):
"first" decodes the first latent frame only -- the VAE is causal in time, so that is exactly frame 0 of the
whole clip's decode (tests/models/test_wan.py checks it bit for bit) at a fraction of the cost -- and "mean" decodes
every frame; `decode_video` always gives the whole clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from solrl.models.base import Cond, ModelSpec, T2IModel
from solrl.models.diffusers_t2i import Family, _base_param, default_device, resolve_weights
from solrl.rewards.frames import REWARD_FRAMES


@dataclass(frozen=True)
class WanFamily(Family):
    """A Wan2.2 checkpoint: `Family`'s fields plus its clip defaults and experts. Facts from the Wan2.2 repository
    (Wan-Video/Wan2.2 `wan/configs/wan_ti2v_5B.py`, `wan_t2v_A14B.py`, `shared_config.py`, `__init__.py`
    SUPPORTED_SIZES) and the diffusers repos' model_index.json (`boundary_ratio`, `expand_timesteps`)."""

    frames: int = 81                   # frame_num
    height: int = 480
    width: int = 832
    fps: int = 16                      # sample_fps (what the clips are played at)
    experts: tuple[str, ...] = ("transformer",)   # pipeline components that denoise, high-noise expert first
    sample_steps: int = 50             # the original sampler's steps (the presets' evaluation steps)

    def clip(self, frames: int | None = 0, height: int | None = 0, width: int | None = 0) -> tuple[int, int, int]:
        """(frames, height, width) of a clip as asked, each unset one (0 / None) the checkpoint's default."""
        return int(frames or self.frames), int(height or self.height), int(width or self.width)


# Layers kept in high precision by the explorer: the embedders (patch, timestep / text condition), the output
# projection and norms (Wan's are RMSNorm / LayerNorm, no Linear, but the pattern keeps the rule of the image
# families), and any Linear below the model width (its hidden size: 3072 TI2V-5B, 5120 A14B), as the reference's
# thresholds are SANA's and SD3.5's widths (docs/method.md). The leading * lets the patterns match inside the
# A14B's experts (`transformer.blocks...`, `transformer_2.blocks...`).
_WAN_SKIP = ("*patch_embedding*", "*condition_embedder.*", "*proj_out", "*norm*")
# LoRA on the attention projections of every block (self- and cross-attention: attn1 / attn2 .to_{q,k,v,out.0}),
# the targets the reference uses for the image transformers; the names match in both A14B experts.
_WAN_LORA = ("to_q", "to_k", "to_v", "to_out.0")

WAN22_TI2V_5B = WanFamily(
    name="wan2.2-ti2v-5b", repo_id="Wan-AI/Wan2.2-TI2V-5B-Diffusers", pipeline="WanPipeline",
    components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    lora_targets=_WAN_LORA, quant_skip=_WAN_SKIP, quant_min_features=3072, default_solver="dpm2",
    resolution=704, max_sequence_length=512, frames=121, height=704, width=1280, fps=24, sample_steps=50,
)
WAN22_T2V_A14B = WanFamily(
    name="wan2.2-t2v-a14b", repo_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers", pipeline="WanPipeline",
    components=("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler"),
    lora_targets=_WAN_LORA, quant_skip=_WAN_SKIP, quant_min_features=5120, default_solver="dpm2",
    resolution=480, max_sequence_length=512, frames=81, height=480, width=832, fps=16,
    experts=("transformer", "transformer_2"), sample_steps=40,
)
WAN_FAMILIES: dict[str, WanFamily] = {f.name: f for f in (WAN22_TI2V_5B, WAN22_T2V_A14B)}


class WanExperts(nn.Module):
    """Wan2.2 A14B's two denoisers as one module: `transformer` (high-noise expert) and `transformer_2`
    (low-noise expert), named as the pipeline names them. LoRA targets match in both, so one adapter holds both
    experts' LoRA (keys `transformer.transformer.*` and `transformer.transformer_2.*` in solrl's wire format;
    `export_expert_loras` writes the two diffusers files). Which expert a row uses is `WanModel.velocity`'s
    choice; this module has no forward of its own."""

    EXPERTS: ClassVar[tuple[str, str]] = ("transformer", "transformer_2")

    def __init__(self, transformer: nn.Module, transformer_2: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    @property
    def config(self) -> dict[str, Any]:
        """Each expert's diffusers config (what `from_config` rebuilds the pair from: an inference copy)."""
        return {name: dict(getattr(self, name).config) for name in self.EXPERTS}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> WanExperts:
        from diffusers import WanTransformer3DModel

        return cls(*(WanTransformer3DModel.from_config(config[name]) for name in cls.EXPERTS))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("WanExperts has no forward: WanModel.velocity picks the expert of each row's timestep")


def check_clip(frames: int, height: int, width: int, temporal: int, spatial: int, name: str, vae: int = 0) -> None:
    """Frames a causal VAE with `temporal`x time compression can make (temporal * k + 1) and a size in multiples
    of `spatial` pixels (the VAE's `vae`x x the denoiser's patch), else ValueError naming the setting."""
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(f"model.frames={frames}: {name}'s VAE makes clips of {temporal}k + 1 frames "
                         f"(e.g. {(max(frames, 1) - 1) // temporal * temporal + 1} or "
                         f"{((max(frames, 1) - 1) // temporal + 1) * temporal + 1})")
    for key, side in (("height", height), ("width", width)):
        if side <= 0 or side % spatial:
            how = f" (VAE {vae}x x patch {spatial // vae})" if vae else ""
            raise ValueError(f"model.{key}={side} must be a positive multiple of {spatial} for {name}{how}")


class WanModel(T2IModel):
    """A Wan2.2 `WanPipeline` through the T2IModel interface (one subclass per checkpoint)."""

    family: ClassVar[WanFamily]
    decode_batch: ClassVar[int] = 1   # clips per VAE call (a 720p clip's decode is memory-heavy)

    def __init__(self, pipe: Any, frames: int | None = None, height: int | None = None, width: int | None = None,
                 reward_frames: str = "first") -> None:
        fam = self.family
        self.pipe = pipe
        missing = [c for c in fam.experts if getattr(pipe, c, None) is None]
        if missing:
            raise ValueError(f"{fam.name}: the pipeline has no {missing} (its denoisers are {list(fam.experts)})")
        self.boundary_ratio = pipe.config.boundary_ratio
        if len(fam.experts) == 2:
            if self.boundary_ratio is None:
                raise ValueError(f"{fam.name}: model_index.json has no boundary_ratio (the switch between experts)")
            self.transformer: nn.Module = WanExperts(pipe.transformer, pipe.transformer_2)
        else:
            self.transformer = pipe.transformer
        self.expand_timesteps = bool(pipe.config.expand_timesteps)
        if reward_frames not in REWARD_FRAMES:
            raise ValueError(f"reward_frames must be one of {REWARD_FRAMES}, got {reward_frames!r}")
        self.reward_frames = reward_frames
        self.temporal = int(pipe.vae_scale_factor_temporal)
        self.spatial = int(pipe.vae_scale_factor_spatial)
        self.frames, self.height, self.width = fam.clip(frames, height, width)
        cfg = self._expert(self.transformer, 0).config
        self.patch = tuple(int(p) for p in cfg.patch_size)
        check_clip(self.frames, self.height, self.width, self.temporal, self.spatial * self.patch[1], fam.name,
                   self.spatial)
        latent = (int(cfg.in_channels), (self.frames - 1) // self.temporal + 1, self.height // self.spatial,
                  self.width // self.spatial)
        sched = dict(getattr(pipe.scheduler, "config", {}) or {})
        self.num_train_timesteps = int(sched.get("num_train_timesteps", 1000))
        shift = next((float(sched[k]) for k in ("flow_shift", "shift") if sched.get(k)), 1.0)
        self.spec = ModelSpec(name=fam.name, latent_shape=latent, lora_targets=fam.lora_targets,
                              quant_skip=fam.quant_skip, quant_min_features=fam.quant_min_features,
                              default_solver=fam.default_solver, default_shift=shift)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path | None = None, *, frames: int | None = None, height: int | None = None,
             width: int | None = None, reward_frames: str = "first", device: str | torch.device | None = None,
             dtype: torch.dtype | None = None) -> WanModel:
        """Load from a local diffusers directory or the HF cache (offline). Default device: CUDA if present;
        default dtype: bf16 on CUDA with the VAE in fp32 (as diffusers' Wan examples load it), fp32 on CPU."""
        import diffusers

        root = resolve_weights(cls.family, path)
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        pipe = diffusers.WanPipeline.from_pretrained(root, local_files_only=True, use_safetensors=True,
                                                     dtype={"default": dtype, "vae": torch.float32})
        pipe.to(device)
        for name in ("transformer", "transformer_2", "vae", "text_encoder"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.eval().requires_grad_(False)
        return cls(pipe, frames, height, width, reward_frames)

    @property
    def device(self) -> torch.device:
        return _base_param(self.transformer).device

    # ---------------------------------------------------------------- text
    def max_sequence_length(self) -> int:
        limit = getattr(self.pipe.tokenizer, "model_max_length", None) or 10**9
        return int(min(self.family.max_sequence_length, limit))

    def encode(self, prompts: list[str]) -> Cond:
        # the pipeline's own encoding: UMT5 states of the real tokens, zeros after them (padded to the length)
        embeds, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, device=self.device,
                                            max_sequence_length=self.max_sequence_length())
        return Cond(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device))


    # ---------------------------------------------------------------- the denoiser
    @staticmethod
    def _expert(transformer: nn.Module, index: int) -> nn.Module:
        return getattr(transformer, WanExperts.EXPERTS[index]) if isinstance(transformer, WanExperts) else transformer

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B] bool: the rows the high-noise expert denoises (WanPipeline: t >= boundary_ratio * 1000)."""
        if self.boundary_ratio is None:
            return torch.ones_like(timestep, dtype=torch.bool)
        return timestep >= self.boundary_ratio * self.num_train_timesteps

    def _forward(self, module: nn.Module, x: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        module = self.denoiser(module)   # each expert compiled on its own with model.compile
        p = _base_param(module)
        if self.expand_timesteps:   # TI2V-5B: one timestep per latent token (all the row's in text-to-video)
            f, h, w = x.shape[2:]
            seq = (f // self.patch[0]) * (h // self.patch[1]) * (w // self.patch[2])
            timestep = timestep[:, None].expand(-1, seq)
        out = module(hidden_states=x.to(p.device, p.dtype), timestep=timestep.to(p.device),
                     encoder_hidden_states=embeds.to(p.device, p.dtype), return_dict=False)[0]
        return out.to(x.device, x.dtype)

    def velocity(self, transformer, x, t, cond):
        if x.ndim != 5:
            raise ValueError(f"{self.family.name} takes latents [B, C, F, H, W], got shape {tuple(x.shape)}")
        t = t.reshape(-1).expand(x.shape[0]) if t.numel() == 1 else t.reshape(-1)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"t has {t.shape[0]} entries for a batch of {x.shape[0]}")
        if len(cond) != x.shape[0]:
            raise ValueError(f"cond has {len(cond)} prompts for a batch of {x.shape[0]}")
        timestep = t.to(torch.float32) * float(self.num_train_timesteps)
        if not isinstance(transformer, WanExperts):
            return self._forward(transformer, x, timestep, cond.embeds)
        high = self.high_noise(timestep)
        if bool(high.all()) or not bool(high.any()):
            return self._forward(self._expert(transformer, 0 if bool(high.all()) else 1), x, timestep, cond.embeds)
        rows = [torch.nonzero(m).flatten() for m in (high, ~high)]   # each expert's rows, in batch order
        parts = [self._forward(self._expert(transformer, i), x[r.to(x.device)], timestep[r],
                               cond.embeds[r.to(cond.embeds.device)]) for i, r in enumerate(rows)]
        return torch.cat(parts)[torch.argsort(torch.cat(rows)).to(x.device)]

    # ---------------------------------------------------------------- decoding
    def _decode(self, latents: torch.Tensor, frames: int) -> np.ndarray:
        vae = self.pipe.vae
        p = _base_param(vae)
        out = []
        for i in range(0, latents.shape[0], self.decode_batch):
            z = latents[i: i + self.decode_batch].detach().to(p.device, p.dtype)
            # WanPipeline's un-normalisation, op for op: z / (1 / std) + mean
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
            inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device,
                                                                                                       z.dtype)
            with torch.no_grad():
                video = vae.decode(z / inv_std + mean, return_dict=False)[0]
            arr = self.pipe.video_processor.postprocess_video(video.float(), output_type="np")  # [b, F, H, W, 3]
            out.append((arr * 255).round().astype(np.uint8))
        if not out:
            return np.zeros((0, frames, self.height, self.width, 3), dtype=np.uint8)
        return np.concatenate(out)

    def decode_video(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, F, H, W] -> the whole clips, uint8 [B, frames, H, W, 3]."""
        return self._decode(latents, self.frames)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """The frames the rewards score: reward_frames "first" -> frame 0 only, [B, 1, H, W, 3] (decoded from the
        first latent frame alone: the causal VAE gives exactly the whole clip's frame 0); "mean" -> every frame."""
        if self.reward_frames == "first":
            return self._decode(latents[:, :, :1], 1)
        return self._decode(latents, self.frames)


class Wan22TI2V5B(WanModel):
    """Wan2.2 TI2V-5B, text-to-video: one 5B transformer (48-channel latents), the Wan2.2 VAE (16x16 in space)."""

    family = WAN22_TI2V_5B


class Wan22T2VA14B(WanModel):
    """Wan2.2 T2V-A14B: a high-noise and a low-noise 14B expert switched at boundary_ratio, the Wan2.1 VAE."""

    family = WAN22_T2V_A14B


WAN_CLASSES: dict[str, type[WanModel]] = {c.family.name: c for c in (Wan22TI2V5B, Wan22T2VA14B)}


__all__ = ["REWARD_FRAMES", "WAN22_T2V_A14B", "WAN22_TI2V_5B", "WAN_CLASSES", "WAN_FAMILIES", "Wan22T2VA14B",
           "Wan22TI2V5B", "WanExperts", "WanFamily", "WanModel", "check_clip"]
