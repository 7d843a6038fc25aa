"""FlowGRPO (train.algo=flow_grpo): seeded, batch-invariant SDE rollouts with per-step log-probs, the trainer's
recomputation of them (ratio 1 on an epoch's first optimizer step), the loss against hand values, exact resume,
the services mode against the embedded loop, and bad configs refused before any work.

The model is the seeded random shapes model of tests/engine/test_loop.py (6 layers); the services test uses the tiny
config and real Redis of tests/services/test_distributed.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from solrl.algo import flow_grpo_loss, mean_kl, threshold_groups
from solrl.config import ConfigError, apply_overrides, get_preset
from solrl.engine import data_parallel as ddp
from solrl.engine.loop import train
from solrl.engine.session import Session
from solrl.engine.update import Batch, FlowGRPOTrainer
from solrl.rollout.passes import SamplerSpec, generate
from solrl.sampling import SeedNoise, flow_sigmas, noise_for_seeds, sample
from solrl.telemetry import read_metrics, strip_timings
from tests.engine.test_loop import random_model_dir, tiny_cfg  # noqa: F401  (a module-scoped fixture)
from tests.services.test_distributed import TINY as DIST_TINY
from tests.services.test_distributed import model_dir, queue, run_on_services  # noqa: F401  (fixtures)

PROMPT = "two blue squares"
# |ratio - 1| on an epoch's first optimizer step: 0 when the log-probs recompute bit for bit; else the trainer's
# forwards (rows of several samples and timesteps) differ in batch shape from the rollout's, and the CPU GEMM's
# summation order moves a velocity by ~6e-7 and a log-prob by ~1e-7: two float32 steps of exp near 1 at most
RATIO_TOL = 2.4e-7


def quiet(*_):
    return None


# ---------------------------------------------------------------- seeded SDE noise


def test_seed_noise_streams_start_with_the_initial_noise_and_ignore_the_batch():
    shape = (2, 4, 4)
    streams = SeedNoise([3, 7, 11], shape)
    init = streams.initial()
    assert torch.equal(init, noise_for_seeds([3, 7, 11], shape))  # the ODE explorer's x_T, bit for bit
    steps = [streams.step() for _ in range(3)]
    alone = SeedNoise([7], shape)
    assert torch.equal(alone.initial()[0], init[1])
    for k in range(3):
        assert torch.equal(alone.step()[0], steps[k][1])  # seed 7's step noise whatever shares its batch
    assert not torch.equal(steps[0], init) and not torch.equal(steps[0], steps[1])  # fresh draws
    with pytest.raises(RuntimeError, match="initial"):
        SeedNoise([1], shape).step()
    with pytest.raises(ValueError, match=r"seeds\[0\]"):
        SeedNoise([-1], shape)


def test_sde_trajectory_of_a_seed_does_not_depend_on_its_batch():
    """With a batch-invariant velocity (elementwise), the SDE trajectory and log-probs of a seed are bit-equal
    alone and in a batch: only the seed decides the noise."""
    def velocity(x, t):
        return torch.tanh(x) * t.view(-1, 1, 1, 1) - 0.3

    def run(seeds):
        streams = SeedNoise(seeds, (2, 3, 3))
        return sample(velocity, streams.initial(), flow_sigmas(4), "sde", True, eta=0.7, step_noise=streams.step)

    batch, alone = run([5, 9, 13]), run([9])
    assert torch.equal(batch.trajectory[1], alone.trajectory[0])
    assert torch.equal(batch.log_probs[1], alone.log_probs[0])
    assert not torch.equal(batch.trajectory[0], batch.trajectory[1])
    with pytest.raises(ValueError, match="step_noise"):
        sample(velocity, torch.zeros(1, 2, 3, 3), flow_sigmas(2), "euler", step_noise=lambda: None)


def test_recorded_log_prob_is_the_gaussian_density_of_the_recorded_step(random_model_dir):  # noqa: F811
    """Each recorded log-prob equals log N(x_{j+1}; mean, std^2) averaged over the latent, computed here by hand
    in float64 from the FlowGRPO step (g = eta sqrt(s / (1 - s)), 1 - s_next at s = 1; mean and std as in
    yifan123/flow_grpo `sd3_sde_with_logprob.py`), and x_{j+1} - mean is std times the seed's own stream noise.
    Tolerance 1e-5: the rollout computes in float32, the hand value in float64."""
    sess = Session.build(tiny_cfg(random_model_dir, "shapes-flow-grpo"))
    sampler, eta, steps = sess.rollout_sampler(), sess.cfg.rollout.sde_eta, sess.cfg.rollout.steps
    assert (sampler.solver, sampler.eta) == ("sde", 0.7)
    seeds = [11, 12]
    cond = sess.cache([PROMPT] * 2)
    with sess.adapters.use("old"):
        gen = generate(sess.model, sess.model.transformer, [PROMPT] * 2, seeds, steps, sampler, 8, sess.cache)
    assert gen.trajectory.shape == (2, steps + 1, *sess.model.spec.latent_shape) and gen.log_probs.shape == (2, steps)
    assert torch.equal(gen.trajectory[:, -1], gen.x0)
    streams = SeedNoise(seeds, sess.model.spec.latent_shape)
    assert torch.equal(gen.trajectory[:, 0], streams.initial())
    sigmas = flow_sigmas(steps).tolist()
    for j in range(steps):
        x, x_next = gen.trajectory[:, j], gen.trajectory[:, j + 1]
        with torch.no_grad(), sess.adapters.use("old"):
            v = sess.model.velocity(sess.model.transformer, x, torch.full((2,), sigmas[j]), cond).double()
        s, s_next = sigmas[j], sigmas[j + 1]
        g = eta * math.sqrt(s / (1 - (s_next if s == 1.0 else s)))
        dt = s_next - s
        mean = x.double() * (1 + g**2 / (2 * s) * dt) + v * (1 + g**2 * (1 - s) / (2 * s)) * dt
        std = g * math.sqrt(-dt)
        density = -((x_next.double() - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
        assert torch.allclose(gen.log_probs[:, j].double(), density.mean(dim=(1, 2, 3)), atol=1e-5, rtol=0)
        assert torch.allclose(x_next.double(), mean + std * streams.step().double(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_trainer_recomputes_the_recorded_log_probs(random_model_dir, guidance):  # noqa: F811
    """The trainer's transition (its own forward batches, mixing samples and timesteps) gives the recorded
    log-probs back with the adapter the rollouts were sampled with, with classifier-free guidance too. The
    tolerance, 1e-6, is the CPU GEMM's: a row's velocity depends on the forward's batch shape by ~6e-7 here."""
    cfg = tiny_cfg(random_model_dir, "shapes-flow-grpo", extra=[f"sampler.guidance={guidance}", "train.micro_batch=5"])
    sess = Session.build(cfg)
    trainer = sess.trainer
    assert isinstance(trainer, FlowGRPOTrainer) and trainer.guidance == guidance
    seeds, steps = [21, 22, 23], cfg.rollout.steps
    with sess.adapters.use("old"):
        gen = generate(sess.model, sess.model.transformer, [PROMPT] * 3, seeds, steps, sess.rollout_sampler(), 8,
                       sess.cache)
    batch = Batch(gen.x0, sess.cache([PROMPT] * 3), np.zeros(3, np.float32), [0, 0, 0], gen.trajectory, gen.log_probs)
    ts = torch.arange(steps).repeat(3, 1)
    worst = 0.0
    for idx, tj in trainer.micro_batches(torch.arange(3), ts):  # 9 rows in forwards of 5 and 4
        with torch.no_grad():
            lp = trainer.transition(batch, idx, tj, "default").log_prob
        diff = (lp - gen.log_probs[idx, tj]).abs().max().item()
        worst = max(worst, diff)
        # the float32 ratio: 1 to a float32 step or two (exactly 1 on some CPUs; their GEMMs differ by batch shape)
        assert (torch.exp(lp - gen.log_probs[idx, tj]) - 1).abs().max().item() <= RATIO_TOL
    assert worst <= 1e-6, worst
    with torch.no_grad():  # and a different policy gives different log-probs: the check can fail
        for p in sess.adapters.trainable_parameters():
            p.add_(0.05)
        lp = trainer.transition(batch, torch.arange(3), torch.zeros(3, dtype=torch.long), "default").log_prob
    assert (lp - gen.log_probs[:, 0]).abs().max().item() > 1e-4


# ---------------------------------------------------------------- the loss


def test_flow_grpo_loss_against_hand_values():
    old = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([1.00005, 0.9], dtype=torch.float64))).requires_grad_()
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mean = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    mean_ref = mean.detach() - torch.tensor([[0.1, 0.1], [0.2, 0.0]], dtype=torch.float64)
    g = torch.tensor([[0.5], [1.0]], dtype=torch.float64)
    loss, stats = flow_grpo_loss(logp, old, adv, mean, mean_ref, g, clip_range=1e-4, adv_clip_max=5.0, kl_beta=0.04)
    # row 0: A = 2, ratio 1.00005 inside the clip: -2 * 1.00005 = -2.0001
    # row 1: A = -1, ratio 0.9: max(0.9, 0.9999) = 0.9999 (the clipped branch)
    # KL: row 0 mean(0.01, 0.01) / (2 * 0.25) = 0.02, row 1 mean(0.04, 0) / (2 * 1) = 0.01 -> 0.015
    assert stats["policy"] == pytest.approx((-2.0001 + 0.9999) / 2, abs=1e-12)
    assert stats["kl"] == pytest.approx(0.015, abs=1e-12)
    assert loss.item() == pytest.approx(-0.5001 + 0.04 * 0.015, abs=1e-12)
    assert stats["clip_frac"] == 0.5 and stats["ratio_max_dev"] == pytest.approx(0.1)
    loss.backward()
    # d/dlogp: row 0 -A * ratio / 2; row 1 clipped: no gradient
    assert logp.grad.tolist() == pytest.approx([-1.00005, 0.0], abs=1e-12)
    # d/dmean: kl_beta * (mean - mean_ref) / g^2 / (2 elements) / (2 rows)
    assert mean.grad.flatten().tolist() == pytest.approx([0.004, 0.004, 0.002, 0.0], abs=1e-12)
    assert mean_kl(mean, mean_ref, g).tolist() == pytest.approx([0.02, 0.01])
    with pytest.raises(ValueError, match="mean_ref is required"):
        flow_grpo_loss(logp, old, adv, mean, None, g, kl_beta=0.1)


def test_reward_threshold_zeroes_low_groups():
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out, zeroed = threshold_groups(adv, [0.1, 0.3, 0.7, 0.9], [0, 0, 1, 1], 0.5)
    assert zeroed == 1 and out.tolist() == [0.0, 0.0, 0.5, -0.5]
    assert threshold_groups(adv, [0.1, 0.3, 0.7, 0.9], [0, 0, 1, 1], None)[0] is adv


# ---------------------------------------------------------------- the loop


@pytest.mark.parametrize("mode", ["sol_rl", "naive_scaling"])
def test_an_epoch_sees_ratio_one_first_then_moves(random_model_dir, mode):  # noqa: F811
    sess = Session.build(tiny_cfg(random_model_dir, "shapes-sol-flow-grpo", extra=[f"rollout.mode={mode}"]))
    rec = sess.epoch(0)
    assert rec["forwards_regenerate"] == 2 * (6 if mode == "naive_scaling" else 4) * 3  # prompts x seeds x steps
    assert rec["train.optimizer_steps"] == 2            # one per prompt group (the shapes presets)
    assert rec["train.ratio_max_dev_first_step"] <= RATIO_TOL  # the recorded log-probs are the policy's own
    assert rec["train.ratio_max_dev"] > 1e-5                   # the second step's policy has moved
    assert 0 < rec["train.clip_frac"] < 1 and rec["train.kl"] > 0
    old, new = sess.adapters.parameters("old"), sess.adapters.trainable_parameters()
    assert all(torch.equal(o, n) for o, n in zip(old, new, strict=True))  # the next epoch samples with the policy


def test_resume_is_bit_identical(random_model_dir, tmp_path):  # noqa: F811
    def cfg(epochs):  # 2 prompts x 2 seeds, a 2-step evaluation of one prompt: the run is about the training
        return tiny_cfg(random_model_dir, "shapes-flow-grpo", epochs=epochs,
                        extra=["rollout.pool=2", "rollout.kept=2", "eval.prompts=1", "eval.steps=2"])

    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg(2), full, progress=False, log=quiet)
    train(cfg(1), part, progress=False, log=quiet)
    train(cfg(2), part, resume=True, progress=False, log=quiet)
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        assert (full / "checkpoints/epoch_0002" / name).read_bytes() == (part / "checkpoints/epoch_0002" / name).read_bytes()
    assert (full / "adapter_ema.safetensors").read_bytes() == (part / "adapter_ema.safetensors").read_bytes()

    def train_only(path):
        return [{k: v for k, v in strip_timings(r).items() if not k.startswith("eval.")}
                for r in read_metrics(path / "metrics.jsonl")]

    assert train_only(full) == train_only(part) and len(train_only(full)) == 3
    assert train_only(full)[2]["train.loss"] != train_only(full)[1]["train.loss"]


def test_services_mode_matches_the_embedded_loop(model_dir, queue, tmp_path):  # noqa: F811
    """Two-stage FlowGRPO over real Redis: the explorer ranks with the ODE, the regenerator samples the kept seeds
    with the SDE and sends trajectories and log-probs in each Rollout; the trainer's run equals the embedded one."""
    cfg = apply_overrides(get_preset("shapes-sol-flow-grpo"),
                          DIST_TINY + [f"model.path={model_dir}", "epochs=2"]).validate()
    run_on_services(cfg, queue, tmp_path / "dist", "g1")
    emb = Session.build(cfg)
    emb_recs = [emb.epoch(e) for e in range(cfg.epochs)]
    dist_recs = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["epoch"] > 0]
    for d, e in zip(dist_recs, emb_recs, strict=True):
        assert d["rollout.reward_mean"] == e["rollout.reward_mean"] and d["proxy_gap"] == e["proxy_gap"]
        assert d["train.ratio_max_dev_first_step"] == e["train.ratio_max_dev_first_step"] <= RATIO_TOL
        for key in ("train.loss", "train.kl", "train.approx_kl", "train.clip_frac", "train.grad_norm"):
            assert d[key] == e[key], key  # fp32 on both sides: the regenerator's LoRA arithmetic is the trainer's

    from solrl.engine.checkpoint import latest_checkpoint, load_adapters

    dist = Session.build(cfg)
    load_adapters(latest_checkpoint(tmp_path / "dist"), dist.adapters)
    base = Session.build(cfg).adapters.state_dict("default")
    for name in ("default", "old", "ema"):
        a, b = dist.adapters.state_dict(name), emb.adapters.state_dict(name)
        moved = max((b[k] - base[k]).abs().max().item() for k in b)
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert moved > 0 and worst == 0.0, (name, worst, moved)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("preset, overrides, message", [
    ("shapes-sol-rl", ["train.algo=ppo"], r"train.algo must be one of \('nft', 'flow_grpo'\)"),
    ("shapes-sol-rl", ["train.algo=flow_grpo"], r"deterministic ODE sampler \(rollout.sde_eta=0\)"),
    ("shapes-flow-grpo", ["rollout.sde_eta=0"], r"deterministic ODE sampler \(rollout.sde_eta=0\)"),
    ("shapes-flow-grpo", ["rollout.sde_eta=-0.5"], "rollout.sde_eta must be a finite float >= 0"),
    ("shapes-sol-rl", ["rollout.sde_eta=0.7"], "rollout.sde_eta=0.7 applies to train.algo=flow_grpo only"),
    ("shapes-flow-grpo", ["train.clip_range=0"], "train.clip_range must be a finite float > 0"),
    ("shapes-flow-grpo", ["rollout.mode=naive_quant"], r"rollout.mode=naive_quant"),
    ("shapes-flow-grpo", ["train.kl_beta=-1"], "train.kl_beta must be a finite float >= 0"),
    ("shapes-sol-rl", ["train.reward_threshold=0.5"], "train.reward_threshold applies to train.algo=flow_grpo"),
])
def test_bad_configs_are_refused_naming_the_key(preset, overrides, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_preset(preset), overrides).validate()


def test_cli_refuses_flow_grpo_on_the_ode_sampler_before_any_work(tmp_path, capsys):
    from solrl.cli.app import main

    out = tmp_path / "run"
    code = main(["train", "--preset", "shapes-sol-rl", "--set", "train.algo=flow_grpo", "--out", str(out)])
    assert code != 0 and "rollout.sde_eta" in capsys.readouterr().err
    assert not out.exists()


def test_bad_rollouts_and_data_parallel_are_refused(random_model_dir):  # noqa: F811
    sess = Session.build(tiny_cfg(random_model_dir, "shapes-flow-grpo"))
    ode = Batch(torch.zeros(2, 3, 32, 32), sess.cache([PROMPT] * 2), np.zeros(2, np.float32), [0, 0])
    with pytest.raises(ValueError, match="no trajectory / log_probs"):
        sess.trainer.update(ode, torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="data-parallel"):
        sess.trainer.data_parallel(ddp.Ranks(rank=0, world=2))
    with pytest.raises(ValueError, match="eta > 0"):
        SamplerSpec("sde", 1.0, 1.0, 0.0)
