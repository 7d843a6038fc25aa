"""`solrl plan`: stage times per epoch and the GPU placement (solrl/deploy/), and the layouts it emits."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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


def add_parser(sub: argparse._SubParsersAction) -> None:
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

