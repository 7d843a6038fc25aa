"""The run skeleton the embedded loop (solrl/engine/loop.py) and the queue-driven one (solrl/engine/queue_loop.py)
share: resume from the latest checkpoint; the run directory's config.json, metrics.jsonl and eval/; the evaluation
before training; per epoch the record (the evaluation cadence, the adaptive proxy's decisions, the checkpoint
cadence); the EMA adapter at the end. Where the two differ (how an epoch's rollouts are made, a progress bar or a
status, what is logged) they pass callables.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from solrl.adapters import encode_adapter
from solrl.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from solrl.engine.evaluate import eval_metrics
from solrl.engine.monitors import alarms, reference_drift
from solrl.engine.session import Session
from solrl.telemetry import MetricsWriter, read_metrics, save_png


def resume_session(sess: Session, run_dir: Path, what: str, log: Callable[[str], None] = print) -> int:
    """Load run_dir's latest checkpoint into `sess` (adapters, optimizer, step, version, the rollout adapter); the
    epochs it covers. FileNotFoundError, prefixed `what`, when there is none."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"{what}: no checkpoint in {run_dir / 'checkpoints'}")
    state = load_checkpoint(ckpt, sess.adapters, sess.trainer.opt)
    start, sess.trainer.global_step, sess.version = state["epoch"], state["global_step"], state["adapter_version"]
    sess.resume_rollout_adapter(ckpt, log)
    return start


def run_epochs(sess: Session, run_dir: Path, start: int, epoch: Callable[[int], dict[str, Any]], *, resume: bool,
               log: Callable[[str], None] = print, epochs: Iterable[int] | None = None,
               fresh_truncate: int | None = None,
               on_state: Callable[[str, int], None] = lambda state, epoch: None,
               on_record: Callable[[dict[str, Any]], None] = lambda rec: None,
               after_epoch: Callable[[dict[str, Any]], None] = lambda rec: None) -> dict[str, Any] | None:
    """Epochs `start` .. cfg.epochs - 1 of `sess`'s run into `run_dir` (rank 0), `epoch(e)` making each one's record.

    `epochs`: what to iterate (a progress bar over them; default the range). `fresh_truncate`: what metrics.jsonl
    keeps of an earlier run on a fresh start (None: all of it; -1: none). `on_state(state, epoch)` as the run
    goes "evaluating" or "running"; `on_record(rec)` each record as it is written (epoch 0's included);
    `after_epoch(rec)` once an epoch is recorded and checkpointed. Returns the evaluation before training (None on
    a resumed run)."""
    cfg = sess.cfg
    cfg.save(run_dir / "config.json")
    writer = MetricsWriter(run_dir, cfg.tensorboard, truncate_after_epoch=start if resume else fresh_truncate,
                           wandb=cfg.wandb, wandb_run={"project": cfg.wandb_project, "name": run_dir.name,
                                                       "config": cfg.to_dict()})
    (run_dir / "eval").mkdir(exist_ok=True)
    proxy_fields = sess.setup_proxy(run_dir, start, log)  # the adaptive proxy calibrates on this device
    base_eval = None
    # the evaluation before training, which the reference rewards' drift is measured from (a resumed run's is in
    # its metrics.jsonl)
    before = (next((r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("epoch") == 0), None)
              if resume and (run_dir / "metrics.jsonl").exists() else None)
    if start == 0:
        on_state("evaluating", 0)
        t0 = time.perf_counter()
        base_eval, grids = sess.evaluate()
        save_eval(run_dir / "eval" / "epoch_0000", base_eval, grids, writer, 0)
        rec0 = {"epoch": 0, **eval_metrics(base_eval), "adapter_version": 0, **proxy_fields,
                "time_eval_s": time.perf_counter() - t0}
        writer.write(rec0)
        on_record(rec0)
        before = rec0
        log(f"held-out reward before training (EMA = base): {base_eval['mean_reward']:.4f}")
    for e in range(start, cfg.epochs) if epochs is None else epochs:
        on_state("running", e)
        rec = epoch(e)
        done = e + 1
        if cfg.eval.every and done % cfg.eval.every == 0 or done == cfg.epochs:
            on_state("evaluating", done)
            t0 = time.perf_counter()
            ev, grids = sess.evaluate()
            save_eval(run_dir / "eval" / f"epoch_{done:04d}", ev, grids, writer, done)
            rec.update({**eval_metrics(ev), "time_eval_s": time.perf_counter() - t0})
            rec.update(reference_drift(rec, before))
        sess.after_epoch(done, rec, run_dir, log)
        raised = alarms(cfg.monitor, rec)
        rec["monitor.alarms"] = len(raised)
        for line in raised:
            log(f"monitor alarm, epoch {done}: {line}")
        writer.write(rec)
        on_record(rec)
        stop = bool(raised) and cfg.monitor.stop
        if cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or done == cfg.epochs or stop):
            save_checkpoint(run_dir, done, sess.adapters, sess.trainer.opt, sess.trainer.global_step, sess.version,
                            rollout_adapter=sess.rollout_old)
        after_epoch(rec)
        if stop:
            sess.stopped = f"epoch {done}: " + "; ".join(raised)
            log(f"monitor.stop: the run ends after epoch {done} of {cfg.epochs}")
            break
    writer.close()
    (run_dir / "adapter_ema.safetensors").write_bytes(
        encode_adapter(sess.adapters.state_dict("ema"), sess.version, sess.adapters.spec))
    return base_eval


def save_eval(out: Path, ev: dict[str, Any], grids: dict[int, np.ndarray], writer: MetricsWriter, step: int) -> None:
    """An evaluation's eval.json and grids under `out`, the grids also to the metrics writer."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    for n, g in grids.items():
        save_png(g, out / f"grid_{n}steps.png")
        writer.add_image(f"eval/grid_{n}steps", g, step)


__all__ = ["resume_session", "run_epochs", "save_eval"]
