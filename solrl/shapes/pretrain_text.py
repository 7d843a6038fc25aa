"""`solrl shapes pretrain-text`: pretrain the shapes text encoder contrastively on the world's images, with
order-swapped captions as hard negatives, before the denoiser is trained on it.

Why: a text encoder trained from scratch only through the denoising loss never learned which object of a
relation goes where (`solrl bench relations`: order at chance, ~1/255 pixel change when the relation word
flips; docs/notes/shapes.md). Text-to-image models at scale start from a pretrained text encoder; contrastive
image-text encoders are known to read captions as bags of words unless trained against negatives that only
differ in order (Yuksekgonul et al. 2023, "When and why vision-language models behave like bags-of-words",
their NegCLIP). Here the negatives are the world's own: "a red circle to the left of a blue square" against
"a red circle to the right of a blue square" for the same image.

The score of an image and a caption is a late interaction (the FILIP form, Yao et al. 2021): each caption
token takes its best-matching image patch, and the mean over tokens is the score. So the loss trains what the
denoiser's cross-attention reads: per-token features that pick out the region an object is in, not a single
pooled vector. Written here because no library trains a CLIP-style pair on a procedural world; the encoder
itself is `transformers.CLIPTextModel`, as in the bundled model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm
from transformers import CLIPTextModel

from solrl.shapes.model import BOS, PAD, images_to_latents, text_encoder_config, token_ids
from solrl.shapes.pretrain import lr_at
from solrl.shapes.prompts import PromptSampler, form_weights
from solrl.shapes.world import IMAGE_SIZE, parse, render, reverse_relation, split_prompts


@dataclass
class TextPretrainConfig:
    steps: int = 300
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1       # cosine floor as a share of lr (the schedule is `solrl.shapes.pretrain.lr_at`'s)
    weight_decay: float = 0.01
    relation_share: float = 0.5     # share of relation captions per batch (singles : counts stay 2 : 1)
    hard_negatives: bool = True     # each relation image also scored against its caption with the relation reversed
    text_width: int = 64
    text_layers: int = 2
    seed: int = 0
    eval_every: int = 100
    eval_prompts: int = 199         # held-out relation prompts scored against their reversed caption (1 image each)


class PatchEncoder(nn.Module):
    """A small CNN from a 32x32 image to an 8x8 grid of patch features of the text width. Two coordinate
    channels (CoordConv) give every patch its place on the canvas, which an order-aware match needs."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(5, 32, 3, padding=1), nn.GELU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.GELU(),
            nn.Conv2d(64, width, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [B, 3, H, W] in [-1, 1] -> [B, P, width]
        b, _, h, w = x.shape
        ys = torch.linspace(-1, 1, h).view(1, 1, h, 1).expand(b, 1, h, w)
        xs = torch.linspace(-1, 1, w).view(1, 1, 1, w).expand(b, 1, h, w)
        f = self.net(torch.cat([x, xs, ys], dim=1))
        return f.flatten(2).transpose(1, 2)


def late_interaction(patches: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores [images, captions]: for each caption token (mask 1) the cosine of its best patch, averaged."""
    p = F.normalize(patches, dim=-1)
    t = F.normalize(tokens, dim=-1)
    sim = torch.einsum("ipd,tld->itlp", p, t).amax(dim=-1)          # [I, T, L]
    m = mask.float()[None]
    return (sim * m).sum(-1) / m.sum(-1)


def _scored_mask(ids: torch.Tensor) -> torch.Tensor:
    """Tokens that take part in the score: the words and EOS (BOS is the same in every caption)."""
    return (ids != PAD) & (ids != BOS)


def _opposite(caption: str) -> str | None:
    """The caption with its relation reversed, or None when it is not a relation."""
    return reverse_relation(caption) if parse(caption).form == "relation" else None


def hard_negatives(captions: list[str], allowed: set[str]) -> tuple[list[int], list[str]]:
    """For each relation caption whose reversed caption is in `allowed` (the training captions: a held-out
    caption never reaches pretraining, not even as a negative): its index and the reversed caption."""
    rows, negs = [], []
    for i, c in enumerate(captions):
        o = _opposite(c)
        if o is not None and o in allowed:
            rows.append(i)
            negs.append(o)
    return rows, negs


class _Pair(nn.Module):
    def __init__(self, cfg: TextPretrainConfig) -> None:
        super().__init__()
        self.text = CLIPTextModel(text_encoder_config(cfg.text_width, cfg.text_layers))
        self.image = PatchEncoder(cfg.text_width)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))   # CLIP's initial temperature

    def tokens(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = token_ids(captions)
        return self.text(input_ids=ids, attention_mask=mask).last_hidden_state, _scored_mask(ids)


@torch.no_grad()
def order_accuracy(pair: _Pair, captions: list[str], seed: int = 1000) -> float:
    """Share of relation images scored higher with their caption than with the caption whose relation is
    reversed (0.5: the encoder does not read the order)."""
    rels = [c for c in captions if parse(c).form == "relation"]
    rng = np.random.default_rng(seed)
    x = images_to_latents(np.stack([render(parse(c), rng) for c in rels]))
    patches = pair.image(x)
    right = 0
    for i, c in enumerate(rels):
        tok, m = pair.tokens([c, _opposite(c)])
        s = late_interaction(patches[i: i + 1], tok, m)[0]
        right += int(s[0] > s[1])
    return right / len(rels)


def pretrain_text(cfg: TextPretrainConfig, out: Path, progress: bool = True) -> CLIPTextModel:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    pair = _Pair(cfg)
    opt = torch.optim.AdamW(pair.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_caps, held = split_prompts()
    train_set = set(train_caps)
    held_rel = [c for c in held if parse(c).form == "relation"][: cfg.eval_prompts]
    sampler = PromptSampler(train_caps, form_weights(cfg.relation_share))
    rng = np.random.default_rng(cfg.seed)
    log = (out / "log.jsonl").open("w")
    t0 = time.time()
    last_eval: dict = {}
    for step in tqdm(range(cfg.steps), desc="pretrain-text", disable=not progress):
        caps = sampler(rng, cfg.batch_size)
        x = images_to_latents(np.stack([render(parse(c), rng) for c in caps]))
        rows, negs = hard_negatives(caps, train_set) if cfg.hard_negatives else ([], [])
        tok, m = pair.tokens(caps + negs)
        scores = late_interaction(pair.image(x), tok, m) * pair.logit_scale.exp().clamp(max=100)
        target = torch.arange(len(caps))
        # images -> captions over every caption (hard negatives included); captions -> images over the batch
        loss = 0.5 * (F.cross_entropy(scores, target) + F.cross_entropy(scores[:, : len(caps)].T, target))
        lr = lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec = {"step": step + 1, "loss": round(loss.item(), 5), "lr": lr,
               "elapsed_s": round(time.time() - t0, 2)}
        if rows:   # how often the batch's relation images already prefer their caption to the reversed one
            s = scores.detach()
            rec["batch_order_acc"] = round(float((s[rows, rows] > s[rows, len(caps) + torch.arange(len(rows))])
                                                 .float().mean()), 4)
        if (cfg.eval_every > 0 and (step + 1) % cfg.eval_every == 0) or step + 1 == cfg.steps:
            pair.eval()
            rec["heldout_order_acc"] = round(order_accuracy(pair, held_rel), 4)
            pair.train()
            last_eval = {"step": step + 1, "heldout_order_acc": rec["heldout_order_acc"]}
        log.write(json.dumps(rec) + "\n")
        log.flush()
    pair.text.eval().requires_grad_(False)
    pair.text.save_pretrained(out / "text_encoder", safe_serialization=True)
    card = {"config": asdict(cfg), "elapsed_s": round(time.time() - t0, 1), "torch_threads": torch.get_num_threads(),
            "heldout_relations": len(held_rel), "image_size": IMAGE_SIZE, **({"last_eval": last_eval} if last_eval else {})}
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    return pair.text
