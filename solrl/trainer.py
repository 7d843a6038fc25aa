"""The DiffusionNFT update on the LoRA: one call per epoch over that epoch's rollouts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from solrl.adapters import LoraAdapters
from solrl.algo import NFTConfig, compute_advantages, ema_decay, lerp_params_, nft_loss, timestep_indices
from solrl.config import TrainConfig
from solrl.models.base import Cond, T2IModel
from solrl.sampling import flow_sigmas


@dataclass
class Batch:
    """Training data of one epoch: BF16 (or, for naive_quant, low-precision) final latents and rewards."""

    x0: torch.Tensor        # [N, C, H, W]
    cond: Cond              # [N] encoded prompts
    rewards: np.ndarray     # [N]
    group: list[int]        # [N] prompt index (advantages are normalised per prompt)


class NFTTrainer:
    """Owns the optimizer and the adapter bookkeeping (trainable "default", sampling "old", eval "ema")."""

    def __init__(self, model: T2IModel, adapters: LoraAdapters, cfg: TrainConfig, rollout_steps: int,
                 shift: float = 1.0) -> None:
        self.model, self.adapters, self.cfg = model, adapters, cfg
        self.params = adapters.trainable_parameters()
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                     eps=cfg.eps)
        self.nft = NFTConfig(beta=cfg.beta, adv_clip_max=cfg.adv_clip_max, kl_beta=cfg.kl_beta,
                             timestep_fraction=cfg.timestep_fraction)
        # Training timesteps are the rollout grid (the sigmas the samples were generated on, t > 0).
        self.grid = flow_sigmas(rollout_steps, shift)[:-1].float()
        self.global_step = 0

    def old_decay(self, step: int) -> float:
        return min(self.cfg.old_decay_rate * step, self.cfg.old_decay_cap)

    def update(self, batch: Batch, generator: torch.Generator) -> dict[str, float]:
        """Advantages -> DiffusionNFT loss over random timesteps -> optimizer step(s) -> old / EMA decay."""
        cfg = self.cfg
        adv = compute_advantages(torch.from_numpy(batch.rewards).double(), batch.group).float()
        n = batch.x0.shape[0]
        order = torch.randperm(n, generator=generator)
        micro = [order[i: i + cfg.micro_batch] for i in range(0, n, cfg.micro_batch)]
        groups = np.array_split(np.arange(len(micro)), min(cfg.optimizer_steps_per_epoch, len(micro)))
        sums: dict[str, float] = {}
        count = 0
        grad_norms = []
        for g in groups:
            self.opt.zero_grad(set_to_none=True)
            plan = [(micro[i], timestep_indices(len(self.grid), cfg.timestep_fraction, generator)) for i in g]
            denom = sum(len(ts) for _, ts in plan)
            for idx, ts in plan:
                x0, cond, a = batch.x0[idx], batch.cond.index(idx), adv[idx]
                for j in ts:
                    t = self.grid[j].expand(len(idx))
                    noise = torch.randn(x0.shape, generator=generator)
                    tb = t[:, None, None, None]
                    xt = (1 - tb) * x0 + tb * noise
                    with torch.no_grad():
                        with self.adapters.use("old"):
                            v_old = self.model.velocity(self.model.transformer, xt, t, cond)
                        if cfg.kl_beta > 0:
                            with self.adapters.disabled():
                                v_ref = self.model.velocity(self.model.transformer, xt, t, cond)
                        else:
                            v_ref = v_old
                    with self.adapters.use("default"):
                        v = self.model.velocity(self.model.transformer, xt, t, cond)
                    loss, stats = nft_loss(x0, xt, t, v, v_old, v_ref, a, self.nft)
                    (loss / denom).backward()
                    for k, val in stats.items():
                        sums[k] = sums.get(k, 0.0) + float(val)
                    count += 1
            gn = torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
            grad_norms.append(float(gn))
            self.opt.step()
            self.global_step += 1
            with torch.no_grad():
                lerp_params_(self.adapters.parameters("old"), self.params, self.old_decay(self.global_step))
                lerp_params_(self.adapters.parameters("ema"), self.params,
                             ema_decay(self.global_step, cfg.ema_decay))
        out = {f"train.{k}": v / max(count, 1) for k, v in sums.items()}
        out.update({"train.grad_norm": float(np.mean(grad_norms)), "train.global_step": self.global_step,
                    "train.lr": self.opt.param_groups[0]["lr"], "train.advantage_abs_mean": float(adv.abs().mean()),
                    "train.samples": n, "train.timestep_evals": count})
        return out
