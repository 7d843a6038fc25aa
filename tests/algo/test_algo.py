"""Tests for solrl.algo: selection, advantages, the DiffusionNFT loss, GRPO loss, decays and lerp."""

from __future__ import annotations

import math

import pytest
import torch

from solrl.algo import (
    NFTConfig,
    compute_advantages,
    ema_decay,
    grpo_loss,
    lerp_params_,
    nft_loss,
    old_decay,
    select,
    timestep_indices,
)


def col(*values: float) -> torch.Tensor:
    """A [1, 1, 1, len(values)] float32 tensor."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, 1, -1)


# ---------------------------------------------------------------- NFT loss by hand


def test_nft_loss_by_hand_beta_one():
    # x0 = (1, -1), x_t = (0.5, 0.5), t = 0.5, v = (0.2, -0.4), v_old = 0, v_ref = (0.1, 0.1), A = 2.5
    # r = 2.5 / 5 / 2 + 0.5 = 0.75
    # v+ = v = (0.2, -0.4): x0+ = x_t - 0.5 v+ = (0.4, 0.7), error (-0.6, 1.7),
    #   weight = (0.6 + 1.7) / 2 = 1.15, L+ = ((0.36 + 2.89) / 2) / 1.15
    # v- = 2 v_old - v = (-0.2, 0.4): x0- = (0.6, 0.3), error (-0.4, 1.3),
    #   weight = (0.4 + 1.3) / 2 = 0.85, L- = ((0.16 + 1.69) / 2) / 0.85
    # policy = 5 * (0.75 L+ + 0.25 L-) / 1; kl = ((0.1)^2 + (-0.5)^2) / 2 = 0.13
    l_pos = (0.36 + 2.89) / 2 / 1.15
    l_neg = (0.16 + 1.69) / 2 / 0.85
    policy = 5 * (0.75 * l_pos + 0.25 * l_neg)
    loss, stats = nft_loss(col(1, -1), col(0.5, 0.5), torch.tensor([0.5]), col(0.2, -0.4), col(0, 0),
                           col(0.1, 0.1), torch.tensor([2.5]), NFTConfig(beta=1.0))
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(policy + 1e-4 * 0.13, rel=1e-6)
    assert stats["policy"] == pytest.approx(policy, rel=1e-6)
    assert stats["kl"] == pytest.approx(0.13, rel=1e-6)
    assert stats["r_mean"] == pytest.approx(0.75) and stats["adv_clip_frac"] == 0.0
    assert stats["drift_old"] == pytest.approx((0.2**2 + 0.4**2) / 2, rel=1e-6)  # mean (v - v_old)^2, v_old = 0


def test_nft_loss_by_hand_beta_half():
    # same x0, x_t, t, v, v_ref, A; v_old = (0.1, -0.2), beta = 0.5
    # v+ = 0.5 v + 0.5 v_old = (0.15, -0.3): x0+ = (0.425, 0.65), error (-0.575, 1.65),
    #   weight (0.575 + 1.65) / 2 = 1.1125, L+ = ((0.330625 + 2.7225) / 2) / 1.1125
    # v- = 1.5 v_old - 0.5 v = (0.05, -0.1): x0- = (0.475, 0.55), error (-0.525, 1.55),
    #   weight (0.525 + 1.55) / 2 = 1.0375, L- = ((0.275625 + 2.4025) / 2) / 1.0375
    # policy = 5 * (0.75 L+ + 0.25 L-) / 0.5
    l_pos = (0.330625 + 2.7225) / 2 / 1.1125
    l_neg = (0.275625 + 2.4025) / 2 / 1.0375
    policy = 5 * (0.75 * l_pos + 0.25 * l_neg) / 0.5
    loss, stats = nft_loss(col(1, -1), col(0.5, 0.5), torch.tensor([0.5]), col(0.2, -0.4), col(0.1, -0.2),
                           col(0.1, 0.1), torch.tensor([2.5]), NFTConfig(beta=0.5))
    assert loss.item() == pytest.approx(policy + 1e-4 * 0.13, rel=1e-6)
    assert stats["policy"] == pytest.approx(policy, rel=1e-6)

    # without the KL term (kl_beta 0) no reference velocity is needed: v_ref None gives the policy alone, bit for bit
    # what kl_beta 0 with a reference gives, and names no KL in its stats
    args = (col(1, -1), col(0.5, 0.5), torch.tensor([0.5]), col(0.2, -0.4), col(0.1, -0.2))
    no_ref, no_ref_stats = nft_loss(*args, None, torch.tensor([2.5]), NFTConfig(beta=0.5, kl_beta=0.0))
    with_ref, _ = nft_loss(*args, col(0.1, 0.1), torch.tensor([2.5]), NFTConfig(beta=0.5, kl_beta=0.0))
    assert no_ref.item() == with_ref.item() == pytest.approx(policy, rel=1e-6) and "kl" not in no_ref_stats
    with pytest.raises(ValueError, match="v_ref is None but kl_beta"):
        nft_loss(*args, None, torch.tensor([2.5]), NFTConfig(beta=0.5))


def test_nft_loss_batch_clips_advantages_and_floors_the_weight():
    # sample 0: A = 7 -> clipped to 5 -> r = 1, only the positive branch counts.
    #   x0 = (0, 0), x_t = (1, 1), t = 1, v = (1, 0.5): x0+ = (0, 0.5), error (0, 0.5),
    #   weight 0.25, L+ = (0.25 / 2) / 0.25 = 0.5
    # sample 1: A = -5 -> r = 0, only the negative branch; v_old = v so v- = v = (1, 1): x0- = x0,
    #   error 0, weight floored at 1e-5, L- = 0
    # policy = 5 * mean(0.5, 0) = 1.25; kl (v_ref = v) = 0
    x0 = torch.zeros(2, 1, 1, 2)
    x_t = torch.ones(2, 1, 1, 2)
    v = torch.tensor([[1.0, 0.5], [1.0, 1.0]]).view(2, 1, 1, 2).requires_grad_(True)
    loss, stats = nft_loss(x0, x_t, torch.ones(2), v, v.detach().clone(), v.detach().clone(),
                           torch.tensor([7.0, -5.0]))
    assert loss.item() == pytest.approx(1.25, rel=1e-6)
    assert stats["adv_clip_frac"] == 0.5 and stats["r_mean"] == 0.5 and stats["kl"] == 0.0
    # gradient with the weight held constant: d/dv of 5 * (1/2 batch) * (1/2 elements) * e^2 / 0.25
    # with e = x_t - v - x0 is 5 * 0.5 * 0.5 * 2 * e * (-1) / 0.25 = -10 e = (0, -5) for sample 0;
    # sample 1 has zero error, and the KL term has v = v_ref
    loss.backward()
    assert torch.allclose(v.grad.flatten(), torch.tensor([0.0, -5.0, 0.0, 0.0]))


# ---------------------------------------------------------------- NFT loss behaviour


def _x0_distance_after_step(advantage: float) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 2, 3, 3, generator=gen)
    noise = torch.randn(1, 2, 3, 3, generator=gen)
    t = torch.tensor([0.6])
    x_t = (1 - t) * x0 + t * noise
    v = (noise - x0 + 0.5 * torch.randn(1, 2, 3, 3, generator=gen)).requires_grad_(True)
    v_old, v_ref = v.detach().clone(), v.detach().clone()

    def distance() -> float:
        return (x_t - t * v.detach() - x0).norm().item()

    before = distance()
    loss, _ = nft_loss(x0, x_t, t, v, v_old, v_ref, torch.tensor([advantage]))
    loss.backward()
    with torch.no_grad():
        v -= 0.01 * v.grad
    return before, distance()


@pytest.mark.parametrize("advantage", [5.0, 1.0])
def test_positive_advantage_moves_x0_prediction_toward_x0(advantage):
    before, after = _x0_distance_after_step(advantage)
    assert after < before


@pytest.mark.parametrize("advantage", [-5.0, -1.0])
def test_negative_advantage_moves_x0_prediction_away(advantage):
    before, after = _x0_distance_after_step(advantage)
    assert after > before


@pytest.mark.parametrize("bad", ["v_ref", "x0", "v_old"])
def test_nft_nonfinite_input_gives_zero_loss_and_finite_grads(bad):
    tensors = {name: torch.randn(2, 1, 2, 2, generator=torch.Generator().manual_seed(i))
               for i, name in enumerate(["x0", "x_t", "v_old", "v_ref"])}
    tensors[bad][0, 0, 0, 0] = float("nan") if bad != "x0" else float("inf")
    v = torch.randn(2, 1, 2, 2, requires_grad=True)
    loss, stats = nft_loss(tensors["x0"], tensors["x_t"], torch.tensor([0.3, 0.7]), v, tensors["v_old"],
                           tensors["v_ref"], torch.tensor([1.0, -1.0]))
    assert loss.item() == 0.0 and stats["loss"] == 0.0 and stats["nonfinite"] == 1.0
    assert loss.requires_grad
    loss.backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


def test_nft_no_gradient_into_old_and_reference_velocities():
    gen = torch.Generator().manual_seed(3)
    x0, x_t = torch.randn(2, 1, 2, 2, generator=gen), torch.randn(2, 1, 2, 2, generator=gen)
    v, v_old, v_ref = (torch.randn(2, 1, 2, 2, generator=gen).requires_grad_(True) for _ in range(3))
    loss, stats = nft_loss(x0, x_t, torch.tensor([0.2, 0.9]), v, v_old, v_ref, torch.tensor([0.5, -2.0]))
    assert stats["nonfinite"] == 0.0
    loss.backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert v_old.grad is None and v_ref.grad is None


def test_nft_rejects_bad_input():
    z = torch.zeros(2, 1, 2, 2)
    with pytest.raises(ValueError, match="v_old"):
        nft_loss(z, z, torch.ones(2), z, torch.zeros(2, 1, 2, 3), z, torch.ones(2))
    with pytest.raises(ValueError, match="t_B"):
        nft_loss(z, z, torch.ones(3), z, z, z, torch.ones(2))
    with pytest.raises(ValueError, match="advantages_B"):
        nft_loss(z, z, torch.ones(2), z, z, z, torch.ones(2, 1))
    with pytest.raises(TypeError, match="cfg"):
        nft_loss(z, z, torch.ones(2), z, z, z, torch.ones(2), cfg={"beta": 1.0})
    for kwargs in ({"beta": 0.0}, {"adv_clip_max": -1.0}, {"kl_beta": -1e-4}, {"timestep_fraction": 0.0},
                   {"timestep_fraction": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            NFTConfig(**kwargs)


# ---------------------------------------------------------------- timesteps


def test_timestep_indices_size_and_draw():
    picked = timestep_indices(10, 0.6, torch.Generator().manual_seed(5))
    assert picked == torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()[:6]
    assert len(set(picked)) == 6 and all(0 <= i < 10 for i in picked)
    assert len(timestep_indices(10, 0.4, torch.Generator().manual_seed(0))) == 4
    assert len(timestep_indices(3, 0.1, torch.Generator().manual_seed(0))) == 1  # int(0.3) = 0 -> floor 1
    assert len(timestep_indices(7, 0.5, torch.Generator().manual_seed(0))) == 3  # int(3.5) truncates
    assert sorted(timestep_indices(10, 1.0, None)) == list(range(10))
    with pytest.raises(ValueError, match="fraction"):
        timestep_indices(10, 0.0, None)
    with pytest.raises(ValueError, match="num_steps"):
        timestep_indices(0, 0.5, None)


# ---------------------------------------------------------------- selection


def test_select_best_worst_with_ties():
    scores = [0.5, 0.9, 0.1, 0.9, 0.3, 0.7]
    assert select(scores, 4) == [1, 3, 2, 4]
    assert select(torch.tensor(scores), 4, "best_worst") == [1, 3, 2, 4]
    assert select([1.0, 1.0, 1.0, 1.0], 2) == [0, 1]
    assert sorted(select(scores, 6)) == list(range(6))


def test_select_mean_deviation():
    # mean 4 -> deviations 3, 2, 1, 6
    assert select([1.0, 2.0, 3.0, 10.0], 2, "mean_deviation") == [3, 0]
    assert select([1.0, 3.0, 5.0], 2, "mean_deviation") == [0, 2]  # tie at 2: lower index first


def test_select_random_uses_the_generator():
    picked = select([0.0] * 10, 4, "random", torch.Generator().manual_seed(7))
    assert picked == torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()[:4]
    assert len(set(picked)) == 4


def test_select_extremes_random():
    scores = [0.2, 0.9, 0.1, 0.5, 0.4]  # argmax 1, argmin 2
    picked = select(scores, 3, "extremes_random", torch.Generator().manual_seed(3))
    rest = [0, 3, 4]
    expected_extra = rest[torch.randperm(3, generator=torch.Generator().manual_seed(3)).tolist()[0]]
    assert picked == [1, 2, expected_extra]
    assert select(scores, 2, "extremes_random") == [1, 2]
    assert select(scores, 1, "extremes_random") == [1]
    assert sorted(select(scores, 5, "extremes_random")) == list(range(5))
    flat = select([3.0, 3.0, 3.0], 2, "extremes_random", torch.Generator().manual_seed(0))
    assert flat[0] == 0 and flat[1] in (1, 2)


@pytest.mark.parametrize(
    ("args", "match"),
    [(([1.0, 2.0], 0), "k"), (([1.0, 2.0], 3), "k"), (([1.0, 2.0, 3.0], 1), "even"),
     (([1.0, 2.0], 2, "top"), "mode"), (([1.0, float("nan")], 2), "scores"), (([], 1), "scores"),
     ((torch.zeros(2, 2), 2), "scores"), (([1.0, 2.0], 1.0, "random"), "k")],
)
def test_select_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        select(*args)


# ---------------------------------------------------------------- advantages


def test_advantages_group_mean_global_population_std():
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    groups = ["a", "b", "a", "c", "b", "a"]
    # group means: a = (1 + 3 + 6) / 3, b = (2 + 5) / 2, c = 4
    # population std of 1..6: sqrt(((2.5^2 + 1.5^2 + 0.5^2) * 2) / 6) = sqrt(17.5 / 6)
    std = math.sqrt(17.5 / 6)
    means = [10 / 3, 3.5, 10 / 3, 4.0, 3.5, 10 / 3]
    expected = torch.tensor([(r - m) / (std + 1e-4) for r, m in zip(rewards, means)], dtype=torch.float64)
    adv = compute_advantages(rewards, groups)
    assert adv.dtype == torch.float64
    assert torch.allclose(adv, expected, atol=1e-12)
    unbiased = torch.tensor([(r - m) / (math.sqrt(17.5 / 5) + 1e-4) for r, m in zip(rewards, means)])
    assert not torch.allclose(adv.float(), unbiased)
    as_tensors = compute_advantages(torch.tensor(rewards), torch.tensor([0, 1, 0, 2, 1, 0]))
    assert torch.allclose(as_tensors, expected, atol=1e-6)


def test_advantages_edge_cases_and_errors():
    assert torch.equal(compute_advantages([3.0, 3.0], ["p", "p"]), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="group_ids_N"):
        compute_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="rewards_N"):
        compute_advantages([], [])
    with pytest.raises(ValueError, match="rewards_N"):
        compute_advantages([1.0, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="eps"):
        compute_advantages([1.0, 2.0], ["a", "a"], eps=0.0)


# ---------------------------------------------------------------- decays and lerp


def test_old_and_ema_decay_at_known_steps():
    assert old_decay(0) == 0.0
    assert old_decay(100) == pytest.approx(0.1)
    assert old_decay(500) == 0.5 and old_decay(10_000) == 0.5
    assert ema_decay(0) == pytest.approx(0.1)
    assert ema_decay(1) == pytest.approx(2 / 11)
    assert ema_decay(71) == pytest.approx(72 / 81)
    assert ema_decay(80) == pytest.approx(0.9) and ema_decay(10_000) == 0.9
    assert ema_decay(50, max_decay=0.99) == pytest.approx(51 / 60)
    assert ema_decay(1000, max_decay=0.99) == 0.99  # 1001 / 1010 > 0.99
    with pytest.raises(ValueError, match="step"):
        old_decay(-1)
    with pytest.raises(ValueError, match="max_decay"):
        ema_decay(3, max_decay=1.5)


def test_lerp_params_in_place():
    target = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.tensor([[4.0]])]
    source = [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])]
    first = target[0]
    lerp_params_(target, source, 0.25)  # 0.25 * target + 0.75 * source
    assert target[0] is first and target[0].grad_fn is None
    assert torch.allclose(target[0].detach(), torch.tensor([2.5, 5.0]))
    assert torch.allclose(target[1], torch.tensor([[1.0]]))
    lerp_params_(target, source, 0.0)
    assert torch.equal(target[0].detach(), source[0])
    kept = target[1].clone()
    lerp_params_(target, source, 1.0)
    assert torch.equal(target[1], kept)


def test_lerp_params_rejects_mismatch():
    with pytest.raises(ValueError, match="as many"):
        lerp_params_([torch.zeros(2)], [], 0.5)
    with pytest.raises(ValueError, match="shapes"):
        lerp_params_([torch.zeros(2)], [torch.zeros(3)], 0.5)
    with pytest.raises(ValueError, match="decay"):
        lerp_params_([torch.zeros(2)], [torch.zeros(2)], 1.5)


# ---------------------------------------------------------------- GRPO


def test_grpo_loss_at_ratio_one_is_minus_mean_clipped_advantage():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    loss, stats = grpo_loss(logp, logp.detach().clone(), torch.tensor([1.0, -2.0, 7.0]))
    assert loss.item() == pytest.approx(-(1.0 - 2.0 + 5.0) / 3)
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([-1.0, 2.0, -5.0]) / 3)


def test_grpo_loss_clipping():
    old = torch.zeros(4)
    # ratios 1.5, 0.5, 1.5, 0.5 with advantages 1, 1, -1, -1 and clip 0.1:
    #   A>0, r=1.5: max(-1.5, -1.1) = -1.1 (clipped, no grad)
    #   A>0, r=0.5: max(-0.5, -0.9) = -0.5 (unclipped, grad -A r)
    #   A<0, r=1.5: max(1.5, 1.1) = 1.5 (unclipped, grad -A r)
    #   A<0, r=0.5: max(0.5, 0.9) = 0.9 (clipped, no grad)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = grpo_loss(logp, old, adv, clip_range=0.1)
    assert loss.item() == pytest.approx((-1.1 - 0.5 + 1.5 + 0.9) / 4)
    assert stats["clip_frac"] == 1.0
    assert stats["approx_kl"] == pytest.approx(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([0.0, -0.5, 1.5, 0.0]) / 4)


def test_grpo_loss_treats_old_log_prob_as_constant_and_checks_input():
    logp = torch.zeros(2, requires_grad=True)
    old = torch.full((2,), 0.1, requires_grad=True)
    loss, _ = grpo_loss(logp, old, torch.ones(2))
    loss.backward()
    assert old.grad is None
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, old, torch.ones(3))
    with pytest.raises(ValueError, match="clip_range"):
        grpo_loss(logp, old, torch.ones(2), clip_range=0.0)
