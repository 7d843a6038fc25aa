"""Single solver steps on a rectified-flow ODE/SDE, seen through the predicted velocity only.

Conventions: x_t = (1 - t) * x0 + t * noise, v = noise - x0, t (= sigma) in [0, 1], t = 1 is noise.
Step arithmetic runs in at least float32 (as the reference and diffusers do) and the new state
comes back in the dtype of the state that went in.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

Sigma = float | Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _check_same_shape(name: str, t: Tensor, x: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.shape != x.shape:
        raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")


def _sigma_column(sigma: Sigma, x: Tensor, dtype: torch.dtype, name: str) -> Tensor:
    """`sigma` (a float, a 0-d tensor or one value per sample [B]) broadcastable against x."""
    if isinstance(sigma, Tensor):
        if sigma.ndim == 0:
            return sigma.to(device=x.device, dtype=dtype)
        if sigma.ndim == 1 and sigma.shape[0] == x.shape[0]:
            return sigma.to(device=x.device, dtype=dtype).view(-1, *([1] * (x.ndim - 1)))
        raise ValueError(f"{name} must be a float, a 0-d tensor or a [B={x.shape[0]}] tensor, got {tuple(sigma.shape)}")
    if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"{name} must be a float or a Tensor, got {type(sigma).__name__}")
    # filled on the device (torch.tensor(value, device=...) would copy from the host and wait for the stream)
    return torch.full((), float(sigma), dtype=dtype, device=x.device)


def _check_decreasing(s: Sigma, s_next: Sigma, s_c: Tensor, s_next_c: Tensor) -> None:
    """0 < s <= 1 and 0 <= s_next < s: checked in Python for floats (the sampler's grid: no host sync), on the
    tensors otherwise (the trainer's per-sample sigmas)."""
    if isinstance(s, Tensor) or isinstance(s_next, Tensor):
        ok_s, ok_next = bool(torch.all((s_c > 0) & (s_c <= 1))), bool(torch.all((s_next_c >= 0) & (s_next_c < s_c)))
    else:
        s_f, n_f = (float(torch.tensor(float(v), dtype=s_c.dtype)) for v in (s, s_next))   # as rounded (CPU)
        ok_s, ok_next = 0.0 < s_f <= 1.0, 0.0 <= n_f < s_f
    if not ok_s:
        raise ValueError("s must lie in (0, 1]")
    if not ok_next:
        raise ValueError("s_next must lie in [0, s)")


def euler_step(v: Tensor, x: Tensor, s: Sigma, s_next: Sigma) -> Tensor:
    """One Euler step of dx/dt = v from t = s to t = s_next (same update as diffusers' flow Euler)."""
    _check_same_shape("v", v, x)
    dtype = _compute_dtype(x)
    dt = _sigma_column(s_next, x, dtype, "s_next") - _sigma_column(s, x, dtype, "s")
    return (x.to(dtype) + dt * v.to(dtype)).to(x.dtype)


@dataclass(frozen=True)
class DPMHistory:
    """What the multistep DPM-Solver-2 carries to the next step: the last x0 prediction and its sigma."""

    x0: Tensor
    sigma: float


def _as_float(value: Sigma, name: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a single value for dpm2_step, got shape {tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma; -inf at sigma = 1."""
    return -math.inf if sigma >= 1.0 else math.log((1.0 - sigma) / sigma)


def dpm2_step(
    v: Tensor, x: Tensor, s: Sigma, s_next: Sigma, history: DPMHistory | None = None
) -> tuple[Tensor, DPMHistory]:
    """One step of the flow DPM-Solver-2 used by the reference (multistep, data prediction).

    Same scheme as NVlabs/DiffusionNFT `flow_grpo/diffusers_patch/solver.py` (`dpm2`): one velocity
    per step; the x0 prediction D = x - s*v is extrapolated with the previous step's prediction in
    log-SNR lambda = log((1 - s) / s). With alpha = 1 - s the update
    x' = (s'/s) x - alpha' (e^{-h} - 1) (D + (D - D_prev) / (2 r)),  h = lambda' - lambda,
    r = (lambda - lambda_prev) / h, is computed as x' = (s'/s) x + (1 - s'/s) (D + (D - D_prev) / (2 r))
    (alpha' (e^{-h} - 1) = s'/s - 1 exactly), which stays finite at s = 1.
    First order (exactly the Euler step) when there is no history, when s_next = 0 (lambda' = inf),
    and when the previous sigma was 1 (lambda_prev = -inf gives r = inf, as in the reference).
    Returns the new state and the history for the next call.
    """
    _check_same_shape("v", v, x)
    s_f, s_next_f = _as_float(s, "s"), _as_float(s_next, "s_next")
    if not 0.0 < s_f <= 1.0:
        raise ValueError(f"s must lie in (0, 1], got {s_f}")
    if not 0.0 <= s_next_f < s_f:
        raise ValueError(f"s_next must lie in [0, s), got {s_next_f} with s={s_f}")
    if history is not None and not history.sigma > s_f:
        raise ValueError(f"history.sigma must be greater than s, got {history.sigma} with s={s_f}")
    dtype = _compute_dtype(x)
    x_c, v_c = x.to(dtype), v.to(dtype)
    x0 = x_c - s_f * v_c
    if history is None or s_next_f == 0.0 or history.sigma >= 1.0:
        x_next = x_c + (s_next_f - s_f) * v_c
    else:
        _check_same_shape("history.x0", history.x0, x)
        lam, lam_next = _log_snr(s_f), _log_snr(s_next_f)
        r = (lam - _log_snr(history.sigma)) / (lam_next - lam)
        d = x0 + (x0 - history.x0.to(dtype)) / (2.0 * r)
        ratio = s_next_f / s_f
        x_next = ratio * x_c + (1.0 - ratio) * d
    return x_next.to(x.dtype), DPMHistory(x0=x0, sigma=s_f)


class SDEStep(NamedTuple):
    """Result of one stochastic step: the sample, its log-prob [B], and the Gaussian it came from.

    `std` is the transition's standard deviation g * sqrt(-dt); `noise_scale` is g = eta * sqrt(s / (1 - s))
    alone (the reference's `std_dev_t`, which its KL term divides by), both shaped to broadcast against x."""

    x_next: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    noise_scale: Tensor


def sde_step_with_logprob(
    v: Tensor,
    x: Tensor,
    s: Sigma,
    s_next: Sigma,
    eta: float,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    noise: Tensor | None = None,
) -> SDEStep:
    """FlowGRPO SDE step: x_next ~ N(mean, std^2) with the log-prob of the transition.

    Follows yifan123/flow_grpo `sd3_sde_with_logprob.py` ('sde' type): noise scale
    g = eta * sqrt(s / (1 - s)) (1 - s replaced by 1 - s_next at s = 1, which is the reference's
    `sigmas[1]` guard on the first step), dt = s_next - s < 0,
    mean = x (1 + g^2 dt / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) dt, and transition std = g sqrt(-dt)
    (returned as `std`, shaped to broadcast against x).
    With `prev_sample` the log-prob of that sample is returned instead of drawing one; with `noise` (a
    standard-normal tensor shaped like x, e.g. a seed's own stream, `SeedNoise.step`) that noise is used
    instead of drawing from `generator`. A drawn
    sample is first rounded to x's dtype and its log-prob taken after rounding, so recomputing it
    later from the stored trajectory gives the same number.
    `reduction` over non-batch dims: "mean" as the reference does (the scale its PPO clip range of
    ~1e-4 was tuned for), or "sum" for the joint log-density.
    """
    _check_same_shape("v", v, x)
    if x.ndim < 2:
        raise ValueError(f"x must be [B, ...] with at least one non-batch dim, got shape {tuple(x.shape)}")
    if isinstance(eta, bool) or not isinstance(eta, numbers.Real) or not math.isfinite(eta) or eta <= 0:
        raise ValueError(f"eta must be a finite float > 0, got {eta!r}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if sum(a is not None for a in (generator, prev_sample, noise)) > 1:
        raise ValueError("pass at most one of generator, prev_sample and noise, not both or all")
    if noise is not None:
        _check_same_shape("noise", noise, x)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    dtype = _compute_dtype(x)
    s_c = _sigma_column(s, x, dtype, "s")
    s_next_c = _sigma_column(s_next, x, dtype, "s_next")
    _check_decreasing(s, s_next, s_c, s_next_c)
    x_c, v_c = x.to(dtype), v.to(dtype)
    dt = s_next_c - s_c
    g = eta * torch.sqrt(s_c / (1.0 - torch.where(s_c == 1.0, s_next_c, s_c)))
    mean = x_c * (1.0 + g**2 / (2.0 * s_c) * dt) + v_c * (1.0 + g**2 * (1.0 - s_c) / (2.0 * s_c)) * dt
    std = g * torch.sqrt(-dt)
    if prev_sample is None:
        if noise is None:
            noise_device = generator.device if generator is not None else x.device
            noise = torch.randn(x.shape, generator=generator, device=noise_device, dtype=dtype)
        if noise.device.type == "cpu" and x.device.type == "cuda":   # no host sync: an async copy from pinned memory
            noise = noise.pin_memory().to(x.device, non_blocking=True)
        noise = noise.to(device=x.device, dtype=dtype)
        x_next = (mean.detach() + std * noise).to(x.dtype)
    else:
        _check_same_shape("prev_sample", prev_sample, x)
        x_next = prev_sample
    target = x_next.detach().to(dtype)
    log_prob = -((target - mean) ** 2) / (2.0 * std**2) - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    dims = tuple(range(1, x.ndim))
    log_prob = log_prob.mean(dim=dims) if reduction == "mean" else log_prob.sum(dim=dims)
    return SDEStep(x_next=x_next, log_prob=log_prob, mean=mean, std=std, noise_scale=g)
