"""The run config's schema: nested dataclasses, `validate()` (rejects bad values before any work starts), saving to
and loading from JSON, and the typed conversion a loaded or overridden value goes through."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solrl.precision import PrecisionConfig
from solrl.prompts import takes_relation_share
from solrl.rollout.strategies import LOW, MODES, strategy  # rollout.mode: the strategies' names (no torch)

SELECTIONS = ("best_worst", "random", "mean_deviation", "extremes_random")
ADV_STDS = ("global", "prompt")   # train.adv_std
GATES = ("", "flat")              # guard.gate: solrl.algo.guards.GATE_CHECKS' names (numpy-free here)
SOLVERS = ("euler", "dpm2")
ALGOS = ("nft", "flow_grpo")  # train.algo: DiffusionNFT (solrl/algo/nft.py) or FlowGRPO (solrl/algo/grpo.py)
# The built-in model registry's names (solrl.models.available_models(), sorted), here without torch for
# command-line choices; tests/cli/test_cli_fast.py keeps the two equal.
MODEL_NAMES = ("flux1-dev", "sana1.5-1.6b", "sd3.5-large", "shapes", "wan2.2-t2v-a14b", "wan2.2-ti2v-5b")
# The video models (solrl/models/wan.py): (the VAE's time compression, the pixel multiple of height / width = VAE x
# patch). A clip has temporal * k + 1 frames (Wan's causal VAE); the loader checks the same against the checkpoint.
VIDEO_MODELS: dict[str, tuple[int, int]] = {"wan2.2-ti2v-5b": (4, 32), "wan2.2-t2v-a14b": (4, 16)}
REWARD_FRAMES = ("first", "mean")  # reward_frames: which frames of a clip a (per-image) reward scores


class ConfigError(ValueError):
    """A bad preset, key or value, reported before any work starts."""


@dataclass
class ModelConfig:
    name: str = "shapes"
    path: str | None = None  # local directory with the weights; None = the model's default location
    # torch device of the model: "" = the model's default (the CPU for shapes, CUDA where present for the real
    # models); e.g. "cuda" runs the shapes bed on a GPU (seeds' noise is still drawn on the CPU)
    device: str = ""
    # torch.compile the denoiser that sampling runs (GPU roles; refused on the CPU): T2IModel.compile_denoiser
    compile: bool = False
    # video models only (VIDEO_MODELS), 0 = the model's default: the clip's frames (4k + 1) and size in pixels
    frames: int = 0
    height: int = 0
    width: int = 0


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: float = 64.0
    targets: tuple[str, ...] = ()  # empty = the model's own LoRA targets
    init: str = "gaussian"


@dataclass
class SamplerConfig:
    solver: str = ""          # empty = the model's default (Euler for SANA / shapes, DPM-Solver-2 for SD3.5 / FLUX)
    shift: float = 1.0
    guidance: float = 1.0     # classifier-free guidance scale; 1.0 = no CFG (as the reference's rollouts)


@dataclass
class ProxyConfig:
    """The adaptive proxy (solrl/engine/proxy.py), used when rollout.explore_precision.backend is "auto": at the start
    of a run, measure each candidate proxy (FORMAT@EXPLORE_STEPS[/POLICY]) against BF16 at full steps on
    `prompts` x `seeds` and explore with the cheapest whose mean Kendall tau reaches `target` under the
    `device` cost model (b200: FP4 1/4, FP8 1/2 of a BF16 forward; h100 / h200: FP8 1/2, no FP4; cpu:
    measured). During the run, `patience` epochs in a row below `target` (the loop's kept-seed tau) move
    to the next dearer candidate; `every` > 0 calibrates again every that many epochs."""

    candidates: tuple[str, ...] = ("nvfp4-emu@4", "nvfp4-emu@6", "fp8-e4m3-emu@4", "fp8-e4m3-emu@6", "bf16@6")
    device: str = "b200"
    target: float = 0.5
    prompts: int = 4
    seeds: int = 16
    patience: int = 3
    every: int = 0


@dataclass
class RolloutConfig:
    mode: str = "sol_rl"      # sol_rl | diffusion_nft | naive_scaling | naive_quant
    prompts_per_epoch: int = 48
    pool: int = 96            # n: seeds explored per prompt
    kept: int = 24            # k: seeds trained on per prompt
    explore_steps: int = 6
    steps: int = 10           # full rollout steps (regeneration / BF16)
    selection: str = "best_worst"
    explore_precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(backend="nvfp4-emu"))
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig(backend="bf16"))
    micro_batch: int = 64     # images per model forward while sampling
    # flow_grpo: the noise level (eta) of the SDE the trained rollouts are sampled with (regeneration, or the
    # one-stage BF16 sampling), recording each step's log-prob; exploration and evaluation stay on the ODE
    # solver. 0 = deterministic ODE rollouts, which is what nft trains on (and flow_grpo cannot: no log-probs).
    sde_eta: float = 0.0
    proxy: ProxyConfig = field(default_factory=ProxyConfig)  # explore_precision.backend = "auto"
    # pipelined epochs: 0 = on-policy (epoch e's rollouts sampled with the adapter after e-1 updates); 1 = epoch
    # e+1's rollouts are sampled with the adapter before epoch e's update, so in the services mode they are
    # produced while the trainer trains epoch e (docs/method.md, "Pipelined epochs")
    staleness: int = 0
    # prompts whose text encodings are kept (LRU; solrl.rollout.passes.PromptCache): bounds what a long run holds
    # (SD3.5 / FLUX: 2.7 / 4.2 MB a prompt, kept in host memory on CUDA)
    prompt_cache_entries: int = 1024


@dataclass
class TrainConfig:
    algo: str = "nft"                   # nft (DiffusionNFT) | flow_grpo (PPO-clipped GRPO on SDE log-probs)
    lr: float = 3e-4
    conv_lr: float = 0.0                # learning rate of the LoRA on convolution targets (lora.targets such as conv1,
                                        # conv2); 0 = train.lr
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    micro_batch: int = 16               # (sample, timestep) rows per training forward
    optimizer_steps_per_epoch: int = 1  # gradient accumulation over the whole epoch by default; 0 = one step per
                                        # prompt group (as many steps as rollout.prompts_per_epoch)
    timestep_fraction: float = 0.6
    beta: float = 1.0                   # guidance strength of DiffusionNFT
    adv_clip_max: float = 5.0
    kl_beta: float = 1e-4               # nft: velocity-space KL; flow_grpo: KL between the SDE transition means
    clip_range: float = 1e-4            # flow_grpo: PPO ratio clip (yifan123/flow_grpo config/base.py)
    # the advantages' scale: "global" = one std over the whole batch (NVlabs/DiffusionNFT's stat tracker, global_std=True),
    # "prompt" = each prompt group's own std (yifan123/flow_grpo's per-prompt stat tracking, global_std=False): a prompt
    # whose rewards a hack spreads far then weighs no more than one whose rewards barely differ (docs/training.md)
    adv_std: str = "global"
    reward_threshold: float | None = None  # flow_grpo: a prompt group whose mean reward is below this gets zero
                                           # advantages (the MMDanceGRPO design's threshold filter); None = off
    ema_decay: float = 0.9
    old_decay_rate: float = 0.001       # old <- d*old + (1-d)*new, d = min(rate*step, cap)
    old_decay_cap: float = 0.5
    # recompute each transformer block's activations in the backward pass (diffusers'
    # enable_gradient_checkpointing): "auto" = on for a real model on CUDA where the planner's memory model says the trainer
    # does not fit this GPU without it (solrl.engine.update.use_gradient_checkpointing),
    # "true" / "false" = always / never
    gradient_checkpointing: str = "auto"


@dataclass
class EvalConfig:
    every: int = 5                      # epochs; 0 = only at the start and the end
    steps: tuple[int, ...] = (10,)
    prompts: int = 48                   # held-out prompts (a fixed, form-stratified subset)
    seeds_per_prompt: int = 2
    seed: int = 1234
    grid: bool = True
    reward: str = ""                    # "" = the run's reward; the shapes presets score with "shapes"


@dataclass
class MonitorConfig:
    """Reward-hacking monitors and their alarms (solrl/engine/monitors.py, docs/training.md). Each held-out
    evaluation records the flat, near-duplicate and diversity measures of its images and the mean of each reference
    reward; a threshold of 0 is off. A crossed threshold logs a line, counts in `monitor.alarms` (the record) and
    `solrl_monitor_alarms_total` (the trainer's metrics), and with `stop` ends the run after that epoch's checkpoint."""

    # rewards scored on the held-out images beside eval.reward and never trained on: their drift shows a hack the
    # trained reward cannot (e.g. the exact shapes reward while training JPEG compressibility)
    reference_rewards: tuple[str, ...] = ()
    flat_share_max: float = 0.0         # alarm above this share of blank canvases (held-out or trained rollouts)
    duplicate_share_max: float = 0.0    # alarm above this share of images with a near-duplicate among their prompt's seeds
    diversity_min: float = 0.0          # alarm below this mean RMS distance (0..1) between a prompt's seeds
    reference_drop_max: float = 0.0     # alarm when a reference reward falls more than this below its value before training
    stop: bool = False                  # end the run at the first alarm (after that epoch's checkpoint)


@dataclass
class GuardConfig:
    """Guards against reward hacking that act on the rollouts (solrl/algo/guards.py, docs/training.md); off by default.

    `gate`: a cheap validity check on every candidate image; "flat" fails a blank canvas (solrl.algo.guards.is_flat).
    Before ranking, a failing candidate is never kept while k valid ones remain (it fills the worst half when fewer
    do); after sampling, a trained sample that fails is scored as its prompt group's lowest reward, so it never
    draws a positive advantage. `reference` and `reference_floor`: the constrained reward: a trained sample whose
    `reference` reward (a reward the run does not train on, e.g. the exact shapes reward while training JPEG
    compressibility) is below the floor is scored as its prompt group's lowest reward: the trained reward gains
    only while the reference holds. Embedded runs and the services alike: the explorer services gate their ranking
    (ExploreJob.gate), the trainer decodes the trained latents and demotes."""

    gate: str = ""                      # "" (off) | "flat"
    reference: str = ""                 # "" (off) | a registered reward name
    reference_floor: float = 0.0


@dataclass
class PromptsConfig:
    """Prompt sets (solrl.prompts): a built-in name or a .txt / .jsonl / .json file. Real-model presets
    leave both empty, and a run must name its own."""

    train: str = "shapes:train"         # what the explorer samples prompts from
    eval: str = "shapes:held-out"       # held-out prompts (shapes sets: a fixed, form-stratified subset)
    # shapes sets: the share of relation captions among an epoch's training prompts; single-object and count
    # captions share the rest 2:1 (the pretraining mix's proportions, `solrl shapes pretrain --relation-share`); the default
    # is FORM_WEIGHTS["relation"] of solrl/shapes/prompts.py (tests/prompts/test_prompts.py checks they agree)
    relation_share: float = 0.4


@dataclass
class RunConfig:
    name: str = "shapes-sol-rl"
    seed: int = 0
    epochs: int = 100
    reward: str = "shapes"
    # video models: the frames an image reward scores, "first" (frame 0 only, as the MMDanceGRPO design scores
    # HPSv3; only that frame is decoded) or "mean" (every frame decoded and scored, the mean per clip)
    reward_frames: str = "first"
    checkpoint_every: int = 1
    tensorboard: bool = True
    wandb: str = ""                     # Weights & Biases logging: "" (off), "offline" or "online" (extra: wandb)
    wandb_project: str = "solrl"
    threads: int = 0                    # torch threads; 0 = leave torch's default
    model: ModelConfig = field(default_factory=ModelConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    # ---------------------------------------------------------------- checks
    def validate(self) -> RunConfig:
        r, t = self.rollout, self.train
        if self.epochs < 0 or self.seed < 0:
            raise ConfigError(f"epochs and seed must be >= 0, got epochs={self.epochs}, seed={self.seed}")
        if self.wandb not in ("", "offline", "online"):
            raise ConfigError(f"wandb must be '' (off), 'offline' or 'online', got {self.wandb!r}")
        if self.wandb:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ConfigError(f"wandb={self.wandb!r} needs the wandb package: pip install 'solrl[wandb]'")
        for name in ("prompts_per_epoch", "pool", "kept", "explore_steps", "steps", "micro_batch",
                     "prompt_cache_entries"):
            if getattr(r, name) <= 0:
                raise ConfigError(f"rollout.{name} must be positive, got {getattr(r, name)}")
        if r.mode not in MODES:
            raise ConfigError(f"rollout.mode must be one of {MODES}, got {r.mode!r}")
        s = strategy(r.mode)
        if r.selection not in SELECTIONS:
            raise ConfigError(f"rollout.selection must be one of {SELECTIONS}, got {r.selection!r}")
        if s.selects and r.kept > r.pool:
            raise ConfigError(f"rollout.kept (k={r.kept}) must not exceed rollout.pool (n={r.pool})")
        if s.selects and r.selection == "best_worst" and r.kept % 2:
            raise ConfigError(f"rollout.kept must be even for best_worst selection, got {r.kept}")
        if self.sampler.solver and self.sampler.solver not in SOLVERS:
            raise ConfigError(f"sampler.solver must be one of {SOLVERS} or empty, got {self.sampler.solver!r}")
        if self.sampler.guidance < 1.0 or self.sampler.shift <= 0:
            raise ConfigError("sampler.guidance must be >= 1 and sampler.shift > 0")
        if t.gradient_checkpointing not in ("auto", "true", "false"):
            raise ConfigError(f"train.gradient_checkpointing must be auto, true or false, got "
                              f"{t.gradient_checkpointing!r}")
        if not 0 < t.timestep_fraction <= 1:
            raise ConfigError(f"train.timestep_fraction must be in (0, 1], got {t.timestep_fraction}")
        if not math.isfinite(t.conv_lr) or t.conv_lr < 0:
            raise ConfigError(f"train.conv_lr must be a finite float >= 0 (0: train.lr), got {t.conv_lr}")
        for name in ("lr", "micro_batch", "beta", "adv_clip_max", "max_grad_norm"):
            if getattr(t, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
        self._validate_algo()
        self._validate_video()
        self._validate_device()
        self._validate_staleness()
        if t.optimizer_steps_per_epoch < 0:
            raise ConfigError(f"train.optimizer_steps_per_epoch must be >= 0 (0: one per prompt group), "
                              f"got {t.optimizer_steps_per_epoch}")
        if t.optimizer_steps_per_epoch > r.prompts_per_epoch:
            raise ConfigError(f"train.optimizer_steps_per_epoch={t.optimizer_steps_per_epoch} exceeds "
                              f"rollout.prompts_per_epoch={r.prompts_per_epoch}: each optimizer step trains on whole "
                              f"prompt groups, so an epoch has at most one step per prompt")
        if self.lora.rank <= 0 or self.lora.alpha <= 0:
            raise ConfigError("lora.rank and lora.alpha must be positive")
        if self.eval.prompts <= 0 or self.eval.seeds_per_prompt <= 0 or self.eval.every < 0:
            raise ConfigError("eval.prompts and eval.seeds_per_prompt must be positive, eval.every >= 0")
        if any(s <= 0 for s in self.eval.steps) or not self.eval.steps:
            raise ConfigError(f"eval.steps must be positive step counts, got {self.eval.steps}")
        for name in ("train", "eval"):
            if not getattr(self.prompts, name).strip():
                raise ConfigError(f"prompts.{name} is required for model {self.model.name!r}: a prompt file (.txt, one "
                                  f"prompt per line; .jsonl / .json with a \"prompt\" field) or a built-in set "
                                  f"(shapes:train, shapes:held-out, ocr:train, ocr:test), e.g. "
                                  f"--set prompts.{name}=/data/prompts/{name}.txt")
        if self.checkpoint_every < 0 or self.threads < 0:
            raise ConfigError("checkpoint_every and threads must be >= 0")
        if not 0 < self.prompts.relation_share < 1:
            raise ConfigError(f"prompts.relation_share must be in (0, 1), got {self.prompts.relation_share}")
        if self.prompts.relation_share != PromptsConfig.relation_share and not takes_relation_share(self.prompts.train):
            raise ConfigError(f"prompts.relation_share applies to the shapes world's prompt sets only; prompts.train is "
                              f"{self.prompts.train!r}")
        self._validate_monitor()
        self._validate_guard()
        self._resolve_fallbacks()
        self._validate_precision()
        return self

    def _validate_monitor(self) -> None:
        m = self.monitor
        for name in ("flat_share_max", "duplicate_share_max", "diversity_min", "reference_drop_max"):
            v = getattr(m, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"monitor.{name} must be a finite number >= 0 (0 = off), got {v!r}")
        for name in ("flat_share_max", "duplicate_share_max"):
            if getattr(m, name) > 1:
                raise ConfigError(f"monitor.{name} is a share in [0, 1] (0 = off), got {getattr(m, name)}")
        if not isinstance(m.stop, bool):
            raise ConfigError(f"monitor.stop must be true or false, got {m.stop!r}")
        from solrl.rewards import available_rewards

        for name in m.reference_rewards:
            if name not in available_rewards():
                raise ConfigError(f"monitor.reference_rewards: unknown reward {name!r}; available: {available_rewards()}")
        if m.reference_drop_max and not m.reference_rewards:
            raise ConfigError("monitor.reference_drop_max watches the reference rewards: name them in "
                              "monitor.reference_rewards (e.g. [\"shapes\"])")

    def _validate_guard(self) -> None:
        g, t, r = self.guard, self.train, self.rollout
        if t.adv_std not in ADV_STDS:
            raise ConfigError(f"train.adv_std must be one of {ADV_STDS}, got {t.adv_std!r}")
        if g.gate not in GATES:
            raise ConfigError(f"guard.gate must be one of {GATES} ('' = off), got {g.gate!r}")
        if g.gate and strategy(r.mode).selects and r.selection != "best_worst":
            raise ConfigError(f"guard.gate ranks failing candidates out of the best half: it needs "
                              f"rollout.selection=best_worst, got {r.selection!r}")
        floor = g.reference_floor
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or not math.isfinite(floor):
            raise ConfigError(f"guard.reference_floor must be a finite number, got {floor!r}")
        if g.reference:
            from solrl.rewards import available_rewards
            from solrl.rewards.multi import is_spec

            if is_spec(g.reference) or g.reference not in available_rewards():
                raise ConfigError(f"guard.reference: unknown reward {g.reference!r} (one registered name); "
                                  f"available: {available_rewards()}")
            if g.reference == self.reward:
                raise ConfigError(f"guard.reference must be a reward the run does not train on; reward is "
                                  f"{self.reward!r} too")
        elif floor:
            raise ConfigError("guard.reference_floor applies to guard.reference: name the reward it holds "
                              "(e.g. guard.reference=shapes)")

    def _resolve_fallbacks(self) -> None:
        """A precision whose `fallback` is set (a preset's choice that depends on the machine, PrecisionConfig) becomes
        the backend that runs here, once: its own where it can run on this machine and the model's device, else the
        fallback; `note` says which and why."""
        for name in ("explore_precision", "precision"):
            pc = getattr(self.rollout, name)
            if not pc.fallback:
                continue
            from solrl.precision import build_backend, cannot_run_here

            why = cannot_run_here(pc.backend, self._model_device())
            if why is None:
                pc.fallback = ""
                here = build_backend(pc).environment()
                pc.note = f"{pc.backend}: it runs here" + (f" ({here})" if here else "")
            else:
                pc.note = f"{pc.fallback} instead of {pc.backend}: {why.split('. ')[0]}"   # its first sentence
                pc.backend, pc.fallback = pc.fallback, ""

    def _model_device(self) -> str:
        """The device the model loads on: model.device, else the model's default (the CPU for the shapes bed, CUDA
        where present for the real models; solrl.models.load_model)."""
        if self.model.device:
            return self.model.device
        import torch

        return "cuda" if self.model.name != "shapes" and torch.cuda.is_available() else "cpu"

    def _validate_algo(self) -> None:
        r, t = self.rollout, self.train
        if t.algo not in ALGOS:
            raise ConfigError(f"train.algo must be one of {ALGOS}, got {t.algo!r}")
        if not math.isfinite(t.kl_beta) or t.kl_beta < 0:
            raise ConfigError(f"train.kl_beta must be a finite float >= 0, got {t.kl_beta}")
        if not math.isfinite(r.sde_eta) or r.sde_eta < 0:
            raise ConfigError(f"rollout.sde_eta must be a finite float >= 0, got {r.sde_eta}")
        if t.algo == "nft":
            if r.sde_eta != 0:
                raise ConfigError(f"rollout.sde_eta={r.sde_eta} applies to train.algo=flow_grpo only; nft trains on "
                                  f"the deterministic ODE rollouts (rollout.sde_eta=0)")
            if t.reward_threshold is not None:
                raise ConfigError("train.reward_threshold applies to train.algo=flow_grpo only (set it to none)")
            return
        if r.sde_eta == 0:
            raise ConfigError("train.algo=flow_grpo needs the log-prob of every step of the trained rollouts, which the "
                              "deterministic ODE sampler (rollout.sde_eta=0) does not have: set rollout.sde_eta > 0 "
                              "(the SDE's noise level; flow_grpo uses 0.7), or use a *-flow-grpo preset")
        if strategy(r.mode).trains_on == LOW:
            raise ConfigError("train.algo=flow_grpo cannot train on the low-precision explorer's samples "
                              "(rollout.mode=naive_quant): its log-probs must be the BF16 policy's; use sol_rl, "
                              "diffusion_nft or naive_scaling")
        if not math.isfinite(t.clip_range) or t.clip_range <= 0:
            raise ConfigError(f"train.clip_range must be a finite float > 0, got {t.clip_range}")
        if t.reward_threshold is not None and not math.isfinite(t.reward_threshold):
            raise ConfigError(f"train.reward_threshold must be a finite float or none, got {t.reward_threshold}")

    def _validate_staleness(self) -> None:
        r = self.rollout
        if isinstance(r.staleness, bool) or r.staleness not in (0, 1):
            raise ConfigError(f"rollout.staleness must be 0 (on-policy) or 1 (epoch e+1's rollouts sampled with the "
                              f"adapter before epoch e's update), got {r.staleness!r}")
        if r.staleness and r.explore_precision.backend == "auto":
            raise ConfigError("rollout.staleness=1 with rollout.explore_precision.backend=auto: the adaptive proxy's "
                              "decisions after epoch e would reach the explorers only for epoch e+2; use a fixed "
                              "explore precision or rollout.staleness=0")

    def _validate_device(self) -> None:
        """model.device names a torch device this machine has ("" = the model's default); model.compile needs CUDA."""
        import torch

        if not isinstance(self.model.compile, bool):
            raise ConfigError(f"model.compile must be true or false, got {self.model.compile!r}")
        if self.model.compile and (self.model.device.startswith("cpu") or not torch.cuda.is_available()):
            raise ConfigError("model.compile=true: torch.compile of the denoiser is for GPU roles (on the CPU it "
                              "compiles for minutes and the CPU runs are the bit-for-bit references); this run "
                              f"samples on {self.model.device or 'the CPU'}: leave model.compile off")
        if not self.model.device:
            return

        try:
            dev = torch.device(self.model.device)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"model.device={self.model.device!r} is not a torch device (e.g. cpu, cuda, cuda:1): "
                              f"{e}") from None
        from solrl.models import cuda_stood_in

        if dev.type == "cuda" and not torch.cuda.is_available() and not cuda_stood_in():
            raise ConfigError(f"model.device={self.model.device!r}: torch {torch.__version__} sees no CUDA device on "
                              "this machine (leave it empty or set cpu)")
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"model.device={self.model.device!r}: only cpu and cuda are supported")

    def _validate_video(self) -> None:
        """A video model's clip and rewards; the video settings are refused for an image model."""
        m = self.model
        if self.reward_frames not in REWARD_FRAMES:
            raise ConfigError(f"reward_frames must be one of {REWARD_FRAMES}, got {self.reward_frames!r}")
        if m.name not in VIDEO_MODELS:
            for key in ("frames", "height", "width"):
                if getattr(m, key):
                    raise ConfigError(f"model.{key}={getattr(m, key)} applies to the video models "
                                      f"{sorted(VIDEO_MODELS)}, not {m.name!r} (set it to 0)")
            if self.reward_frames != "first":
                raise ConfigError(f"reward_frames={self.reward_frames!r} applies to the video models "
                                  f"{sorted(VIDEO_MODELS)}, not {m.name!r}")
            return
        temporal, multiple = VIDEO_MODELS[m.name]
        if m.frames < 0 or m.frames and (m.frames - 1) % temporal:
            lo = max(m.frames - 1, 0) // temporal * temporal + 1
            raise ConfigError(f"model.frames={m.frames}: {m.name}'s VAE makes clips of {temporal}k + 1 frames "
                              f"(e.g. {lo} or {lo + temporal}); 0 = the model's default")
        for key in ("height", "width"):
            side = getattr(m, key)
            if side < 0 or side % multiple:
                raise ConfigError(f"model.{key}={side} must be a multiple of {multiple} pixels for {m.name} "
                                  f"(0 = the model's default)")
        from solrl.rewards.frames import frame_incapable

        for key in ("reward", "eval.reward"):
            name = self.reward if key == "reward" else self.eval.reward
            if not name:
                continue
            try:
                bad = frame_incapable(name)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc}") from None
            if bad:
                raise ConfigError(
                    f"{key}={name!r}: {bad} cannot score video frames ({m.name} makes videos; the shapes world's "
                    f"rewards parse renders of that world only). Use a reward of any image, e.g. hpsv3, hpsv2, "
                    f"pickscore, clipscore, imagereward, ocr or jpeg_compressibility: it scores frame 0 "
                    f"(reward_frames=first) or each frame, averaged (reward_frames=mean)")

    def model_options(self) -> dict[str, Any]:
        """Keyword options of the model's loader (`solrl.models.load_model`): for a video model the clip
        (model.frames / height / width, those set) and the frames its rewards score (reward_frames); none for an
        image model."""
        if self.model.name not in VIDEO_MODELS:
            return {}
        clip = {k: getattr(self.model, k) for k in ("frames", "height", "width") if getattr(self.model, k)}
        return {**clip, "reward_frames": self.reward_frames}

    def _validate_precision(self) -> None:
        from solrl.precision import available_backends

        r = self.rollout
        for name in ("explore_precision", "precision"):
            backend = getattr(r, name).backend
            if backend not in available_backends() and not (name == "explore_precision" and backend == "auto"):
                extra = " or auto (the adaptive proxy, rollout.proxy)" if name == "explore_precision" else ""
                raise ConfigError(f"rollout.{name}.backend: unknown precision backend {backend!r}; available: "
                                  f"{available_backends()}{extra}")
        if r.explore_precision.backend == "auto":
            from solrl.rollout.candidates import check_proxy_config

            try:
                check_proxy_config(r.proxy, r.steps)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        if isinstance(data, dict) and "prompt_split" in data and "prompts" not in data:
            # configs written before prompt sets: prompt_split "train" | "all" of the shapes world
            split = data["prompt_split"]
            data = {k: v for k, v in data.items() if k != "prompt_split"}
            data["prompts"] = {"train": "shapes:all" if split == "all" else "shapes:train"}
        return _build(cls, data, "")

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(data)


# -------------------------------------------------------------------- typed conversion

def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping")
        return _build(tp, value, where + ".")
    if origin is typing.Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list")
        item = args[0] if args else str
        if (len(args) == 2 and args[1] is Ellipsis) or len(args) == 1:
            return tuple(_convert(item, v, where) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, where) for a, v in zip(args, value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
        if f != int(f):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(prefix + u for u in unknown)}")
    kwargs = {k: _convert(hints[k], v, prefix + k) for k, v in data.items()}
    return cls(**kwargs)
