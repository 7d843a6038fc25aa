"""`solrl shapes pretrain`: train the bundled shapes model from a fixed seed (flow matching).

Data are rendered on the fly from the training prompts of the world's split (held-out prompts are
never rendered here), forms balanced so relations do not swamp single objects and counts.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from solrl.shapes.model import ShapesModel, images_to_latents
from solrl.shapes.prompts import PromptSampler, form_weights
from solrl.shapes.world import parse, render, split_prompts


@dataclass
class PretrainConfig:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup: int = 50
    min_lr_ratio: float = 0.1
    caption_dropout: float = 0.1   # trains the unconditional branch for classifier-free guidance
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 250
    init_from: str | None = None   # continue from saved weights (a second phase); None = random init
    ema_decay: float = 0.0         # > 0: keep an exponential moving average of the weights and save it
    t_sampling: str = "uniform"    # "uniform" or "logit_normal" (SD3's weighting of the middle of t)
    denoiser: str = "pixart"       # architecture of a fresh model (ignored with init_from): pixart | sana | unet
    layers: int = 8
    heads: int = 6
    patch: int = 4
    text_width: int = 64           # text encoder hidden size (a fresh model; heads of 16)
    text_layers: int = 2           # text encoder blocks (a fresh model)
    unet_channels: tuple[int, ...] = (32, 64, 64)  # a fresh UNet's channels per resolution
    attn_full_res: bool = False    # a fresh UNet also cross-attends to the caption at the full 32x32 resolution
    text_encoder_from: str | None = None  # a fresh model starts from this pretrained text encoder (DIR/text_encoder,
                                   # `solrl shapes pretrain-text`); its width sets the denoiser's cross-attention
    freeze_text: bool = False      # keep the text encoder's weights fixed (as T2I models keep their pretrained one)
    relation_share: float = 0.4    # share of relation captions in the data (singles : counts stay 2 : 1)
    stop_at: int = 0               # > 0: end after this step (saved there) while lr follows the `steps` schedule:
                                   # a checkpoint chosen from a longer run's tracked curve, reproduced alone
    eval_every: int = 500          # > 0: score the saved (EMA) weights on held-out and training prompts
    eval_prompts: int = 48         # prompts of each split per tracking evaluation (1 fixed seed each)
    eval_steps: int = 10           # Euler steps of those samples (the rollout grid)
    track_guidance: float = 0.0    # > 1: also sample the held-out prompts with classifier-free guidance at this scale
                                   # ("heldout_guided"): what the conditional model knows beyond what it draws
                                   # unguided, per caption form, the headroom RL was measured to reach (docs/notes/shapes.md)
    device: str = "cpu"            # where the model trains ("cuda" on a GPU); data, noise and timesteps are
                                   # drawn on the CPU from the seeded generators either way, then moved
    track_on_device: bool = False  # tracking samples run their forwards on `device` too (fast sweeps on a GPU);
                                   # default: on a CPU copy, as the rollouts that use the bundled model run


def _parent_card(init_from: str | None) -> dict | None:
    if not init_from:
        return None
    card = Path(init_from) / "card.json"
    return json.loads(card.read_text()) if card.exists() else {"path": str(init_from)}


def lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def _warm_ema(decay: float):
    """EMA with the usual warm-up, d_n = min(decay, (1 + n) / (10 + n)) after n averaged steps: a short run
    from random weights does not keep a share of its initialisation (0.999^3000 = 5% at a fixed decay)."""
    def update(ema_params, params, num_averaged):
        n = int(num_averaged)
        d = min(decay, (1 + n) / (10 + n))
        for e, p in zip(ema_params, params):
            if e.is_floating_point():
                e.lerp_(p, 1.0 - d)
            else:  # integer buffers (position ids) are copied
                e.copy_(p)
    return update


def _saved(model: ShapesModel, ema) -> ShapesModel:
    """The model to save: the EMA weights when an average is kept, else the raw ones."""
    if ema is None:
        return model
    transformer, text_encoder = ema.module
    return ShapesModel(transformer, text_encoder)


def track(model: ShapesModel, cfg: PretrainConfig) -> dict:
    """Exact-reward summary of `model` on held-out and on training prompts (fixed prompts and seeds; with
    `track_guidance`, the held-out ones also sampled with CFG):
    the curve that tells whether pretraining is teaching shapes, not just lowering the loss. Sampled on
    the CPU (a copy when the model trains elsewhere), as the rollouts that use the bundled model are, unless
    `track_on_device` (the sampling state stays on the CPU; the forwards run where the model trains)."""
    from solrl.engine.evaluate import evaluate, summary_metrics
    from solrl.rollout.passes import SamplerSpec
    from solrl.shapes.metrics import eval_prompts

    if cfg.device != "cpu" and not cfg.track_on_device:
        model = ShapesModel(copy.deepcopy(model.transformer).cpu(), copy.deepcopy(model.text_encoder).cpu())
    train_caps, held = split_prompts()
    held_prompts = eval_prompts(cfg.eval_prompts, held)
    splits = [("heldout", held_prompts, 1.0), ("train", eval_prompts(cfg.eval_prompts, train_caps), 1.0)]
    if cfg.track_guidance > 1.0:  # the same prompts and seeds, sampled with CFG
        splits.append(("heldout_guided", held_prompts, cfg.track_guidance))
    out = {}
    for split, prompts, guidance in splits:
        summary, _ = evaluate(model, model.transformer, (cfg.eval_steps,), prompts, 1, seed=1000,
                              sampler=SamplerSpec(guidance=guidance))
        keep = summary_metrics(summary)
        out[split] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in keep.items()}
    return out


def pretrain(cfg: PretrainConfig, out: Path, progress: bool = True) -> ShapesModel:
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r}: torch sees no CUDA device here")
    if not (cfg.track_guidance == 0 or (math.isfinite(cfg.track_guidance) and cfg.track_guidance > 1)):
        raise ValueError(f"track_guidance must be 0 (off) or a guidance scale > 1, got {cfg.track_guidance!r}")
    if not 0 <= cfg.stop_at <= cfg.steps:
        raise ValueError(f"stop_at must be in [0, steps={cfg.steps}], got {cfg.stop_at}")
    out.mkdir(parents=True, exist_ok=True)
    if cfg.init_from:
        model = ShapesModel.load(cfg.init_from)
    else:
        text_width, text_encoder = cfg.text_width, None
        if cfg.text_encoder_from:
            from transformers import CLIPTextModel

            src = Path(cfg.text_encoder_from) / "text_encoder"
            if not (src / "config.json").exists():
                raise ValueError(f"text_encoder_from: no text encoder in {src} (train one with "
                                 "`solrl shapes pretrain-text --out DIR`)")
            text_encoder = CLIPTextModel.from_pretrained(src, local_files_only=True, use_safetensors=True)
            text_width = text_encoder.config.hidden_size
        model = ShapesModel.random(cfg.seed, denoiser=cfg.denoiser, layers=cfg.layers, heads=cfg.heads,
                                   patch=cfg.patch, text_width=text_width, text_layers=cfg.text_layers,
                                   unet_channels=tuple(cfg.unet_channels), attn_full_res=cfg.attn_full_res)
        if text_encoder is not None:
            model.text_encoder = text_encoder
    model.transformer.to(device).train().requires_grad_(True)
    model.text_encoder.to(device).train(not cfg.freeze_text).requires_grad_(not cfg.freeze_text)
    params = [*model.transformer.parameters(), *([] if cfg.freeze_text else model.text_encoder.parameters())]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_caps, _ = split_prompts()
    sampler = PromptSampler(train_caps, form_weights(cfg.relation_share))
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    ema = None
    if cfg.ema_decay > 0:  # torch's own averaging utility; the averaged copy is what gets saved
        from torch.optim.swa_utils import AveragedModel
        ema = AveragedModel(torch.nn.ModuleList([model.transformer, model.text_encoder]),
                            multi_avg_fn=_warm_ema(cfg.ema_decay), use_buffers=True)
    last = cfg.stop_at or cfg.steps
    if cfg.t_sampling not in ("uniform", "logit_normal"):
        raise ValueError(f"t_sampling must be 'uniform' or 'logit_normal', got {cfg.t_sampling!r}")
    log = (out / "loss.jsonl").open("w")
    evals = (out / "eval.jsonl").open("w")
    t0 = time.time()
    bar = tqdm(range(last), desc="pretrain", disable=not progress)
    for step in bar:
        prompts = sampler(rng, cfg.batch_size)
        x0 = images_to_latents(np.stack([render(parse(p), rng) for p in prompts]))
        drop = torch.rand(cfg.batch_size, generator=gen) < cfg.caption_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        noise = torch.randn(x0.shape, generator=gen)
        if cfg.t_sampling == "logit_normal":
            t = torch.sigmoid(torch.randn(cfg.batch_size, generator=gen))
        else:
            t = torch.rand(cfg.batch_size, generator=gen)
        x0, noise, t = x0.to(device), noise.to(device), t.to(device)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        v = model.velocity(model.transformer, xt, t, model.encode(prompts))
        loss = F.mse_loss(v, noise - x0)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if ema is not None:
            ema.update_parameters(torch.nn.ModuleList([model.transformer, model.text_encoder]))
        rec = {"step": step + 1, "loss": loss.item(), "grad_norm": gn.item(), "lr": lr_at(step, cfg),
               "elapsed_s": round(time.time() - t0, 2)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        bar.set_postfix(loss=f"{rec['loss']:.4f}")
        if cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or step + 1 == last):
            with torch.no_grad():
                saved = _saved(model, ema)
                was = saved.transformer.training, saved.text_encoder.training
                saved.transformer.eval(), saved.text_encoder.eval()
                rec_eval = {"step": step + 1, "elapsed_s": round(time.time() - t0, 2), **track(saved, cfg)}
                saved.transformer.train(was[0]), saved.text_encoder.train(was[1])
            evals.write(json.dumps(rec_eval) + "\n")
            evals.flush()
        if (step + 1) % cfg.save_every == 0 or step + 1 == last:
            card = {"config": asdict(cfg), "steps_done": step + 1, "elapsed_s": rec["elapsed_s"],
                    "torch_threads": torch.get_num_threads(), "parent": _parent_card(cfg.init_from)}
            _saved(model, ema).save(out / f"step_{step + 1:05d}", card)
    if ema is not None:
        model = _saved(model, ema)
    model.transformer.cpu().eval().requires_grad_(False)
    model.text_encoder.cpu().eval().requires_grad_(False)
    return model
