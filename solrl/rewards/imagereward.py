"""`imagereward`: ImageReward-v1.0 (Xu et al. 2023, THUDM/ImageReward) on transformers 5's BLIP classes.

ImageReward is BLIP: a ViT-L/16 image encoder (224 px), a BERT-base text encoder with cross-attention
to the image tokens, and an MLP head (768 -> 1024 -> 128 -> 64 -> 16 -> 1, no activations) on the
text encoder's [CLS] output; reward = (mlp - 0.16717362830052426) / 1.0333394966054072. Prompts are
tokenized with bert-base-uncased, padded / truncated to 35 tokens; images are resized (shortest side
224, bicubic), centre-cropped to 224 and normalised with the CLIP mean / std. All of this follows
`ImageReward/ImageReward.py` and `ImageReward/models/BLIP/` in the THUDM repository.

The `image-reward` package pins old timm / transformers and does not import on transformers 5, so
it is not used: its checkpoint (`ImageReward.pt`, a state dict) is mapped onto transformers'
`BlipVisionModel` (BLIP's ViT: LayerNorm eps 1e-6) and `BlipTextModel` (BLIP's "med" BERT, the same
module names), see `blip_to_hf`. Sources: SOLRL_IMAGEREWARD_CHECKPOINT (the file, or a directory /
cached repo `THUDM/ImageReward` holding it) and SOLRL_IMAGEREWARD_TOKENIZER (default
google-bert/bert-base-uncased). Tested here on tiny random BLIP configs; not checked against the
real checkpoint (no weights here).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from solrl.rewards.inputs import check_images
from solrl.rewards.weights import (
    default_device,
    missing_checkpoint_and_tokenizer,
    resolve_dir,
    resolve_file,
    source,
)

IR_ENV, IR_DEFAULT, IR_FILE = "SOLRL_IMAGEREWARD_CHECKPOINT", "THUDM/ImageReward", "ImageReward.pt"
IR_TOK_ENV, IR_TOK_DEFAULT = "SOLRL_IMAGEREWARD_TOKENIZER", "google-bert/bert-base-uncased"
TOKENIZER_FILES = (("tokenizer.json", "vocab.txt"),)
IR_MEAN, IR_STD = 0.16717362830052426, 1.0333394966054072
MAX_TOKENS = 35
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MLP_LAYERS = (0, 2, 4, 6, 7)  # nn.Sequential indices of the Linear layers (dropouts between them)

_VIT = [  # BLIP ViT block names -> transformers BlipEncoderLayer names
    ("norm1", "layer_norm1"), ("attn.qkv", "self_attn.qkv"), ("attn.proj", "self_attn.projection"),
    ("norm2", "layer_norm2"), ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"),
]


def _count(sd: dict, prefix: str) -> int:
    ids = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(ids) + 1 if ids else 0


def blip_to_hf(sd: dict, *, vision_heads: int = 16, text_heads: int = 12):
    """(BlipVisionConfig, vision state dict, BlipTextConfig, text state dict, MLP [(W, b)]) from an ImageReward state dict.

    Written by hand: no library maps ImageReward's BLIP checkpoint to transformers' classes.
    """
    from transformers import BlipTextConfig, BlipVisionConfig

    v, t = "blip.visual_encoder.", "blip.text_encoder."
    need = [f"{v}patch_embed.proj.weight", f"{v}pos_embed", f"{v}cls_token", f"{t}embeddings.word_embeddings.weight"]
    need += [f"mlp.layers.{i}.weight" for i in MLP_LAYERS]
    lacking = [k for k in need if k not in sd]
    if lacking:
        raise ValueError(f"checkpoint is not an ImageReward state dict: lacks {lacking}")
    width, _, patch, _ = sd[f"{v}patch_embed.proj.weight"].shape
    grid = round(math.sqrt(sd[f"{v}pos_embed"].shape[1] - 1))
    v_layers = _count(sd, f"{v}blocks.")
    vcfg = BlipVisionConfig(hidden_size=width, intermediate_size=sd[f"{v}blocks.0.mlp.fc1.weight"].shape[0],
                            num_hidden_layers=v_layers, num_attention_heads=vision_heads, image_size=grid * patch,
                            patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6)
    vsd = {"embeddings.class_embedding": sd[f"{v}cls_token"], "embeddings.position_embedding": sd[f"{v}pos_embed"],
           "embeddings.patch_embedding.weight": sd[f"{v}patch_embed.proj.weight"],
           "embeddings.patch_embedding.bias": sd[f"{v}patch_embed.proj.bias"],
           "post_layernorm.weight": sd[f"{v}norm.weight"], "post_layernorm.bias": sd[f"{v}norm.bias"]}
    for i in range(v_layers):
        for a, b in _VIT:
            for p in ("weight", "bias"):
                vsd[f"encoder.layers.{i}.{b}.{p}"] = sd[f"{v}blocks.{i}.{a}.{p}"]
    word = sd[f"{t}embeddings.word_embeddings.weight"]
    t_layers = _count(sd, f"{t}encoder.layer.")
    tcfg = BlipTextConfig(
        vocab_size=word.shape[0], hidden_size=word.shape[1], num_hidden_layers=t_layers,
        num_attention_heads=text_heads,
        intermediate_size=sd[f"{t}encoder.layer.0.intermediate.dense.weight"].shape[0],
        encoder_hidden_size=sd[f"{t}encoder.layer.0.crossattention.self.key.weight"].shape[1],
        max_position_embeddings=sd[f"{t}embeddings.position_embeddings.weight"].shape[0],
        hidden_act="gelu", layer_norm_eps=1e-12,
        is_decoder=True)  # builds the cross-attention blocks; forward() is called with is_decoder=False (bidirectional)
    tsd = {k[len(t):]: val for k, val in sd.items() if k.startswith(t) and not k.endswith("position_ids")}
    mlp = [(sd[f"mlp.layers.{i}.weight"], sd[f"mlp.layers.{i}.bias"]) for i in MLP_LAYERS]
    return vcfg, vsd, tcfg, tsd, mlp


def preprocess(images: np.ndarray, size: int):
    """CLIP-style eval transform of ImageReward: shortest side -> size (bicubic), centre crop, CLIP mean / std."""
    import torch
    from PIL import Image

    mean, std = np.array(CLIP_MEAN, np.float32), np.array(CLIP_STD, np.float32)
    out = np.empty((len(images), 3, size, size), dtype=np.float32)
    for i, img in enumerate(images):
        pil = Image.fromarray(img)
        w, h = pil.size
        scale = size / min(w, h)
        nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)  # torchvision Resize(int) rule
        if (nw, nh) != (w, h) or scale != 1:
            pil = pil.resize((nw, nh), Image.BICUBIC)
        left, top = round((nw - size) / 2.0), round((nh - size) / 2.0)  # torchvision CenterCrop rule
        arr = np.asarray(pil.crop((left, top, left + size, top + size)), dtype=np.float32) / 255.0
        out[i] = ((arr - mean) / std).transpose(2, 0, 1)
    return torch.from_numpy(out)


class ImageReward:
    """`imagereward`: ImageReward-v1.0 scores (roughly N(0, 1) over its training images)."""

    name = "imagereward"
    needs_weights = True

    def __init__(self, checkpoint: str | Path | None = None, tokenizer_dir: str | Path | None = None, *,
                 vision_heads: int = 16, text_heads: int = 12, device: str | None = None,
                 batch_size: int = 32) -> None:
        import torch
        from transformers import BertTokenizer, BlipTextModel, BlipVisionModel

        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        checkpoint = checkpoint or resolve_file(source(IR_ENV, IR_DEFAULT), what="imagereward", env=IR_ENV,
                                                filename=IR_FILE)
        tokenizer_dir = tokenizer_dir or resolve_dir(source(IR_TOK_ENV, IR_TOK_DEFAULT), what="imagereward tokenizer",
                                                     env=IR_TOK_ENV, files=TOKENIZER_FILES)
        sd = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
        sd = sd.get("state_dict", sd)
        vcfg, vsd, tcfg, tsd, mlp = blip_to_hf(sd, vision_heads=vision_heads, text_heads=text_heads)
        self.vision = BlipVisionModel(vcfg).eval()
        self.text = BlipTextModel(tcfg, add_pooling_layer=False).eval()
        for part, state in (("vision", vsd), ("text", tsd)):
            missing, unexpected = getattr(self, part).load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("position_ids")]
            if missing or unexpected:
                raise ValueError(f"imagereward: checkpoint {checkpoint} does not fill the {part} encoder: "
                                 f"missing {missing[:8]}, unexpected {unexpected[:8]}")
        self.mlp = torch.nn.Sequential(*[torch.nn.Linear(w.shape[1], w.shape[0]) for w, _ in mlp]).eval()
        with torch.no_grad():
            for layer, (w, b) in zip(self.mlp, mlp):
                layer.weight.copy_(w)
                layer.bias.copy_(b)
        self.device = device or default_device()
        for m in (self.vision, self.text, self.mlp):
            m.float().to(self.device)
        self.tokenizer = BertTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        self.image_size, self.batch_size = vcfg.image_size, batch_size

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        images = check_images(images, len(prompts))
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                pix = preprocess(images[i:i + self.batch_size], self.image_size).to(self.device)
                tok = self.tokenizer(list(prompts[i:i + self.batch_size]), padding="max_length", truncation=True,
                                     max_length=MAX_TOKENS, return_tensors="pt").to(self.device)
                img = self.vision(pixel_values=pix).last_hidden_state
                txt = self.text(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                                encoder_hidden_states=img, is_decoder=False,
                                encoder_attention_mask=torch.ones(img.shape[:2], dtype=torch.long, device=self.device))
                r = self.mlp(txt.last_hidden_state[:, 0, :].float()).squeeze(-1)
                out.append(((r - IR_MEAN) / IR_STD).cpu())
        return torch.cat(out).numpy().astype(np.float32) if out else np.zeros(0, np.float32)

    @staticmethod
    def missing() -> list[str]:
        return missing_checkpoint_and_tokenizer(IR_ENV, IR_DEFAULT, IR_FILE, IR_TOK_ENV, IR_TOK_DEFAULT,
                                                TOKENIZER_FILES)
