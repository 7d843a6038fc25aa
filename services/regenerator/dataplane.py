"""The regenerator's logic, free of any transport (the KServe `DataPlane` pattern).

A BF16 copy of the denoiser re-samples kept seeds at full steps (same seed -> same noise as the
explorer) and scores the images: these final latents and rewards are what the trainer learns from.
Sampling and scoring are the core `solrl.rollout.regenerate`; this class adds input checks (errors
name the request field) and the hot-reloadable serving copy (every result names its adapter version).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import solrl
from services.common.adapter_reload import HotSwapModel, serving_precision
from services.explorer.dataplane import check_int, check_prompts, check_seeds, default_sampler, resolve_sampler
from solrl.adapters import LoraSpec
from solrl.models.base import T2IModel
from solrl.precision import PrecisionConfig
from solrl.rewards import Scorer
from solrl.rollout import PromptCache, SamplerSpec, regenerate

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


class RegeneratorDataPlane:
    """Regenerate over a hot-reloadable copy of `model.transformer` in `precision` (BF16 by default).

    `model.transformer` becomes the plain base the adapters merge into (kept as given); `lora` is the
    layout pushed adapters must have. A request for a newer adapter version than served waits up to
    `version_wait_s`.
    """

    def __init__(self, model: T2IModel, precision: PrecisionConfig, lora: LoraSpec, scorer: Scorer, *,
                 model_name: str = "", steps: int = 10, sampler: SamplerSpec | None = None, micro_batch: int = 64,
                 max_seeds: int = 4096, max_steps: int = 1000, version_wait_s: float = 30.0) -> None:
        if not isinstance(model, T2IModel):
            raise TypeError(f"model must be a T2IModel, got {type(model).__name__}")
        if not callable(scorer):
            raise TypeError(f"scorer must be callable, got {type(scorer).__name__}")
        self.max_seeds = check_int(max_seeds, "max_seeds", 1, 1 << 20)
        self.max_steps = check_int(max_steps, "max_steps", 1, 100_000)
        self.steps = check_int(steps, "steps", 1, self.max_steps)
        self.micro_batch = check_int(micro_batch, "micro_batch", 1, 1 << 16)
        if not version_wait_s >= 0:
            raise ValueError(f"version_wait_s must be >= 0, got {version_wait_s!r}")
        self.model, self.scorer = model, scorer
        self.model_name = model_name or model.spec.name
        self.sampler = resolve_sampler(default_sampler(model), *(
            (sampler.solver, sampler.shift, sampler.guidance) if sampler is not None else ()))
        self.version_wait_s = float(version_wait_s)
        self.hot = HotSwapModel(model.transformer, lora, serving_precision(precision, model.spec))
        self.cache = PromptCache(model)
        self._closed = False

    def ready(self) -> bool:
        return not self._closed

    def info(self) -> dict[str, Any]:
        cur = self.hot.current()
        return {"service": "regenerator", "version": solrl.__version__, "model": self.model_name,
                "precision": self.hot.backend, "adapter_version": cur.version, "adapter_sha256": cur.sha256,
                "resident_weight_bytes": self.hot.weight_bytes()["total"],
                "reward": getattr(self.scorer, "name", type(self.scorer).__name__),
                "defaults": {"steps": self.steps, "solver": self.sampler.solver, "shift": self.sampler.shift,
                             "guidance": self.sampler.guidance},
                "ready": self.ready()}

    def close(self) -> None:
        self._closed = True
        close = getattr(self.scorer, "close", None)
        if callable(close):
            close()

    def regenerate(self, prompt: str, seeds: Sequence[int], *, steps: int | None = None,
                   sampler: SamplerSpec | None = None, min_version: int = 0,
                   fields: Mapping[str, str] = FIELDS) -> RegenerateOutcome:
        """Sample `seeds` for `prompt` at full steps and score them. Errors name the request field
        (`fields` maps argument names to the caller's field names)."""
        f = {**FIELDS, **fields}
        prompt = check_prompts(self.cache, [prompt], f["prompt"])[0]
        seeds = check_seeds(seeds, f["seeds"], self.max_seeds)
        steps = self.steps if steps is None else check_int(steps, f["steps"], 1, self.max_steps)
        min_version = check_int(min_version, f["min_version"], 0, 2**63 - 1)
        serving = self.hot.acquire(min_version, self.version_wait_s)  # this call's copy, whatever is pushed later
        result = regenerate(self.model, serving.module, [prompt], [seeds], steps,
                            self.sampler if sampler is None else sampler, self.scorer, self.micro_batch, self.cache)
        return RegenerateOutcome(result.seeds, result.x0.detach().float().cpu(), result.images,
                                 np.asarray(result.rewards, dtype=np.float32), serving.version, serving.sha256,
                                 result.forwards)
