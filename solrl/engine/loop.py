"""The embedded loop: a training run in one process (or one torchrun launch), its epochs on the session's own
explorer and regenerator (solrl/engine/session.py); rank 0 writes the run directory, ranks > 0 follow.

All randomness of epoch e is derived from (run seed, e), so a run is reproducible and a resumed run
continues the same trajectory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from solrl.config import RunConfig
from solrl.engine import data_parallel as ddp
from solrl.engine.run import resume_session, run_epochs
from solrl.engine.session import Session
from solrl.telemetry import plot_reward_curve, read_metrics
from solrl.telemetry.machine import describe_machine


def train(cfg: RunConfig, run_dir: Path, resume: bool = False, progress: bool = True,
          log=print, ranks: ddp.Ranks = ddp.SINGLE) -> dict[str, Any]:
    """Run (or resume) a training run in `run_dir`. Returns the summary also written to summary.json.
    `ranks`: under torchrun (solrl/engine/data_parallel.py), rank 0 runs all of this; the other ranks only train, and
    return {}."""
    ddp.check_ranks(cfg, ranks.world)
    if ranks.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    start = 0
    sess = Session.build(cfg, local_explorer=ranks.is_main)  # ranks > 0 sample nothing: no explorer copy
    if resume:
        start = resume_session(sess, run_dir, "--resume", log)
        log(f"resuming {run_dir} after epoch {start}")
    sess.trainer.data_parallel(ranks)
    if not ranks.is_main:
        for e in range(start, cfg.epochs):
            sess.follow(e)
        return {}
    t_run = time.perf_counter()
    bar = tqdm(range(start, cfg.epochs), desc=cfg.name, disable=not progress, unit="epoch")

    def evaluating(state: str, done: int) -> None:
        if state == "evaluating" and done:
            bar.set_description(f"{cfg.name} epoch {done} eval")

    run_epochs(sess, run_dir, start,
               lambda e: sess.epoch(e, on_stage=lambda st: bar.set_description(f"{cfg.name} epoch {e + 1} {st}")),
               resume=resume, log=log, epochs=bar, on_state=evaluating,
               after_epoch=lambda rec: bar.set_postfix(reward=f"{rec['rollout.reward_mean']:.3f}",
                                                       loss=f"{rec.get('train.loss', 0):.4f}"))
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_reward_curve(records, run_dir / "reward_curve.png", title=f"{cfg.name} ({cfg.rollout.mode})")
    evals = [r for r in records if "eval.mean_reward" in r]
    summary = {
        "name": cfg.name, "mode": cfg.rollout.mode, "epochs": cfg.epochs,
        "eval_before": evals[0]["eval.mean_reward"] if evals else None,
        "eval_after": evals[-1]["eval.mean_reward"] if evals else None,
        "wall_time_s": round(time.perf_counter() - t_run, 1),
        "mean_epoch_times_s": {k: float(np.mean([r[k] for r in records if k in r]))
                               for k in (f"{kind}_{phase}_s" for kind in ("time", "cpu")
                                         for phase in ("sync", "explore", "regenerate", "train", "epoch"))
                               if any(k in r for r in records)},
        "forwards_per_epoch": {k: int(np.mean([r[k] for r in records if k in r]))
                               for k in ("forwards_explore", "forwards_regenerate", "forwards_rollout_total")
                               if any(k in r for r in records)},
        "explorer_weight_bytes": sess.explorer.weight_bytes() if sess.explorer else None,
        "machine": describe_machine(),
        "monitor_alarms": sum(r.get("monitor.alarms", 0) for r in records),
        "stopped_by_monitor": sess.stopped,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


__all__ = ["train"]
