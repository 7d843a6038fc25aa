"""`solrl` command line: train, eval, shapes pretrain, and listings."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from solrl.config import PRESETS, ConfigError, resolve, resolve_run


def _steps(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps must be comma-separated integers, got {text!r}") from None
    if not steps or any(s <= 0 for s in steps):
        raise argparse.ArgumentTypeError(f"--steps must be positive integers, got {text!r}")
    return steps


def _pools(text: str) -> tuple[int, ...]:
    try:
        return _steps(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--pools must be comma-separated positive integers, got {text!r}") from None


def cmd_train(a: argparse.Namespace) -> int:
    from solrl import ddp
    from solrl.loop import train

    overrides = list(a.set or [])
    if a.epochs is not None:
        overrides.append(f"epochs={a.epochs}")
    cfg, run_dir = resolve_run(a.preset, a.config, overrides, a.out, a.resume)
    if not a.resume and (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    ddp.check_ranks(cfg, ddp.from_env().world)  # before the process group: every rank refuses alike
    with ddp.launch() as ranks:  # under torchrun: data-parallel, rank 0 samples and writes (solrl/ddp.py)
        if not ranks.is_main:
            train(cfg, run_dir, resume=bool(a.resume), progress=False, log=lambda *_: None, ranks=ranks)
            return 0
        print(f"solrl train: {cfg.name} ({cfg.rollout.mode}), {cfg.epochs} epochs -> {run_dir}"
              + (f", {ranks.world} data-parallel ranks" if ranks.parallel else ""))
        s = train(cfg, run_dir, resume=bool(a.resume), progress=not a.no_progress, ranks=ranks)
    print(json.dumps({k: s[k] for k in ("eval_before", "eval_after", "wall_time_s", "mean_epoch_times_s",
                                        "forwards_per_epoch")}, indent=2))
    if s["eval_before"] is not None and s["eval_after"] is not None:
        print(f"held-out reward (EMA adapter): {s['eval_before']:.4f} -> {s['eval_after']:.4f} "
              f"({s['eval_after'] - s['eval_before']:+.4f}) in {s['wall_time_s']:.0f} s")
    print(f"curve: {run_dir / 'reward_curve.png'}   grids: {run_dir / 'eval'}/epoch_*/")
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from solrl.evaluate import write_eval
    from solrl.loop import Session, load_run_for_eval

    out = Path(a.out)
    if a.checkpoint == "base":
        if a.epoch is not None:
            raise ConfigError("--epoch needs --checkpoint RUN_DIR (a training run's directory)")
        name = a.preset if a.preset in PRESETS else "shapes-sol-rl"
        if a.preset not in PRESETS and a.preset != "shapes":
            raise ConfigError(f"unknown preset {a.preset!r}; use 'shapes' or one of {sorted(PRESETS)}")
        cfg = resolve(name, None, list(a.set or []))
        sess = Session.build(cfg)
        extra = {"checkpoint": "base", "model": cfg.model.name}
    else:
        sess = load_run_for_eval(Path(a.checkpoint), a.epoch, list(a.set or []))
        cfg = sess.cfg
        extra = {"checkpoint": str(a.checkpoint), "adapter": "ema", "model": cfg.model.name,
                 "epoch": a.epoch if a.epoch is not None else "latest"}
    summary, grids = sess.evaluate(tuple(a.steps) if a.steps else None, a.prompts, a.seeds_per_prompt)
    extra["prompt_set"] = cfg.prompts.eval
    write_eval(out, summary, grids, extra)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    for n, r in summary["results"].items():
        more = f"  by form {r['by_form']}" if "by_form" in r else ""
        print(f"{n:>3} steps: mean_reward {r['mean_reward']:.4f}{more}")
    print(f"wrote {out / 'eval.json'} and grids")
    return 0


def cmd_dashboard(a: argparse.Namespace) -> int:
    """Serve RUN_DIR's dashboard until Ctrl-C / SIGTERM (the services' HTTP server, found by name: solrl/plugins.py)."""
    from solrl import plugins

    run_dir = Path(a.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    try:
        serve_dashboard = plugins.load("dashboard")
    except ImportError as err:
        return _missing_services(err)
    return serve_dashboard(run_dir, a.host, a.port)


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Measure the candidate proxies of `rollout.proxy` on the preset's base model (or a run's checkpoint) and
    say which one a run with rollout.explore_precision.backend=auto would explore with."""
    from solrl.loop import Session, load_run_for_eval
    from solrl.proxy import calibrate, format_calibration

    sets = list(a.set or []) + ["rollout.explore_precision.backend=auto"]
    if a.checkpoint:
        sess = load_run_for_eval(Path(a.checkpoint), a.epoch, sets)
    else:
        sess = Session.build(resolve(a.preset or "shapes-sol-rl", None, sets))
    cal = calibrate(sess)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(cal, indent=1) + "\n")
    print(format_calibration(cal))
    print(f"wrote {out / 'calibration.json'}")
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    """Stage times per epoch and the GPU placement with the shortest epoch (solrl/deploy/); --calibrate fits the
    cost model to the paper's table and writes OUT/plan.md and OUT/plan.json."""
    from solrl.deploy.fit import calibration_report
    from solrl.deploy.placement import make_plan
    from solrl.deploy.recipe import resolve_config
    from solrl.deploy.report import format_plan, plan_dict

    if a.calibrate:
        out = Path(a.out or "benchmarks/results")
        res = calibration_report(out)
        c = res["calibration"]
        print(f"fitted: sampling efficiency {c['eta_rollout']:.4f}, training efficiency {c['eta_train']:.4f}, "
              f"{c['image_s'] * 1000:.2f} ms per 1024 px image; RMS error {res['rms_error']:.1%}, largest "
              f"{res['max_error']:.1%}")
        print(f"wrote {out / 'plan.md'} and {out / 'plan.json'}")
        return 0
    cfg, preset = resolve_config(a.model, a.preset, list(a.set or []))
    p = make_plan(cfg, preset, a.gpu, a.gpus, layout=a.layout, explorers=a.explorers,
                  regenerators=a.regenerators, trainer_ranks=a.trainer_ranks)
    if a.emit:
        from solrl.deploy.layouts import emit

        print(emit(p, a.emit, list(a.set or [])), end="")
    elif a.json:
        print(json.dumps(plan_dict(p), indent=1))
    else:
        print(format_plan(p))
    return 0


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


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


def _missing_services(err: ImportError) -> int:
    print(f"solrl: error: the services are not available ({err}); run `make protos` in the repository",
          file=sys.stderr)
    return 2


def cmd_bench(a: argparse.Namespace) -> int:
    from solrl.bench import run_bench

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    kw = {k: v for k, v in (("prompts", a.prompts), ("seeds", a.seeds), ("epochs", a.epochs)) if v}
    if a.seed is not None:
        kw["seed"] = a.seed
    if a.precisions:
        kw["precisions"] = tuple(a.precisions.split(","))
    if a.steps:
        kw["steps"] = a.steps
    if a.reward:
        if a.name == "ranking":
            kw["rewards"] = tuple(x for x in a.reward.split(",") if x)
        else:
            kw["reward"] = a.reward
    if a.policies:
        kw["policies"] = tuple(x for x in a.policies.split(",") if x)
    if a.repeats:
        kw["repeats"] = a.repeats
    if a.jobs:
        kw["jobs"] = a.jobs
    if a.modes:
        kw["modes"] = tuple(x for x in a.modes.split(",") if x)
    if a.compare:
        kw["compare"] = a.compare
    if a.device:
        kw["device"] = a.device
    if a.sets:
        kw["overrides"] = tuple(a.sets)
    if a.models:
        kw["models"] = tuple(x for x in a.models.split(",") if x)
    if a.arms:
        kw["arms"] = tuple(x for x in a.arms.split(",") if x)
    if a.pools:
        kw["pools"] = a.pools
    if a.name == "cli":
        kw["commands"] = command_words()
    if a.name in ("curve", "selection") and a.threads:
        kw["threads"] = a.threads  # per run: the runs set their own torch threads
    try:
        result = run_bench(a.name, Path(a.out), small=a.small, **kw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(Path(a.out, f"{result.get('bench', a.name)}.md").read_text())
    return 0


def cmd_up(a: argparse.Namespace) -> int:
    from solrl.deploy.up import run

    try:
        return run(a)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def cmd_list(a: argparse.Namespace) -> int:
    if a.what == "presets":
        for n in sorted(PRESETS):
            print(n)
    elif a.what == "models" and a.action == "quantized":
        from solrl.models import load_model
        from solrl.models.architectures import ARCHITECTURES
        from solrl.precision.policy import POLICIES, architecture_share_report, format_report, share_report

        names = a.model or ["shapes", *ARCHITECTURES]
        for name in names:
            try:
                policies = tuple(a.policy or POLICIES)
                if name in ARCHITECTURES and a.path is None:  # counted on the meta device: no weights needed
                    print(format_report(architecture_share_report(name, a.backend, policies)))
                else:
                    print(format_report(share_report(load_model(name, a.path), a.backend, policies)))
            except (FileNotFoundError, ValueError) as exc:
                raise ConfigError(f"models quantized: {exc}") from None
    elif a.what == "models":
        from solrl.models import available_models

        print("\n".join(available_models()))
    else:
        _list_rewards()
    return 0


def _list_rewards() -> None:
    """One line per reward: name, whether it needs downloaded weights, and whether it can be built here."""
    from solrl.rewards import available_rewards, reward_info

    for n in available_rewards():
        info = reward_info(n)
        missing = info.missing()
        status = "ready" if not missing else "missing: " + "; ".join(missing)
        weights = f"needs weights: {info.weights}" if info.needs_weights else "no weights"
        print(f"{n:<22} {weights} [{status}]")


def cmd_reward_score(a: argparse.Namespace) -> int:
    """Score PNG(s) against a prompt with one reward (or a weighted spec) and print JSON."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from solrl.rewards import build_reward

    images = []
    for path in a.image:
        if not Path(path).is_file():
            raise ConfigError(f"--image {path}: no such file")
        try:
            with Image.open(path) as im:
                images.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
        except UnidentifiedImageError:
            raise ConfigError(f"--image {path}: not an image PIL can read") from None
    if len({im.shape for im in images}) != 1:
        raise ConfigError(f"--image: all images must have the same size, got {[list(im.shape[:2]) for im in images]}")
    try:
        scorer = build_reward(a.reward)
        batch = np.stack(images)
        prompts = [a.prompt] * len(images)
        detail = scorer.score_detailed(batch, prompts) if hasattr(scorer, "weights") else None
        scores = np.asarray(scorer(batch, prompts), dtype=np.float64) if detail is None else detail["total"]
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"--reward {a.reward}: {err}") from None
    # the same keys for one image or many: one entry per --image, in order
    out = {"reward": getattr(scorer, "name", a.reward), "prompt": a.prompt, "images": list(a.image),
           "scores": [float(x) for x in scores]}
    if detail is not None:
        out["components"] = {k: [float(x) for x in v] for k, v in detail.items() if k != "total"}
        out["weights"] = scorer.weights
    print(json.dumps(out))
    return 0


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default, unless its text already speaks of it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):
                yield from _all_parsers(sp)


def command_words() -> tuple[tuple[str, ...], ...]:
    """Every command as its words after `solrl`: () for the top level, then each subcommand (the service roles'
    included), in the parser's order (what `solrl bench cli` times)."""
    out: list[tuple[str, ...]] = [()]
    for sp in _all_parsers(build_parser()):
        words = tuple(sp.prog.split()[1:])  # "solrl bench" -> ("bench",)
        if words and words not in out:
            out.append(words)
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = _build_parser()
    for sp in _all_parsers(p):
        sp.formatter_class = _Help
    return p


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solrl", description="RL post-training of diffusion models with two-stage rollouts")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run the embedded two-stage loop")
    t.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)} (default shapes-sol-rl)")
    t.add_argument("--config", default=None, help="a JSON run config (instead of a preset)")
    t.add_argument("--epochs", type=int, default=None, help="epochs to train (default: the preset's)")
    t.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. rollout.pool=48")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="held-out exact-reward evaluation")
    e.add_argument("--preset", default="shapes", help="with --checkpoint base: the preset whose model and "
                                                          "evaluation settings to use")
    e.add_argument("--checkpoint", default="base", help="'base' or a run directory (its EMA adapter)")
    e.add_argument("--epoch", type=int, default=None,
                   help="with a run directory: the checkpoint after this epoch (default: the latest; 0: before training)")
    e.add_argument("--out", required=True, help="directory for eval.json and the grids")
    e.add_argument("--steps", type=_steps, default=None, help="comma-separated step counts, e.g. 10,40")
    e.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: the config's eval.prompts)")
    e.add_argument("--seeds-per-prompt", type=int, default=None,
                   help="seeds per prompt (default: the config's eval.seeds_per_prompt)")
    e.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. eval.reward=shapes_dense")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("calibrate", help="measure candidate explorer proxies against BF16 at full steps and choose "
                                         "one (what rollout.explore_precision.backend=auto does at a run's start)")
    c.add_argument("--preset", default=None, help="run preset (default shapes-sol-rl)")
    c.add_argument("--checkpoint", default=None, help="a run directory: calibrate on its adapter (see --epoch)")
    c.add_argument("--epoch", type=int, default=None, help="with --checkpoint: that epoch's adapter (default latest)")
    c.add_argument("--out", required=True, help="directory for calibration.json")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="e.g. rollout.proxy.device=h100, rollout.proxy.target=0.6, "
                        "'rollout.proxy.candidates=[\"fp8-e4m3-emu@4\",\"bf16@6\"]'")
    c.set_defaults(fn=cmd_calibrate)

    pl = sub.add_parser("plan", help="cost model: each stage's time per epoch and the GPU placement (colocated or "
                                     "per role) with the shortest epoch; --emit prints its compose / kustomize values")
    pl.add_argument("--model", default=None, help="a registered model (default: the preset's)")
    pl.add_argument("--preset", default=None, help="run preset (default: the model's two-stage preset)")
    pl.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. rollout.pool=48")
    pl.add_argument("--gpus", type=int, default=8, help="GPUs to place the roles on")
    pl.add_argument("--gpu", default="b200", help="GPU kind: b200, h100 or h200")
    pl.add_argument("--layout", default="auto", choices=["auto", "colocated", "disaggregated"],
                    help="auto: the shorter epoch of the two")
    pl.add_argument("--explorers", type=int, default=None, help="pin the explorer GPUs (disaggregated)")
    pl.add_argument("--regenerators", type=int, default=None, help="pin the regenerator GPUs (disaggregated)")
    pl.add_argument("--trainer-ranks", type=int, default=None, help="pin the trainer's ranks (GPUs)")
    pl.add_argument("--emit", choices=["compose", "kustomize"], default=None,
                    help="print the chosen layout as a compose env file or a kustomize fragment")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    pl.add_argument("--calibrate", action="store_true",
                    help="fit the efficiencies to the paper's table; write OUT/plan.md and OUT/plan.json")
    pl.add_argument("--out", default=None, help="with --calibrate: directory (default benchmarks/results)")
    pl.set_defaults(fn=cmd_plan)

    d = sub.add_parser("dashboard", help="serve the live dashboard of a run directory (reward curves, proxy "
                                         "agreement, stage times, the latest evaluation grid, the config)")
    d.add_argument("run_dir", help="a run directory (solrl train --out, or the trainer service's)")
    d.add_argument("--host", default="127.0.0.1", help="bind address")
    d.add_argument("--port", type=int, default=8094, help="HTTP port (0: any free port)")
    d.set_defaults(fn=cmd_dashboard)

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
    sp.add_argument("--unet-channels", type=_int_tuple, default=(32, 64, 64),
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

    from solrl.bench import BENCHES

    b = sub.add_parser("bench", help="benchmarks: writes OUT/<name>.json and OUT/<name>.md",
                       description="\n".join(f"{k}: {v}" for k, v in BENCHES.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", choices=sorted(BENCHES))
    b.add_argument("--out", required=True, help="directory for NAME.json, NAME.md and plots")
    b.add_argument("--small", action="store_true", help="tiny settings (seconds; what the tests run)")
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default; curve: per run)")
    b.add_argument("--seed", type=int, default=None, help="seed of the sampled seeds / training runs (default 0)")
    b.add_argument("--prompts", type=int, default=None,
                   help="ranking / relations: held-out prompts; rollout / ablate: prompts per epoch")
    b.add_argument("--seeds", type=int, default=None, help="ranking / relations: seeds per prompt")
    b.add_argument("--epochs", type=int, default=None,
                   help="rollout / curve / ablate / serve / selection: epochs per mode, setting or arm")
    b.add_argument("--precisions", default=None,
                   help="ranking: comma-separated proxy precisions; NAME@2/6 limits one to those explore steps")
    b.add_argument("--steps", type=_steps, default=None, help="ranking: comma-separated explore steps; "
                                                                 "pretrain_sweep: STOP_AT[,EVAL_EVERY]")
    b.add_argument("--policies", default=None,
                   help="ranking: comma-separated per-layer policies for the quantizing precisions (default reference; "
                        "see solrl models quantized)")
    b.add_argument("--reward", default=None, help="ranking: comma-separated rewards to score with (default shapes); "
                                                  "curve: train on this reward (default: shapes); shapes-world rewards "
                                                  "are evaluated with the exact shapes reward")
    b.add_argument("--repeats", type=int, default=None,
                   help="curve / selection: training runs (run seeds) per mode or arm (default 3); cli: runs per command "
                        "(default 5)")
    b.add_argument("--jobs", type=int, default=None,
                   help="curve / selection: training runs at once, in separate processes (default 1); with --threads, threads "
                        "per run, "
                        "else the cores shared out; finished runs under --out are reused")
    b.add_argument("--modes", default=None,
                   help="curve: comma-separated modes to train (default the paper's four; sol_rl_auto: sol_rl with "
                        "the adaptive proxy; flow_grpo / sol_flow_grpo: FlowGRPO one- / two-stage)")
    b.add_argument("--arms", default=None,
                   help="selection: comma-separated arms (default all: none, random, oracle, proxy_bf16, proxy_nvfp4)")
    b.add_argument("--pools", type=_pools, default=None, help="selection: comma-separated pool sizes n (default 16)")
    b.add_argument("--compare", default=None,
                   help="curve: an earlier curve JSON measured with the same settings whose modes are set beside these")
    b.add_argument("--device", default=None, help="pretrain_sweep: train (and track) on this torch device, e.g. cuda; "
                                                  "curve: each run's model.device")
    b.add_argument("--models", default=None,
                   help="relations: comma-separated shapes model directories (default: the bundled base), e.g. "
                        "solrl shapes pretrain's step_NNNNN")
    b.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE",
                   help="curve / selection: a config override for every run (repeat), e.g. train.beta=0.5")
    b.set_defaults(fn=cmd_bench)

    sv = sub.add_parser("serve", help="run one service role (what containers run)")
    roles = sv.add_subparsers(dest="role", required=True)
    roles.add_parser("reward", help="reward service: solrl.reward.v1 + KServe v2 / Triton gRPC", add_help=False)
    for role, text in (("explorer", "low-precision explorer: Explore + KServe v2 'explore' model, adapter hot reload"),
                       ("regenerator", "BF16 regenerator: Regenerate, adapter hot reload"),
                       ("trainer", "trainer: drives explorers/regenerators through Redis, pushes adapters")):
        roles.add_parser(role, help=text, add_help=False)
    for role in ("reward", "explorer", "regenerator", "trainer"):
        # the role's own options are parsed when the role runs (services.<role>.args, light; the server module,
        # with grpc, torch and its stubs, only after): importing them only to build this parser would slow every
        # `solrl` command
        roles.choices[role].set_defaults(fn=lambda a, role=role: _serve(role, a.service_args), takes_extra=True)

    up = sub.add_parser("up", help="start every role as a local process against a Redis URL (Ctrl-C stops all)")
    try:
        from solrl.deploy.up import add_arguments as _up_args

        _up_args(up)
        up.set_defaults(fn=cmd_up)
    except ImportError as err:
        up.set_defaults(fn=lambda a, err=err: _missing_services(err))

    rw = sub.add_parser("reward", help="score images with a reward")
    rsub = rw.add_subparsers(dest="reward_cmd", required=True)
    rs = rsub.add_parser("score", help="score PNG(s) against a prompt; prints JSON: reward, prompt, images, scores")
    rs.add_argument("--reward", required=True, help="a reward name (solrl rewards list) or 'pickscore:1.0+ocr:0.5'")
    rs.add_argument("--image", required=True, action="append", help="a PNG (repeat for several)")
    rs.add_argument("--prompt", required=True, help="the prompt the images were drawn for")
    rs.set_defaults(fn=cmd_reward_score)

    for what in ("presets", "models", "rewards"):
        lp = sub.add_parser(what, help=f"list {what}" + (" (`models quantized`: what each precision policy "
                                                          "quantizes)" if what == "models" else ""))
        lp.add_argument("action", nargs="?", default="list", choices=["list", "quantized"] if what == "models"
                        else ["list"])
        if what == "models":
            lp.add_argument("--model", action="append",
                            help="quantized: a registered model (repeat; default: shapes and the three real models, "
                                 "whose architectures are counted without weights)")
            lp.add_argument("--path", default=None, help="quantized: the model's local weights directory")
            lp.add_argument("--backend", default="nvfp4-emu", help="quantized: the explorer backend (default nvfp4-emu)")
            lp.add_argument("--policy", action="append", help="quantized: a policy (repeat; default all)")
        lp.set_defaults(fn=cmd_list, what=what)
    return p


def _serve(role: str, argv: list[str]) -> int:
    """`solrl serve <role> [options]`: the container entry point. The role's options come from its light
    services.<role>.args (no grpc, torch: `--help` and option errors are fast); its server module (grpc,
    torch, the stubs) loads once they parse, and the services' logging is set up before it runs."""
    from solrl import plugins

    try:
        options = plugins.role_module(role, "args")
    except ImportError as err:
        return _missing_services(err)
    parser = argparse.ArgumentParser(prog=f"solrl serve {role}", formatter_class=_Help)
    options.add_arguments(parser)
    args = parser.parse_args(argv)
    try:  # the service shells need the generated stubs (`make protos`); the core CLI does not
        module = plugins.role_module(role, "server")
        configure_logging = plugins.load("logging")
    except ImportError as err:
        return _missing_services(err)
    try:
        configure_logging()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return module.run(args) or 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "takes_extra", False):
        args.service_args = extra  # `solrl serve ROLE ...`: the role's own parser reads them
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"solrl: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
