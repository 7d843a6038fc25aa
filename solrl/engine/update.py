"""The update on the LoRA, one call per epoch over that epoch's rollouts: DiffusionNFT (`NFTTrainer`) or
FlowGRPO (`FlowGRPOTrainer`, train.algo=flow_grpo); `build_trainer` picks by the config."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import record_function

from solrl.adapters import LoraAdapters
from solrl.algo import (
    NFTConfig,
    compute_advantages,
    ema_decay,
    flow_grpo_loss,
    lerp_params_,
    nft_loss,
    threshold_groups,
    timestep_indices,
)
from solrl.config import ConfigError, RunConfig, TrainConfig
from solrl.engine import data_parallel as ddp
from solrl.models.base import Cond, T2IModel, compute_device
from solrl.precision.base import allow_tf32
from solrl.registry import load_entry
from solrl.sampling import SDEStep, flow_sigmas, sde_step_with_logprob

# The planner's memory model, which sits above the engine (it plans the engine's roles): named, not imported, as the
# registries name what sits above the core (solrl/registry.py, docs/architecture.md)
MEMORY_MODEL = ("solrl.deploy.memory:trainer_fits_without_checkpointing", "solrl.deploy.recipe:PlanError")


def use_gradient_checkpointing(setting: str, model: T2IModel, run: RunConfig | None = None) -> bool:
    """Whether the trainer recomputes block activations in the backward pass (train.gradient_checkpointing).
    "true" / "false": as said. "auto": off for the shapes model and on the CPU, where activations are small and the
    recompute would only cost time; for a real model (a diffusers pipeline: SANA, SD3.5, FLUX, Wan2.2) on CUDA, on
    where the planner's memory model says this trainer process (`run`'s, on this GPU's memory, with this many
    ranks) does not fit without it (solrl.deploy.memory.trainer_fits_without_checkpointing), and on wherever that cannot be
    told (no run given, a model the planner has no architecture for)."""
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"train.gradient_checkpointing must be auto, true or false, got {setting!r}")
    if setting != "auto":
        return setting == "true"
    from solrl.models.diffusers_t2i import DiffusersT2I
    from solrl.models.wan import WanModel

    device = compute_device(model.transformer)
    if not isinstance(model, (DiffusersT2I, WanModel)) or device.type != "cuda":
        return False
    if run is None:
        return True
    fits, plan_error = (load_entry(ref) for ref in MEMORY_MODEL)
    hbm_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    try:
        return not fits(run, hbm_gb, ranks)
    except plan_error:
        return True


def set_gradient_checkpointing(transformer: torch.nn.Module, on: bool) -> bool:
    """Turn diffusers' gradient checkpointing on (or off) in every denoiser of `transformer` (both experts of
    Wan2.2 A14B); returns whether it is now on (False where the denoiser does not support it). The numbers do
    not change: the blocks' forwards are recomputed in the backward pass (torch.utils.checkpoint)."""
    from diffusers import ModelMixin

    denoisers = [m for m in transformer.modules()
                 if isinstance(m, ModelMixin) and getattr(m, "_supports_gradient_checkpointing", False)]
    for m in denoisers:
        if on:
            m.enable_gradient_checkpointing()
        elif m.is_gradient_checkpointing:
            m.disable_gradient_checkpointing()
    return bool(on and denoisers)


@dataclass
class Batch:
    """Training data of one epoch: BF16 (or, for naive_quant, low-precision) final latents and rewards."""

    x0: torch.Tensor        # [N, C, H, W] ([N, C, F, H, W] for a video model)
    cond: Cond              # [N] encoded prompts
    rewards: np.ndarray     # [N]
    group: list[int]        # [N] prompt index (advantages are normalised per prompt)
    # flow_grpo: each rollout's SDE trajectory x_T .. x0 [N, S+1, C, H, W] and transition log-probs [N, S]
    trajectory: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


class NFTTrainer:
    """Owns the optimizer and the adapter bookkeeping (trainable "default", sampling "old", eval "ema")."""

    def __init__(self, model: T2IModel, adapters: LoraAdapters, cfg: TrainConfig, rollout_steps: int,
                 shift: float = 1.0, *, run: RunConfig | None = None) -> None:
        """run: the whole run's settings, for train.gradient_checkpointing=auto's memory estimate."""
        self.model, self.adapters, self.cfg = model, adapters, cfg
        allow_tf32(compute_device(adapters.model))   # FP32 LoRA matmuls on tensor cores (CUDA)
        self.gradient_checkpointing = set_gradient_checkpointing(
            adapters.model, use_gradient_checkpointing(cfg.gradient_checkpointing, model, run))
        self.params = adapters.trainable_parameters()
        # train.conv_lr > 0: the LoRA on convolutions in a second parameter group at its own learning rate (one
        # group otherwise, so optimizer checkpoints of runs without it keep their layout)
        conv = {id(p) for p in adapters.conv_parameters(adapters.TRAINABLE)} if cfg.conv_lr > 0 else set()
        if cfg.conv_lr > 0 and not conv:
            raise ConfigError(f"train.conv_lr={cfg.conv_lr} sets the learning rate of the LoRA on convolutions, but no "
                              f"LoRA target is a convolution (lora.targets, e.g. add conv1,conv2 for a UNet)")
        groups: list[dict] = [{"params": [p for p in self.params if id(p) not in conv]}]
        if conv:
            groups.append({"params": [p for p in self.params if id(p) in conv], "lr": cfg.conv_lr})
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, eps=cfg.eps)
        self.nft = NFTConfig(beta=cfg.beta, adv_clip_max=cfg.adv_clip_max, kl_beta=cfg.kl_beta,
                             timestep_fraction=cfg.timestep_fraction)
        # Training timesteps are the rollout grid (the sigmas the samples were generated on, t > 0).
        self.grid = flow_sigmas(rollout_steps, shift)[:-1].float()
        self.global_step = 0
        # data-parallel (torchrun): this rank's place and the DDP wrapper of the trainable forward (data_parallel)
        self.ranks: ddp.Ranks = ddp.SINGLE
        self.ddp: torch.nn.Module | None = None

    def data_parallel(self, ranks: ddp.Ranks) -> None:
        """Train this rank's share of every optimizer step, gradients summed over the ranks (solrl/engine/data_parallel.py)."""
        if ranks.parallel:
            self.ranks = ranks
            self.ddp = ddp.wrap(self.model, [p for name in self.adapters.ADAPTERS
                                             for p in self.adapters.parameters(name)])

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients, step, and move the EMA adapter; returns the gradient norm."""
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm)
        self.opt.step()
        self.global_step += 1
        lerp_params_(self.adapters.parameters("ema"), self.params, ema_decay(self.global_step, self.cfg.ema_decay))
        return float(gn)

    def old_decay(self, step: int) -> float:
        return min(self.cfg.old_decay_rate * step, self.cfg.old_decay_cap)

    def plan(self, group: list[int], generator: torch.Generator) -> list[torch.Tensor]:
        """Sample order of one epoch: the sample indices of each optimizer step.

        Prompt groups are kept whole: groups come in a random order (members shuffled within each) and
        each optimizer step takes a contiguous run of whole groups. So every step's advantages are centred
        on its own prompts, as they are with the reference's single step per epoch. Asking for more steps
        than there are groups is an error; 0 asks for one step per group.
        """
        members: dict[int, list[int]] = {}
        for i, g in enumerate(group):
            members.setdefault(int(g), []).append(i)
        steps = self.cfg.optimizer_steps_per_epoch or len(members)  # 0: one step per prompt group
        if steps > len(members):
            raise ValueError(
                f"train.optimizer_steps_per_epoch={steps} exceeds the {len(members)} prompt groups of this epoch: "
                f"each optimizer step trains on whole prompt groups; use at most {len(members)} steps or more "
                f"prompts per epoch (rollout.prompts_per_epoch)")
        keys = list(members)
        ordered = []
        for k in torch.randperm(len(keys), generator=generator).tolist():
            idx = members[keys[k]]
            ordered.append([idx[j] for j in torch.randperm(len(idx), generator=generator).tolist()])
        return [torch.tensor([i for c in chunk for i in ordered[c]], dtype=torch.long)
                for chunk in np.array_split(np.arange(len(ordered)), steps)]

    def timestep_plan(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """[n, K] grid indices: each sample's own random subset of the rollout grid (timestep_indices),
        as the reference permutes timesteps per sample."""
        return torch.tensor([timestep_indices(len(self.grid), self.cfg.timestep_fraction, generator)
                             for _ in range(n)], dtype=torch.long)

    def micro_batches(self, samples: torch.Tensor, ts: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One optimizer step's (sample, timestep) rows cut into forwards of at most train.micro_batch rows.

        The reference loops over timesteps with one micro-batch of samples per forward; a forward here
        takes rows of several samples and timesteps at once (each row has its own t), so a step of a few
        samples still fills the batch. The step's gradient is the same mean over its rows either way; only
        the float summation order differs. Chunks are balanced (np.array_split), e.g. 80 rows at 32 -> 27/27/26.
        `ts` is the epoch's [N, K] timestep plan; returns (sample indices, grid indices) per forward."""
        k = ts.shape[1]
        rows_s = samples.repeat_interleave(k)
        rows_t = ts[samples].reshape(-1)
        chunks = -(-len(rows_s) // self.cfg.micro_batch)
        return [(rows_s[c], rows_t[c]) for c in
                (torch.from_numpy(a) for a in np.array_split(np.arange(len(rows_s)), chunks))]

    def forwards(self, samples: torch.Tensor, ts: torch.Tensor, shape: torch.Size,
                 generator: torch.Generator) -> tuple[int, Iterator[tuple[torch.Tensor, ...]]]:
        """This rank's forwards of one optimizer step: (sample indices, grid indices, noise), and how many.

        The noise of each single-process forward is drawn in turn, so the generator advances the same way with
        any number of ranks; a data-parallel rank keeps its rows (a contiguous share of the step's samples) and
        cuts them into its own forwards of at most train.micro_batch rows (ddp.local_forwards)."""
        chunks = self.micro_batches(samples, ts)
        draws = ((idx, tj, torch.randn((len(idx), *shape), generator=generator)) for idx, tj in chunks)
        if not self.ranks.parallel:
            return len(chunks), draws
        lo, hi = ddp.rows_of_rank(len(samples), ts.shape[1], self.ranks)
        return ddp.local_forwards(draws, lo, hi, self.cfg.micro_batch)

    def update(self, batch: Batch, generator: torch.Generator) -> dict[str, float]:
        """Advantages -> DiffusionNFT loss over per-sample random timesteps -> optimizer step(s) (EMA after
        each) -> the old adapter decayed once, at the end of the epoch (as the reference)."""
        cfg = self.cfg
        adv = compute_advantages(torch.from_numpy(batch.rewards).double(), batch.group, std=cfg.adv_std).float()
        n = batch.x0.shape[0]
        steps = self.plan(batch.group, generator)
        ts_all = self.timestep_plan(n, generator)
        sums: dict[str, float] = {}
        rows_seen = 0
        forwards = 0
        grad_norms = []
        for samples in steps:
            self.opt.zero_grad(set_to_none=True)
            denom = len(samples) * ts_all.shape[1]
            n_fwd, fwds = self.forwards(samples, ts_all, batch.x0.shape[1:], generator)
            for i, (idx, tj, noise) in enumerate(fwds):
                x0, cond, a = batch.x0[idx], batch.cond.index(idx), adv[idx]
                t = self.grid[tj]
                tb = t.view(-1, *([1] * (x0.ndim - 1)))  # [N, 1, 1, 1], or [N, 1, 1, 1, 1] for video latents
                xt = (1 - tb) * x0 + tb * noise
                with torch.no_grad():
                    with self.adapters.use("old"), record_function("solrl.train.forward_old"):
                        v_old = self.model.velocity(self.model.transformer, xt, t, cond)
                    v_ref = None  # kl_beta 0: no KL term, so no reference forward
                    if cfg.kl_beta > 0:
                        with self.adapters.disabled(), record_function("solrl.train.forward_ref"):
                            v_ref = self.model.velocity(self.model.transformer, xt, t, cond)
                # data-parallel: DDP's forward decides whether this backward all-reduces (the step's last one)
                with (self.adapters.use("default"), ddp.grad_sync(self.ddp, last=i == n_fwd - 1),
                      record_function("solrl.train.forward")):
                    v = (self.ddp(xt, t, cond) if self.ddp is not None
                         else self.model.velocity(self.model.transformer, xt, t, cond))
                    loss, stats = nft_loss(x0, xt, t, v, v_old, v_ref, a, self.nft)
                # each forward's mean loss weighted by its rows: the step's gradient is the mean over its
                # samples and timesteps, however the rows are cut
                with record_function("solrl.train.backward"):
                    (loss * (len(idx) / denom)).backward()
                for k, val in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(val) * len(idx)
                rows_seen += len(idx)
                forwards += 1
            with record_function("solrl.train.optimizer"):
                grad_norms.append(self.optimizer_step())
        lerp_params_(self.adapters.parameters("old"), self.params, self.old_decay(self.global_step))
        if self.ranks.parallel:  # the metrics over every rank's rows, as one process reports them
            sums, rows_seen, forwards = ddp.sum_stats(sums, rows_seen, forwards)
        out = {f"train.{k}": v / max(rows_seen, 1) for k, v in sums.items()}
        out.update({"train.grad_norm": float(np.mean(grad_norms)), "train.global_step": self.global_step,
                    "train.lr": self.opt.param_groups[0]["lr"], "train.advantage_abs_mean": float(adv.abs().mean()),
                    "train.samples": n, "train.timestep_evals": rows_seen, "train.forwards": forwards,
                    "train.optimizer_steps": len(steps)})
        return out


class FlowGRPOTrainer(NFTTrainer):
    """FlowGRPO on the LoRA (train.algo=flow_grpo): PPO-clipped ratios of the rollouts' own SDE transitions.

    For each (sample, grid step) row of the epoch's plan (the same whole-prompt-group optimizer steps and
    per-sample random timestep subsets as DiffusionNFT, `plan` / `timestep_plan`; the MMDanceGRPO design
    samples the trained timesteps at random too), the trainable adapter's velocity at the recorded state x_j
    gives the log-prob of the recorded next state x_{j+1} under the SDE step (solrl/sampling/steps.py); the
    ratio to the recorded log-prob is clipped to 1 +- train.clip_range against the group-normalised advantage
    (solrl/algo/grpo.py), plus train.kl_beta times the KL between the step's Gaussian mean and the adapter-free
    model's (yifan123/flow_grpo `scripts/train_sd3.py`). With classifier-free guidance the unconditional branch is
    detached, as there.

    The rollouts are sampled with the "old" adapter, which here is an exact copy of the trainable one at the
    start of the epoch (copied after every update instead of NFT's slow decay): the recorded log-probs are the
    old policy's, so the first optimizer step of an epoch sees a ratio of 1 (up to float rounding where the
    trainer's forward batches differ in shape from the rollout's). The EMA adapter (evaluation) is kept as for
    NFT."""

    def __init__(self, model: T2IModel, adapters: LoraAdapters, cfg: TrainConfig, rollout_steps: int,
                 shift: float = 1.0, *, eta: float, guidance: float = 1.0, run: RunConfig | None = None) -> None:
        super().__init__(model, adapters, cfg, rollout_steps, shift, run=run)
        if not eta > 0:
            raise ValueError(f"eta (rollout.sde_eta) must be > 0 for flow_grpo, got {eta!r}")
        self.eta, self.guidance = float(eta), float(guidance)
        self.sigmas = flow_sigmas(rollout_steps, shift).float()  # s_j and s_{j+1} of every step, as sampled

    def data_parallel(self, ranks: ddp.Ranks) -> None:
        if ranks.parallel:
            raise ConfigError("train.algo=flow_grpo does not train data-parallel yet (its batches carry trajectories "
                              "the ranks do not share): run it with one trainer process")

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: Cond) -> torch.Tensor:
        """The denoiser's velocity as the rollouts sampled it: with guidance != 1, v_u + w (v_c - v_u) with the
        unconditional branch detached (as yifan123/flow_grpo's `compute_log_prob` with `train.cfg`)."""
        v = self.model.velocity(self.model.transformer, x, t, cond)
        if self.guidance == 1.0:
            return v
        with torch.no_grad():
            v_u = self.model.velocity(self.model.transformer, x, t, self.model.encode_uncond(len(x)))
        return v_u + self.guidance * (v - v_u)

    def transition(self, batch: Batch, idx: torch.Tensor, tj: torch.Tensor, adapter: str | None) -> SDEStep:
        """The SDE step of rows (sample idx[i], grid step tj[i]) under `adapter` (None: adapters disabled, the
        reference model): its Gaussian (mean, std, noise scale) and the log-prob of the recorded next state."""
        x, x_next = batch.trajectory[idx, tj], batch.trajectory[idx, tj + 1]
        s, cond = self.sigmas[tj], batch.cond.index(idx)
        with self.adapters.use(adapter) if adapter is not None else self.adapters.disabled():
            v = self.velocity(x, s, cond)
        return sde_step_with_logprob(v, x, s, self.sigmas[tj + 1], self.eta, prev_sample=x_next)

    def update(self, batch: Batch, generator: torch.Generator) -> dict[str, float]:
        cfg = self.cfg
        if batch.trajectory is None or batch.log_probs is None:
            raise ValueError("train.algo=flow_grpo trains on SDE rollouts: the batch has no trajectory / log_probs "
                             "(were the rollouts sampled with rollout.sde_eta > 0?)")
        n, steps_n = batch.log_probs.shape
        if steps_n != len(self.sigmas) - 1 or tuple(batch.trajectory.shape[:2]) != (n, steps_n + 1):
            raise ValueError(f"rollouts of {steps_n} steps (trajectory {tuple(batch.trajectory.shape)}) do not match the "
                             f"trainer's grid of {len(self.sigmas) - 1} steps (rollout.steps)")
        adv = compute_advantages(torch.from_numpy(batch.rewards).double(), batch.group, std=cfg.adv_std).float()
        adv, zeroed = threshold_groups(adv, batch.rewards, batch.group, cfg.reward_threshold)
        plan = self.plan(batch.group, generator)
        ts_all = self.timestep_plan(n, generator)
        sums: dict[str, float] = {}
        rows_seen = forwards = 0
        grad_norms, max_dev, first_dev = [], 0.0, 0.0
        for k, samples in enumerate(plan):
            self.opt.zero_grad(set_to_none=True)
            denom = len(samples) * ts_all.shape[1]
            for idx, tj in self.micro_batches(samples, ts_all):
                step = self.transition(batch, idx, tj, "default")
                mean_ref = None
                if cfg.kl_beta > 0:
                    with torch.no_grad():
                        mean_ref = self.transition(batch, idx, tj, None).mean
                loss, stats = flow_grpo_loss(step.log_prob, batch.log_probs[idx, tj], adv[idx], step.mean, mean_ref,
                                             step.noise_scale, cfg.clip_range, cfg.adv_clip_max, cfg.kl_beta)
                (loss * (len(idx) / denom)).backward()
                dev = stats.pop("ratio_max_dev")
                max_dev = max(max_dev, dev)
                if k == 0:
                    first_dev = max(first_dev, dev)
                for key, val in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(val) * len(idx)
                rows_seen += len(idx)
                forwards += 1
            grad_norms.append(self.optimizer_step())
        with torch.no_grad():  # the next epoch samples with the policy as it is now: "old" = an exact copy
            for old, new in zip(self.adapters.parameters("old"), self.params, strict=True):
                old.copy_(new)
        out = {f"train.{k}": v / max(rows_seen, 1) for k, v in sums.items()}
        out.update({"train.grad_norm": float(np.mean(grad_norms)), "train.global_step": self.global_step,
                    "train.lr": self.opt.param_groups[0]["lr"], "train.advantage_abs_mean": float(adv.abs().mean()),
                    "train.samples": n, "train.timestep_evals": rows_seen, "train.forwards": forwards,
                    "train.optimizer_steps": len(plan), "train.ratio_max_dev": max_dev,
                    "train.ratio_max_dev_first_step": first_dev, "train.groups_below_threshold": zeroed})
        return out


def build_trainer(model: T2IModel, adapters: LoraAdapters, cfg: RunConfig, shift: float,
                  guidance: float = 1.0) -> NFTTrainer:
    """The trainer of `cfg.train.algo` (nft: NFTTrainer; flow_grpo: FlowGRPOTrainer)."""
    if cfg.train.algo == "flow_grpo":
        return FlowGRPOTrainer(model, adapters, cfg.train, cfg.rollout.steps, shift, eta=cfg.rollout.sde_eta,
                               guidance=guidance, run=cfg)
    return NFTTrainer(model, adapters, cfg.train, cfg.rollout.steps, shift, run=cfg)
