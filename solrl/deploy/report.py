"""The plan's output: its JSON form and the text `solrl plan` prints."""

from __future__ import annotations

import dataclasses
from typing import Any

from solrl.deploy.placement import Layout, Plan
from solrl.deploy.recipe import Recipe
from solrl.hardware import GPUS, USABLE_HBM


def plan_dict(p: Plan) -> dict[str, Any]:
    f, r = p.facts.forward, p.recipe
    return {
        "model": r.model, "preset": r.preset, "gpu": p.gpu, "gpus": p.gpus, "recipe": dataclasses.asdict(r),
        "forward": {**dataclasses.asdict(f), "tflops": f.flops / 1e12, "quantized_share": p.facts.quantized_share,
                    "params": p.facts.params},
        "calibration": dataclasses.asdict(p.calibration), "stage_one_gpu_s": p.stage_one_gpu_s,
        "memory_gb": dataclasses.asdict(p.memory), "gradient_checkpointing": p.gradient_checkpointing,
        "role_memory_gb": p.role_memory(), "best": dataclasses.asdict(p.best),
        "colocated": dataclasses.asdict(p.colocated) if p.colocated else None,
        "disaggregated": dataclasses.asdict(p.disaggregated) if p.disaggregated else None,
        "pipelined": dataclasses.asdict(p.pipelined) if p.pipelined else None, "eval_s": p.eval_s, "notes": p.notes,
    }


def _recipe_line(r: Recipe) -> str:
    parts = []
    if r.explored:
        parts.append(f"{r.prompts} prompts x {r.explored} seeds explored ({r.explore_steps} steps, "
                     f"{r.explore_format.upper()})")
    if r.regenerated:
        parts.append(f"{r.prompts} x {r.regenerated} sampled in BF16 ({r.steps} steps)")
    cfg = ", CFG x2" if r.cfg_mult == 2 else ""
    return (f"{r.mode}: " + " -> ".join(parts) + f"{cfg}; training {r.samples} samples x {r.train_timesteps} "
            f"timesteps x {r.train_passes} forward-equivalents")


def seconds_text(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"


def _layout_row(x: Layout) -> str:
    t = x.stage_s
    cells = [t.get("explore"), t.get("regenerate"), t["rollout"], t["train"], x.epoch_s, x.pipelined_s]
    return f"{x.label:<82}" + "".join(f"{seconds_text(v):>9}" for v in cells)


def role_memory_lines(roles: dict[str, dict[str, float]]) -> list[str]:
    return [f"  {role:<12}{sum(parts.values()):6.1f} GB: " + ", ".join(f"{k} {v:.2f}" if v < 1 else f"{k} {v:.1f}"
                                                                     for k, v in parts.items() if v)
            for role, parts in roles.items()]


def format_plan(p: Plan) -> str:
    f, r, m, gpu = p.facts.forward, p.recipe, p.memory, GPUS[p.gpu]
    total = f.linear_macs + f.conv_macs + f.attention_macs
    lines = [
        f"solrl plan: {r.model} ({r.preset}) on {p.gpus}x {gpu.name}",
        f"recipe     {_recipe_line(r)}",
        f"forward    {f.flops / 1e12:.4g} TFLOPs per sample (Linear {f.linear_macs / total:.1%}, convolutions "
        f"{f.conv_macs / total:.1%}, attention {f.attention_macs / total:.1%}); "
        + (f"the explorer runs {p.facts.quantized_share:.1%} of it in {r.explore_format.upper()}"
           if r.explored and r.explore_format != "bf16" else "every stage computes in BF16"),
        "one GPU    " + ", ".join(f"{k} {seconds_text(v)} s" for k, v in p.stage_one_gpu_s.items())
        + f" per epoch (efficiency: sampling {p.calibration.eta_rollout:.3f}, training {p.calibration.eta_train:.3f}"
        f" of peak; {p.calibration.image_s * 1000:.0f} ms per 1024 px image on a B200)",
        f"memory     GB: denoiser BF16 {m.denoiser:.1f}, text encoders + VAE {sum(m.components.values()):.1f}, reward "
        f"{sum(m.reward.values()):.1f}, one LoRA adapter (FP32) {m.lora:.2f}; activations: sampling micro-batch "
        f"{m.sample_activations:.1f}, VAE decode batch {m.decode_activations:.1f}, training "
        f"{m.train_per_sample:.2f} a row ({m.train_per_sample_checkpointed:.2f} with gradient checkpointing; "
        f"micro-batch {m.train_micro_batch}); the prompt cache holds {m.prompt_mb:.1f} MB a prompt on the CPU",
        f"trainer    at most {r.max_trainer_ranks} data-parallel ranks: every rank trains a sample of every optimizer "
        f"step, and a step can hold as few as {r.max_trainer_ranks} samples ({r.ranks_rule})",
        "",
        f"{'layout (seconds per epoch)':<82}{'explore':>9}{'regen':>9}{'rollout':>9}{'train':>9}{'epoch':>9}"
        f"{'stale 1':>9}",
    ]
    for x in (p.colocated, p.disaggregated):
        if x is not None:
            lines.append(_layout_row(x))
    if p.best not in (p.colocated, p.disaggregated):
        lines.append(_layout_row(p.best))
    lines += ["", f"best: {p.best.label}: {seconds_text(p.best.epoch_s)} s per epoch; gradient checkpointing "
              f"{'on' if p.gradient_checkpointing else 'off'}; memory per GPU (usable {gpu.hbm_gb * USABLE_HBM:.0f} GB):"]
    lines += role_memory_lines(p.role_memory())
    if p.disaggregated is not None and p.disaggregated is not p.best:
        lines.append(f"{p.disaggregated.label} (the deployment files' kind): gradient checkpointing "
                     f"{'on' if p.disaggregated.gradient_checkpointing else 'off'}; memory per GPU:")
        lines += role_memory_lines(p.role_memory(p.disaggregated))
    if p.pipelined is not None:
        lines.append(f"with rollout.staleness = 1 the best split would be {p.pipelined.label}: "
                     f"{seconds_text(p.pipelined.pipelined_s)} s per epoch")
    if p.recipe.eval_every:
        lines.append(f"eval: {seconds_text(p.eval_s)} s on one GPU every {p.recipe.eval_every} epochs (not in the epoch)")
    lines.append("stale 1: the epoch if rollouts of epoch e+1 ran beside training of epoch e on other GPUs "
                 "(rollout.staleness = 1)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
