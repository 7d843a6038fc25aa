"""`solrl shapes pretrain` and `solrl shapes pretrain-text`: pretraining the bundled shapes model."""

from __future__ import annotations

import argparse
from pathlib import Path

from solrl.cli.common import int_tuple
from solrl.config import ConfigError


def cmd_pretrain(a: argparse.Namespace) -> int:
    import torch

    from solrl.shapes.pretrain import PretrainConfig, pretrain

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = PretrainConfig(steps=a.steps, batch_size=a.batch_size, seed=a.seed, init_from=a.init_from,
                         **({"lr": a.lr} if a.lr else {}), **({"warmup": a.warmup} if a.warmup is not None else {}),
                         ema_decay=a.ema_decay, t_sampling=a.t_sampling, eval_every=a.eval_every, save_every=a.save_every,
                         stop_at=a.stop_at, track_guidance=a.track_guidance, denoiser=a.denoiser, layers=a.layers,
                         heads=a.heads, patch=a.patch, device=a.device, text_width=a.text_width,
                         text_layers=a.text_layers, unet_channels=a.unet_channels, attn_full_res=a.attn_full_res,
                         relation_share=a.relation_share, track_on_device=a.track_on_device, eval_prompts=a.eval_prompts,
                         text_encoder_from=a.text_encoder_from, freeze_text=a.freeze_text,
                         **({"min_lr_ratio": a.min_lr_ratio} if a.min_lr_ratio is not None else {}))
    if cfg.steps <= 0 or cfg.batch_size <= 0 or cfg.eval_prompts <= 0 or cfg.save_every <= 0:
        raise ConfigError("--steps, --batch-size, --eval-prompts and --save-every must be positive")
    try:
        pretrain(cfg, Path(a.out), progress=not a.no_progress)
    except ValueError as err:   # a bad --device or --t-sampling: a usage error, not a traceback
        raise ConfigError(str(err)) from None
    print(f"saved checkpoints under {a.out}")
    return 0


def cmd_pretrain_text(a: argparse.Namespace) -> int:
    import torch

    from solrl.shapes.pretrain_text import TextPretrainConfig, pretrain_text

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.steps <= 0 or a.batch_size < 2:
        raise ConfigError("--steps must be positive and --batch-size at least 2 (the other images are the negatives)")
    if not 0 < a.relation_share < 1:
        raise ConfigError(f"--relation-share must be in (0, 1), got {a.relation_share}")
    cfg = TextPretrainConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed, eval_every=a.eval_every,
                             relation_share=a.relation_share, hard_negatives=not a.no_hard_negatives,
                             text_width=a.text_width, text_layers=a.text_layers)
    pretrain_text(cfg, Path(a.out), progress=not a.no_progress)
    print(f"saved {a.out}/text_encoder (pretrain the denoiser on it: solrl shapes pretrain --text-encoder-from {a.out})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("shapes", help="the shapes world")
    ssub = s.add_subparsers(dest="shapes_cmd", required=True)
    sp = ssub.add_parser("pretrain", help="train the bundled shapes model from a fixed seed")
    sp.add_argument("--out", required=True, help="directory for the weights, eval.jsonl and the card")
    sp.add_argument("--steps", type=int, default=1200, help="length of the learning-rate schedule")
    sp.add_argument("--stop-at", type=int, default=0,
                    help="end after this step, saving it, while lr follows the --steps schedule (a checkpoint "
                         "chosen from a longer run, reproduced without running the rest)")
    sp.add_argument("--batch-size", type=int, default=64, help="images per optimizer step")
    sp.add_argument("--seed", type=int, default=0, help="seed of the weights, data and noise")
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sp.add_argument("--init-from", default=None, help="continue from saved weights (second phase)")
    sp.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the pretraining config's)")
    sp.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: the pretraining config's)")
    sp.add_argument("--min-lr-ratio", type=float, default=None, help="cosine floor as a share of --lr")
    sp.add_argument("--ema-decay", type=float, default=0.0, help="save an EMA of the weights (e.g. 0.999)")
    sp.add_argument("--t-sampling", choices=["uniform", "logit_normal"], default="uniform",
                    help="how training timesteps are drawn")
    sp.add_argument("--denoiser", choices=["pixart", "sana", "unet"], default="unet",
                    help="denoiser family of a fresh model: diffusers UNet (the bundled model's), PixArt or SANA "
                         "transformer")
    sp.add_argument("--layers", type=int, default=8, help="transformer blocks of a fresh PixArt / SANA model")
    sp.add_argument("--heads", type=int, default=4,
                    help="attention heads of a fresh model (transformers: width 32 each)")
    sp.add_argument("--patch", type=int, default=4, help="patch size of a fresh PixArt / SANA model")
    sp.add_argument("--text-width", type=int, default=64, help="text encoder hidden size of a fresh model (x16)")
    sp.add_argument("--text-layers", type=int, default=2, help="text encoder blocks of a fresh model")
    sp.add_argument("--unet-channels", type=int_tuple, default=(32, 64, 64),
                    help="a fresh UNet's channels per resolution, comma-separated (default 32,64,64)")
    sp.add_argument("--attn-full-res", action="store_true",
                    help="a fresh UNet cross-attends to the caption at the full 32x32 resolution too")
    sp.add_argument("--relation-share", type=float, default=0.4,
                    help="share of two-object relation captions in the data (singles : counts stay 2 : 1)")
    sp.add_argument("--text-encoder-from", default=None,
                    help="a fresh model starts from the text encoder in DIR/text_encoder (solrl shapes pretrain-text)")
    sp.add_argument("--freeze-text", action="store_true", help="keep the text encoder's weights fixed")
    sp.add_argument("--save-every", type=int, default=250,
                    help="save the (EMA) weights to OUT/step_NNNNN every N steps (and at the last step)")
    sp.add_argument("--eval-every", type=int, default=500,
                    help="score the saved weights on held-out and training prompts every N steps (0: never); "
                         "OUT/eval.jsonl")
    sp.add_argument("--track-guidance", type=float, default=0.0,
                    help="also score the held-out prompts sampled with classifier-free guidance at this scale (> 1) "
                         "at each tracking evaluation: the headroom RL can reach (heldout_guided in OUT/eval.jsonl)")
    sp.add_argument("--device", default="cpu", help="train on this torch device, e.g. cuda (data and noise are "
                                                    "drawn on the CPU either way; tracking samples on the CPU)")
    sp.add_argument("--eval-prompts", type=int, default=48,
                    help="held-out and training prompts per tracking evaluation (1 fixed seed each)")
    sp.add_argument("--track-on-device", action="store_true",
                    help="run the tracking samples' forwards on --device too (default: on a CPU copy)")
    sp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sp.set_defaults(fn=cmd_pretrain)

    tp = ssub.add_parser("pretrain-text", help="pretrain the shapes text encoder contrastively, with order-swapped "
                                               "captions as hard negatives (reads which object goes where)")
    tp.add_argument("--out", required=True, help="directory for text_encoder/, log.jsonl and card.json")
    tp.add_argument("--steps", type=int, default=300, help="optimizer steps")
    tp.add_argument("--batch-size", type=int, default=128, help="images per step (the others are the negatives)")
    tp.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (warm-up, then cosine to a tenth)")
    tp.add_argument("--seed", type=int, default=0, help="seed of the weights, data and negatives")
    tp.add_argument("--relation-share", type=float, default=0.5, help="share of relation captions per batch")
    tp.add_argument("--no-hard-negatives", action="store_true",
                    help="drop the order-swapped negatives (the bag-of-words baseline)")
    tp.add_argument("--text-width", type=int, default=64, help="hidden size (x16)")
    tp.add_argument("--text-layers", type=int, default=2, help="transformer blocks")
    tp.add_argument("--eval-every", type=int, default=100,
                    help="score held-out relation images against their reversed caption every N steps (0: at the end)")
    tp.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    tp.add_argument("--no-progress", action="store_true", help="no progress bar")
    tp.set_defaults(fn=cmd_pretrain_text)

