"""Stage times: the calibrated efficiencies and per-image overhead, and each stage's whole-epoch work on one GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass

from solrl.deploy.facts import ModelFacts
from solrl.deploy.recipe import Recipe
from solrl.hardware import GPUS, REFERENCE_GPU, Gpu


@dataclass(frozen=True)
class Calibration:
    eta_rollout: float        # sampling: achieved / peak FLOPs (every format)
    eta_train: float          # training: achieved / peak BF16 FLOPs
    image_s: float            # seconds per 1024x1024 image on one B200: VAE decode, hand-off, scoring


# Fitted by `solrl plan --calibrate` (fit_calibration); tests/deploy/test_plan.py checks a fresh fit gives these.
CALIBRATION = Calibration(eta_rollout=0.21889, eta_train=0.22484, image_s=0.035611)


@dataclass(frozen=True)
class Stage:
    """One stage's whole-epoch work on one GPU: seconds = compute_s / efficiency + image_units x image_s."""

    name: str                 # explore | regenerate | train
    units: int                # prompts (sampling) or samples (training): the granularity it spreads over GPUs
    flops: float
    compute_s: float          # at 100% of peak on one GPU
    image_units: float        # images x pixels / 1024^2 x (B200 BF16 peak / this GPU's)
    parts: tuple[int, ...] = ()   # units that spread over the GPUs one part after another (training: each
                                  # optimizer step's samples); () = all units at once

    def share(self, gpus: int) -> float:
        """The share of the one-GPU time the stage takes on `gpus` GPUs: ceil(units / g) of its units, part by part."""
        return sum(math.ceil(p / gpus) for p in self.parts or (self.units,)) / self.units

    def seconds(self, cal: Calibration, gpus: int = 1) -> float:
        eff = cal.eta_train if self.name == "train" else cal.eta_rollout
        one = self.compute_s / eff + self.image_units * cal.image_s
        return one * self.share(gpus)


def stages(facts: ModelFacts, recipe: Recipe, gpu: Gpu) -> dict[str, Stage]:
    """The epoch's stages that have work, in order."""
    fwd, peak = facts.forward, {k: v * 1e12 for k, v in gpu.tflops.items() if v}
    bf16_s = fwd.flops / peak["bf16"]                       # one BF16 forward at peak
    q_flops = 2.0 * facts.quantized_macs
    explore_s = (fwd.flops - q_flops) / peak["bf16"] + q_flops / peak[recipe.explore_format]
    pixels = (facts.resolution / 1024) ** 2 * GPUS[REFERENCE_GPU].tflops["bf16"] / gpu.tflops["bf16"]
    out = {}
    if recipe.explored:
        images = recipe.prompts * recipe.explored
        n = images * recipe.explore_steps * recipe.cfg_mult
        out["explore"] = Stage("explore", recipe.prompts, n * fwd.flops, n * explore_s, images * pixels)
    if recipe.regenerated:
        images = recipe.prompts * recipe.regenerated
        n = images * recipe.steps * recipe.cfg_mult
        out["regenerate"] = Stage("regenerate", recipe.prompts, n * fwd.flops, n * bf16_s, images * pixels)
    n = recipe.samples * recipe.train_timesteps * recipe.train_passes
    out["train"] = Stage("train", recipe.samples, n * fwd.flops, n * bf16_s, 0.0, recipe.step_samples)
    return out
