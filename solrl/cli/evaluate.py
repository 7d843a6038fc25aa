"""`solrl eval`: held-out exact-reward evaluation of the base model or a run's checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from solrl.cli.common import step_list
from solrl.config import PRESETS, ConfigError, resolve


def cmd_eval(a: argparse.Namespace) -> int:
    from solrl.engine.evaluate import write_eval
    from solrl.engine.session import Session, load_run_for_eval

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="held-out exact-reward evaluation")
    e.add_argument("--preset", default="shapes", help="with --checkpoint base: the preset whose model and "
                                                          "evaluation settings to use")
    e.add_argument("--checkpoint", default="base", help="'base' or a run directory (its EMA adapter)")
    e.add_argument("--epoch", type=int, default=None,
                   help="with a run directory: the checkpoint after this epoch (default: the latest; 0: before training)")
    e.add_argument("--out", required=True, help="directory for eval.json and the grids")
    e.add_argument("--steps", type=step_list, default=None, help="comma-separated step counts, e.g. 10,40")
    e.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: the config's eval.prompts)")
    e.add_argument("--seeds-per-prompt", type=int, default=None,
                   help="seeds per prompt (default: the config's eval.seeds_per_prompt)")
    e.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. eval.reward=shapes_dense")
    e.set_defaults(fn=cmd_eval)

