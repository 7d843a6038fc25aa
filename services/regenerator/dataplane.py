"""The regenerator's logic, free of any transport (the KServe `DataPlane` pattern).

A BF16 copy of the denoiser re-samples kept seeds at full steps (same seed -> same noise as the
explorer) and scores the images: these final latents and rewards are what the trainer learns from.
Sampling and scoring are the core `solrl.rollout.passes.regenerate`; this class adds input checks (errors
name the request field) and the hot-reloadable serving copy (every result names its adapter version).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.rollout.plane import (
    RolloutPlane,
    check_int,
    check_prompts,
    check_seeds,
)
from solrl.adapters import LoraSpec
from solrl.models.base import T2IModel
from solrl.precision import PrecisionConfig
from solrl.rewards import Scorer
from solrl.rollout.passes import SamplerSpec, regenerate

FIELDS = {"prompt": "prompt", "seeds": "seeds", "steps": "steps", "min_version": "min_version"}


@dataclass(frozen=True)
class RegenerateOutcome:
    seeds: list[int]          # [K]
    x0: torch.Tensor          # [K, C, H, W] final latents (float32, CPU)
    images: np.ndarray        # uint8 [K, H, W, 3]
    rewards: np.ndarray       # float32 [K]
    version: int              # adapter version sampled with
    sha256: str
    forwards: int
    # sampler.solver "sde" (flow_grpo) only: [K, S+1, C, H, W] states x_T .. x0 and [K, S] step log-probs
    trajectory: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


class RegeneratorDataPlane(RolloutPlane):
    SERVICE = "regenerator"

    """Regenerate over a hot-reloadable copy of `model.transformer` in `precision` (BF16 by default).

    `model.transformer` is the one base: rounded in place and served, pushed adapters carried unmerged as
    fp32 LoRA layers on it (HotSwapModel; no second copy); `lora` pins the layout pushed adapters must have
    (None: each adapter's own metadata). A request for a newer adapter version than served waits up to
    `version_wait_s`.
    """

    def __init__(self, model: T2IModel, precision: PrecisionConfig, lora: LoraSpec | None, scorer: Scorer, *,
                 model_name: str = "", steps: int = 10, sampler: SamplerSpec | None = None, micro_batch: int = 64,
                 max_seeds: int = 4096, max_steps: int = 1000, version_wait_s: float = 30.0) -> None:
        super().__init__(model, precision, lora, scorer, model_name=model_name, steps=steps, sampler=sampler,
                         micro_batch=micro_batch, max_seeds=max_seeds, max_steps=max_steps,
                         version_wait_s=version_wait_s)

    def regenerate(self, prompt: str, seeds: Sequence[int], *, steps: int | None = None,
                   sampler: SamplerSpec | None = None, min_version: int = 0,
                   fields: Mapping[str, str] = FIELDS) -> RegenerateOutcome:
        """Sample `seeds` for `prompt` at full steps and score them. Errors name the request field
        (`fields` maps argument names to the caller's field names). With the SDE sampler (solver "sde",
        flow_grpo's rollouts) the outcome also holds each seed's trajectory and per-step log-probs."""
        f = {**FIELDS, **fields}
        prompt = check_prompts(self.cache, [prompt], f["prompt"])[0]
        seeds = check_seeds(seeds, f["seeds"], self.max_seeds)
        steps = self.steps if steps is None else check_int(steps, f["steps"], 1, self.max_steps)
        min_version = check_int(min_version, f["min_version"], 0, 2**63 - 1)
        # this call's version, held to its end (a push waits for it)
        with self.hot.serving(min_version, self.version_wait_s) as serving:
            result = regenerate(self.model, serving.module, [prompt], [seeds], steps,
                                self.sampler if sampler is None else sampler, self.scorer, self.micro_batch,
                                self.cache)
        sde = result.trajectory is not None
        return RegenerateOutcome(result.seeds, result.x0.detach().float().cpu(), result.images,
                                 np.asarray(result.rewards, dtype=np.float32), serving.version, serving.sha256,
                                 result.forwards, result.trajectory.detach().float().cpu() if sde else None,
                                 result.log_probs.detach().float().cpu() if sde else None)
