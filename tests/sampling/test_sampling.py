"""Tests for solrl.sampling: seed noise, sigmas, Euler / DPM-Solver-2 / SDE steps, the loop, CFG."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from solrl.sampling import (
    DPMHistory,
    cfg_velocity,
    dpm2_step,
    euler_step,
    flow_sigmas,
    noise_for_seeds,
    sample,
    sde_step_with_logprob,
)

# A problem with a known solution: data x0 ~ N(m, a^2) per coordinate. For rectified flow the exact
# velocity E[noise - x0 | x_t] is linear in x, and the probability-flow ODE maps noise z at t = 1
# to m + a * z at t = 0 (x_t = (1 - t) m + sqrt((1 - t)^2 a^2 + t^2) z along the path).
GAUSS_M = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
GAUSS_A = torch.tensor([0.5, 0.8, 1.5], dtype=torch.float64)


def gaussian_velocity(x: torch.Tensor, t_B: torch.Tensor, m=GAUSS_M, a=GAUSS_A) -> torch.Tensor:
    t = t_B.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
    var = (1 - t) ** 2 * a**2 + t**2
    return (t - (1 - t) * a**2) / var * (x - (1 - t) * m) - m


def nonlinear_velocity(x: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    t = t_B.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
    return torch.tanh(x) * (1 + t) - 0.3 * x + 0.1


class Counting:
    """Wraps a velocity function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, x, t_B):
        self.calls += 1
        return self.fn(x, t_B)


# ---------------------------------------------------------------- noise


def test_noise_is_the_seeded_cpu_generator_draw():
    noise = noise_for_seeds([7, 123], (2, 3, 4))
    assert noise.shape == (2, 2, 3, 4) and noise.dtype == torch.float32
    for row, seed in zip(noise, [7, 123]):
        expected = torch.randn((2, 3, 4), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(row, expected)


def test_noise_is_batch_independent():
    seeds = [0, 1, 2**63 - 1, 42, 17, 99999, 5, 6, 7, 8, 123456789, 10, 11, 12, 13, 2**40]
    batch = noise_for_seeds(seeds, (4, 8, 8))
    assert batch.shape == (16, 4, 8, 8)
    for i, seed in enumerate(seeds):
        assert torch.equal(noise_for_seeds([seed], (4, 8, 8))[0], batch[i])
    assert not torch.equal(batch[0], batch[1])
    # order in the batch does not matter either
    assert torch.equal(noise_for_seeds(seeds[::-1], (4, 8, 8)).flip(0), batch)


def test_noise_dtype_and_device_arguments():
    base = noise_for_seeds([3, 4], (1, 2, 2))
    as64 = noise_for_seeds([3, 4], (1, 2, 2), dtype=torch.float64, device=torch.device("cpu"))
    assert as64.dtype == torch.float64 and torch.equal(as64, base.double())
    meta = noise_for_seeds([3, 4], (1, 2, 2), device="meta")
    assert meta.device.type == "meta" and meta.shape == (2, 1, 2, 2)
    assert noise_for_seeds([], (1, 2, 2)).shape == (0, 1, 2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_on_cuda_is_bit_identical_to_cpu():
    cpu = noise_for_seeds([11, 12], (4, 8, 8))
    gpu = noise_for_seeds([11, 12], (4, 8, 8), device="cuda")
    assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("seeds", [[-1], [2**63], [1.5], [True], ["3"], "12"])
def test_noise_rejects_bad_seeds(seeds):
    with pytest.raises(ValueError, match="seeds"):
        noise_for_seeds(seeds, (1, 2, 2))


def test_noise_rejects_bad_shape_and_dtype():
    with pytest.raises(ValueError, match="shape_CHW"):
        noise_for_seeds([1], (1, 0, 2))
    with pytest.raises(ValueError, match="shape_CHW"):
        noise_for_seeds([1], ())
    with pytest.raises(ValueError, match="dtype"):
        noise_for_seeds([1], (1, 2, 2), dtype=torch.int64)


# ---------------------------------------------------------------- sigmas


def test_flow_sigmas_plain_and_shifted_by_hand():
    plain = flow_sigmas(4)
    assert plain.dtype == torch.float64
    assert plain.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    # shift 3: s' = 3s / (1 + 2s): 0.75 -> 2.25/2.5, 0.5 -> 1.5/2, 0.25 -> 0.75/1.5
    shifted = flow_sigmas(4, shift=3.0)
    assert torch.allclose(shifted, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0], dtype=torch.float64))


def test_flow_sigmas_match_diffusers_shift():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(sigmas=torch.linspace(1, 0, 11)[:-1].tolist())
    assert torch.allclose(scheduler.sigmas.double(), flow_sigmas(10, shift=3.0), atol=1e-7)


@pytest.mark.parametrize("kwargs", [{"num_steps": 0}, {"num_steps": 2.5}, {"num_steps": True},
                                    {"num_steps": 4, "shift": 0.0}, {"num_steps": 4, "shift": float("nan")}])
def test_flow_sigmas_rejects_bad_input(kwargs):
    with pytest.raises(ValueError, match="num_steps|shift"):
        flow_sigmas(**kwargs)


# ---------------------------------------------------------------- Euler


def test_euler_sampling_matches_diffusers_scheduler():
    num_steps, shift = 8, 3.0
    x_T = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1, 0, num_steps + 1)[:-1].tolist())
    x = x_T.clone()
    for i, timestep in enumerate(scheduler.timesteps):
        v = nonlinear_velocity(x, scheduler.sigmas[i].expand(2))
        x = scheduler.step(v, timestep, x).prev_sample
    ours = sample(nonlinear_velocity, x_T, flow_sigmas(num_steps, shift=shift), solver="euler")
    assert ours.x0.dtype == torch.float32
    assert torch.allclose(ours.x0, x, atol=1e-6, rtol=1e-6)


def test_euler_step_accepts_per_sample_sigmas():
    x = torch.ones(2, 1, 1, 2)
    v = torch.tensor([1.0, 2.0]).view(2, 1, 1, 1).expand(2, 1, 1, 2)
    out = euler_step(v, x, torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.25]))
    assert torch.allclose(out[:, 0, 0, 0], torch.tensor([1 - 0.25 * 1.0, 1 - 0.25 * 2.0]))


# ---------------------------------------------------------------- DPM-Solver-2


def test_dpm2_step_matches_reference_lambda_form():
    """The simplified update equals the textbook DPM-Solver++(2M) form written with alpha, lambda, e^-h."""
    gen = torch.Generator().manual_seed(1)
    x, v, x0_prev = (torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    s_prev, s, s_next = 0.8, 0.6, 0.35
    out, history = dpm2_step(v, x, s, s_next, DPMHistory(x0=x0_prev, sigma=s_prev))

    def lam(q: float) -> float:
        return math.log((1 - q) / q)

    h, h_prev = lam(s_next) - lam(s), lam(s) - lam(s_prev)
    d0 = x - s * v
    d1 = (h / h_prev) * (d0 - x0_prev)
    alpha_next = 1 - s_next
    expected = (s_next / s) * x - alpha_next * (math.exp(-h) - 1) * d0 - 0.5 * alpha_next * (math.exp(-h) - 1) * d1
    assert torch.allclose(out, expected, atol=1e-12)
    assert history.sigma == s and torch.allclose(history.x0, d0)


def test_dpm2_is_euler_without_history_at_the_end_and_after_sigma_one():
    gen = torch.Generator().manual_seed(2)
    x, v, x0_prev = (torch.randn(1, 2, 3, 3, generator=gen) for _ in range(3))
    assert torch.allclose(dpm2_step(v, x, 0.9, 0.7)[0], euler_step(v, x, 0.9, 0.7))
    assert torch.allclose(dpm2_step(v, x, 0.2, 0.0, DPMHistory(x0_prev, 0.4))[0], euler_step(v, x, 0.2, 0.0))
    # previous sigma 1 has log-SNR -inf: the reference's r is inf and its correction vanishes
    assert torch.allclose(dpm2_step(v, x, 0.9, 0.8, DPMHistory(x0_prev, 1.0))[0], euler_step(v, x, 0.9, 0.8), atol=1e-6)


def _max_error(solver: str, num_steps: int, z: torch.Tensor) -> float:
    result = sample(gaussian_velocity, z, flow_sigmas(num_steps), solver=solver)
    return (result.x0 - (GAUSS_M + GAUSS_A * z)).abs().max().item()


def test_gaussian_problem_has_the_stated_solution():
    z = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert _max_error("euler", 4000, z) < 1e-3


def test_dpm2_is_higher_order_than_euler_on_known_solution():
    z = torch.randn(6, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    steps = (8, 16, 32, 64)
    euler = [_max_error("euler", n, z) for n in steps]
    dpm2 = [_max_error("dpm2", n, z) for n in steps]
    for e, d in zip(euler, dpm2):
        assert d < e / 4
    for coarse, fine in itertools.pairwise(euler):  # first order: halving the step halves the error
        assert 1.8 < coarse / fine < 2.2
    # observed order ~1.7 on this linear-in-sigma grid (the first and last steps are first order and
    # the log-SNR steps at both ends of the grid do not shrink with N); clearly above Euler's 1
    for coarse, fine in itertools.pairwise(dpm2):
        assert coarse / fine > 3.0


# ---------------------------------------------------------------- the loop, NFE, CFG


@pytest.mark.parametrize("solver", ["euler", "dpm2", "sde"])
def test_sample_counts_forwards_and_records_trajectory(solver):
    fn = Counting(nonlinear_velocity)
    x_T = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(5))
    result = sample(fn, x_T, flow_sigmas(6), solver=solver, return_trajectory=True,
                    generator=torch.Generator().manual_seed(0) if solver == "sde" else None)
    assert result.nfe == fn.calls == 6
    assert result.trajectory.shape == (3, 7, 2, 4, 4)
    assert torch.equal(result.trajectory[:, 0], x_T) and torch.equal(result.trajectory[:, -1], result.x0)
    assert (result.log_probs is not None) == (solver == "sde")
    assert sample(fn, x_T, flow_sigmas(6), solver="euler").trajectory is None


def test_sample_passes_state_and_float32_sigma_batch():
    seen = []

    def fn(x, t_B):
        seen.append((x.dtype, t_B.dtype, t_B.shape, float(t_B[0])))
        return torch.zeros_like(x)

    sample(fn, torch.zeros(2, 1, 2, 2, dtype=torch.float64), [1.0, 0.5, 0.0])
    assert seen == [(torch.float64, torch.float32, (2,), 1.0), (torch.float64, torch.float32, (2,), 0.5)]


def test_cfg_scale_one_makes_no_unconditional_calls():
    cond, uncond = Counting(nonlinear_velocity), Counting(lambda x, t: torch.zeros_like(x))
    x_T = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(6))
    guided = sample(cfg_velocity(cond, uncond, 1.0), x_T, flow_sigmas(5))
    assert uncond.calls == 0 and cond.calls == 5 and guided.nfe == 5
    assert torch.equal(guided.x0, sample(nonlinear_velocity, x_T, flow_sigmas(5)).x0)


def test_cfg_combines_both_branches():
    cond = Counting(lambda x, t: torch.full_like(x, 2.0))
    uncond = Counting(lambda x, t: torch.full_like(x, 0.5))
    v = cfg_velocity(cond, uncond, 4.0)(torch.zeros(1, 1, 2, 2), torch.ones(1))
    assert torch.allclose(v, torch.full((1, 1, 2, 2), 0.5 + 4.0 * (2.0 - 0.5)))
    assert cond.calls == uncond.calls == 1
    with pytest.raises(ValueError, match="scale"):
        cfg_velocity(cond, uncond, float("inf"))


def test_sample_rejects_bad_input():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="solver"):
        sample(nonlinear_velocity, x, flow_sigmas(2), solver="heun")
    with pytest.raises(ValueError, match="decreasing"):
        sample(nonlinear_velocity, x, [1.0, 0.5, 0.5, 0.0])
    with pytest.raises(ValueError, match="sigmas"):
        sample(nonlinear_velocity, x, [1.5, 0.0])
    with pytest.raises(ValueError, match="velocity_fn"):
        sample(lambda x, t: x[:, :, :1], x, flow_sigmas(2))
    with pytest.raises(ValueError, match="x_T"):
        sample(nonlinear_velocity, torch.zeros(3), flow_sigmas(2))


# ---------------------------------------------------------------- SDE step and log-prob


def test_sde_log_prob_is_the_gaussian_density():
    gen = torch.Generator().manual_seed(7)
    x, v = torch.randn(2, 3, 4, 4, generator=gen), torch.randn(2, 3, 4, 4, generator=gen)
    s, s_next, eta = 0.6, 0.4, 0.7
    step = sde_step_with_logprob(v, x, s, s_next, eta, generator=torch.Generator().manual_seed(8))
    g = eta * math.sqrt(s / (1 - s))
    dt = s_next - s
    mean = x * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
    std = g * math.sqrt(-dt)
    density = torch.distributions.Normal(mean, std).log_prob(step.x_next)
    assert torch.allclose(step.mean, mean, atol=1e-6)
    assert torch.allclose(step.std, torch.tensor(std), atol=1e-7)
    assert torch.allclose(step.log_prob, density.mean(dim=(1, 2, 3)), atol=1e-5)
    summed = sde_step_with_logprob(v, x, s, s_next, eta, prev_sample=step.x_next, reduction="sum")
    assert torch.allclose(summed.log_prob, density.sum(dim=(1, 2, 3)), rtol=1e-5)
    again = sde_step_with_logprob(v, x, s, s_next, eta, prev_sample=step.x_next)
    assert torch.allclose(again.log_prob, step.log_prob) and again.x_next is step.x_next


def test_sde_step_per_sample_sigmas_and_sigma_one_guard():
    x, v = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    step = sde_step_with_logprob(v, x, torch.tensor([1.0, 0.5]), torch.tensor([0.9, 0.25]), 0.5,
                                 generator=torch.Generator().manual_seed(0))
    # at s = 1 the reference divides by 1 - sigmas[1] (= 1 - s_next) instead of 0
    g = torch.tensor([0.5 * math.sqrt(1.0 / (1 - 0.9)), 0.5 * math.sqrt(0.5 / 0.5)])
    assert torch.allclose(step.std.flatten(), g * torch.sqrt(torch.tensor([0.1, 0.25])))
    assert torch.isfinite(step.log_prob).all()


def test_sde_step_is_reproducible_and_differentiable_in_v():
    x = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(9))
    v = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(10), requires_grad=True)
    a = sde_step_with_logprob(v, x, 0.5, 0.3, 0.7, generator=torch.Generator().manual_seed(1))
    b = sde_step_with_logprob(v, x, 0.5, 0.3, 0.7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.x_next, b.x_next) and not a.x_next.requires_grad
    a.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_sde_trajectory_log_probs_recompute_exactly():
    x_T = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(11))
    sigmas = flow_sigmas(5)
    result = sample(nonlinear_velocity, x_T, sigmas, solver="sde", return_trajectory=True,
                    generator=torch.Generator().manual_seed(12), eta=0.8)
    assert result.log_probs.shape == (2, 5)
    for i in range(5):
        x = result.trajectory[:, i]
        v = nonlinear_velocity(x, torch.full((2,), float(sigmas[i])))
        step = sde_step_with_logprob(v, x, float(sigmas[i]), float(sigmas[i + 1]), 0.8,
                                     prev_sample=result.trajectory[:, i + 1])
        assert torch.equal(step.log_prob, result.log_probs[:, i])


def test_sde_sampling_reaches_the_data_distribution():
    """With the exact velocity of N(m, a^2) data the SDE keeps the marginals, so samples end near N(m, a^2)."""
    m, a = torch.tensor([0.5]), torch.tensor([0.3])
    z = torch.randn(20000, 1, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    result = sample(lambda x, t: gaussian_velocity(x, t, m.double(), a.double()), z, flow_sigmas(100),
                    solver="sde", eta=0.7, generator=torch.Generator().manual_seed(14))
    assert abs(result.x0.mean().item() - 0.5) < 0.01
    assert abs(result.x0.std().item() - 0.3) < 0.015


def test_sde_step_rejects_bad_input():
    x, v = torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="not both"):
        sde_step_with_logprob(v, x, 0.5, 0.3, 0.7, generator=torch.Generator(), prev_sample=x)
    with pytest.raises(ValueError, match="eta"):
        sde_step_with_logprob(v, x, 0.5, 0.3, 0.0)
    with pytest.raises(ValueError, match="s_next"):
        sde_step_with_logprob(v, x, 0.5, 0.5, 0.7)
    with pytest.raises(ValueError, match="reduction"):
        sde_step_with_logprob(v, x, 0.5, 0.3, 0.7, reduction="max")
    with pytest.raises(ValueError, match="v must have the shape"):
        sde_step_with_logprob(v[:, :, :1], x, 0.5, 0.3, 0.7)
    with pytest.raises(ValueError, match="s_next"):
        dpm2_step(v, x, 0.5, 0.6)
