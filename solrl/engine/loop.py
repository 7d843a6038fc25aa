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

from solrl.adapters import encode_adapter
from solrl.config import RunConfig
from solrl.engine import data_parallel as ddp
from solrl.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from solrl.engine.evaluate import eval_metrics
from solrl.engine.session import Session
from solrl.telemetry import MetricsWriter, plot_reward_curve, read_metrics, save_png
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
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        state = load_checkpoint(ckpt, sess.adapters, sess.trainer.opt)
        start, sess.trainer.global_step, sess.version = state["epoch"], state["global_step"], state["adapter_version"]
        sess.resume_rollout_adapter(ckpt, log)
        log(f"resuming {run_dir} after epoch {start}")
    sess.trainer.data_parallel(ranks)
    if not ranks.is_main:
        for e in range(start, cfg.epochs):
            sess.follow(e)
        return {}
    cfg.save(run_dir / "config.json")
    writer = MetricsWriter(run_dir, cfg.tensorboard, truncate_after_epoch=start if resume else None,
                           wandb=cfg.wandb, wandb_run={"project": cfg.wandb_project, "name": run_dir.name,
                                                       "config": cfg.to_dict()})
    (run_dir / "eval").mkdir(exist_ok=True)
    t_run = time.perf_counter()
    proxy_fields = sess.setup_proxy(run_dir, start, log)
    if start == 0:
        t0 = time.perf_counter()
        base_eval, grids = sess.evaluate()
        _save_eval(run_dir / "eval" / "epoch_0000", base_eval, grids, writer, 0)
        writer.write({"epoch": 0, **eval_metrics(base_eval), "adapter_version": 0, **proxy_fields,
                      "time_eval_s": time.perf_counter() - t0})
        log(f"held-out reward before training (EMA = base): {base_eval['mean_reward']:.4f}")
    bar = tqdm(range(start, cfg.epochs), desc=cfg.name, disable=not progress, unit="epoch")
    for e in bar:
        rec = sess.epoch(e, on_stage=lambda st, e=e: bar.set_description(f"{cfg.name} epoch {e + 1} {st}"))
        done = e + 1
        if cfg.eval.every and done % cfg.eval.every == 0 or done == cfg.epochs:
            bar.set_description(f"{cfg.name} epoch {done} eval")
            t0 = time.perf_counter()
            ev, grids = sess.evaluate()
            _save_eval(run_dir / "eval" / f"epoch_{done:04d}", ev, grids, writer, done)
            rec.update({**eval_metrics(ev), "time_eval_s": time.perf_counter() - t0})
        sess.after_epoch(done, rec, run_dir, log)
        writer.write(rec)
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.epochs):
            save_checkpoint(run_dir, done, sess.adapters, sess.trainer.opt, sess.trainer.global_step, sess.version,
                            rollout_adapter=sess.rollout_old)
        bar.set_postfix(reward=f"{rec['rollout.reward_mean']:.3f}", loss=f"{rec.get('train.loss', 0):.4f}")
    writer.close()
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_reward_curve(records, run_dir / "reward_curve.png", title=f"{cfg.name} ({cfg.rollout.mode})")
    (run_dir / "adapter_ema.safetensors").write_bytes(
        encode_adapter(sess.adapters.state_dict("ema"), sess.version, sess.adapters.spec))
    evals = [r for r in records if "eval.mean_reward" in r]
    summary = {
        "name": cfg.name, "mode": cfg.rollout.mode, "epochs": cfg.epochs,
        "eval_before": evals[0]["eval.mean_reward"] if evals else None,
        "eval_after": evals[-1]["eval.mean_reward"] if evals else None,
        "wall_time_s": round(time.perf_counter() - t_run, 1),
        "mean_epoch_times_s": {k: float(np.mean([r[k] for r in records if k in r]))
                               for k in ("time_sync_s", "time_explore_s", "time_regenerate_s", "time_train_s",
                                         "time_epoch_s") if any(k in r for r in records)},
        "forwards_per_epoch": {k: int(np.mean([r[k] for r in records if k in r]))
                               for k in ("forwards_explore", "forwards_regenerate", "forwards_rollout_total")
                               if any(k in r for r in records)},
        "explorer_weight_bytes": sess.explorer.weight_bytes() if sess.explorer else None,
        "machine": describe_machine(),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _save_eval(out: Path, ev: dict[str, Any], grids: dict[int, np.ndarray], writer: MetricsWriter, step: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    for n, g in grids.items():
        save_png(g, out / f"grid_{n}steps.png")
        writer.add_image(f"eval/grid_{n}steps", g, step)


__all__ = ["train"]
