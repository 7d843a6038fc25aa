"""`solrl calibrate`: the adaptive proxy's candidates measured against BF16, and its choice."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from solrl.config import resolve


def cmd_calibrate(a: argparse.Namespace) -> int:
    """Measure the candidate proxies of `rollout.proxy` on the preset's base model (or a run's checkpoint) and
    say which one a run with rollout.explore_precision.backend=auto would explore with."""
    from solrl.engine.proxy import calibrate, format_calibration
    from solrl.engine.session import Session, load_run_for_eval

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


def add_parser(sub: argparse._SubParsersAction) -> None:
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

