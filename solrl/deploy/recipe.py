"""What the planner plans: the GPU by kind, one epoch's recipe read from a RunConfig, and the run config to plan
(a preset, the model, overrides)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from solrl.config import PRESETS, ConfigError, RunConfig, apply_overrides, get_preset
from solrl.hardware import GPUS, Gpu, precision_format


class PlanError(ConfigError):
    """Bad input to the planner, or a recipe no layout can run."""


def get_gpu(kind: str) -> Gpu:
    if kind not in GPUS:
        raise PlanError(f"unknown GPU kind {kind!r}; allowed: {', '.join(GPUS)}")
    return GPUS[kind]


@dataclass(frozen=True)
class Recipe:
    """What one epoch does, read from a RunConfig (and the GPU: formats it has kernels for)."""

    preset: str
    model: str
    mode: str
    prompts: int
    explored: int             # seeds sampled by the explorer per prompt (0: no explore stage)
    explore_steps: int
    explore_format: str
    regenerated: int          # seeds sampled in BF16 at full steps per prompt (0: no regenerate stage)
    steps: int
    kept: int
    cfg_mult: int             # 2 with classifier-free guidance
    train_timesteps: int
    train_passes: int         # forward-equivalents per (sample, timestep)
    rollout_micro_batch: int
    train_micro_batch: int
    eval_every: int
    eval_forwards: int        # per evaluation (BF16)
    reward: str
    step_samples: tuple[int, ...] = ()   # samples of each optimizer step (ddp.step_samples)
    ranks_rule: str = ""                  # where the rank cap comes from (ddp.ranks_rule), for messages
    notes: tuple[str, ...] = ()

    @property
    def samples(self) -> int:
        return self.prompts * self.kept

    @property
    def max_trainer_ranks(self) -> int:
        """The trainer's rule (ddp.max_ranks): every rank needs a sample of every optimizer step."""
        return min(self.step_samples) if self.step_samples else self.samples

    @property
    def explorer_needed(self) -> bool:
        return self.explored > 0


def recipe_from_config(cfg: RunConfig, preset: str, gpu: Gpu) -> tuple[Recipe, Any]:
    """The epoch's recipe and the explorer's PrecisionConfig (for the quantized share)."""
    from solrl.algo.nft import timestep_count
    from solrl.engine import data_parallel as ddp
    from solrl.rollout.strategies import strategy

    r, notes = cfg.rollout, []
    s = strategy(r.mode)
    explore_pc, explore_steps = r.explore_precision, r.explore_steps
    if r.explore_precision.backend == "auto":
        from solrl.rollout.candidates import check_proxy_config

        cands = check_proxy_config(r.proxy, r.steps)
        runnable = [c for c in cands if gpu.tflops.get(precision_format(c.backend))]
        c = (runnable or cands)[0]
        explore_pc, explore_steps = dataclasses.replace(r.explore_precision, backend=c.backend), c.steps
        notes.append(f"explorer 'auto' (the adaptive proxy): planned with its first candidate that runs on "
                     f"{gpu.name}, {c.name}; it may move to a dearer one during the run")
    fmt = precision_format(explore_pc.backend)
    if fmt != "bf16" and gpu.tflops.get(fmt) is None:
        to = "fp8" if gpu.tflops.get("fp8") else "bf16"
        why = " (FP4 needs Blackwell, sm_100+)" if fmt == "fp4" else ""
        notes.append(f"{gpu.name} has no {fmt.upper()} kernels{why}: the explorer is planned in {to.upper()}; run it "
                     f"with --set rollout.explore_precision.backend={to}")
        fmt = to
    if fmt != "bf16" and explore_pc.backend.endswith("-emu"):
        notes.append(f"explorer backend {explore_pc.backend!r} emulates {fmt.upper()} with BF16 GEMMs: planned at "
                     f"BF16 speed (nvfp4 / fp8 run Transformer Engine's kernels, fp8 torchao's without it)")
        fmt = "bf16"
    elif fmt != "bf16" and not explore_pc.quantize_activations:
        notes.append("weight-only quantization computes in BF16: the explorer is planned at BF16 speed")
        fmt = "bf16"
    if precision_format(r.precision.backend) != "bf16" or r.precision.backend == "fp32":
        notes.append(f"regenerator precision {r.precision.backend!r}: planned at BF16 speed")
    if cfg.model.name == "flux1-dev" and cfg.sampler.guidance == 1.0:
        notes.append("FLUX.1-dev: guidance is distilled into the model (an input), one forward per step")
    explored, regenerated = s.explored(r), s.bf16_sampled(r)
    if s.explores:  # the proxy's candidate's steps, or full steps for a mode that explores at full steps
        explore_steps = s.explore_steps(r, explore_steps)
    ev = cfg.eval
    recipe = Recipe(
        preset=preset, model=cfg.model.name, mode=r.mode, prompts=r.prompts_per_epoch, explored=explored,
        explore_steps=explore_steps, explore_format=fmt, regenerated=regenerated, steps=r.steps, kept=r.kept,
        cfg_mult=2 if cfg.sampler.guidance != 1.0 else 1,
        train_timesteps=timestep_count(r.steps, cfg.train.timestep_fraction),
        train_passes=5 if cfg.train.kl_beta > 0 else 4, rollout_micro_batch=r.micro_batch,
        train_micro_batch=cfg.train.micro_batch, eval_every=ev.every,
        eval_forwards=ev.prompts * ev.seeds_per_prompt * sum(ev.steps), reward=cfg.reward,
        step_samples=tuple(ddp.step_samples(r.prompts_per_epoch, r.kept, cfg.train.optimizer_steps_per_epoch)),
        ranks_rule=ddp.ranks_rule(cfg), notes=tuple(notes))
    # the layers it quantizes: the emulated backend of the planned format selects them by the same rules
    return recipe, dataclasses.replace(explore_pc, backend={"fp4": "nvfp4-emu", "fp8": "fp8-e4m3-emu"}.get(fmt, "bf16"))


def default_preset(model: str) -> str:
    """The model's two-stage preset (shapes-sol-rl, sana-sol-rl, ...)."""
    for name, make in PRESETS.items():
        if name.endswith("-sol-rl") and make().model.name == model:
            return name
    raise PlanError(f"no preset for model {model!r}; models with presets: "
                    f"{sorted({make().model.name for make in PRESETS.values()})}")


def resolve_config(model: str | None, preset: str | None, overrides: list[str] | None) -> tuple[RunConfig, str]:
    """The run config to plan: a preset (default: the model's two-stage one), the model, overrides; checked
    like a run's, except that prompt files are not needed to plan."""
    from solrl.config import MODEL_NAMES

    if model is not None and model not in MODEL_NAMES:
        raise PlanError(f"unknown model {model!r}; available: {list(MODEL_NAMES)}")
    if preset is None:
        if model is None:
            raise PlanError("give --model or --preset")
        preset = default_preset(model)
    cfg = get_preset(preset)
    if model is not None:
        cfg.model.name = model
    cfg = apply_overrides(cfg, list(overrides or []))
    if cfg.model.name not in MODEL_NAMES:
        raise PlanError(f"unknown model {cfg.model.name!r}; available: {list(MODEL_NAMES)}")
    check = dataclasses.replace(cfg, prompts=dataclasses.replace(cfg.prompts, train=cfg.prompts.train or "-",
                                                                  eval=cfg.prompts.eval or "-"))
    check.validate()
    return cfg, preset
