"""Presets: functions returning a `RunConfig`, by name (the real-model and video presets built here, the shapes bed's
registered by "module:function"); and a run's config from a preset or a config file plus overrides."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from solrl.config.overrides import apply_overrides
from solrl.config.schema import (
    MODES,
    ConfigError,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    PromptsConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from solrl.precision import PrecisionConfig
from solrl.registry import load_entry


def with_flow_grpo(cfg: RunConfig, name: str) -> RunConfig:
    """`cfg`'s rollouts trained with FlowGRPO (train.algo=flow_grpo) instead of DiffusionNFT: the trained rollouts
    sampled with the SDE at noise level 0.7, PPO clip range 1e-4, advantages clipped to 5 and a KL weight of 0.04
    (yifan123/flow_grpo `config/base.py` and its GenEval / OCR runs in `config/grpo.py`). The two-stage
    presets keep exploring with the ODE solver in low precision; only the kept seeds are sampled with the SDE."""
    cfg.name = name
    cfg.train.algo, cfg.train.clip_range, cfg.train.adv_clip_max, cfg.train.kl_beta = "flow_grpo", 1e-4, 5.0, 0.04
    cfg.rollout.sde_eta = 0.7
    return cfg


def _real_base(family: str, model: str, mode: str, *, micro_batch: int, timestep_fraction: float,
               max_grad_norm: float, eval_steps: int) -> RunConfig:
    """The reference hyperparameters (docs/method.md) for the real models (8 GPUs, 48 prompts x 96 -> 24 per epoch,
    one optimizer step per epoch, LoRA r32 a64 gaussian, AdamW 3e-4, HPSv2). The explorer runs NVFP4 through
    Transformer Engine (Blackwell); on other machines use `--set rollout.explore_precision.backend=nvfp4-emu`
    (or `fp8` on Hopper). The model's own solver, shift, LoRA targets and skip list come from its spec."""
    cfg = RunConfig(name=f"{family}-{mode.replace('_', '-')}", seed=42, epochs=300, reward="hpsv2")
    cfg.model = ModelConfig(name=model)
    cfg.lora = LoraConfig(rank=32, alpha=64.0, init="gaussian")
    cfg.rollout = RolloutConfig(
        mode=mode, prompts_per_epoch=48, pool=24 if mode == "diffusion_nft" else 96, kept=24, explore_steps=6,
        steps=10, selection="best_worst", micro_batch=24,
        explore_precision=PrecisionConfig(backend="nvfp4"), precision=PrecisionConfig(backend="bf16"))
    cfg.train = TrainConfig(lr=3e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8, max_grad_norm=max_grad_norm,
                            micro_batch=micro_batch, optimizer_steps_per_epoch=1,
                            timestep_fraction=timestep_fraction, beta=1.0, kl_beta=1e-4)
    cfg.eval = EvalConfig(every=10, steps=(eval_steps,), prompts=48, seeds_per_prompt=1)
    cfg.prompts = PromptsConfig(train="", eval="")  # the user's prompt files: required
    return cfg


_REAL = {
    # family: (registry model, micro-batch, timestep fraction, max grad norm, eval steps) -- docs/method.md
    "sana": ("sana1.5-1.6b", 16, 0.6, 1.0, 40),
    "flux1": ("flux1-dev", 12, 0.4, 1.0, 28),
    "sd35l": ("sd3.5-large", 4, 0.6, 0.002, 40),
}


def _real_preset(family: str, mode: str) -> Callable[[], RunConfig]:
    model, mb, frac, gn, ev = _REAL[family]
    return lambda: _real_base(family, model, mode, micro_batch=mb, timestep_fraction=frac, max_grad_norm=gn,
                              eval_steps=ev)


def _real_flow_grpo(family: str, mode: str) -> Callable[[], RunConfig]:
    """{family}-sol-flow-grpo (two-stage, from {family}-sol-rl) and {family}-flow-grpo (one-stage, from
    {family}-diffusion-nft), with flow_grpo's trainer settings (`config/grpo.py`): timestep fraction 0.99 (9 of
    the 10 steps), max grad norm 1.0, two optimizer steps per epoch."""
    name = f"{family}-{'sol-' if mode == 'sol_rl' else ''}flow-grpo"

    def build() -> RunConfig:
        cfg = with_flow_grpo(_real_preset(family, mode)(), name)
        cfg.train.timestep_fraction, cfg.train.max_grad_norm, cfg.train.optimizer_steps_per_epoch = 0.99, 1.0, 2
        return cfg

    return build


def _video_base(family: str, model: str, mode: str, *, frames: int, height: int, width: int,
                eval_steps: int) -> RunConfig:
    """Wan2.2 text-to-video (solrl/models/wan.py, docs/video.md). The clip is the model's own default from the
    Wan2.2 repository (Wan-Video/Wan2.2 `wan/configs/`: TI2V-5B 121 frames at 704x1280, 24 fps, 50 steps;
    T2V-A14B 81 frames at 480x832 -- its smaller supported size, 720x1280 being the other --, 16 fps, 40 steps),
    the evaluation steps are those sample steps; the flow shift is the checkpoint's scheduler config (as for the
    image families). The RL settings follow the reference for images (docs/method.md: rollout 10 steps, explore 6,
    LoRA r32 a64 on the attention projections -- here of both A14B experts --, AdamW 3e-4) with groups sized
    for video: 8 clips per prompt (the MMDanceGRPO design's rollout.n = 8), explored from 32 (the reference's
    4x pool), 16 prompts per epoch, one clip per forward. The reward is HPSv3 on each clip's first frame
    (reward_frames=first), as in the MMDanceGRPO design; reward_frames=mean scores every frame."""
    cfg = RunConfig(name=f"{family}-{mode.replace('_', '-')}", seed=42, epochs=300, reward="hpsv3",
                    reward_frames="first")
    cfg.model = ModelConfig(name=model, frames=frames, height=height, width=width)
    cfg.lora = LoraConfig(rank=32, alpha=64.0, init="gaussian")
    cfg.rollout = RolloutConfig(
        mode=mode, prompts_per_epoch=16, pool=8 if mode == "diffusion_nft" else 32, kept=8, explore_steps=6,
        steps=10, selection="best_worst", micro_batch=1,
        explore_precision=PrecisionConfig(backend="nvfp4"), precision=PrecisionConfig(backend="bf16"))
    cfg.train = TrainConfig(lr=3e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8, max_grad_norm=1.0,
                            micro_batch=1, optimizer_steps_per_epoch=1, timestep_fraction=0.6, beta=1.0,
                            kl_beta=1e-4)
    cfg.eval = EvalConfig(every=10, steps=(eval_steps,), prompts=16, seeds_per_prompt=1)
    cfg.prompts = PromptsConfig(train="", eval="")  # the user's prompt files: required
    return cfg


_VIDEO = {
    # family: (registry model, frames, height, width, eval steps) -- Wan-Video/Wan2.2 wan/configs/
    "wan22-ti2v5b": ("wan2.2-ti2v-5b", 121, 704, 1280, 50),
    "wan22-a14b": ("wan2.2-t2v-a14b", 81, 480, 832, 40),
}


def _video_preset(family: str, mode: str) -> Callable[[], RunConfig]:
    model, frames, height, width, ev = _VIDEO[family]
    return lambda: _video_base(family, model, mode, frames=frames, height=height, width=width, eval_steps=ev)


def _video_flow_grpo(family: str, mode: str) -> Callable[[], RunConfig]:
    """{family}-sol-flow-grpo / {family}-flow-grpo: FlowGRPO as the MMDanceGRPO design trains Wan2.2 (GRPO on SDE
    rollouts, clip range 1e-4), with the trainer settings of the image families' flow-grpo presets."""
    name = f"{family}-{'sol-' if mode == 'sol_rl' else ''}flow-grpo"

    def build() -> RunConfig:
        cfg = with_flow_grpo(_video_preset(family, mode)(), name)
        cfg.train.timestep_fraction, cfg.train.optimizer_steps_per_epoch = 0.99, 2
        return cfg

    return build


def _entry_preset(target: str) -> Callable[[], RunConfig]:
    """A preset named "module:function", imported when it is built: how a package above the core (the shapes bed,
    solrl/shapes/presets.py) registers its presets without the core importing it."""

    def build() -> RunConfig:
        return load_entry(target)()

    return build


def register_preset(name: str, make: Callable[[], RunConfig] | str) -> None:
    """Add preset `name`: a function returning its RunConfig, or "module:function" imported when it is built."""
    if name in PRESETS:
        raise ConfigError(f"preset {name!r} is already registered")
    PRESETS[name] = _entry_preset(make) if isinstance(make, str) else make


_SHAPES = "solrl.shapes.presets"   # the shapes bed's presets, imported when one is built
PRESETS: dict[str, Callable[[], RunConfig]] = {
    "shapes-sol-rl": _entry_preset(f"{_SHAPES}:shapes_sol_rl"),
    "shapes-diffusion-nft": _entry_preset(f"{_SHAPES}:shapes_diffusion_nft"),
    "shapes-naive-scaling": _entry_preset(f"{_SHAPES}:shapes_naive_scaling"),
    "shapes-naive-quant": _entry_preset(f"{_SHAPES}:shapes_naive_quant"),
    **{f"{fam}-{m.replace('_', '-')}": _real_preset(fam, m) for fam in _REAL for m in MODES},
    "shapes-flow-grpo": _entry_preset(f"{_SHAPES}:shapes_flow_grpo"),
    "shapes-sol-flow-grpo": _entry_preset(f"{_SHAPES}:shapes_sol_flow_grpo"),
    **{f"{fam}-{'sol-' if m == 'sol_rl' else ''}flow-grpo": _real_flow_grpo(fam, m) for fam in _REAL
       for m in ("sol_rl", "diffusion_nft")},
    **{f"{fam}-{m.replace('_', '-')}": _video_preset(fam, m) for fam in _VIDEO for m in MODES},
    **{f"{fam}-{'sol-' if m == 'sol_rl' else ''}flow-grpo": _video_flow_grpo(fam, m) for fam in _VIDEO
       for m in ("sol_rl", "diffusion_nft")},
}
DEFAULT_PRESET = "shapes-sol-rl"


def get_preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]()


def resolve_run(preset: str | None, config_file: str | None, overrides: list[str] | None, out: str | None,
                resume: str | None) -> tuple[RunConfig, Path]:
    """A run's config and directory: a new run from preset / config file / overrides (in `out`, default
    runs/<name>-<time>), or, with `resume` = RUN_DIR, the config saved in RUN_DIR plus the overrides."""
    if resume:
        run_dir = Path(resume)
        if out and Path(out) != run_dir:
            raise ConfigError(f"--out {out} and --resume {resume} name different run directories")
        if preset or config_file:
            raise ConfigError("--resume takes the config saved in the run directory; drop --preset / --config")
        if not (run_dir / "config.json").exists():
            raise ConfigError(f"--resume {run_dir}: no config.json there (not a run directory)")
        return apply_overrides(RunConfig.load(run_dir / "config.json"), list(overrides or [])).validate(), run_dir
    cfg = resolve(preset, config_file, overrides)
    return cfg, Path(out) if out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve(preset: str | None = None, config_file: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """preset (or config file) + overrides, validated."""
    if preset and config_file:
        raise ConfigError("give either a preset or a config file, not both")
    cfg = RunConfig.load(config_file) if config_file else get_preset(preset or DEFAULT_PRESET)
    return apply_overrides(cfg, overrides or []).validate()
