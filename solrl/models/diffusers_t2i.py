"""Real text-to-image models on diffusers pipelines: SANA-1.5 1.6B, FLUX.1-dev, SD3.5-Large.

Each family wraps its diffusers pipeline (`SanaPipeline`, `FluxPipeline`, `StableDiffusion3Pipeline`) and
uses the pipeline's own prompt encoding, latent packing and VAE scaling; only the denoising loop is ours
(solrl.sampling), so the explorer, regenerator and trainer call one velocity function. Weights come from
a local directory in the diffusers layout or from the Hugging Face cache, never from the network.

Convention mapping (ours: x_t = (1 - t) x0 + t noise, t = 1 pure noise, v = noise - x0): diffusers'
flow-matching schedulers use the same x_t and target with sigma = t; what differs is the timestep the
denoiser takes (diffusers `pipeline_sana.py`, `pipeline_stable_diffusion_3.py`, `pipeline_flux.py`):
  SANA   timestep = 1000 t * transformer.config.timestep_scale
  SD3.5  timestep = 1000 t, plus pooled CLIP-L/G embeddings
  FLUX   timestep = t (the transformer scales by 1000 itself), latents packed in 2x2 patches with
         position ids, and the distilled guidance strength as an embedding (`guidance_embeds`).
The default shift is read from the checkpoint's scheduler config (`shift` / `flow_shift`; FLUX's dynamic
shift exp(mu) at the model's image sequence length), as diffusers' schedulers would apply it.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from solrl.models.base import Cond, ModelSpec, T2IModel


class MissingModelWeightsError(FileNotFoundError):
    """A model's weights are not on this machine (nothing is downloaded at run time)."""


@dataclass(frozen=True)
class Family:
    """What differs between the supported diffusers families (facts from docs/method.md and diffusers)."""

    name: str                        # registry name
    repo_id: str                     # Hugging Face repo in the diffusers layout
    pipeline: str                    # diffusers pipeline class name
    components: tuple[str, ...]      # sub-folders the loader needs
    lora_targets: tuple[str, ...]
    quant_skip: tuple[str, ...]
    quant_min_features: int
    default_solver: str
    resolution: int                  # the reference's training resolution (docs/method.md)
    max_sequence_length: int         # text tokens, as the reference's training script encodes them
    gated: bool = False


# Skip lists: the reference (docs/method.md) keeps embedders (timestep, caption, patch), the final layer, norms (here the
# AdaLN modulation Linears, which live in the norm modules) and, for SANA, the self-attention q/k/v in
# high precision, plus any Linear whose larger dimension is below the family's threshold.
SANA = Family(
    name="sana1.5-1.6b", repo_id="Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers", pipeline="SanaPipeline",
    components=("transformer", "vae", "text_encoder", "tokenizer", "scheduler"),
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    quant_skip=("patch_embed.*", "time_embed.*", "caption_projection.*", "proj_out", "*norm*",
                "*attn1.to_q", "*attn1.to_k", "*attn1.to_v"),
    # text: 300 Gemma tokens, SanaPipeline's default, which the reference's SANA rollouts keep
    quant_min_features=2240, default_solver="euler", resolution=1024, max_sequence_length=300,
)
SD35 = Family(
    name="sd3.5-large", repo_id="stabilityai/stable-diffusion-3.5-large", pipeline="StableDiffusion3Pipeline",
    components=("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
                "tokenizer_2", "tokenizer_3", "scheduler"),
    # DiffusionNFT's SD3 targets: attn.{to,add}_{q,k,v,out}
    lora_targets=("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out"),
    quant_skip=("pos_embed.*", "time_text_embed.*", "context_embedder", "proj_out", "*norm*"),
    # text: 128 T5 tokens (+ CLIP's 77), as yifan123/flow_grpo scripts/train_sd3.py encodes prompts
    # (compute_text_embeddings(..., max_sequence_length=128)); the pipeline's default is 256
    quant_min_features=2432, default_solver="dpm2", resolution=1024, max_sequence_length=128, gated=True,
)
FLUX = Family(
    name="flux1-dev", repo_id="black-forest-labs/FLUX.1-dev", pipeline="FluxPipeline",
    components=("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"),
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    quant_skip=("x_embedder", "time_text_embed.*", "context_embedder", "proj_out", "*norm*"),
    # text: 128 T5 tokens, as yifan123/flow_grpo scripts/train_flux.py encodes prompts
    # (compute_text_embeddings(..., max_sequence_length=128)); the pipeline's default 512 costs ~35% more per forward
    quant_min_features=1000, default_solver="dpm2", resolution=512, max_sequence_length=128, gated=True,
)
FAMILIES: dict[str, Family] = {f.name: f for f in (SANA, SD35, FLUX)}

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def missing_files(path: Path, family: Family) -> list[str]:
    """What a diffusers directory lacks for `family`: model_index.json, component folders, configs, weights."""
    if not path.is_dir():
        return [f"{path} (directory)"]
    out = []
    if not (path / "model_index.json").is_file():
        out.append("model_index.json")
    for comp in family.components:
        d = path / comp
        if not d.is_dir():
            out.append(f"{comp}/")
        elif comp.startswith("tokenizer"):
            if not any(d.glob("tokenizer*")) and not (d / "vocab.json").is_file() and not any(d.glob("*.model")):
                out.append(f"{comp}/ (tokenizer files)")
        elif comp == "scheduler":
            if not (d / "scheduler_config.json").is_file():
                out.append(f"{comp}/scheduler_config.json")
        else:
            if not (d / "config.json").is_file():
                out.append(f"{comp}/config.json")
            if not any(f.name.endswith(_WEIGHT_SUFFIXES) for f in d.iterdir()):
                out.append(f"{comp}/*.safetensors (weights)")
    return out


def _how_to_provide(family: Family) -> str:
    gated = (" The repo is gated: accept its licence on huggingface.co and log in (`hf auth login`) first."
             if family.gated else "")
    return (f"On a machine with internet: `hf download {family.repo_id} --local-dir DIR` (or "
            f"`huggingface-cli download {family.repo_id} --local-dir DIR`), copy DIR here and set "
            f"`--set model.path=DIR`; or download into the Hugging Face cache and point HF_HOME at it.{gated}")


def resolve_weights(family: Family, path: str | Path | None) -> Path:
    """The local directory holding `family`'s weights (a given path, else the HF cache snapshot).

    Raises MissingModelWeightsError listing what is missing and how to provide it.
    """
    if path is not None:
        root = Path(path).expanduser()
        where = str(root)
    else:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        where = f"the Hugging Face cache ({constants.HF_HUB_CACHE}) as {family.repo_id}"
        try:
            root = Path(snapshot_download(family.repo_id, local_files_only=True))
        except (LocalEntryNotFoundError, OSError, ValueError) as err:
            raise MissingModelWeightsError(
                f"model {family.name!r}: weights not found in {where} ({type(err).__name__}); needed: "
                f"model_index.json and {', '.join(c + '/' for c in family.components)}. {_how_to_provide(family)}"
            ) from None
    missing = missing_files(root, family)
    if missing:
        raise MissingModelWeightsError(
            f"model {family.name!r}: weights incomplete in {where}; missing: {missing}. {_how_to_provide(family)}")
    return root


def _base_param(module: nn.Module) -> torch.Tensor:
    """The first floating non-LoRA parameter (gives the device and dtype the denoiser computes in)."""
    for name, p in module.named_parameters():
        if p.is_floating_point() and "lora_" not in name:
            return p
    raise ValueError("the denoiser has no floating parameters")


class DiffusersT2I(T2IModel):
    """A diffusers pipeline seen through the T2IModel interface (one subclass per family).

    `transformer` is the pipeline's denoiser (the one the LoRA goes into); `velocity` may be called with
    another module of the same class (an inference copy). Latents are [B, C, H, W] before any packing.
    """

    family: ClassVar[Family]

    def __init__(self, pipe: Any, resolution: int | None = None) -> None:
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self.resolution = int(resolution or min(self.family.resolution, self.native_resolution()))
        step = self.vae_scale_factor * self.latent_multiple()
        if self.resolution <= 0 or self.resolution % step != 0:
            raise ValueError(f"resolution {self.resolution} must be a positive multiple of {step} for {self.family.name}")
        side = self.resolution // self.vae_scale_factor
        self.spec = ModelSpec(
            name=self.family.name, latent_shape=(self.latent_channels(), side, side),
            lora_targets=self.family.lora_targets, quant_skip=self.family.quant_skip,
            quant_min_features=self.family.quant_min_features, default_solver=self.family.default_solver,
            default_shift=self.scheduler_shift(),
        )

    def latent_multiple(self) -> int:
        """The latent side must be a multiple of this: the denoiser's patch size (FLUX packs 2x2)."""
        return int(getattr(self.transformer.config, "patch_size", 1) or 1)

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path | None = None, *, resolution: int | None = None,
             device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> DiffusersT2I:
        """Load from a local diffusers directory or the HF cache (offline). Default device: CUDA if present;
        default dtype: bf16 on CUDA, fp32 on CPU (the precision backends round to bf16 themselves)."""
        import diffusers

        root = resolve_weights(cls.family, path)
        device = torch.device(device) if device is not None else default_device()
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        pipe_cls = getattr(diffusers, cls.family.pipeline)
        pipe = pipe_cls.from_pretrained(root, local_files_only=True, dtype=dtype, use_safetensors=True)
        pipe.to(device)
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.eval().requires_grad_(False)
        return cls(pipe, resolution)

    # ---------------------------------------------------------------- facts read from the checkpoint
    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels)

    def native_resolution(self) -> int:
        """The pipeline's default image side (its `default_sample_size * vae_scale_factor`)."""
        return int(self.transformer.config.sample_size) * self.vae_scale_factor

    def image_seq_len(self) -> int:
        side = self.resolution // self.vae_scale_factor
        return side * side

    def scheduler_shift(self) -> float:
        cfg = dict(getattr(self.pipe.scheduler, "config", {}) or {})
        if cfg.get("use_dynamic_shifting"):
            from diffusers.pipelines.flux.pipeline_flux import calculate_shift

            mu = calculate_shift(self.image_seq_len(), cfg.get("base_image_seq_len", 256),
                                 cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                 cfg.get("max_shift", 1.15))
            return float(math.exp(mu))  # exponential time shift: sigma' = e^mu s / (1 + (e^mu - 1) s)
        for key in ("shift", "flow_shift"):
            if cfg.get(key):
                return float(cfg[key])
        return 1.0

    @property
    def device(self) -> torch.device:
        return _base_param(self.transformer).device

    # ---------------------------------------------------------------- shared pieces
    def _inputs(self, transformer: nn.Module, x: torch.Tensor, t: torch.Tensor, cond: Cond):
        p = _base_param(transformer)
        t = t.reshape(-1).expand(x.shape[0]) if t.numel() == 1 else t.reshape(-1)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"t has {t.shape[0]} entries for a batch of {x.shape[0]}")
        if len(cond) != x.shape[0]:
            raise ValueError(f"cond has {len(cond)} prompts for a batch of {x.shape[0]}")
        return p.device, p.dtype, t.to(p.device, torch.float32)

    decode_batch: ClassVar[int] = 8   # images per VAE call (a 1024px decode is memory-heavy)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        vae = self.pipe.vae
        p = _base_param(vae)
        shift = getattr(vae.config, "shift_factor", None)
        out = []
        for i in range(0, latents.shape[0], self.decode_batch):
            z = latents[i: i + self.decode_batch].detach().to(p.device, p.dtype) / vae.config.scaling_factor
            if shift is not None:
                z = z + shift
            with torch.no_grad():
                img = vae.decode(z, return_dict=False)[0]
            # the pipelines' postprocess: [-1, 1] -> [0, 1]; then diffusers' numpy_to_pil rounding to uint8
            arr = self.pipe.image_processor.postprocess(img.float(), output_type="np")
            out.append((arr * 255).round().astype(np.uint8))
        if not out:
            side = self.resolution
            return np.zeros((0, side, side, 3), dtype=np.uint8)
        return np.concatenate(out)

    text_tokenizer: ClassVar[str] = "tokenizer"   # the pipeline component whose length limit applies

    def max_sequence_length(self) -> int:
        """The pipeline's default text length, never more than the tokenizer declares it takes."""
        limit = getattr(getattr(self.pipe, self.text_tokenizer), "model_max_length", None) or 10**9
        return int(min(self.family.max_sequence_length, limit))


class SanaModel(DiffusersT2I):
    """SANA-1.5 1.6B: SanaTransformer2DModel + AutoencoderDC (32x) + Gemma-2 text encoder.

    Prompts are encoded as `SanaPipeline.__call__` does by default: with its complex human instruction
    prepended and `select_index` keeping the first token and the last `max_sequence_length - 1`.
    """

    family = SANA

    def __init__(self, pipe: Any, resolution: int | None = None) -> None:
        super().__init__(pipe, resolution)
        # The instruction is the pipeline's own default argument (read, not copied).
        self.complex_human_instruction = inspect.signature(type(pipe).__call__).parameters[
            "complex_human_instruction"].default

    def _encode(self, prompts: list[str], instruction) -> Cond:
        embeds, mask, _, _ = self.pipe.encode_prompt(
            prompts, do_classifier_free_guidance=False, device=self.device,
            max_sequence_length=self.max_sequence_length(), complex_human_instruction=instruction)
        return Cond(embeds, mask)

    def encode(self, prompts: list[str]) -> Cond:
        return self._encode(list(prompts), self.complex_human_instruction)

    def encode_empty(self) -> Cond:
        # the pipeline's negative prompt: "" without the instruction
        return self._encode([""], None)

    def velocity(self, transformer, x, t, cond):
        dev, dt, t = self._inputs(transformer, x, t, cond)
        out = transformer(
            x.to(dev, dt), encoder_hidden_states=cond.embeds.to(dev, dt), encoder_attention_mask=cond.mask.to(dev),
            timestep=t * 1000.0 * float(transformer.config.timestep_scale), return_dict=False)[0]
        if out.shape[1] == 2 * x.shape[1]:   # learned sigma: keep the velocity half
            out = out.chunk(2, dim=1)[0]
        return out.to(x.device, x.dtype)


class SD3Model(DiffusersT2I):
    """SD3.5-Large: SD3Transformer2DModel + AutoencoderKL + CLIP-L, CLIP-G and T5-XXL."""

    family = SD35
    text_tokenizer = "tokenizer_3"

    def encode(self, prompts: list[str]) -> Cond:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length())
        return Cond(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device), pooled)

    def velocity(self, transformer, x, t, cond):
        dev, dt, t = self._inputs(transformer, x, t, cond)
        out = transformer(hidden_states=x.to(dev, dt), timestep=t * 1000.0,
                          encoder_hidden_states=cond.embeds.to(dev, dt),
                          pooled_projections=cond.pooled.to(dev, dt), return_dict=False)[0]
        return out.to(x.device, x.dtype)


class FluxModel(DiffusersT2I):
    """FLUX.1-dev: FluxTransformer2DModel + AutoencoderKL + CLIP-L (pooled) and T5-XXL.

    Latents stay [B, 16, H/8, W/8] everywhere in solrl (so seed -> noise, x0 and the loss are the same as
    for the other families); `velocity` packs them into 2x2 patches for the transformer and unpacks the
    prediction. `guidance` is FLUX.1-dev's distilled guidance strength (FluxPipeline's default 3.5); it is
    an input of the model, not classifier-free guidance.
    """

    family = FLUX
    text_tokenizer = "tokenizer_2"

    def __init__(self, pipe: Any, resolution: int | None = None, guidance: float = 3.5) -> None:
        super().__init__(pipe, resolution)
        self.guidance = float(guidance)

    def latent_channels(self) -> int:
        return int(self.transformer.config.in_channels) // 4

    def latent_multiple(self) -> int:
        return 2 * int(self.transformer.config.patch_size)

    def native_resolution(self) -> int:
        # FluxTransformer2DModel has no sample_size; the VAE's configured sample size bounds the side.
        return int(self.pipe.vae.config.sample_size)

    def image_seq_len(self) -> int:
        side = self.resolution // self.vae_scale_factor // 2
        return side * side

    def encode(self, prompts: list[str]) -> Cond:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length())
        return Cond(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device), pooled)

    def _position_ids(self, h: int, w: int, text: int, dev: torch.device, dt: torch.dtype):
        """The image and text position ids (the pipeline builds the image's on the host and copies them over: a host
        sync per step), made once per shape and device."""
        key = (h, w, text, dev, dt)
        cache = self.__dict__.setdefault("_ids", {})
        if key not in cache:
            cache[key] = (self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, dev, dt),
                          torch.zeros(text, 3, device=dev, dtype=dt))
        return cache[key]

    def velocity(self, transformer, x, t, cond):
        dev, dt, t = self._inputs(transformer, x, t, cond)
        b, c, h, w = x.shape
        packed = self.pipe._pack_latents(x.to(dev, dt), b, c, h, w)
        img_ids, txt_ids = self._position_ids(h, w, cond.embeds.shape[1], dev, dt)
        guidance = (torch.full((b,), self.guidance, device=dev, dtype=torch.float32)
                    if transformer.config.guidance_embeds else None)
        out = transformer(hidden_states=packed, timestep=t, guidance=guidance,
                          pooled_projections=cond.pooled.to(dev, dt), encoder_hidden_states=cond.embeds.to(dev, dt),
                          txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        out = self.pipe._unpack_latents(out, h * self.vae_scale_factor, w * self.vae_scale_factor,
                                        self.vae_scale_factor)
        return out.to(x.device, x.dtype)


MODEL_CLASSES: dict[str, type[DiffusersT2I]] = {c.family.name: c for c in (SanaModel, SD3Model, FluxModel)}


__all__ = [
    "FAMILIES",
    "FLUX",
    "MODEL_CLASSES",
    "SANA",
    "SD35",
    "DiffusersT2I",
    "Family",
    "FluxModel",
    "MissingModelWeightsError",
    "SD3Model",
    "SanaModel",
    "missing_files",
    "resolve_weights",
]
