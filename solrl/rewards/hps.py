"""Human Preference Score rewards: `hpsv2` (HPSv2 / v2.1) and `hpsv3`.

`hpsv2`: HPS is an OpenCLIP ViT-H-14 fine-tuned on human preferences (Wu et al. 2023, tgxs002/HPSv2);
score = cos(image, text) of its normalised embeddings (~0.25-0.37 on generated images). The `hpsv2`
package pins old protobuf / timm and OpenCLIP pulls torchvision into the environment, so neither is
used: the checkpoint (`HPS_v2.1_compressed.pt` or `HPS_v2_compressed.pt`, an OpenCLIP state dict under
"state_dict") is converted to transformers' `CLIPModel` (key mapping below; OpenCLIP's ViT-H-14 is
the OpenAI CLIP layout with exact GELU, as the laion/CLIP-ViT-H-14 port on the Hub shows). Text goes
through the OpenAI CLIP BPE (transformers' CLIPTokenizer; OpenCLIP's SimpleTokenizer uses the same
vocabulary), 77 tokens. Images: the longest side resized to 224 (bicubic) and padded to a square
with black, then the OpenAI CLIP mean / std — HPSv2's evaluation transform (ResizeMaxSize + pad).
Sources: SOLRL_HPSV2_CHECKPOINT (file, or a directory / cached repo `xswu/HPSv2` holding it) and
SOLRL_HPSV2_TOKENIZER (default laion/CLIP-ViT-H-14-laion2B-s32B-b79K, tokenizer files only).

`hpsv3`: a Qwen2-VL-7B reward model (Ma et al. 2025, MizzenAI/HPSv3), scored by the `hpsv3` package's own
`HPSv3RewardInferencer` with the checkpoint from SOLRL_HPSV3_CHECKPOINT and the config from SOLRL_HPSV3_CONFIG
(default: the package's HPSv3_7B.yaml); score = the predicted mean (mu). The package pins transformers 4.45.2,
so it runs in its own environment (envs/hpsv3, the `hpsv3` target of services/Dockerfile) behind the reward
service; tests/rewards/test_hpsv3.py runs it there on a tiny same-class checkpoint (docs/rewards.md, "HPSv3").
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from solrl.rewards.clip import to_pil
from solrl.rewards.inputs import check_images
from solrl.rewards.weights import (
    MissingWeightsError,
    default_device,
    missing_checkpoint_and_tokenizer,
    resolve_dir,
    resolve_file,
    source,
)

HPSV2_ENV, HPSV2_DEFAULT, HPSV2_FILE = "SOLRL_HPSV2_CHECKPOINT", "xswu/HPSv2", "HPS_v2.1_compressed.pt"
HPSV2_TOK_ENV, HPSV2_TOK_DEFAULT = "SOLRL_HPSV2_TOKENIZER", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
TOKENIZER_FILES = (("tokenizer.json", "vocab.json"),)
HPSV3_ENV = "SOLRL_HPSV3_CHECKPOINT"
HPSV3_CONFIG_ENV = "SOLRL_HPSV3_CONFIG"
HPSV3_BASE = "Qwen/Qwen2-VL-7B-Instruct"
HPSV3_TRANSFORMERS = "4.45.2"

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
VIT_H_14_HEADS = (16, 16)  # (vision, text) attention heads of OpenCLIP ViT-H-14 (head widths 80 and 64)


# ---------------------------------------------------------------------- OpenCLIP -> transformers CLIP

def _layers(sd: dict, prefix: str) -> int:
    ids = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(ids) + 1 if ids else 0


def openclip_to_hf(sd: dict, *, vision_heads: int, text_heads: int, bos_token_id: int = 49406,
                   eos_token_id: int = 49407):
    """(CLIPConfig, state dict) of transformers' CLIPModel equal to an OpenCLIP ViT (OpenAI layout) state dict.

    Written by hand: no installed library converts OpenCLIP checkpoints to transformers without OpenCLIP.
    """
    import torch
    from transformers import CLIPConfig

    need = ["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding", "visual.proj",
            "token_embedding.weight", "positional_embedding", "text_projection", "ln_final.weight", "logit_scale"]
    lacking = [k for k in need if k not in sd]
    if lacking:
        raise ValueError(f"checkpoint is not an OpenCLIP ViT state dict: lacks {lacking}")
    v_width, _, patch, _ = sd["visual.conv1.weight"].shape
    grid = round(math.sqrt(sd["visual.positional_embedding"].shape[0] - 1))
    t_ctx, t_width = sd["positional_embedding"].shape
    embed_dim = sd["visual.proj"].shape[1]
    v_layers, t_layers = _layers(sd, "visual.transformer.resblocks."), _layers(sd, "transformer.resblocks.")
    text = {"vocab_size": sd["token_embedding.weight"].shape[0], "hidden_size": t_width,
            "intermediate_size": sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
            "num_hidden_layers": t_layers, "num_attention_heads": text_heads, "max_position_embeddings": t_ctx,
            "hidden_act": "gelu", "projection_dim": embed_dim, "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id, "pad_token_id": 1}
    vision = {"hidden_size": v_width, "intermediate_size": sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
              "num_hidden_layers": v_layers, "num_attention_heads": vision_heads, "image_size": grid * patch,
              "patch_size": patch, "hidden_act": "gelu", "projection_dim": embed_dim}
    cfg = CLIPConfig(projection_dim=embed_dim, logit_scale_init_value=float(sd["logit_scale"]), text_config=text,
                     vision_config=vision)
    out: dict[str, torch.Tensor] = {
        "vision_model.embeddings.patch_embedding.weight": sd["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": sd["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": sd["visual.positional_embedding"],
        "visual_projection.weight": sd["visual.proj"].t(),
        "text_model.embeddings.token_embedding.weight": sd["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": sd["positional_embedding"],
        "text_projection.weight": sd["text_projection"].t(),
        "logit_scale": sd["logit_scale"].reshape(()),
    }
    for src, dst in (("visual.ln_pre", "vision_model.pre_layrnorm"), ("visual.ln_post", "vision_model.post_layernorm"),
                     ("ln_final", "text_model.final_layer_norm")):
        out[f"{dst}.weight"], out[f"{dst}.bias"] = sd[f"{src}.weight"], sd[f"{src}.bias"]
    for src_root, dst_root, n in (("visual.transformer.resblocks", "vision_model.encoder.layers", v_layers),
                                  ("transformer.resblocks", "text_model.encoder.layers", t_layers)):
        for i in range(n):
            s, d = f"{src_root}.{i}", f"{dst_root}.{i}"
            q, k, v = sd[f"{s}.attn.in_proj_weight"].chunk(3)
            qb, kb, vb = sd[f"{s}.attn.in_proj_bias"].chunk(3)
            for name, w, b in (("q_proj", q, qb), ("k_proj", k, kb), ("v_proj", v, vb)):
                out[f"{d}.self_attn.{name}.weight"], out[f"{d}.self_attn.{name}.bias"] = w, b
            for a, c in (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"),
                         ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[f"{d}.{c}.weight"], out[f"{d}.{c}.bias"] = sd[f"{s}.{a}.weight"], sd[f"{s}.{a}.bias"]
    return cfg, {k: v.float().contiguous() for k, v in out.items()}


def resize_max_pad(images: np.ndarray, size: int):
    """HPSv2's evaluation transform: longest side -> size (bicubic), centred on a black square, CLIP-normalised.

    Returns float32 [B, 3, size, size]. Written by hand (OpenCLIP's version needs torchvision).
    """
    import torch
    from PIL import Image

    out = np.empty((len(images), 3, size, size), dtype=np.float32)
    mean, std = np.array(OPENAI_MEAN, np.float32), np.array(OPENAI_STD, np.float32)
    for i, pil in enumerate(to_pil(images)):
        w, h = pil.size
        scale = size / float(max(h, w))
        nh, nw = round(h * scale), round(w * scale)
        if (nh, nw) != (h, w):
            pil = pil.resize((nw, nh), Image.BICUBIC)
        canvas = Image.new("RGB", (size, size), (0, 0, 0))
        canvas.paste(pil, ((size - nw) // 2, (size - nh) // 2))
        arr = np.asarray(canvas, dtype=np.float32) / 255.0
        out[i] = ((arr - mean) / std).transpose(2, 0, 1)
    return torch.from_numpy(out)


class HPSv2:
    """`hpsv2`: cos(image, text) of the HPS-tuned OpenCLIP ViT-H-14, run as a transformers CLIPModel."""

    name = "hpsv2"
    needs_weights = True

    def __init__(self, checkpoint: str | Path | None = None, tokenizer_dir: str | Path | None = None, *,
                 heads: tuple[int, int] = VIT_H_14_HEADS, device: str | None = None, batch_size: int = 32) -> None:
        import torch
        from transformers import CLIPModel, CLIPTokenizer

        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        checkpoint = checkpoint or resolve_file(source(HPSV2_ENV, HPSV2_DEFAULT), what="hpsv2", env=HPSV2_ENV,
                                                filename=HPSV2_FILE)
        tokenizer_dir = tokenizer_dir or resolve_dir(source(HPSV2_TOK_ENV, HPSV2_TOK_DEFAULT), what="hpsv2 tokenizer",
                                                     env=HPSV2_TOK_ENV, files=TOKENIZER_FILES)
        state = torch.load(str(checkpoint), map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
        state = {k.removeprefix("module."): v for k, v in state.items()}
        self.tokenizer = CLIPTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        # the text tower pools at the end-of-text token (OpenCLIP: the argmax id, which is the same token)
        cfg, sd = openclip_to_hf(state, vision_heads=heads[0], text_heads=heads[1],
                                 bos_token_id=self.tokenizer.bos_token_id, eos_token_id=self.tokenizer.eos_token_id)
        self.model = CLIPModel(cfg).eval()
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise ValueError(f"hpsv2: checkpoint {checkpoint} does not fill the model: missing {missing[:8]}, "
                             f"unexpected {unexpected[:8]}")
        self.device = device or default_device()
        self.model.to(self.device)
        self.image_size, self.batch_size = cfg.vision_config.image_size, batch_size
        self.max_length = cfg.text_config.max_position_embeddings

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        from solrl.rewards.clip import embedding

        images = check_images(images, len(prompts))
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                pix = resize_max_pad(images[i:i + self.batch_size], self.image_size).to(self.device)
                tok = self.tokenizer(list(prompts[i:i + self.batch_size]), padding="max_length", truncation=True,
                                     max_length=self.max_length, return_tensors="pt").to(self.device)
                img = torch.nn.functional.normalize(embedding(self.model.get_image_features(pixel_values=pix)), dim=-1)
                txt = torch.nn.functional.normalize(embedding(self.model.get_text_features(**tok)), dim=-1)
                out.append((img * txt).sum(-1).float().cpu())
        return torch.cat(out).numpy().astype(np.float32) if out else np.zeros(0, np.float32)

    @staticmethod
    def missing() -> list[str]:
        return missing_checkpoint_and_tokenizer(HPSV2_ENV, HPSV2_DEFAULT, HPSV2_FILE, HPSV2_TOK_ENV, HPSV2_TOK_DEFAULT,
                                                TOKENIZER_FILES)


class HPSv3:
    """`hpsv3`: HPSv3's own scoring code (`hpsv3.HPSv3RewardInferencer`, in its environment); score = mu.

    The inferencer builds `Qwen2VLRewardModelBT` (a Qwen2VLForConditionalGeneration with a float32 head
    hidden -> 1024 -> 16 -> 2) from the config's `model_name_or_path`, loads the checkpoint with strict=True,
    and returns (mu, sigma) per image: the head's output at the `<|Reward|>` token that ends its instruction.
    Its pins (transformers 4.45.2) are not solrl's (5.x), so it runs in its own environment: envs/hpsv3.
    """

    name = "hpsv3"
    needs_weights = True

    def __init__(self, checkpoint: str | Path | None = None, config: str | Path | None = None, *,
                 device: str | None = None, batch_size: int = 4) -> None:
        # batch_size: images per inferencer call. Without flash-attn (HPSv3 then uses SDPA), transformers 4.45's
        # Qwen2-VL vision tower attends over one masked sequence of every patch in the call (~1000 an image), so
        # its cost grows with the square of the batch: small batches
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        checkpoint = str(checkpoint or os.environ.get(HPSV3_ENV, "").strip())
        if not checkpoint or not Path(checkpoint).expanduser().is_file():
            raise MissingWeightsError(
                f"hpsv3: weights not found (nothing is downloaded). Needed: the HPSv3 checkpoint (HPSv3.safetensors "
                f"from the MizzenAI/HPSv3 repo) as a local file in {HPSV3_ENV} (now {checkpoint or 'unset'}), "
                f"plus its base model (the config's model_name_or_path, {HPSV3_BASE}) in the HF cache.")
        checkpoint = str(Path(checkpoint).expanduser())
        _check_hpsv3_environment()
        from hpsv3 import HPSv3RewardInferencer

        config = str(config or hpsv3_config())
        base = hpsv3_base_model(config)
        if base is None:
            raise MissingWeightsError(_hpsv3_base_hint(config))
        self.base_model, self.config, self.batch_size = base, config, batch_size
        self.device = device or default_device()
        dtype = _hpsv3_dtype(config)
        if dtype != "float32" and not self.device.startswith("cuda"):
            # HPSv3 casts the decoder's output to its float32 head under CUDA autocast only: elsewhere the bf16
            # hidden states meet float32 weights and the product fails
            raise ValueError(f"hpsv3: the config {config} runs the model in {dtype}, which HPSv3's head supports "
                             f"on CUDA only; on {self.device} give {HPSV3_CONFIG_ENV} a config with bf16: false and "
                             "torch_dtype: float32")
        # from_pretrained(base): a local directory, or the Hub id found in the cache above (the service images set
        # HF_HUB_OFFLINE=1, so nothing is fetched)
        self._inf = HPSv3RewardInferencer(config_path=config, checkpoint_path=checkpoint, device=self.device)

    @staticmethod
    def pil_images(images: np.ndarray) -> list:
        """What the inferencer is given: PIL RGB images (its message's "image"); it resizes them itself to
        256 * 28 * 28 pixels (both sides multiples of 28, bicubic), so any size is accepted."""
        return to_pil(images)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        import torch

        images = check_images(images, len(prompts))
        bad = [p for p in prompts if any(t in p for t in HPSV3_RESERVED)]
        if bad:
            raise ValueError(f"hpsv3: prompt {bad[0]!r} holds one of the model's special tokens {HPSV3_RESERVED}")
        out = []
        with torch.inference_mode():
            for i in range(0, len(images), self.batch_size):
                chunk = self.pil_images(images[i:i + self.batch_size])
                rewards = self._inf.reward(image_paths=chunk, prompts=list(prompts[i:i + self.batch_size]))
                out.append(rewards.float().reshape(len(chunk), -1)[:, 0].cpu())   # (mu, sigma): mu
        return torch.cat(out).numpy().astype(np.float32) if out else np.zeros(0, np.float32)

    @staticmethod
    def missing() -> list[str]:
        import importlib.util

        out = []
        ckpt = os.environ.get(HPSV3_ENV, "").strip()
        if not ckpt or not Path(ckpt).expanduser().is_file():
            out.append(f"{HPSV3_ENV} (unset or not a file)")
        if importlib.util.find_spec("hpsv3") is None:
            out.append("package hpsv3 (its own environment: envs/hpsv3/install.sh)")
            return out
        try:
            _check_hpsv3_environment()
        except ImportError as err:
            return out + [str(err)]
        try:
            config = hpsv3_config()
            if hpsv3_base_model(config) is None:
                out.append(f"base model of {config} ({HPSV3_BASE} by default, in the HF cache)")
        except Exception as err:   # a config that is not a file, or not YAML: reported, never raised
            out.append(str(err))
        return out


# Qwen2-VL's special tokens that HPSv3's message places itself: a prompt holding one would break its parse
HPSV3_RESERVED = ("<|Reward|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                  "<|im_start|>", "<|im_end|>")


def hpsv3_config() -> str:
    """HPSv3's inference config: SOLRL_HPSV3_CONFIG, else the package's own HPSv3_7B.yaml."""
    src = os.environ.get(HPSV3_CONFIG_ENV, "").strip()
    if src:
        if not Path(src).expanduser().is_file():
            raise FileNotFoundError(f"hpsv3: {HPSV3_CONFIG_ENV}={src} is not a file (an HPSv3 YAML config)")
        return str(Path(src).expanduser())
    import importlib.util

    spec = importlib.util.find_spec("hpsv3")
    return str(Path(spec.origin).parent / "config" / "HPSv3_7B.yaml")


def _read_config(config: str) -> dict:
    import yaml

    return yaml.safe_load(Path(config).read_text()) or {}


def _hpsv3_dtype(config: str) -> str:
    cfg = _read_config(config)
    if cfg.get("bf16"):
        return "bfloat16"
    if cfg.get("fp16"):
        return "float16"
    return str(cfg.get("torch_dtype") or "float32")


def hpsv3_base_model(config: str) -> str | None:
    """The config's model_name_or_path as a local directory (or its cached HF snapshot); None if absent here."""
    from solrl.rewards.weights import _cached_snapshot

    name = str(_read_config(config).get("model_name_or_path") or HPSV3_BASE)
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    snap = _cached_snapshot(name)
    return name if snap is not None and (snap / "config.json").is_file() else None


def _hpsv3_base_hint(config: str) -> str:
    name = _read_config(config).get("model_name_or_path") or HPSV3_BASE
    return (f"hpsv3: base model {name!r} (model_name_or_path of {config}) is neither a local directory nor in the "
            f"HF cache (nothing is downloaded). Fetch it where there is network (`hf download {name}`) and share its "
            f"HF_HOME, or point {HPSV3_CONFIG_ENV} at a config whose model_name_or_path is a local copy.")


def _check_hpsv3_environment() -> None:
    """hpsv3 1.0.0 imports transformers 4.45's trainer internals and Qwen2-VL layout; refuse other versions clearly."""
    import importlib.util

    if importlib.util.find_spec("hpsv3") is None:
        raise ImportError(f"hpsv3: the `hpsv3` package is not installed here. It pins transformers=={HPSV3_TRANSFORMERS} "
                          "(solrl uses 5.x), so it runs in its own environment: envs/hpsv3/install.sh, then "
                          "`.venv/hpsv3/bin/solrl serve reward --rewards hpsv3` (docs/rewards.md, HPSv3)")
    import transformers

    if transformers.__version__ != HPSV3_TRANSFORMERS:
        raise ImportError(
            f"hpsv3: the hpsv3 package (1.0.0) runs with transformers=={HPSV3_TRANSFORMERS} (its pin); this "
            f"environment has {transformers.__version__}, whose Qwen2-VL layout and trainer module it cannot use. "
            "Serve it from its own environment: envs/hpsv3/install.sh (docs/rewards.md, HPSv3)")
    try:
        import hpsv3  # noqa: F401
    except ImportError as err:
        raise ImportError(f"hpsv3: the `hpsv3` package does not import here ({err}); build its environment with "
                          "envs/hpsv3/install.sh (docs/rewards.md, HPSv3)") from err
