"""`solrl train`: the embedded two-stage loop."""

from __future__ import annotations

import argparse
import json

from solrl.config import PRESETS, ConfigError, resolve_run


def cmd_train(a: argparse.Namespace) -> int:
    from solrl.engine import data_parallel as ddp
    from solrl.engine.loop import train

    overrides = list(a.set or [])
    if a.epochs is not None:
        overrides.append(f"epochs={a.epochs}")
    cfg, run_dir = resolve_run(a.preset, a.config, overrides, a.out, a.resume)
    if not a.resume and (run_dir / "checkpoints").exists() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    ddp.check_ranks(cfg, ddp.from_env().world)  # before the process group: every rank refuses alike
    with ddp.launch() as ranks:  # under torchrun: data-parallel, rank 0 samples and writes (solrl/engine/data_parallel.py)
        if not ranks.is_main:
            train(cfg, run_dir, resume=bool(a.resume), progress=False, log=lambda *_: None, ranks=ranks)
            return 0
        print(f"solrl train: {cfg.name} ({cfg.rollout.mode}), {cfg.epochs} epochs -> {run_dir}"
              + (f", {ranks.world} data-parallel ranks" if ranks.parallel else ""))
        if cfg.rollout.mode in ("sol_rl", "naive_quant"):
            note = cfg.rollout.explore_precision.note
            print(f"explorer: {cfg.rollout.explore_precision.backend} at {cfg.rollout.explore_steps} steps"
                  + (f" ({note})" if note else ""))
        s = train(cfg, run_dir, resume=bool(a.resume), progress=not a.no_progress, ranks=ranks)
    print(json.dumps({k: s[k] for k in ("eval_before", "eval_after", "wall_time_s", "mean_epoch_times_s",
                                        "forwards_per_epoch")}, indent=2))
    if s["eval_before"] is not None and s["eval_after"] is not None:
        print(f"held-out reward (EMA adapter): {s['eval_before']:.4f} -> {s['eval_after']:.4f} "
              f"({s['eval_after'] - s['eval_before']:+.4f}) in {s['wall_time_s']:.0f} s")
    print(f"curve: {run_dir / 'reward_curve.png'}   grids: {run_dir / 'eval'}/epoch_*/")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="run the embedded two-stage loop")
    t.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)} (default shapes-sol-rl)")
    t.add_argument("--config", default=None, help="a JSON run config (instead of a preset)")
    t.add_argument("--epochs", type=int, default=None, help="epochs to train (default: the preset's)")
    t.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. rollout.pool=48")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(fn=cmd_train)

