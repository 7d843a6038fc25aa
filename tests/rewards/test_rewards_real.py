"""Real reward scorers: OCR for real, the CLIP family / HPSv2 / ImageReward on tiny random models saved in
their real layouts, missing-weights errors, weighted multi-rewards, and `solrl reward score`."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from solrl.rewards import (
    MissingWeightsError,
    PromptError,
    available_rewards,
    build_reward,
    ready_rewards,
    reward_info,
)
from solrl.rewards.multi import MultiReward, parse_spec

CLIP_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
CLIP_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)

ocr_installed = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("rapidocr_onnxruntime", "rapidfuzz")),
    reason="the ocr extra (rapidocr_onnxruntime, rapidfuzz) is not installed")


def render(text: str, size: tuple[int, int] = (256, 96), font_size: int = 40) -> np.ndarray:
    """Black text on white, PIL's bundled font (no system fonts needed)."""
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((16, (size[1] - font_size) // 2), text, fill="black",
                             font=ImageFont.load_default(size=font_size))
    return np.asarray(img)


# ---------------------------------------------------------------------------------------------- OCR

@pytest.fixture(scope="module")
def ocr():
    return build_reward("ocr")


@ocr_installed
def test_ocr_scores_rendered_text(ocr) -> None:
    images = np.stack([render("OPEN"), render("OPEN"), render("HELLO")])
    prompts = ['a shop sign that says "OPEN"', 'a shop sign that says "CLOSED"', 'a card reading "hello"']
    s = ocr(images, prompts)
    assert s.dtype == np.float32 and s.shape == (3,)
    assert s[0] == pytest.approx(1.0) and s[2] == pytest.approx(1.0)  # case-insensitive match
    assert s[1] < 0.5 < s[0]
    assert np.array_equal(ocr(images[:1], prompts[:1]), s[:1])  # deterministic, batch-independent
    assert ocr(render("OPEN")[None], ['"O P E N"']) == pytest.approx(1.0)  # spaces do not count


@ocr_installed
def test_ocr_prompt_errors(ocr) -> None:
    img = render("OPEN")[None]
    with pytest.raises(PromptError, match="prompts: the ocr reward needs the text to render in double quotes"):
        ocr(img, ["a shop sign that says OPEN"])
    with pytest.raises(PromptError, match="quoted text is empty"):
        ocr(img, ['a sign that says ""'])
    with pytest.raises(ValueError, match="got 1 images but 2 prompts"):
        ocr(img, ['"a"', '"b"'])


@ocr_installed
def test_text_reward_follows_flow_grpo() -> None:
    from solrl.rewards.ocr import quoted_text, text_reward

    assert quoted_text('a sign "Open 24h" and "x"') == "Open 24h"
    assert text_reward("WE ARE OPEN NOW", "open") == 1.0           # substring: distance 0
    assert text_reward("OPFN", "open") == pytest.approx(0.75)      # one substitution of 4
    assert text_reward("", "open") == 0.0                           # nothing recognised
    assert text_reward("completely different text", "ab") == 0.0   # distance capped at len(target)


@ocr_installed
def test_ocr_in_the_reward_service_plane() -> None:
    from services.reward.dataplane import RewardDataPlane

    plane = RewardDataPlane.build(["ocr"], max_delay_ms=1.0)
    try:
        assert plane.score("ocr", render("OPEN")[None], ['"open"'])[0] == pytest.approx(1.0)
        with pytest.raises(PromptError, match="^prompts: "):
            plane.score("ocr", render("OPEN")[None], ["no quotes"])
    finally:
        plane.close()


# ---------------------------------------------------------------------------------------------- tiny CLIP

def _byte_chars() -> list[str]:
    """The 256 byte-level BPE symbols of GPT-2 / CLIP tokenizers (the published table)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def save_clip_tokenizer(path) -> None:
    """A 520-token CLIP BPE tokenizer (bytes, bytes + </w>, a few merges, start/end of text)."""
    from transformers import CLIPTokenizer

    chars = _byte_chars()
    merges = [("o", "p"), ("op", "e"), ("ope", "n</w>"), ("s", "a"), ("y", "s</w>"), ("c", "a")]
    vocab = chars + [c + "</w>" for c in chars] + [a + b for a, b in merges] + ["<|startoftext|>", "<|endoftext|>"]
    CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges).save_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    """A random CLIPModel + tokenizer + PIL image processor, saved as a Hub repo would hold them."""
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    d = tmp_path_factory.mktemp("tiny_clip")
    save_clip_tokenizer(d)
    cfg = CLIPConfig(
        projection_dim=16,
        text_config={"vocab_size": 520, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "bos_token_id": 518,
                     "eos_token_id": 519, "pad_token_id": 519},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(str(d))
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                          image_mean=CLIP_MEAN.tolist(), image_std=CLIP_STD.tolist()).save_pretrained(str(d))
    return d


def clip_pixels_by_hand(img: np.ndarray, size: int) -> np.ndarray:
    """CLIP's eval transform written out: shortest side -> size (PIL bicubic), centre crop, /255, mean / std."""
    h, w = img.shape[:2]
    nh, nw = (size, int(size * w / h)) if h <= w else (int(size * h / w), size)
    pil = Image.fromarray(img).resize((nw, nh), Image.BICUBIC)
    top, left = (nh - size) // 2, (nw - size) // 2
    arr = np.asarray(pil, np.float32)[top:top + size, left:left + size] / 255.0
    return ((arr - CLIP_MEAN) / CLIP_STD).transpose(2, 0, 1)


def _images(seed: int, n: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def test_clip_preprocessing_matches_the_processor(tiny_clip_dir) -> None:
    from solrl.rewards.clip import ClipScore

    scorer = ClipScore(tiny_clip_dir, device="cpu")
    for h, w in ((32, 32), (48, 80), (90, 40)):
        imgs = _images(h * w, 2, h, w)
        pix = scorer.pixel_values(imgs).numpy()
        assert pix.shape == (2, 3, 32, 32)
        for i in range(2):
            assert np.abs(pix[i] - clip_pixels_by_hand(imgs[i], 32)).max() < 1e-5, (h, w)


def _features(model_dir, images, prompts):
    from transformers import CLIPModel, CLIPTokenizer

    from solrl.rewards.clip import embedding

    model = CLIPModel.from_pretrained(str(model_dir)).eval()
    tok = CLIPTokenizer.from_pretrained(str(model_dir))(prompts, padding=True, return_tensors="pt")
    pix = torch.from_numpy(np.stack([clip_pixels_by_hand(im, 32) for im in images]))
    with torch.no_grad():
        img = embedding(model.get_image_features(pixel_values=pix))
        txt = embedding(model.get_text_features(**tok))
    return model, torch.nn.functional.cosine_similarity(img, txt, dim=-1).numpy()


def test_clipscore_and_pickscore_on_a_tiny_clip(tiny_clip_dir) -> None:
    from solrl.rewards.clip import ClipScore, PickScore

    images, prompts = _images(1, 3, 40, 56), ["a cat", "open", "says a cat"]
    model, cos = _features(tiny_clip_dir, images, prompts)
    clip = ClipScore(tiny_clip_dir, device="cpu", batch_size=2)  # two batches
    np.testing.assert_allclose(clip(images, prompts), cos, atol=1e-5)
    hessel = ClipScore(tiny_clip_dir, device="cpu", clipscore_weight=2.5, clip_negative=True)
    np.testing.assert_allclose(hessel(images, prompts), 2.5 * np.maximum(cos, 0), atol=1e-5)
    pick = PickScore(tiny_clip_dir, tiny_clip_dir, device="cpu")
    scale = model.logit_scale.exp().item()
    assert scale == pytest.approx(1 / 0.07, rel=1e-4)  # CLIP's initial temperature: a real factor, not 1
    np.testing.assert_allclose(pick(images, prompts), scale * cos, rtol=1e-5, atol=1e-5)
    # batch-independent and deterministic
    np.testing.assert_allclose(pick(images[1:2], prompts[1:2]), pick(images, prompts)[1:2], atol=1e-5)


def test_pickscore_through_the_env_vars(tiny_clip_dir, monkeypatch) -> None:
    monkeypatch.setenv("SOLRL_PICKSCORE_MODEL", str(tiny_clip_dir))
    monkeypatch.setenv("SOLRL_PICKSCORE_PROCESSOR", str(tiny_clip_dir))
    assert reward_info("pickscore").missing() == []
    s = build_reward("pickscore")(_images(2, 2, 32, 32), ["a", "b"])
    assert s.shape == (2,) and np.isfinite(s).all()


# ---------------------------------------------------------------------------------------------- HPSv2

def openclip_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random OpenCLIP ViT state dict (OpenAI layout): vision 32 wide, patch 8 on 32 px; text 32 wide, 520 tokens."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def rnd(*shape, std=0.05, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    def blocks(prefix, width, n):
        for i in range(n):
            p = f"{prefix}.{i}"
            sd[f"{p}.ln_1.weight"], sd[f"{p}.ln_1.bias"] = rnd(width, mean=1.0), rnd(width)
            sd[f"{p}.attn.in_proj_weight"], sd[f"{p}.attn.in_proj_bias"] = rnd(3 * width, width, std=0.2), rnd(3 * width)
            sd[f"{p}.attn.out_proj.weight"], sd[f"{p}.attn.out_proj.bias"] = rnd(width, width, std=0.2), rnd(width)
            sd[f"{p}.ln_2.weight"], sd[f"{p}.ln_2.bias"] = rnd(width, mean=1.0), rnd(width)
            sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"] = rnd(4 * width, width, std=0.2), rnd(4 * width)
            sd[f"{p}.mlp.c_proj.weight"], sd[f"{p}.mlp.c_proj.bias"] = rnd(width, 4 * width, std=0.1), rnd(width)

    sd["visual.class_embedding"] = rnd(32, std=0.5)
    sd["visual.positional_embedding"] = rnd(17, 32, std=0.5)
    sd["visual.proj"] = rnd(32, 16, std=0.2)
    sd["visual.conv1.weight"] = rnd(32, 3, 8, 8, std=0.1)
    sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"] = rnd(32, mean=1.0), rnd(32)
    blocks("visual.transformer.resblocks", 32, 2)
    sd["visual.ln_post.weight"], sd["visual.ln_post.bias"] = rnd(32, mean=1.0), rnd(32)
    sd["positional_embedding"] = rnd(77, 32, std=0.5)
    sd["text_projection"] = rnd(32, 16, std=0.2)
    sd["logit_scale"] = torch.tensor(math.log(1 / 0.07))
    sd["token_embedding.weight"] = rnd(520, 32, std=0.5)
    blocks("transformer.resblocks", 32, 2)
    sd["ln_final.weight"], sd["ln_final.bias"] = rnd(32, mean=1.0), rnd(32)
    return sd


HPS_IMAGES = {"seed": 7, "n": 3, "h": 40, "w": 56}  # non-square: exercises resize-longest + black padding
HPS_PROMPTS = ["a cat", "open", "says a cat"]
# Computed with OpenCLIP 3.3.0 itself in a separate environment (open_clip.create_model on this tiny config:
# embed_dim 16, vision 32 px / patch 8 / width 32 / 2 layers / head_width 16, text 520 tokens / width 32 / 2 heads /
# 2 layers; this state dict loaded with strict=True; its eval transform image_transform(32, resize_mode="longest")
# applied to the PIL images; encode_image / encode_text normalised). Ours matched to 1.5e-7, the transform exactly.
HPS_EXPECTED = [0.37636534, 0.11937099, -0.02085089]


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hps")
    torch.save({"state_dict": openclip_state_dict()}, d / "HPS_v2.1_compressed.pt")
    save_clip_tokenizer(d / "tok")
    return d


def test_hpsv2_on_a_tiny_openclip_checkpoint(hps_files) -> None:
    from transformers import CLIPTokenizer

    from solrl.rewards.hps import HPSv2, resize_max_pad

    scorer = HPSv2(hps_files / "HPS_v2.1_compressed.pt", hps_files / "tok", heads=(2, 2), device="cpu")
    images = _images(HPS_IMAGES["seed"], HPS_IMAGES["n"], HPS_IMAGES["h"], HPS_IMAGES["w"])
    s = scorer(images, HPS_PROMPTS)
    assert s.shape == (3,) and np.all(np.abs(s) <= 1.0 + 1e-6)  # a cosine
    # the OpenCLIP forward, written out on the raw state dict (pre-LN ViT, exact GELU, EOT pooling)
    sd = openclip_state_dict()
    pix = resize_max_pad(images, 32)
    assert torch.all(pix[:, :, :4].reshape(3, 3, -1).std(-1) < 1e-6)  # top rows are the black padding
    ids = CLIPTokenizer.from_pretrained(str(hps_files / "tok"))(HPS_PROMPTS, padding="max_length", max_length=77,
                                                               return_tensors="pt")["input_ids"]
    img, txt = _openclip_encode_image(sd, pix), _openclip_encode_text(sd, ids)
    ref = torch.nn.functional.cosine_similarity(img, txt, dim=-1).numpy()
    np.testing.assert_allclose(s, ref, atol=1e-5)
    np.testing.assert_allclose(s, HPS_EXPECTED, atol=1e-5)


def _resblocks(sd, prefix, x, heads, mask=None):
    n = len({k.split(".")[len(prefix.split("."))] for k in sd if k.startswith(prefix + ".")})
    for i in range(n):
        p = f"{prefix}.{i}"
        ln = torch.nn.functional.layer_norm
        h = ln(x, x.shape[-1:], sd[f"{p}.ln_1.weight"], sd[f"{p}.ln_1.bias"])
        attn, _ = torch.nn.functional.multi_head_attention_forward(
            h.transpose(0, 1), h.transpose(0, 1), h.transpose(0, 1), x.shape[-1], heads,
            sd[f"{p}.attn.in_proj_weight"], sd[f"{p}.attn.in_proj_bias"], None, None, False, 0.0,
            sd[f"{p}.attn.out_proj.weight"], sd[f"{p}.attn.out_proj.bias"], training=False, need_weights=False,
            attn_mask=mask)
        x = x + attn.transpose(0, 1)
        h = ln(x, x.shape[-1:], sd[f"{p}.ln_2.weight"], sd[f"{p}.ln_2.bias"])
        h = torch.nn.functional.linear(h, sd[f"{p}.mlp.c_fc.weight"], sd[f"{p}.mlp.c_fc.bias"])
        x = x + torch.nn.functional.linear(torch.nn.functional.gelu(h), sd[f"{p}.mlp.c_proj.weight"],
                                           sd[f"{p}.mlp.c_proj.bias"])
    return x


def _openclip_encode_image(sd, pix):
    ln = torch.nn.functional.layer_norm
    x = torch.nn.functional.conv2d(pix, sd["visual.conv1.weight"], stride=8).flatten(2).transpose(1, 2)
    x = torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], 1) + sd["visual.positional_embedding"]
    x = ln(x, (32,), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    x = _resblocks(sd, "visual.transformer.resblocks", x, 2)
    return ln(x[:, 0], (32,), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"]) @ sd["visual.proj"]


def _openclip_encode_text(sd, ids):
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    mask = torch.full((77, 77), float("-inf")).triu(1)
    x = _resblocks(sd, "transformer.resblocks", x, 2, mask)
    x = torch.nn.functional.layer_norm(x, (32,), sd["ln_final.weight"], sd["ln_final.bias"])
    return x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"]


# ---------------------------------------------------------------------------------------------- ImageReward

def _bert_vocab(path) -> None:
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "cat", "sign", "that", "says", "open", '"', "dog"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(words) + "\n")


def imagereward_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random ImageReward state dict in THUDM's layout: BLIP ViT (32 px, patch 8, width 32, 2 blocks), med BERT
    (13 tokens, width 24, 2 layers, cross-attention to width 32), MLP head 24-16-8-8-4-1."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def lin(name, n_out, n_in, std=0.2):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = torch.randn(n_out, n_in, generator=g) * std, \
            torch.randn(n_out, generator=g) * 0.05

    def norm(name, n):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g) * 0.05

    v = "blip.visual_encoder"
    sd[f"{v}.cls_token"] = torch.randn(1, 1, 32, generator=g) * 0.5
    sd[f"{v}.pos_embed"] = torch.randn(1, 17, 32, generator=g) * 0.5
    sd[f"{v}.patch_embed.proj.weight"] = torch.randn(32, 3, 8, 8, generator=g) * 0.1
    sd[f"{v}.patch_embed.proj.bias"] = torch.randn(32, generator=g) * 0.05
    for i in range(2):
        b = f"{v}.blocks.{i}"
        norm(f"{b}.norm1", 32), lin(f"{b}.attn.qkv", 96, 32), lin(f"{b}.attn.proj", 32, 32)
        norm(f"{b}.norm2", 32), lin(f"{b}.mlp.fc1", 64, 32), lin(f"{b}.mlp.fc2", 32, 64, 0.1)
    norm(f"{v}.norm", 32)
    t = "blip.text_encoder"
    sd[f"{t}.embeddings.position_ids"] = torch.arange(40)[None]
    sd[f"{t}.embeddings.word_embeddings.weight"] = torch.randn(13, 24, generator=g) * 0.5
    sd[f"{t}.embeddings.position_embeddings.weight"] = torch.randn(40, 24, generator=g) * 0.5
    norm(f"{t}.embeddings.LayerNorm", 24)
    for i in range(2):
        e = f"{t}.encoder.layer.{i}"
        for att, kv_in in (("attention", 24), ("crossattention", 32)):
            lin(f"{e}.{att}.self.query", 24, 24), lin(f"{e}.{att}.self.key", 24, kv_in)
            lin(f"{e}.{att}.self.value", 24, kv_in), lin(f"{e}.{att}.output.dense", 24, 24)
            norm(f"{e}.{att}.output.LayerNorm", 24)
        lin(f"{e}.intermediate.dense", 48, 24), lin(f"{e}.output.dense", 24, 48, 0.1), norm(f"{e}.output.LayerNorm", 24)
    for i, (n_out, n_in) in zip((0, 2, 4, 6, 7), ((16, 24), (8, 16), (8, 8), (4, 8), (1, 4))):
        lin(f"mlp.layers.{i}", n_out, n_in, 0.3)
    return sd


IR_IMAGES = {"seed": 3, "n": 2, "h": 48, "w": 40}
IR_PROMPTS = ["a cat", 'a sign that says "open"']
# Computed with THUDM's own BLIP modules (image-reward 1.5, ImageReward/models/BLIP/vit.py VisionTransformer and
# med.py BertModel(add_pooling_layer=False), this state dict loaded with strict=True) plus ImageReward's MLP and
# normalisation, on these inputs, in a separate environment with small import shims for transformers 5. Ours
# matched to the last printed digit.
IR_EXPECTED = [-0.45484003, -0.40415102]


def test_imagereward_on_a_tiny_blip(tmp_path) -> None:
    from transformers import BertTokenizer

    from solrl.rewards.imagereward import ImageReward, preprocess

    torch.save(imagereward_state_dict(), tmp_path / "ImageReward.pt")
    _bert_vocab(tmp_path / "bert")
    scorer = ImageReward(tmp_path / "ImageReward.pt", tmp_path / "bert", vision_heads=2, text_heads=2, device="cpu")
    images = _images(IR_IMAGES["seed"], IR_IMAGES["n"], IR_IMAGES["h"], IR_IMAGES["w"])
    s = scorer(images, IR_PROMPTS)
    assert s.shape == (2,) and abs(s[0] - s[1]) > 1e-4  # the prompt reaches the score through cross-attention
    np.testing.assert_allclose(preprocess(images, 32)[0].numpy(), clip_pixels_by_hand(images[0], 32), atol=1e-5)
    tok = BertTokenizer.from_pretrained(str(tmp_path / "bert"))(IR_PROMPTS, padding="max_length", max_length=35)
    assert len(tok["input_ids"][0]) == 35 and tok["input_ids"][0][0] == 2  # [CLS] first, as ImageReward feeds it
    np.testing.assert_allclose(s, IR_EXPECTED, atol=1e-5)


# ---------------------------------------------------------------------------------------------- missing weights

@pytest.mark.parametrize("name, env, needed", [
    ("clipscore", "SOLRL_CLIPSCORE_MODEL", "config.json"),
    ("pickscore", "SOLRL_PICKSCORE_MODEL", "config.json"),
    ("hpsv2", "SOLRL_HPSV2_CHECKPOINT", "HPS_v2.1_compressed.pt"),
    ("imagereward", "SOLRL_IMAGEREWARD_CHECKPOINT", "ImageReward.pt"),
    ("hpsv3", "SOLRL_HPSV3_CHECKPOINT", "HPSv3"),
])
def test_missing_weights_name_files_and_env(name, env, needed, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(env, str(tmp_path / "absent"))
    info = reward_info(name)
    assert info.needs_weights and info.missing()
    assert name not in ready_rewards()
    with pytest.raises(MissingWeightsError) as exc:
        build_reward(name)
    assert env in str(exc.value) and needed in str(exc.value) and "nothing is downloaded" in str(exc.value)


def test_a_directory_lacking_files_is_named(tmp_path, monkeypatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("SOLRL_CLIPSCORE_MODEL", str(tmp_path))
    with pytest.raises(MissingWeightsError, match=r"lacks model\.safetensors or pytorch_model\.bin"):
        build_reward("clipscore")


def test_registry_lists_every_reward_and_its_needs() -> None:
    assert {"shapes", "jpeg_compressibility", "ocr", "clipscore", "pickscore", "hpsv2", "imagereward",
            "hpsv3"} <= set(available_rewards())
    assert not reward_info("shapes").needs_weights and not reward_info("ocr").needs_weights
    assert {"shapes", "jpeg_compressibility"} <= set(ready_rewards())
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")


# ---------------------------------------------------------------------------------------------- multi-reward

def test_parse_spec_forms_and_errors() -> None:
    want = {"pickscore": 1.0, "ocr": 0.5}
    assert parse_spec("pickscore:1.0+ocr:0.5") == want
    assert parse_spec("pickscore:1, ocr:0.5") == want
    assert parse_spec('{"pickscore": 1.0, "ocr": 0.5}') == want
    assert parse_spec("shapes+ocr:2") == {"shapes": 1.0, "ocr": 2.0}
    for bad, msg in (("ocr:x", "weight of 'ocr' must be a number"), ("ocr:1+ocr:2", "appears twice"),
                     ("ocr:nan", "must be finite"), ("a b:1", "bad reward name"), ("ocr:1+", "empty term"),
                     ("[1]", "bad reward name"), ('{"a": 1', "bad JSON")):
        with pytest.raises(ValueError, match=msg):
            parse_spec(bad)


def _shapes_batch():
    from solrl.shapes.reward import ShapesReward

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    images[0] = 255  # plain image: compresses well
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    return ShapesReward(), images, prompts


def test_weighted_multi_reward() -> None:
    from solrl.rewards.jpeg import JpegCompressibility

    shapes, images, prompts = _shapes_batch()
    multi = build_reward("shapes:2+jpeg_compressibility:-0.5")
    assert isinstance(multi, MultiReward) and multi.name == "shapes:2+jpeg_compressibility:-0.5"
    want = 2 * shapes(images, prompts) - 0.5 * JpegCompressibility()(images, prompts)
    np.testing.assert_allclose(multi(images, prompts), want, rtol=1e-6)
    parts = multi.score_detailed(images, prompts)
    assert set(parts) == {"shapes", "jpeg_compressibility", "total"}
    with pytest.raises(ValueError, match="unknown reward 'pickscor'"):
        build_reward("pickscor:1+shapes:1")


def test_multi_reward_served_by_the_reward_plane() -> None:
    from services.reward.dataplane import RewardDataPlane

    _, images, prompts = _shapes_batch()
    spec = "shapes:1+jpeg_compressibility:0.1"
    plane = RewardDataPlane.build([spec], max_delay_ms=1.0)
    try:
        np.testing.assert_allclose(plane.score(spec, images, prompts), build_reward(spec)(images, prompts), rtol=1e-6)
    finally:
        plane.close()
    default = RewardDataPlane.build(None, max_delay_ms=1.0)  # serves what can be built here, nothing that fails
    try:
        assert {"shapes", "jpeg_compressibility"} <= set(default.models)
        assert all(not reward_info(n).missing() for n in default.models)
    finally:
        default.close()


# ---------------------------------------------------------------------------------------------- CLI

@ocr_installed
def test_cli_reward_score_prints_json(tmp_path, capsys) -> None:
    from solrl.cli.app import main

    png = tmp_path / "sign.png"
    Image.fromarray(render("OPEN")).save(png)
    assert main(["reward", "score", "--reward", "ocr", "--image", str(png), "--prompt", 'a sign that says "OPEN"']) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reward"] == "ocr" and out["scores"] == [pytest.approx(1.0)] and out["images"] == [str(png)]

    assert main(["reward", "score", "--reward", "ocr:1+jpeg_compressibility:0", "--image", str(png), "--image",
                 str(png), "--prompt", '"CLOSED"']) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["scores"]) == 2 and out["scores"][0] < 0.5 and out["images"] == [str(png)] * 2  # same keys
    assert out["components"]["ocr"] == out["scores"] and out["weights"] == {"ocr": 1.0, "jpeg_compressibility": 0.0}

    assert main(["reward", "score", "--reward", "ocr", "--image", str(png), "--prompt", "no quotes"]) == 2
    assert "double quotes" in capsys.readouterr().err


def test_cli_reward_errors_and_listing(tmp_path, capsys, monkeypatch) -> None:
    from solrl.cli.app import main

    png = tmp_path / "x.png"
    Image.fromarray(_images(0, 1, 32, 32)[0]).save(png)
    monkeypatch.setenv("SOLRL_PICKSCORE_MODEL", str(tmp_path / "absent"))
    assert main(["reward", "score", "--reward", "pickscore", "--image", str(png), "--prompt", "a"]) == 2
    assert "SOLRL_PICKSCORE_MODEL" in capsys.readouterr().err
    assert main(["reward", "score", "--reward", "shapes", "--image", str(tmp_path / "no.png"), "--prompt", "a"]) == 2
    (tmp_path / "bad.png").write_text("not a png")
    assert main(["reward", "score", "--reward", "shapes", "--image", str(tmp_path / "bad.png"), "--prompt", "a"]) == 2
    assert "not an image" in capsys.readouterr().err
    assert main(["rewards", "list"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert "needs weights" in lines["pickscore"] and "missing" in lines["pickscore"]
    assert "no weights" in lines["shapes"] and lines["shapes"].endswith("[ready]")
