"""The rollout passes, pure functions of (model, denoiser, sampler settings, scorer, seeds).

`generate` samples images for (prompt, seed) pairs; `explore` scores a seed pool per prompt and selects
which seeds to keep; `regenerate` re-samples the kept seeds at full steps and returns the final
latents and rewards that training uses. Forward counts are image-level denoiser evaluations
(batch rows x solver calls, x2 with classifier-free guidance).

Batching: `explore` and `regenerate` sample each prompt's seeds in forward batches of their own
(micro-batched within the prompt, never mixed with another prompt's), as the reference rollout
does (NVlabs/Sana `train_scripts/sol_rl/train_sana.py`, one prompt per rollout call). A
low-precision explorer quantizes activations with one amax per whole tensor (the real NVFP4 recipe
does; see `solrl.precision.emulated`), so a seed's proxy score depends on what shares its batch;
with per-prompt batches it does not depend on how prompts are spread over calls, explorers or
jobs: the embedded loop (all prompts in one call) and the services (one prompt per job) sample
identical batches and give identical scores.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from solrl.algo import select
from solrl.models.base import Cond, T2IModel
from solrl.rewards.frames import score_frames
from solrl.sampling import SeedNoise, cfg_velocity, flow_sigmas, noise_for_seeds, sample


@dataclass(frozen=True)
class SamplerSpec:
    """solver "euler" | "dpm2" (deterministic ODEs) or "sde" (FlowGRPO's SDE at noise level `eta`, which
    records every step: the rollouts flow_grpo trains on)."""

    solver: str = "euler"
    shift: float = 1.0
    guidance: float = 1.0
    eta: float = 0.0          # the SDE's noise level (solver "sde" only; > 0 there)

    def __post_init__(self) -> None:
        if self.solver == "sde" and not self.eta > 0:
            raise ValueError(f"SamplerSpec: solver 'sde' needs eta > 0, got {self.eta!r}")


@dataclass
class Generated:
    x0: torch.Tensor          # [B, C, H, W] final latents ([B, C, F, H, W] for a video model)
    images: np.ndarray        # uint8 [B, H, W, 3]; a video model's frames its rewards score [B, F', H, W, 3]
    forwards: int             # image-level denoiser evaluations
    # solver "sde" only: the states x_T .. x0 [B, S+1, C, H, W] and each transition's log-prob [B, S]
    trajectory: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


PROMPT_CACHE_ENTRIES = 1024         # prompts whose encodings a PromptCache keeps (rollout.prompt_cache_entries)
HOST_CACHE_MIN_BYTES = 1 << 20      # an encoding at least this large (T5-class encoders) is kept in host memory


class PromptCache:
    """Encoded prompts, computed once per prompt (the text encoder is frozen) and kept for the `max_entries`
    prompts used last (LRU: a long run's prompt set does not pile up). On a CUDA model an encoding of at least
    HOST_CACHE_MIN_BYTES (SD3.5's and FLUX's T5 embeddings: 1.7 and 1.1 MB a prompt at 128 tokens) is kept in host memory
    and moved to the model's device for each batch; smaller ones stay on the device. Moves and eviction do not
    change the numbers: a prompt encodes to the same values whenever it is encoded."""

    def __init__(self, model: T2IModel, max_entries: int = PROMPT_CACHE_ENTRIES) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.model, self.max_entries = model, max_entries
        self._cache: OrderedDict[str, Cond] = OrderedDict()
        self._device: torch.device | None = None   # where the text encoder's outputs (and the model) are

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, prompt: str) -> bool:
        return prompt in self._cache

    def __call__(self, prompts: list[str]) -> Cond:
        distinct = set(prompts)
        if len(distinct) > self.max_entries:
            raise ValueError(f"{len(distinct)} distinct prompts in one batch exceed the prompt cache's "
                             f"{self.max_entries} entries (rollout.prompt_cache_entries)")
        missing = sorted(p for p in distinct if p not in self._cache)
        if missing:
            with torch.no_grad():
                enc = self.model.encode(missing)
            self._device, home = enc.embeds.device, self._home(enc)
            for i, p in enumerate(missing):
                # a copy of its own row (a view would keep the whole batch alive), where it is kept
                self._cache[p] = enc.index(slice(i, i + 1)).to(home, copy=True)
        for p in prompts:
            self._cache.move_to_end(p)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return Cond.cat([self._cache[p] for p in prompts]).to(self._device)

    def _home(self, enc: Cond) -> torch.device:
        """Where an encoding is kept: host memory for a large one on CUDA, else its own device."""
        row = enc.index(slice(0, 1))
        size = sum(t.numel() * t.element_size() for t in (row.embeds, row.mask, row.pooled) if t is not None)
        return torch.device("cpu") if enc.embeds.is_cuda and size >= HOST_CACHE_MIN_BYTES else enc.embeds.device


def generate(model: T2IModel, transformer: nn.Module, prompts: list[str], seeds: list[int], steps: int,
             sampler: SamplerSpec, micro_batch: int = 64, cache: PromptCache | None = None) -> Generated:
    """Sample one image per (prompt, seed). Noise is a pure function of the seed: the initial noise, and with
    the SDE each step's noise too (`SeedNoise`: the seed's generator goes on drawing), so a seed's trajectory
    does not depend on what shares its batch."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
    if steps <= 0 or micro_batch <= 0:
        raise ValueError(f"steps and micro_batch must be positive, got {steps}, {micro_batch}")
    cache = cache or PromptCache(model)
    sigmas = flow_sigmas(steps, sampler.shift)
    noise = noise_for_seeds(seeds, model.spec.latent_shape)
    sde = sampler.solver == "sde"
    outs, trajs, lps, forwards = [], [], [], 0
    with torch.no_grad():
        for i in range(0, len(seeds), micro_batch):
            sl = slice(i, i + micro_batch)
            cond = cache(prompts[sl])
            vfn = model.velocity_fn(transformer, cond)
            if sampler.guidance != 1.0:
                vfn = cfg_velocity(vfn, model.velocity_fn(transformer, model.encode_uncond(len(cond))),
                                   sampler.guidance)
            if sde:
                streams = SeedNoise(seeds[sl], model.spec.latent_shape)
                res = sample(vfn, streams.initial(), sigmas, "sde", return_trajectory=True, eta=sampler.eta,
                             step_noise=streams.step)
                trajs.append(res.trajectory)
                lps.append(res.log_probs)
            else:
                res = sample(vfn, noise[sl], sigmas, sampler.solver)
            outs.append(res.x0)
            forwards += res.nfe * len(cond) * (2 if sampler.guidance != 1.0 else 1)
    x0 = torch.cat(outs) if outs else noise[:0]
    if not sde:
        return Generated(x0, model.decode(x0), forwards)
    traj = torch.cat(trajs) if trajs else torch.zeros(0, steps + 1, *noise.shape[1:])
    lp = torch.cat(lps) if lps else torch.zeros(0, steps)
    return Generated(x0, model.decode(x0), forwards, traj, lp)


def generate_by_prompt(model: T2IModel, transformer: nn.Module, prompts: list[str], seeds: list[list[int]],
                       steps: int, sampler: SamplerSpec, micro_batch: int = 64,
                       cache: PromptCache | None = None) -> Generated:
    """`generate` for each prompt's seed list on its own (forward batches never mix prompts), flattened
    prompt-major. The results do not depend on which other prompts are in the call."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seed lists")
    cache = cache or PromptCache(model)
    parts = [generate(model, transformer, [p] * len(pool), list(pool), steps, sampler, micro_batch, cache)
             for p, pool in zip(prompts, seeds) if len(pool)]
    if not parts:
        return generate(model, transformer, [], [], steps, sampler, micro_batch, cache)
    sde = parts[0].trajectory is not None
    return Generated(torch.cat([g.x0 for g in parts]), np.concatenate([g.images for g in parts]),
                     sum(g.forwards for g in parts), torch.cat([g.trajectory for g in parts]) if sde else None,
                     torch.cat([g.log_probs for g in parts]) if sde else None)


@dataclass
class ExploreResult:
    seeds: list[list[int]]          # [P][n]
    scores: np.ndarray              # [P, n] proxy rewards
    kept: list[list[int]]           # [P][k] indices into seeds[p]
    forwards: int
    generated: Generated            # flattened [P*n] in prompt-major order
    failed: int = 0                 # candidates the validity gate failed (0 without one)

    def kept_seeds(self) -> list[list[int]]:
        return [[s[i] for i in idx] for s, idx in zip(self.seeds, self.kept)]


def explore(model: T2IModel, transformer: nn.Module, prompts: list[str], seeds: list[list[int]], steps: int,
            sampler: SamplerSpec, scorer, k: int, selection: str = "best_worst",
            generator: torch.Generator | None = None, micro_batch: int = 64,
            cache: PromptCache | None = None, valid=None) -> ExploreResult:
    """Sample every seed of every prompt's pool, score, and select k seeds per prompt. `valid` (the validity gate,
    `guard.gate`): images [B, ...] -> bool [B], whether each candidate passes; the failing ones are ranked out of the
    kept seeds (`solrl.algo.selection.select`)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seed pools")
    flat_p = [p for p, pool in zip(prompts, seeds) for _ in pool]
    gen = generate_by_prompt(model, transformer, prompts, seeds, steps, sampler, micro_batch, cache)
    flat_r = score_frames(scorer, gen.images, flat_p)
    ok = np.asarray(valid(gen.images), dtype=bool) if valid is not None else None
    scores, kept, off = [], [], 0
    for pool in seeds:
        r = flat_r[off: off + len(pool)]
        gate = ok[off: off + len(pool)].tolist() if ok is not None else None
        off += len(pool)
        scores.append(r)
        kept.append(list(select(torch.from_numpy(r), k, selection, generator=generator, valid=gate)))
    failed = int((~ok).sum()) if ok is not None else 0
    return ExploreResult([list(p) for p in seeds], np.stack(scores), kept, gen.forwards, gen, failed)


@dataclass
class RegenResult:
    prompts: list[str]              # [P*k] flattened, prompt-major
    seeds: list[int]                # [P*k]
    group: list[int]                # [P*k] prompt index of each rollout
    x0: torch.Tensor                # [P*k, C, H, W]
    images: np.ndarray              # [P*k, H, W, 3]
    rewards: np.ndarray             # [P*k]
    forwards: int
    trajectory: torch.Tensor | None = None  # [P*k, S+1, C, H, W] (solver "sde": flow_grpo's rollouts)
    log_probs: torch.Tensor | None = None   # [P*k, S]


def regenerate(model: T2IModel, transformer: nn.Module, prompts: list[str], seeds: list[list[int]], steps: int,
               sampler: SamplerSpec, scorer, micro_batch: int = 64, cache: PromptCache | None = None) -> RegenResult:
    """Re-sample the kept seeds at full steps (same initial noise as exploration); these are the training data.
    With the SDE (flow_grpo) the result also holds each rollout's trajectory and per-step log-probs."""
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seed lists")
    flat_p = [p for p, ks in zip(prompts, seeds) for _ in ks]
    flat_s = [s for ks in seeds for s in ks]
    group = [i for i, ks in enumerate(seeds) for _ in ks]
    gen = generate_by_prompt(model, transformer, prompts, seeds, steps, sampler, micro_batch, cache)
    rewards = score_frames(scorer, gen.images, flat_p)
    return RegenResult(flat_p, flat_s, group, gen.x0, gen.images, rewards, gen.forwards, gen.trajectory,
                       gen.log_probs)
