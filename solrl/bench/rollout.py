"""Rollout time per epoch, measured: naive_scaling (k-in-n, the whole pool at full steps in the bed's high
precision) vs the two-stage rollout (sol_rl: the pool explored at few steps by each explorer asked for, the kept k
regenerated at full steps) vs diffusion_nft (k-in-k), at the same prompts, pool n and kept k, through the loop's own
epoch code (`Session.epoch`).

Every mode's session is built first and warmed up by one epoch; then the measured epochs alternate between the modes
(epoch e of every mode, then e + 1), so a machine whose speed drifts slows them alike. Each phase is read in wall
seconds and in this process's CPU seconds (all its threads), which a busy neighbour disturbs less.

Beside the measured speed-up, bounds:
- the forward-count bounds (an explore forward as dear as a high-precision one; at half its cost) and the B200 bound
  of this model (FP4 at 1/4 of BF16 on the share of the explore forward's multiply-accumulates it quantizes), as before;
- the bound from the measured per-forward cost: the denoiser forward alone timed here at the batch each pass runs
  (a prompt's pool for naive_scaling and exploration, its k kept seeds for regeneration), the regenerator's with its
  unmerged LoRA as the loop runs it, the explorer's on its merged copy. bound = naive's forward seconds / the two-stage
  rollout's forward seconds: what the rollout would gain if nothing but the denoiser cost time. The goal for a
  real-kernel explorer: the measured rollout speed-up at least 0.9x this bound.

On a CPU the emulated formats (nvfp4-emu, fp8-*-emu) compute in FP32 around a fake quantization, so their forward costs
more than the FP32 one; `bf16-cpu` runs torch's native BF16 kernels where the CPU has BF16 instructions
(solrl/precision/reference.py). The hot reload (the adapter merged and cast or re-quantized into the explorer's copy)
is reported as a share of one explore call (one prompt's pool at the explore steps).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results
from solrl.config import apply_overrides, get_preset
from solrl.engine.session import Session

PHASES = ("sync", "explore", "regenerate", "train", "epoch")


def default_explorers() -> tuple[str, ...]:
    """The real-kernel explorer this machine runs (bf16-cpu where the CPU has BF16 instructions) and the preset's
    NVFP4 emulation."""
    from solrl.precision import runnable_backends

    return (*(("bf16-cpu",) if "bf16-cpu" in runnable_backends() else ()), "nvfp4-emu")


def run(out: Path, small: bool = False, prompts: int | None = None, pools: tuple[int, ...] | None = None,
        kept: int | None = None, epochs: int | None = None, seed: int = 0, precisions: tuple[str, ...] | None = None,
        steps: tuple[int, ...] | None = None) -> dict[str, Any]:
    """`precisions`: the explorers of the two-stage rollout (default: `default_explorers`); `steps`: their explore steps
    (default the preset's 6; 2 with --small). One two-stage mode per (explorer, steps); one table per pool size
    (default 32; 8 with --small)."""
    sizes = tuple(pools or ((8,) if small else (32,)))
    by_pool = {f"n{n}": one_pool(small, prompts, n, kept, epochs, seed, precisions, steps) for n in sizes}
    first = next(iter(by_pool.values()))
    result = {"prompts": first["prompts"], "epochs": first["epochs"], "warmup_epochs": 1, "by_pool": by_pool}
    return write_results(out, "rollout", result, "\n\n".join(markdown(v) for v in by_pool.values()))


def one_pool(small: bool, prompts: int | None, n_pool: int, kept: int | None, epochs: int | None, seed: int,
             precisions: tuple[str, ...] | None, steps: tuple[int, ...] | None) -> dict[str, Any]:
    """The modes at one pool size: build, warm up, alternate the measured epochs, time the forwards."""
    n_prompts, n_kept = prompts or (2 if small else 8), kept or (4 if small else 8)
    if n_pool <= n_kept:
        raise ValueError(f"--pools: every pool must be larger than the {n_kept} kept seeds, got {n_pool}")
    n_epochs = epochs or (1 if small else 3)
    explorers = tuple(precisions or default_explorers())
    from solrl.precision import available_backends

    unknown = [p for p in explorers if p not in available_backends()]
    if unknown:
        raise ValueError(f"--precisions: unknown backend {unknown[0]!r}; available: {available_backends()}")
    step_list = tuple(steps or ((2,) if small else (6,)))
    common = [f"rollout.prompts_per_epoch={n_prompts}", f"rollout.kept={n_kept}", f"seed={seed}", "tensorboard=false"]
    if small:
        common += ["rollout.steps=4"]
    plan: dict[str, tuple[str, list[str]]] = {
        "naive_scaling": ("shapes-naive-scaling", [f"rollout.pool={n_pool}"]),
        "diffusion_nft": ("shapes-diffusion-nft", [f"rollout.pool={n_kept}"]),
    }
    for backend in explorers:
        for s in step_list:
            plan[f"sol_rl:{backend}@{s}"] = ("shapes-sol-rl", [f"rollout.pool={n_pool}", f"rollout.explore_steps={s}",
                                                               f"rollout.explore_precision.backend={backend}"])
    configs = {m: apply_overrides(get_preset(p), common + sets).validate() for m, (p, sets) in plan.items()}
    sessions = {m: Session.build(cfg) for m, cfg in configs.items()}
    for sess in sessions.values():   # a warm-up epoch each (first-call allocations, oneDNN's kernel choices)
        sess.epoch(0)
    recs: dict[str, list[dict[str, Any]]] = {m: [] for m in plan}
    for e in range(1, n_epochs + 1):  # alternate: epoch e of every mode before e + 1 of any
        for m, sess in sessions.items():
            recs[m].append(sess.epoch(e))

    per_mode: dict[str, Any] = {}
    for m, cfg in configs.items():
        rs, r = recs[m], cfg.rollout

        def med(key: str, rs: list[dict[str, Any]] = rs) -> float:
            return float(np.median([x.get(key, 0.0) for x in rs]))

        f_ex, f_rg = int(rs[0].get("forwards_explore", 0)), int(rs[0]["forwards_regenerate"])
        row = {"pool": int(r.pool), "kept": int(r.kept), "explore_steps": int(r.explore_steps) if f_ex else None,
               "steps": int(r.steps), "explore_precision": r.explore_precision.backend if f_ex else None,
               "precision": r.precision.backend, "forwards_explore": f_ex, "forwards_regenerate": f_rg,
               "forwards_total": f_ex + f_rg,
               **{f"{kind}_{ph}_s": med(f"{kind}_{ph}_s") for kind in ("time", "cpu") for ph in PHASES}}
        for kind in ("time", "cpu"):
            row[f"{kind}_rollout_s"] = row[f"{kind}_explore_s"] + row[f"{kind}_regenerate_s"]
        per_mode[m] = row
    forward_s = forward_seconds(sessions, configs)
    naive = per_mode["naive_scaling"]
    from solrl.bench.curve import explore_share
    from solrl.hardware import forward_cost

    speedups: dict[str, Any] = {}
    for m, row in per_mode.items():
        if not m.startswith("sol_rl:"):
            continue
        share = explore_share(configs[m])
        row["explore_quantized_share"] = round(share, 4)
        fs = forward_s[m]
        one_call = fs["explore"] * row["explore_steps"]   # one prompt's pool at the explore steps
        naive_fwd = forward_s["naive_scaling"]["regenerate"] * naive["steps"]
        sol_fwd = one_call + fs["regenerate"] * row["steps"]
        speedups[m] = {
            "measured_rollout_wall": naive["time_rollout_s"] / row["time_rollout_s"],
            "measured_rollout_cpu": naive["cpu_rollout_s"] / row["cpu_rollout_s"],
            "measured_epoch_wall": naive["time_epoch_s"] / row["time_epoch_s"],
            "measured_epoch_cpu": naive["cpu_epoch_s"] / row["cpu_epoch_s"],
            "explore_forward_vs_high_precision": fs["explore"] / forward_s["naive_scaling"]["regenerate"],
            "bound_measured_forwards": naive_fwd / sol_fwd,   # CPU seconds, as measured_rollout_cpu
            "forward_bound_equal_cost": naive["forwards_total"] / row["forwards_total"],
            "forward_bound_half_cost": naive["forwards_total"] / (0.5 * row["forwards_explore"]
                                                                  + row["forwards_regenerate"]),
            "forward_bound_b200": naive["forwards_total"] / (forward_cost(row["explore_precision"], share)
                                                             * row["forwards_explore"] + row["forwards_regenerate"]),
            "hot_reload_share_of_explore_call": row["time_sync_s"] / (row["time_explore_s"] / n_prompts),
        }
        s = speedups[m]
        s["measured_over_bound"] = s["measured_rollout_cpu"] / s["bound_measured_forwards"]
    return {"prompts": n_prompts, "pool": n_pool, "kept": n_kept, "epochs": n_epochs, "warmup_epochs": 1,
            "modes": per_mode, "forward_s": forward_s,
            "speedup": {k: {a: round(b, 4) for a, b in v.items()} for k, v in speedups.items()}}


def forward_seconds(sessions: dict[str, Session], configs: dict[str, Any], repeats: int = 5) -> dict[str, Any]:
    """Per mode, the median process CPU seconds (all threads; on a shared machine steadier than the wall clock) of
    one denoiser forward (model.velocity) at the batch its passes run: "explore" on the explorer's copy at a prompt's
    pool, "regenerate" on the trainer's model with the "old" adapter at the kept seeds (naive_scaling: at the pool).
    Timed after a warm-up call; the modes alternate each repeat."""
    import torch

    calls: dict[tuple[str, str], Any] = {}
    for m, sess in sessions.items():
        r = configs[m].rollout
        spec = sess.model.spec
        cond = sess.cache(["a red circle to the left of a blue square"])
        mode_rows = {"regenerate": r.pool if m == "naive_scaling" else r.kept}
        if sess.explorer is not None:
            mode_rows["explore"] = r.pool
        for phase, rows in mode_rows.items():
            x = torch.randn(rows, *spec.latent_shape, generator=torch.Generator().manual_seed(rows))
            t = torch.full((rows,), 0.5)
            c = type(cond).cat([cond] * rows)
            if phase == "explore":
                def call(sess=sess, x=x, t=t, c=c):
                    return sess.model.velocity(sess.explorer.module, x, t, c)
            else:
                def call(sess=sess, x=x, t=t, c=c):
                    with sess.adapters.use("old"):
                        return sess.model.velocity(sess.model.transformer, x, t, c)
            calls[(m, phase)] = call
    times: dict[tuple[str, str], list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for call in calls.values():
            call()
        for _ in range(repeats):
            for k, call in calls.items():
                t0 = time.process_time()
                call()
                times[k].append(time.process_time() - t0)
    out: dict[str, Any] = {}
    for (m, phase), ts in times.items():
        out.setdefault(m, {})[phase] = statistics.median(ts)
    return out


def markdown(r: dict[str, Any]) -> str:
    rows = ["| mode | pool -> kept | explore fwd | high-precision fwd | rollout s (wall / CPU) | epoch s (wall / CPU) | "
            "hot reload s |", "|---|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        explore = (f"{m['forwards_explore']} ({m['explore_precision']}, {m['explore_steps']} steps)"
                   if m["forwards_explore"] else "0")
        rows.append(f"| {mode} | {m['pool']} -> {m['kept']} | {explore} | {m['forwards_regenerate']} | "
                    f"{m['time_rollout_s']:.2f} / {m['cpu_rollout_s']:.2f} | {m['time_epoch_s']:.2f} / "
                    f"{m['cpu_epoch_s']:.2f} | {m['time_sync_s']:.3f} |")
    fwd = ["| mode | one forward, CPU ms (rows) |", "|---|---|"]
    for mode, f in r["forward_s"].items():
        m = r["modes"][mode]
        parts = []
        if "explore" in f:
            parts.append(f"explore {f['explore'] * 1e3:.1f} ms ({m['pool']} rows, {m['explore_precision']})")
        rows_rg = m["pool"] if mode == "naive_scaling" else m["kept"]
        parts.append(f"high precision {f['regenerate'] * 1e3:.1f} ms ({rows_rg} rows, {m['precision']} weights, "
                     "FP32 kernels on a CPU, LoRA unmerged)")
        fwd.append(f"| {mode} | {'; '.join(parts)} |")
    lines = [f"## Pool {r['pool']} -> {r['kept']}", "",
             f"{r['prompts']} prompts per epoch; median of {r['epochs']} epochs per mode after {r['warmup_epochs']} "
             "warm-up epoch, the modes' epochs alternating; the loop's own epoch code. Wall seconds and this process's "
             "CPU seconds (all threads).", "", *rows, "", "The denoiser forward alone, median CPU time of 5 calls, at the "
             "batch each pass runs:", "", *fwd, ""]
    for mode, s in r["speedup"].items():
        m = r["modes"][mode]
        lines += [f"**{mode}** against naive_scaling:",
                  f"- measured rollout speed-up **{s['measured_rollout_wall']:.2f}x** wall, "
                  f"{s['measured_rollout_cpu']:.2f}x CPU time (epoch: {s['measured_epoch_wall']:.2f}x wall, "
                  f"{s['measured_epoch_cpu']:.2f}x CPU)",
                  f"- one explore forward costs {s['explore_forward_vs_high_precision']:.2f}x a high-precision one at "
                  f"{m['pool']} rows; the bound from the measured forwards is **{s['bound_measured_forwards']:.2f}x**, "
                  f"of which the loop reaches {s['measured_over_bound']:.2f} (CPU time)",
                  f"- forward-count bounds: {s['forward_bound_equal_cost']:.2f}x at equal cost per forward, "
                  f"{s['forward_bound_half_cost']:.2f}x at half; {s['forward_bound_b200']:.2f}x on the B200 bound of "
                  "this model (" + (f"{m['explore_quantized_share']:.0%} of the explore forward's work at the FP4 / "
                                    "FP8 rate" if m["explore_precision"] != "bf16-cpu" else
                                    "a BF16 explorer costs a BF16 forward there") + ")",
                  f"- hot reload (merge and {'cast' if not m['explore_precision'].endswith('emu') else 're-quantize'} "
                  f"into the explorer): {s['hot_reload_share_of_explore_call']:.1%} of one explore call "
                  "(one prompt's pool)", ""]
    lines.append("The paper reports 1.41-2.41x rollout speed-ups on 8x B200 (docs/method.md).")
    return "\n".join(lines)
