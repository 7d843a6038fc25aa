"""Pretraining variants of the shapes base side by side, each tracked with the headroom guidance shows.

What classifier-free guidance adds to a base was compared with what RL adds on it (docs/notes/shapes.md: loosely
related over five bases), so the guided held-out reward is tracked beside the unguided one. This benchmark
trains each variant of the bundled recipe (`solrl shapes pretrain`, one process per variant and seed, `jobs`
at a time, one torch thread each) with `--track-guidance 3` and tables, per tracked step and averaged over the
seeds: the unguided held-out reward, what CFG adds, the relations (half the evaluated prompts) and the shape
accuracy. On a GPU (`device="cuda"`) the runs share it and sample their tracking there too
(`--track-on-device`): 14 runs of 1,100-1,200 steps took 6 minutes on one H200.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from solrl.bench.common import write_results
from solrl.telemetry import read_metrics

# name -> extra `solrl shapes pretrain` flags; the rest is the bundled base's recipe (its card.json)
VARIANTS: dict[str, list[str]] = {
    "base": [],
    "tw128": ["--text-width", "128", "--text-layers", "4"],
    "tw128l2": ["--text-width", "128", "--text-layers", "2"],
    "tw256l2": ["--text-width", "256", "--text-layers", "2"],
    "rel60": ["--relation-share", "0.6"],
    "rel75": ["--relation-share", "0.75"],
    "tw128rel60": ["--text-width", "128", "--text-layers", "4", "--relation-share", "0.6"],
}
RECIPE = ["--steps", "3000", "--batch-size", "64", "--lr", "1e-3", "--warmup", "200", "--ema-decay", "0.999",
          "--denoiser", "unet", "--heads", "4"]
GUIDANCE = 3.0


def _command(run_dir: Path, flags: list[str], seed: int, stop_at: int, eval_every: int, eval_prompts: int,
             device: str, small: bool) -> list[str]:
    recipe = ["--steps", "4", "--batch-size", "4", "--denoiser", "unet", "--heads", "2"] if small else RECIPE
    cmd = [sys.executable, "-m", "solrl.cli", "shapes", "pretrain", "--out", str(run_dir), *recipe, *flags,
           "--seed", str(seed), "--stop-at", str(stop_at), "--eval-every", str(eval_every), "--eval-prompts",
           str(eval_prompts), "--track-guidance", str(GUIDANCE), "--threads", "1", "--device", device, "--no-progress"]
    return cmd + (["--track-on-device"] if device != "cpu" else [])


def _finished(run_dir: Path, stop_at: int) -> bool:
    evals = run_dir / "eval.jsonl"
    recs = read_metrics(evals) if evals.exists() else []
    return bool(recs) and recs[-1]["step"] >= stop_at


def train_all(out: Path, variants: dict[str, list[str]], seeds: list[int], stop_at: int, eval_every: int,
              eval_prompts: int, device: str, jobs: int, small: bool) -> dict[str, Path]:
    """Every (variant, seed) run under out/runs/, `jobs` processes at a time; finished runs are reused."""
    runs: dict[str, Path] = {}
    todo = []
    for name, flags in variants.items():
        for seed in seeds:
            run_dir = out / "runs" / f"{name}_s{seed}"
            runs[f"{name}_s{seed}"] = run_dir
            if not _finished(run_dir, stop_at):
                todo.append((run_dir, _command(run_dir, flags, seed, stop_at, eval_every, eval_prompts, device, small)))
    active: list[tuple[Path, subprocess.Popen, Any]] = []
    failed = []
    while todo or active:
        while todo and len(active) < max(1, jobs):
            run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            log = (run_dir / "log.txt").open("w")
            active.append((run_dir, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for item in list(active):
            run_dir, proc, log = item
            if proc.poll() is not None:
                active.remove(item)
                log.close()
                if proc.returncode != 0:
                    failed.append(run_dir.name)
    if failed:
        raise RuntimeError(f"pretraining runs failed: {failed} (see their log.txt under {out / 'runs'})")
    return runs


def summarize(runs: dict[str, Path]) -> dict[str, Any]:
    """Per variant and tracked step, the mean over its seeds (steps that every seed reached)."""
    by_variant: dict[str, dict[int, list[dict]]] = {}
    for run, run_dir in runs.items():
        variant = run.rsplit("_s", 1)[0]
        for r in read_metrics(run_dir / "eval.jsonl"):
            by_variant.setdefault(variant, {}).setdefault(r["step"], []).append(r)
    table: dict[str, list[dict[str, Any]]] = {}
    for variant, steps in by_variant.items():
        n_seeds = max(len(v) for v in steps.values())
        rows = []
        for step in sorted(steps):
            recs = steps[step]
            if len(recs) < n_seeds:
                continue

            def mean(split: str, key: str, recs=recs) -> float | None:
                vals = [r[split][key] for r in recs if r[split].get(key) is not None]
                return round(sum(vals) / len(vals), 4) if vals else None   # a form absent from the prompts: None

            rows.append({"step": step, "seeds": len(recs), "mean": mean("heldout", "mean_reward"),
                         "guided": mean("heldout_guided", "mean_reward"),
                         "relation": mean("heldout", "form_relation"), "relation_guided": mean("heldout_guided", "form_relation"),
                         "position": mean("heldout", "form_position"), "shape_accuracy": mean("heldout", "shape_accuracy"),
                         "exact_match": mean("heldout", "exact_match")})
        table[variant] = rows
    return table


def markdown(table: dict[str, list[dict[str, Any]]], seeds: int, eval_prompts: int) -> str:
    head = (f"Held-out exact reward of each variant's EMA weights, {eval_prompts} held-out prompts x 1 seed per "
            f"tracking point, mean over {seeds} pretraining seed(s); CFG = sampled with guidance {GUIDANCE:g} "
            "(set beside what RL adds in docs/notes/shapes.md). Variants: the bundled recipe with the flags of "
            "`solrl.bench.pretrain_sweep.VARIANTS`.\n\n")
    lines = ["| variant | step | mean | + CFG | relation | + CFG (relation) | position | shape acc | exact match |",
             "|---|---|---|---|---|---|---|---|---|"]
    def f(x: float | None, spec: str = ".3f") -> str:
        return "-" if x is None else format(x, spec)

    def gain(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else format(a - b, "+.3f")

    for variant, rows in table.items():
        for r in rows:
            lines.append(f"| {variant} | {r['step']} | {f(r['mean'])} | {gain(r['guided'], r['mean'])} | "
                         f"{f(r['relation'])} | {gain(r['relation_guided'], r['relation'])} | {f(r['position'])} | "
                         f"{f(r['shape_accuracy'], '.2f')} | {f(r['exact_match'])} |")
    return head + "\n".join(lines) + "\n"


def run(out: Path, small: bool = False, repeats: int | None = None, jobs: int = 1, device: str = "cpu",
        steps: tuple[int, ...] | None = None, prompts: int | None = None) -> dict[str, Any]:
    """`repeats`: pretraining seeds per variant (default 2); `steps`: (stop_at,) or (stop_at, eval_every)
    (default 1200, 100); `prompts`: held-out prompts per tracking point (default 96)."""
    variants = dict(list(VARIANTS.items())[:2]) if small else VARIANTS
    seeds = list(range(repeats or (1 if small else 2)))
    stop_at, eval_every = (tuple(steps) + (100,))[:2] if steps else ((2, 1) if small else (1200, 100))
    eval_prompts = prompts or (4 if small else 96)
    runs = train_all(out, variants, seeds, stop_at, eval_every, eval_prompts, device, jobs, small)
    table = summarize(runs)
    result = {"variants": {k: VARIANTS[k] for k in variants}, "recipe": RECIPE, "seeds": seeds, "stop_at": stop_at,
              "eval_every": eval_every, "eval_prompts": eval_prompts, "guidance": GUIDANCE, "device": device,
              "table": table}
    return write_results(out, "pretrain_sweep", result, markdown(table, len(seeds), eval_prompts))
