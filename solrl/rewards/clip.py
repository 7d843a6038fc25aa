"""CLIP-family rewards on transformers' `CLIPModel`: `clipscore` and `pickscore`.

Both embed the image and the prompt, L2-normalise, and take the cosine:
- `clipscore` = cos(image, text) with OpenAI CLIP ViT-L/14 (`openai/clip-vit-large-patch14`). This is
  the form the Sol-RL reference trains on (NVlabs/Sana `diffusion/post_training/rewards.py`:
  logits_per_image / 100, and that model's logit scale is exactly 100). Hessel et al. 2021 define
  CLIP-S = 2.5 * max(cos, 0); set `clipscore_weight=2.5, clip_negative=True` for that form.
- `pickscore` = exp(logit_scale) * cos with `yuvalkirstain/PickScore_v1` and the processor of
  `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` (Kirstain et al. 2023, the PickScore model card). Raw, not
  divided by 26 as Flow-GRPO / the Sana reference do; give it weight 1/26 in a multi-reward for theirs.
Preprocessing is the model's own CLIP image processor, PIL backend (resize the shortest side to 224,
bicubic; centre crop 224; scale to [0, 1]; normalise with the CLIP mean / std), so the result does
not depend on whether torchvision is installed. Text: CLIP tokenizer, truncated to 77 tokens.
Weights come from a local directory or the HF cache (`local_files_only=True`), see `weights.py`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from solrl.rewards.inputs import check_images
from solrl.rewards.weights import default_device, dir_available, resolve_dir, source

MODEL_FILES = ("config.json", ("model.safetensors", "pytorch_model.bin"))
PROCESSOR_FILES = ("preprocessor_config.json", ("tokenizer.json", "vocab.json"))

CLIPSCORE_ENV, CLIPSCORE_DEFAULT = "SOLRL_CLIPSCORE_MODEL", "openai/clip-vit-large-patch14"
PICKSCORE_ENV, PICKSCORE_DEFAULT = "SOLRL_PICKSCORE_MODEL", "yuvalkirstain/PickScore_v1"
PICKSCORE_PROC_ENV, PICKSCORE_PROC_DEFAULT = "SOLRL_PICKSCORE_PROCESSOR", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def to_pil(images: np.ndarray) -> list:
    from PIL import Image

    return [Image.fromarray(img) for img in images]


def embedding(out):
    """transformers 5 returns a model output from get_*_features (projected pooler output); older ones a tensor."""
    return out if hasattr(out, "norm") else out.pooler_output


class ClipSimilarity:
    """exp(logit_scale)^use_logit_scale * cos(image, text) of a transformers CLIPModel, batched."""

    def __init__(self, model_dir: str | Path, processor_dir: str | Path | None = None, *, device: str | None = None,
                 batch_size: int = 32, use_logit_scale: bool = False) -> None:
        import torch
        from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer

        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        processor_dir = processor_dir or model_dir
        self.device = device or default_device()
        self.batch_size, self.use_logit_scale = batch_size, use_logit_scale
        self.model = CLIPModel.from_pretrained(str(model_dir), local_files_only=True,
                                               dtype=torch.float32).eval().to(self.device)
        self.image_processor = CLIPImageProcessorPil.from_pretrained(str(processor_dir), local_files_only=True)
        self.tokenizer = CLIPTokenizer.from_pretrained(str(processor_dir), local_files_only=True)
        self.max_length = min(77, self.model.config.text_config.max_position_embeddings)

    def pixel_values(self, images: np.ndarray):
        """[B, 3, S, S] float32 model inputs of uint8 images [B, H, W, 3] (the processor's exact preprocessing)."""
        return self.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        images = check_images(images, len(prompts))
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                pix = self.pixel_values(images[i:i + self.batch_size]).to(self.device)
                tok = self.tokenizer(list(prompts[i:i + self.batch_size]), padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt").to(self.device)
                img = embedding(self.model.get_image_features(pixel_values=pix))
                txt = embedding(self.model.get_text_features(**tok))
                cos = (torch.nn.functional.normalize(img.float(), dim=-1)
                       * torch.nn.functional.normalize(txt.float(), dim=-1)).sum(-1)
                if self.use_logit_scale:
                    cos = self.model.logit_scale.float().exp() * cos
                out.append(cos.cpu())
        return torch.cat(out).numpy().astype(np.float32) if out else np.zeros(0, np.float32)


class ClipScore(ClipSimilarity):
    """`clipscore`: w * cos (w = 1 by default), optionally floored at 0 (Hessel et al.: w = 2.5, floored)."""

    name = "clipscore"
    needs_weights = True

    def __init__(self, model_dir: str | Path | None = None, *, clipscore_weight: float = 1.0,
                 clip_negative: bool = False, **kw) -> None:
        model_dir = model_dir or resolve_dir(source(CLIPSCORE_ENV, CLIPSCORE_DEFAULT), what="clipscore",
                                             env=CLIPSCORE_ENV, files=MODEL_FILES + PROCESSOR_FILES)
        super().__init__(model_dir, **kw)
        self.w, self.clip_negative = float(clipscore_weight), clip_negative

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        cos = super().__call__(images, prompts)
        return (self.w * (np.maximum(cos, 0.0) if self.clip_negative else cos)).astype(np.float32)

    @staticmethod
    def missing() -> list[str]:
        src = source(CLIPSCORE_ENV, CLIPSCORE_DEFAULT)
        return [] if dir_available(src, MODEL_FILES + PROCESSOR_FILES) else [f"{CLIPSCORE_ENV} ({src})"]


class PickScore(ClipSimilarity):
    """`pickscore`: exp(logit_scale) * cos with PickScore_v1 (raw scale, ~18-23 on real images)."""

    name = "pickscore"
    needs_weights = True

    def __init__(self, model_dir: str | Path | None = None, processor_dir: str | Path | None = None, **kw) -> None:
        model_dir = model_dir or resolve_dir(source(PICKSCORE_ENV, PICKSCORE_DEFAULT), what="pickscore model",
                                             env=PICKSCORE_ENV, files=MODEL_FILES)
        processor_dir = processor_dir or resolve_dir(
            source(PICKSCORE_PROC_ENV, PICKSCORE_PROC_DEFAULT), what="pickscore processor",
            env=PICKSCORE_PROC_ENV, files=PROCESSOR_FILES)
        super().__init__(model_dir, processor_dir, use_logit_scale=True, **kw)

    @staticmethod
    def missing() -> list[str]:
        out = []
        for env, default, files in ((PICKSCORE_ENV, PICKSCORE_DEFAULT, MODEL_FILES),
                                    (PICKSCORE_PROC_ENV, PICKSCORE_PROC_DEFAULT, PROCESSOR_FILES)):
            src = source(env, default)
            if not dir_available(src, files):
                out.append(f"{env} ({src})")
        return out
