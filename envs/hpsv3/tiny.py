"""A tiny same-class HPSv3 for CPU tests, and the scoring entry points tests/rewards/test_hpsv3.py drives.

Run with the hpsv3 environment's python (envs/hpsv3/install.sh; transformers 4.45.2, hpsv3 1.0.0):

    .venv/hpsv3/bin/python envs/hpsv3/tiny.py build DIR [--seed 0]
        DIR/base/               a Qwen2-VL (Qwen2VLForConditionalGeneration, tiny config, seeded random weights)
                                with a locally built byte-level BPE tokenizer and a Qwen2VLProcessor: what
                                HPSv3's `model_name_or_path` (Qwen/Qwen2-VL-7B-Instruct) is for the real model
        DIR/HPSv3.safetensors   the reward model in HPSv3's checkpoint layout (transformers 4.45 Qwen2-VL keys
                                `visual.*`, `model.*`, `lm_head.*`, with the vocabulary grown by `<|Reward|>`,
                                plus the 3-layer `rm_head.{0,3,5}` giving (mu, sigma)); other seeded weights
                                than the base, as a fine-tuned checkpoint
        DIR/HPSv3_tiny.yaml     HPSv3's own inference config (the package's HPSv3_7B.yaml) pointed at DIR/base,
                                in float32 (CPU)
    ... tiny.py score,raw,reference IMAGES.npy PROMPTS.json OUT.npz   (any of the three, comma-separated)
        score: solrl's `hpsv3` reward (build_reward) -> [B] float32
        raw: HPSv3RewardInferencer.reward itself -> [B, 2] (mu, sigma)
        reference: [B, 2] without HPSv3's model class: transformers'
        own Qwen2VLForConditionalGeneration forward (1-D positions, as HPSv3's forward gives its decoder) on the
        checkpoint's weights, the last hidden state at the `<|Reward|>` token, and the head's three layers as
        plain matrix products of the tensors read from the file.

`score`, `raw` and `reference` read SOLRL_HPSV3_CHECKPOINT and SOLRL_HPSV3_CONFIG from the environment.
Nothing is downloaded: the tokenizer is trained here on HPSv3's instruction text.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

# The special tokens of Qwen2-VL's tokenizer that its chat format and processor use (names as in
# Qwen/Qwen2-VL-7B-Instruct's tokenizer_config.json); the pad token is <|endoftext|>.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat format: a default system turn, then `<|im_start|>role\n ... <|im_end|>\n`, an image as
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor repeats <|image_pad|> once per merged patch).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
HIDDEN = 32
# images per forward in `raw` / `reference`: Qwen2-VL's vision attention (SDPA, no flash-attn) masks one
# sequence of every patch in the batch, so its cost grows with the square of the batch (~1000 patches an image)
CHUNK = 4


def _tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Qwen2TokenizerFast(tokenizer_object=tok, unk_token=None, bos_token=None, eos_token="<|im_end|>",
                              pad_token="<|endoftext|>", errors="replace")


def build(out: Path, seed: int = 0) -> None:
    import hpsv3
    import torch
    import yaml
    from hpsv3.dataset.data_collator_qwen import INSTRUCTION, prompt_with_special_token
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor, Qwen2VLProcessor

    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    corpus = [INSTRUCTION.format(text_prompt="a photo of a cat on a red sofa"), prompt_with_special_token,
              "a red circle, two blue squares, a dog running on a beach at sunset, a city at night, a bowl of fruit"]
    tok = _tokenizer(corpus)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    image_proc = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 1280, patch_size=14, temporal_patch_size=2,
                                       merge_size=2, image_mean=OPENAI_MEAN, image_std=OPENAI_STD)
    Qwen2VLProcessor(image_processor=image_proc, tokenizer=tok, chat_template=CHAT_TEMPLATE).save_pretrained(base)
    # the vocabulary padded past the tokenizer, as Qwen2-VL-7B's (152064 rows for 151657 tokens): HPSv3 then
    # resizes the embeddings to the tokenizer grown by <|Reward|>, so its checkpoint holds len(tokenizer) + 1 rows
    vocab = -(-(len(tok) + 1) // 64) * 64
    cfg = Qwen2VLConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, rope_theta=1e6, tie_word_embeddings=False,
        initializer_range=0.2, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
        vision_config={"depth": 2, "embed_dim": 32, "hidden_size": HIDDEN, "num_heads": 4, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        torch_dtype="float32")
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(cfg).save_pretrained(base, safe_serialization=True)

    # the fine-tuned reward model: other weights, the vocabulary = tokenizer + <|Reward|>, and the ranknet head
    # (hidden -> 1024 -> 16 -> 2 with ReLUs; its Dropout sits at index 2, so the linears are 0, 3, 5)
    torch.manual_seed(seed + 1)
    ft = Qwen2VLForConditionalGeneration(cfg)
    ft.resize_token_embeddings(len(tok) + 1)
    state = {k: v.detach().clone().contiguous() for k, v in ft.state_dict().items()}
    for i, (n_in, n_out) in zip((0, 3, 5), ((HIDDEN, 1024), (1024, 16), (16, 2))):
        layer = torch.nn.Linear(n_in, n_out)
        state[f"rm_head.{i}.weight"], state[f"rm_head.{i}.bias"] = layer.weight.detach(), layer.bias.detach()
    save_file(state, str(out / "HPSv3.safetensors"))

    config = yaml.safe_load((Path(hpsv3.__file__).parent / "config" / "HPSv3_7B.yaml").read_text())
    config.update(model_name_or_path=str(base), bf16=False, torch_dtype="float32", output_dir=str(out / "output"),
                  dataloader_num_workers=0)
    (out / "HPSv3_tiny.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def score(scorer, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """solrl's `hpsv3` reward -> [B] float32."""
    return np.asarray(scorer(images, prompts), dtype=np.float32)


def raw(scorer, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """HPSv3RewardInferencer.reward itself -> [B, 2] (mu, sigma)."""
    import torch

    from solrl.rewards.hps import HPSv3

    with torch.inference_mode():
        return np.concatenate([scorer._inf.reward(image_paths=HPSv3.pil_images(images[i:i + CHUNK]),
                                                  prompts=list(prompts[i:i + CHUNK])).float().numpy()
                               for i in range(0, len(images), CHUNK)])


def reference(scorer, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """(mu, sigma) [B, 2] without hpsv3's model class (see the module docstring); only the scorer's inputs
    (HPSv3's message through its processor) are shared."""
    if len(images) > CHUNK:
        return np.concatenate([reference(scorer, images[i:i + CHUNK], prompts[i:i + CHUNK])
                               for i in range(0, len(images), CHUNK)])
    import torch
    from safetensors.torch import load_file
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from solrl.rewards.hps import HPSv3

    batch = scorer._inf.prepare_batch(HPSv3.pil_images(images), list(prompts))
    base = Path(scorer.base_model)
    state = load_file(os.environ["SOLRL_HPSV3_CHECKPOINT"])
    head = {k: state.pop(k) for k in [k for k in state if k.startswith("rm_head.")]}
    cfg = Qwen2VLConfig.from_pretrained(base)
    cfg.vocab_size = state["model.embed_tokens.weight"].shape[0]
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    model.load_state_dict(state, strict=True)
    reward_id = len(AutoProcessor.from_pretrained(base).tokenizer)   # the next id: where <|Reward|> is added
    ids = batch["input_ids"]
    assert bool((ids == reward_id).sum(1).eq(1).all()), "one <|Reward|> token per sequence"
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.inference_mode():
        hidden = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=positions,
                       pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                       output_hidden_states=True, return_dict=True).hidden_states[-1]
        h = hidden[ids == reward_id].float()
        h = torch.relu(h @ head["rm_head.0.weight"].T + head["rm_head.0.bias"])
        h = torch.relu(h @ head["rm_head.3.weight"].T + head["rm_head.3.bias"])
        return (h @ head["rm_head.5.weight"].T + head["rm_head.5.bias"]).numpy()


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    cmd = argv[0]
    if cmd == "build":
        seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
        build(Path(argv[1]), seed)
        return
    from solrl.rewards import build_reward

    images, prompts = np.load(argv[1]), json.loads(Path(argv[2]).read_text())
    scorer = build_reward("hpsv3")
    fns = {"score": score, "raw": raw, "reference": reference}
    np.savez(argv[3], **{cmd: fns[cmd](scorer, images, prompts) for cmd in cmd.split(",")})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root: solrl
    main(sys.argv[1:])
