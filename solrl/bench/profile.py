"""Where an epoch's time goes: the phases (sync, explore, regenerate, train) of a preset's epochs, and inside each
phase the regions the loop and the trainer mark (`torch.profiler.record_function`: the old, reference and
trainable forwards, the backward, the optimizer step, sampling, decoding, scoring) and the torch operators that
take the most time.

Phases are timed in wall seconds and in this process's CPU seconds (all its threads; steadier on a shared machine).
Timed epochs run without the profiler (its bookkeeping slows a CPU epoch of many small operators); one more epoch
runs under it, and its shares are what the per-region and per-operator tables report. The first epoch of a
session warms caches (prompt encodings, the explorer's quantized copy) and is left out of the timings.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from solrl.bench.common import SMALL_STEPS, write_results
from solrl.config import apply_overrides, get_preset
from solrl.engine.session import Session

PHASES = ("time_sync_s", "time_explore_s", "time_regenerate_s", "time_train_s", "time_epoch_s")
CPU_PHASES = tuple(k.replace("time_", "cpu_") for k in PHASES)   # the same phases in process CPU seconds
# the regions solrl marks (the prefix every record_function name of the loop and the trainer carries)
REGION_PREFIX = "solrl."


def _region_of(event) -> str | None:
    """The innermost solrl region around a profiler event (None: outside every region)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(REGION_PREFIX):
            return parent.name
        parent = parent.cpu_parent
    return None


def profile_epoch(sess: Session, epoch: int, top: int = 12) -> dict[str, Any]:
    """One epoch under the CPU profiler: wall time, each marked region's total, and the operators' self time per
    phase (explore, regenerate, train, ...) with the `top` largest of each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        rec = sess.epoch(epoch)
    events = prof.events()
    regions: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in events:
        if ev.name.startswith(REGION_PREFIX):
            regions[ev.name] += ev.cpu_time_total / 1e6
            continue
        region = _region_of(ev)
        phase = region.split(".")[1] if region else "other"
        ops[phase][ev.name] += ev.self_cpu_time_total / 1e6
    per_phase = {}
    for phase, table in ops.items():
        total = sum(table.values())
        rows = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        per_phase[phase] = {"self_s": total, "top": [{"op": k, "self_s": v, "share": v / total if total else 0.0}
                                                     for k, v in rows]}
    return {"epoch_s": rec["time_epoch_s"], "phases_s": {k: rec[k] for k in PHASES if k in rec},
            "regions_s": dict(sorted(regions.items())), "ops": per_phase}


def run(out: Path, small: bool = False, epochs: int | None = None, seed: int = 0,
        overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """`epochs` timed epochs (default 3; small: 1) of shapes-sol-rl (overrides: --set) after one warm-up epoch (none
    when small), then one epoch under the profiler."""
    n_epochs = epochs or (1 if small else 3)
    sets = [f"seed={seed}", "tensorboard=false", *overrides]
    if small:
        sets = ["rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2", *SMALL_STEPS, *sets]
    cfg = apply_overrides(get_preset("shapes-sol-rl"), sets).validate()
    sess = Session.build(cfg)
    warm = sess.epoch(0) if not small else None  # small (the tests): no warm-up, the timings are not the point
    first = 0 if small else 1
    recs = [sess.epoch(e) for e in range(first, first + n_epochs)]
    timed = {k: float(np.median([r[k] for r in recs])) for k in PHASES + CPU_PHASES}
    prof = profile_epoch(sess, first + n_epochs)
    rows = recs[0]
    result = {
        "preset": cfg.name, "overrides": list(overrides), "epochs_timed": n_epochs, "threads": torch.get_num_threads(),
        "shape": {"prompts": cfg.rollout.prompts_per_epoch, "pool": cfg.rollout.pool, "kept": cfg.rollout.kept,
                  "explore_steps": cfg.rollout.explore_steps, "steps": cfg.rollout.steps,
                  "train_micro_batch": cfg.train.micro_batch, "timestep_evals": rows.get("train.timestep_evals"),
                  "train_forwards": rows.get("train.forwards"), "kl_beta": cfg.train.kl_beta},
        # what the KL term weighs against the loss (kl_beta > 0 only: without it no reference forward runs)
        "train": [{k: r[k] for k in ("epoch", "train.loss", "train.policy", "train.kl") if k in r}
                  for r in ([warm] if warm else []) + recs],
        "warmup_epoch_s": warm["time_epoch_s"] if warm else None, "median_s": timed,
        "profiled": prof, "profiler_overhead": prof["epoch_s"] / timed["time_epoch_s"],
    }
    return write_results(out, "profile", result, markdown(result))


def markdown(r: dict[str, Any]) -> str:
    s, m, p = r["shape"], r["median_s"], r["profiled"]
    epoch = m["time_epoch_s"]
    lines = [
        f"Preset `{r['preset']}`{' with ' + ', '.join(r['overrides']) if r['overrides'] else ''}: {s['prompts']} prompts "
        f"x {s['pool']} seeds explored at {s['explore_steps']} steps, {s['kept']} kept and regenerated at {s['steps']}; "
        f"{s['timestep_evals']} trained (sample, timestep) rows in {s['train_forwards']} forwards of at most "
        f"{s['train_micro_batch']} (kl_beta {s['kl_beta']}). {r['threads']} torch threads.",
        "",
        f"Median of {r['epochs_timed']} epochs"
        + (f" after a warm-up epoch ({r['warmup_epoch_s']:.1f} s):" if r["warmup_epoch_s"] else " (no warm-up):"),
        "",
        "| phase | wall s | share | CPU s (all threads) |", "|---|---|---|---|",
    ]
    for k, c in zip(PHASES[:-1], CPU_PHASES[:-1]):
        lines.append(f"| {k[5:-2]} | {m[k]:.2f} | {m[k] / epoch:.0%} | {m.get(c, float('nan')):.2f} |")
    lines += [f"| **epoch** | **{epoch:.2f}** | | {m.get(CPU_PHASES[-1], float('nan')):.2f} |", ""]
    if any("train.kl" in t for t in r["train"]):
        lines += ["Training loss and the KL term per epoch:", "",
                  "| epoch | loss | KL | kl_beta x KL | share of the loss |", "|---|---|---|---|---|"]
        for t in r["train"]:
            term = s["kl_beta"] * t["train.kl"]
            lines.append(f"| {t['epoch']} | {t['train.loss']:.4f} | {t['train.kl']:.3g} | {term:.3g} | "
                         f"{term / abs(t['train.loss']):.1e} |")
        lines.append("")
    lines += [f"One more epoch under the profiler took {p['epoch_s']:.1f} s ({r['profiler_overhead']:.2f}x). "
              f"Its marked regions (inclusive CPU time):", "", "| region | s | share of the profiled epoch |",
              "|---|---|---|"]
    for name, sec in p["regions_s"].items():
        lines.append(f"| `{name}` | {sec:.2f} | {sec / p['epoch_s']:.0%} |")
    for phase, t in sorted(p["ops"].items(), key=lambda kv: -kv[1]["self_s"]):
        lines += ["", f"Operators of `{phase}` by self time ({t['self_s']:.2f} s in all):", "",
                  "| operator | self s | share |", "|---|---|---|"]
        lines += [f"| `{o['op']}` | {o['self_s']:.2f} | {o['share']:.0%} |" for o in t["top"]]
    return "\n".join(lines)
