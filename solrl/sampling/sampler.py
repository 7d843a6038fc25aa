"""The sampling loop over a sigma grid, and classifier-free guidance on velocity functions."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from solrl.sampling.steps import DPMHistory, dpm2_step, euler_step, sde_step_with_logprob

VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""A model seen as v = f(x_BCHW, t_B): predicted velocity (noise - x0) at sigma t_B in [0, 1]."""

Solver = Literal["euler", "dpm2", "sde"]
SOLVERS: tuple[str, ...] = ("euler", "dpm2", "sde")


@dataclass(frozen=True)
class SampleResult:
    """Output of `sample`.

    x0: final state. trajectory: [B, N + 1, ...] states from x_T to x0 (when asked for).
    log_probs: [B, N] per-step transition log-probs (solver "sde" only). nfe: velocity_fn calls.
    """

    x0: Tensor
    trajectory: Tensor | None
    log_probs: Tensor | None
    nfe: int


def _sigma_grid(sigmas: Tensor | Sequence[float]) -> list[float]:
    if isinstance(sigmas, Tensor) and sigmas.ndim != 1:
        raise ValueError(f"sigmas must be 1-D, got shape {tuple(sigmas.shape)}")
    values = sigmas.detach().cpu().tolist() if isinstance(sigmas, Tensor) else list(sigmas)
    if len(values) < 2:
        raise ValueError(f"sigmas must hold at least 2 values, got {len(values)}")
    if any(isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) for s in values):
        raise ValueError("sigmas must be finite floats")
    if not (values[0] <= 1.0 and values[-1] >= 0.0):
        raise ValueError(f"sigmas must lie in [0, 1], got first {values[0]} and last {values[-1]}")
    if any(b >= a for a, b in itertools.pairwise(values)):
        raise ValueError("sigmas must be strictly decreasing")
    return [float(s) for s in values]


def sample(
    velocity_fn: VelocityFn,
    x_T: Tensor,
    sigmas: Tensor | Sequence[float],
    solver: Solver = "euler",
    return_trajectory: bool = False,
    *,
    eta: float = 0.7,
    generator: torch.Generator | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    step_noise: Callable[[], Tensor] | None = None,
) -> SampleResult:
    """Integrate from x_T at sigmas[0] to sigmas[-1]; one velocity_fn call per step for every solver.

    "euler" and "dpm2" solve the deterministic ODE; "sde" is the FlowGRPO SDE (noise level `eta`,
    noise from `generator`, or, given `step_noise`, one call of it per step: e.g. `SeedNoise.step`, each seed's
    own stream, which makes the trajectory of a seed independent of its batch) and records per-step log-probs
    (`reduction` over non-batch dims).
    velocity_fn gets the state in x_T's dtype and t_B as float32 [B]. Gradients are not disabled
    here: wrap the call in `torch.no_grad()` for rollouts.
    The state lives where the denoiser computes (`velocity_fn.device`, e.g. a `solrl.models.base.Velocity`; else
    x_T's device): x_T moves there once and the results come back on x_T's device, so a step makes no
    host <-> device copies and no host syncs (the sigmas are Python floats, the SDE's CPU-drawn noise is copied
    asynchronously from pinned memory).
    """
    if not callable(velocity_fn):
        raise TypeError(f"velocity_fn must be callable, got {type(velocity_fn).__name__}")
    if not isinstance(x_T, Tensor) or x_T.ndim < 2:
        raise ValueError("x_T must be a Tensor [B, ...] with at least one non-batch dim")
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    if step_noise is not None and (solver != "sde" or generator is not None):
        raise ValueError("step_noise is the SDE's noise source: only with solver 'sde' and without generator")
    grid = _sigma_grid(sigmas)
    batch = x_T.shape[0]
    home = x_T.device
    x = x_T.to(getattr(velocity_fn, "device", None) or home)
    states = [x] if return_trajectory else None
    log_probs: list[Tensor] = []
    history: DPMHistory | None = None
    nfe = 0
    for s, s_next in itertools.pairwise(grid):
        t_B = torch.full((batch,), s, dtype=torch.float32, device=x.device)
        v = velocity_fn(x, t_B)
        nfe += 1
        if not isinstance(v, Tensor) or v.shape != x.shape:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"velocity_fn must return a Tensor shaped like x {tuple(x.shape)}, got {got}")
        if solver == "euler":
            x = euler_step(v, x, s, s_next)
        elif solver == "dpm2":
            x, history = dpm2_step(v, x, s, s_next, history)
        else:
            step = sde_step_with_logprob(v, x, s, s_next, eta, generator=generator, reduction=reduction,
                                         noise=step_noise() if step_noise is not None else None)
            x = step.x_next
            log_probs.append(step.log_prob)
        if states is not None:
            states.append(x)
    return SampleResult(
        x0=x.to(home),
        trajectory=torch.stack(states, dim=1).to(home) if states is not None else None,
        log_probs=torch.stack(log_probs, dim=1).to(home) if solver == "sde" else None,
        nfe=nfe,
    )


def cfg_velocity(velocity_cond: VelocityFn, velocity_uncond: VelocityFn, scale: float) -> VelocityFn:
    """Classifier-free guidance: v = v_uncond + scale * (v_cond - v_uncond).

    At scale 1 this is exactly `velocity_cond` (returned as is: no unconditional forward is made);
    otherwise each call evaluates both branches: in one forward over [uncond; cond] rows when
    `velocity_cond.paired(velocity_uncond)` gives that batched velocity (`solrl.models.base.Velocity` does on a
    GPU), else in two. The result carries `velocity_cond`'s `device`.
    """
    if not callable(velocity_cond) or not callable(velocity_uncond):
        raise TypeError("velocity_cond and velocity_uncond must be callable")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if scale == 1.0:
        return velocity_cond
    guidance = float(scale)
    pair = getattr(velocity_cond, "paired", None)
    both = pair(velocity_uncond) if pair is not None else None

    def guided(x: Tensor, t_B: Tensor) -> Tensor:
        if both is not None:
            v_uncond, v_cond = both(torch.cat([x, x]), torch.cat([t_B, t_B])).chunk(2)
        else:
            v_uncond, v_cond = velocity_uncond(x, t_B), velocity_cond(x, t_B)
        return v_uncond + guidance * (v_cond - v_uncond)

    guided.device = getattr(velocity_cond, "device", None)
    guided.batched = both is not None
    return guided
