"""Rollout cost per epoch: naive_scaling (k-in-n, all n in BF16 at full steps) vs sol_rl (n explored
in low precision at few steps, k regenerated in BF16) vs diffusion_nft (k-in-k, BF16), at the same
prompts, pool n and kept k, through the loop's own epoch code (`Session.epoch`).

The forward-count bound: naive forwards / sol_rl forwards, where an explore forward is weighted by
its cost relative to a BF16 forward (1.0: counts only; 0.5: the NVFP4 GEMM at half the BF16 cost, as on
Blackwell), and the B200 bound of this model: only the quantized layers' share of a forward's
multiply-accumulates runs at the FP4 rate (1/4 of BF16), the rest (convolutions, layers kept in high
precision) at 1 -- the cost model `solrl bench curve` uses. On a CPU the emulated FP4 forward (quantize,
dequantize, matmul in fp32) costs MORE than
a BF16 one, so the measured CPU speed-up is below the bound; both are reported, with the measured cost
per forward of each precision.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results
from solrl.config import apply_overrides, get_preset
from solrl.engine.session import Session

MODES = ("naive_scaling", "sol_rl", "diffusion_nft")


def run(out: Path, small: bool = False, prompts: int | None = None, pool: int | None = None,
        kept: int | None = None, epochs: int | None = None, seed: int = 0) -> dict[str, Any]:
    n_prompts, n_pool, n_kept = prompts or (2 if small else 8), pool or (8 if small else 32), kept or (4 if small else 8)
    n_epochs = epochs or (1 if small else 3)
    per_mode: dict[str, Any] = {}
    configs = {}
    for mode in MODES:
        preset = "shapes-diffusion-nft" if mode == "diffusion_nft" else f"shapes-{mode.replace('_', '-')}"
        sets = [f"rollout.prompts_per_epoch={n_prompts}", f"rollout.pool={n_kept if mode == 'diffusion_nft' else n_pool}",
                f"rollout.kept={n_kept}", f"seed={seed}", "tensorboard=false"]
        cfg = configs[mode] = apply_overrides(get_preset(preset), sets).validate()
        sess = Session.build(cfg)
        recs = [sess.epoch(e) for e in range(n_epochs)]

        def med(key: str, recs: list[dict[str, Any]] = recs) -> float:
            return float(np.median([r.get(key, 0.0) for r in recs]))

        explore_s, regen_s = med("time_explore_s"), med("time_regenerate_s")
        f_ex, f_rg = int(recs[0].get("forwards_explore", 0)), int(recs[0]["forwards_regenerate"])
        per_mode[mode] = {
            "pool": int(cfg.rollout.pool), "kept": int(cfg.rollout.kept), "explore_steps": int(cfg.rollout.explore_steps),
            "steps": int(cfg.rollout.steps), "explore_precision": cfg.rollout.explore_precision.backend,
            "forwards_explore": f_ex, "forwards_regenerate": f_rg, "forwards_total": f_ex + f_rg,
            "rollout_s": explore_s + regen_s, "explore_s": explore_s, "regenerate_s": regen_s,
            "train_s": med("time_train_s"), "epoch_s": med("time_epoch_s"),
            "s_per_explore_forward": explore_s / f_ex if f_ex else None,
            "s_per_bf16_forward": regen_s / f_rg if f_rg else None,
        }
    naive, sol = per_mode["naive_scaling"], per_mode["sol_rl"]
    from solrl.bench.curve import explore_share
    from solrl.hardware import forward_cost

    share = explore_share(configs["sol_rl"])  # the explorer this run measured
    sol["explore_quantized_share"] = round(share, 4)
    ratio = {
        "measured_rollout_speedup": naive["rollout_s"] / sol["rollout_s"],
        "measured_epoch_speedup": naive["epoch_s"] / sol["epoch_s"],
        "forward_bound_equal_cost": naive["forwards_total"] / sol["forwards_total"],
        "forward_bound_fp4_half_cost": naive["forwards_total"] / (0.5 * sol["forwards_explore"] + sol["forwards_regenerate"]),
        "forward_bound_b200": naive["forwards_total"] / (forward_cost(sol["explore_precision"], share) * sol["forwards_explore"]
                                                         + sol["forwards_regenerate"]),
        "cpu_fp4_forward_cost_vs_bf16": sol["s_per_explore_forward"] / sol["s_per_bf16_forward"],
    }
    result = {"prompts": n_prompts, "epochs": n_epochs, "modes": per_mode, "speedup": ratio}
    return write_results(out, "rollout", result, markdown(result))


def markdown(r: dict[str, Any]) -> str:
    rows = ["| mode | pool -> kept | explore fwd | BF16 fwd | rollout s | epoch s |", "|---|---|---|---|---|---|"]
    for mode, m in r["modes"].items():
        explore = (f"{m['forwards_explore']} ({m['explore_precision']}, {m['explore_steps']} steps)"
                   if m["forwards_explore"] else "0")
        rows.append(f"| {mode} | {m['pool']} -> {m['kept']} | {explore} | {m['forwards_regenerate']} | "
                    f"{m['rollout_s']:.2f} | {m['epoch_s']:.2f} |")
    s = r["speedup"]
    return (f"{r['prompts']} prompts per epoch, median of {r['epochs']} epochs, the loop's own epoch code.\n\n"
            + "\n".join(rows) + "\n\n"
            f"- measured rollout speed-up sol_rl vs naive_scaling: **{s['measured_rollout_speedup']:.2f}x** "
            f"(epoch: {s['measured_epoch_speedup']:.2f}x)\n"
            f"- forward-count bound: {s['forward_bound_equal_cost']:.2f}x if an FP4 forward cost as much as a BF16 one, "
            f"{s['forward_bound_fp4_half_cost']:.2f}x if the whole forward ran at half the cost; "
            f"**{s['forward_bound_b200']:.2f}x** on the B200 bound of this model (FP4 at 1/4 of BF16 on the "
            f"{r['modes']['sol_rl']['explore_quantized_share']:.0%} of the explore forward's work it quantizes)\n"
            f"- on this CPU an emulated FP4 forward costs {s['cpu_fp4_forward_cost_vs_bf16']:.2f}x a BF16 one "
            f"(fake-quant in fp32), which is why the measured speed-up is below the bound here; the paper "
            f"reports 1.41-2.41x rollout speed-up on 8x B200 (docs/method.md).\n")
