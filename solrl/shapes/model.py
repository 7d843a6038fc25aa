"""The bundled `shapes` model: a tiny text-to-image flow model of the shapes world.

Denoiser: a diffusers `UNet2DConditionModel` (32/64/64 channels, cross-attention to the text at 16x16 and
8x8) working directly in pixel space on 32x32 RGB scaled to [-1, 1]. Pixel space, not a VAE: at 32x32 the
image is already as small as a latent would be, a VAE would add its own training run and its own errors
to every score, and the flow-matching maths is the same either way. A UNet because on two CPU cores it
draws shapes after 500 pretraining steps, where PixArt and SANA transformers of the same cost still drew
blobs after thousands (docs/notes/shapes.md); PixArt and SANA denoisers remain available (`--denoiser`).
Text encoder: a 2-layer `transformers.CLIPTextModel` over a word-level tokenizer of the world's closed
vocabulary (unknown words are rejected).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import PixArtTransformer2DModel, SanaTransformer2DModel, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel

from solrl.models.base import Cond, ModelSpec, T2IModel
from solrl.shapes.world import IMAGE_SIZE, VOCAB, tokenize

WEIGHTS_DIR = Path(__file__).parent / "weights"

SPEC = ModelSpec(
    name="shapes",
    latent_shape=(3, IMAGE_SIZE, IMAGE_SIZE),
    lora_targets=("to_q", "to_k", "to_v", "to_out.0"),
    # Embedders (patch, timestep, caption) and the final projection stay high precision, as the
    # reference keeps embedders and the final layer of SANA / SD3.5 / FLUX. Names of all three denoiser
    # families: PixArt (pos_embed, adaln_single), SANA (time_embed), UNet (time_embedding).
    quant_skip=("pos_embed.*", "adaln_single.*", "time_embed.*", "time_embedding.*", "caption_projection.*",
                "proj_out*"),
    quant_min_features=0,
    default_solver="euler",
)

PAD, BOS, EOS = 0, 1, 2
MAX_TOKENS = 14  # BOS + at most 10 words + EOS, with room
_WORD_ID = {w: i + 3 for i, w in enumerate(VOCAB)}


DENOISERS = ("pixart", "sana", "unet")
_DENOISER_CLASSES = {"pixart": PixArtTransformer2DModel, "sana": SanaTransformer2DModel, "unet": UNet2DConditionModel}
_BY_CLASS_NAME = {cls.__name__: cls for cls in _DENOISER_CLASSES.values()}


def transformer_config(layers: int = 8, heads: int = 6, patch: int = 4, denoiser: str = "pixart", text_width: int = 64,
                       unet_channels: tuple[int, ...] = (32, 64, 64), attn_full_res: bool = False) -> dict:
    """The denoiser's diffusers config (heads of width 32; the bundled model's own config.json rules
    when it is loaded).

    denoiser: "pixart" (PixArtTransformer2DModel: softmax self-attention, MLP), "sana"
    (SanaTransformer2DModel, SANA's block: ReLU linear self-attention and a Mix-FFN whose 3x3 depthwise
    convolution gives every token its neighbourhood) or "unet" (UNet2DConditionModel; `layers` and
    `patch` do not apply: `unet_channels` per resolution (32/64/64 by default), cross-attention at all but
    the full resolution, and there too with `attn_full_res`). `text_width`: the text encoder's hidden size,
    which the denoiser's cross-attention reads.
    """
    if denoiser == "pixart":
        return dict(
            sample_size=IMAGE_SIZE, patch_size=patch, in_channels=3, out_channels=3, num_layers=layers,
            num_attention_heads=heads, attention_head_dim=32, cross_attention_dim=32 * heads,
            caption_channels=text_width, norm_type="ada_norm_single", use_additional_conditions=False,
            num_embeds_ada_norm=1000,
        )
    if denoiser == "sana":
        # interpolation_scale=1: fixed sin-cos position embeddings (None would drop them, as SANA 1.0
        # does at scale; a 32x32 canvas with 'on the left' prompts wants absolute positions).
        return dict(
            sample_size=IMAGE_SIZE, patch_size=patch, in_channels=3, out_channels=3, num_layers=layers,
            num_attention_heads=heads, attention_head_dim=32, num_cross_attention_heads=heads,
            cross_attention_head_dim=32, cross_attention_dim=32 * heads, caption_channels=text_width, mlp_ratio=2.5,
            interpolation_scale=1,
        )
    if denoiser == "unet":
        n = len(unet_channels)
        if n < 2 or any(c <= 0 or c % 8 for c in unet_channels):
            raise ValueError(f"unet_channels must be >= 2 positive multiples of 8 (group norm of 8), got {unet_channels}")
        first = "CrossAttn" if attn_full_res else ""
        return dict(
            sample_size=IMAGE_SIZE, in_channels=3, out_channels=3, layers_per_block=1,
            block_out_channels=tuple(unet_channels),
            down_block_types=(first + "DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
            up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + (first + "UpBlock2D",),
            cross_attention_dim=text_width, attention_head_dim=heads, norm_num_groups=8, use_linear_projection=True,
        )
    raise ValueError(f"denoiser must be one of {list(DENOISERS)}, got {denoiser!r}")


def denoiser_kind(transformer: torch.nn.Module) -> str:
    for kind, cls in _DENOISER_CLASSES.items():
        if isinstance(transformer, cls):
            return kind
    raise TypeError(f"not a shapes denoiser: {type(transformer).__name__}")


def text_encoder_config(width: int = 64, layers: int = 2) -> CLIPTextConfig:
    """The caption encoder: `layers` CLIP blocks of `width` (heads of 16; the bundled model: 2 x 64)."""
    if width <= 0 or width % 16 or layers <= 0:
        raise ValueError(f"text encoder width must be a positive multiple of 16 and layers positive, got {width} x {layers}")
    return CLIPTextConfig(
        vocab_size=len(VOCAB) + 3, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=width // 16, max_position_embeddings=MAX_TOKENS, pad_token_id=PAD, bos_token_id=BOS,
        eos_token_id=EOS,
    )


def token_ids(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Word-level tokenisation: [BOS, words..., EOS, PAD...]; "" is the unconditional prompt [BOS, EOS]."""
    ids = torch.full((len(prompts), MAX_TOKENS), PAD, dtype=torch.long)
    for i, p in enumerate(prompts):
        words = tokenize(p) if p.strip() else []
        seq = [BOS, *(_WORD_ID[w] for w in words), EOS]
        ids[i, : len(seq)] = torch.tensor(seq)
    return ids, (ids != PAD).long()


class ShapesModel(T2IModel):
    spec = SPEC

    def __init__(self, transformer: torch.nn.Module, text_encoder: CLIPTextModel) -> None:
        self.transformer = transformer
        self.text_encoder = text_encoder

    # ---------------------------------------------------------------- building and loading
    @classmethod
    def random(cls, seed: int = 0, denoiser: str = "pixart", text_width: int = 64, text_layers: int = 2,
               **arch) -> ShapesModel:
        """Seeded random initialisation (what pretraining starts from); `arch`: transformer_config's
        layers / heads / patch / unet_channels / attn_full_res."""
        config = transformer_config(denoiser=denoiser, text_width=text_width, **arch)
        torch.manual_seed(seed)
        return cls(_DENOISER_CLASSES[denoiser](**config), CLIPTextModel(text_encoder_config(text_width, text_layers)))

    @classmethod
    def load(cls, path: str | Path | None = None, device: str | torch.device | None = None) -> ShapesModel:
        """Load from a directory holding transformer/ and text_encoder/ (default: the bundled weights), in fp32 on
        `device` (default the CPU; on CUDA the bf16 precision backend then keeps the denoiser in real bf16)."""
        device = torch.device(device or "cpu")  # a run's model.device is checked with its config (RunConfig.validate)
        path = Path(path) if path is not None else WEIGHTS_DIR
        missing = [d for d in ("transformer", "text_encoder") if not (path / d / "config.json").exists()]
        if missing:
            raise FileNotFoundError(
                f"shapes model weights not found in {path}: missing {missing}. "
                "Train them with `solrl shapes pretrain --out DIR` or point --set model.path=DIR at them."
            )
        class_name = json.loads((path / "transformer" / "config.json").read_text()).get("_class_name")
        if class_name not in _BY_CLASS_NAME:
            raise ValueError(f"{path / 'transformer'}: denoiser class {class_name!r} is not one of "
                             f"{sorted(_BY_CLASS_NAME)}")
        tr = _BY_CLASS_NAME[class_name].from_pretrained(path / "transformer", local_files_only=True, use_safetensors=True)
        te = CLIPTextModel.from_pretrained(path / "text_encoder", local_files_only=True, use_safetensors=True)
        tr.to(device).eval().requires_grad_(False)
        te.to(device).eval().requires_grad_(False)
        return cls(tr, te)

    def save(self, path: str | Path, card: dict | None = None) -> None:
        path = Path(path)
        self.transformer.save_pretrained(path / "transformer", safe_serialization=True)
        self.text_encoder.save_pretrained(path / "text_encoder", safe_serialization=True)
        if card is not None:
            (path / "card.json").write_text(json.dumps(card, indent=2) + "\n")

    # ---------------------------------------------------------------- the T2IModel interface
    def encode(self, prompts: list[str]) -> Cond:
        ids, mask = token_ids(prompts)
        device = self.text_encoder.get_input_embeddings().weight.device
        ids, mask = ids.to(device), mask.to(device)
        with torch.set_grad_enabled(self.text_encoder.training):
            emb = self.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        return Cond(emb, mask)

    def uncond_cacheable(self) -> bool:
        # pretraining may train the text encoder: its empty prompt is kept only while every weight is frozen
        return not any(p.requires_grad for p in self.text_encoder.parameters())

    def velocity(self, transformer, x, t, cond):
        # The sampling state may live elsewhere than the denoiser (as in diffusers_t2i): run on the denoiser's
        # device and dtype (real bf16 on CUDA), answer on x's (no copies when both are fp32 on the CPU).
        home, home_dtype = x.device, x.dtype
        p = next(transformer.parameters())
        dev = p.device
        x = x.to(dev, p.dtype if p.dtype.is_floating_point else x.dtype)
        t = t.to(dev, x.dtype).reshape(-1).expand(x.shape[0]) if t.numel() == 1 else t.to(dev, x.dtype)
        emb = cond.embeds.to(dev, x.dtype)
        cond = Cond(emb, cond.mask.to(dev), cond.pooled)
        kind = denoiser_kind(getattr(transformer, "_orig_mod", transformer))  # torch.compile keeps it underneath
        if kind == "pixart":
            out = transformer(x, encoder_hidden_states=emb, timestep=t * 1000.0, encoder_attention_mask=cond.mask,
                              added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        elif kind == "unet":
            out = transformer(x, t * 1000.0, encoder_hidden_states=emb, encoder_attention_mask=cond.mask)
        else:
            out = transformer(x, encoder_hidden_states=emb, timestep=t * 1000.0, encoder_attention_mask=cond.mask)
        return out.sample.to(home, home_dtype)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        img = ((latents.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return img.permute(0, 2, 3, 1).cpu().numpy()


def images_to_latents(images: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1] (the inverse of ShapesModel.decode)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
