"""The trainer against the reference (DiffusionNFT `scripts/train_nft_sd3.py`): per-sample timestep
permutations, optimizer steps over whole prompt groups, the old adapter decayed once per epoch, and a
clear error instead of a silent cap on the number of optimizer steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from solrl.algo import compute_advantages
from solrl.config import ConfigError, apply_overrides, get_preset
from solrl.engine.session import Session
from solrl.sampling import flow_sigmas
from tests.engine.test_loop import random_model_dir, tiny_cfg  # noqa: F401  (a module-scoped fixture)


@pytest.fixture(scope="module")
def session(random_model_dir):  # noqa: F811
    return Session.build(tiny_cfg(random_model_dir, extra=["rollout.prompts_per_epoch=4",
                                                           "train.optimizer_steps_per_epoch=2"]))


def test_steps_take_whole_prompt_groups(session):
    trainer = session.trainer
    group = [g for g in range(5) for _ in range(4)]  # 5 prompts x 4 kept, in prompt order
    rng = np.random.default_rng(0)
    shuffled = list(rng.permutation(group))
    for steps in (1, 2, 3, 5, 0):
        trainer.cfg.optimizer_steps_per_epoch = steps
        plan = trainer.plan(shuffled, torch.Generator().manual_seed(steps))
        assert len(plan) == (steps or 5)   # 0: one step per prompt group
        if steps == 0:
            assert all(len({shuffled[i] for i in step.tolist()}) == 1 for step in plan)
        seen = []
        for step in plan:
            idx = step.tolist()
            groups = {shuffled[i] for i in idx}
            assert sorted(idx) == sorted(i for i, g in enumerate(shuffled) if g in groups)  # whole groups only
            # so each step's advantages are centred: they sum to zero over the step
            rewards = np.linspace(0, 1, len(shuffled))
            adv = compute_advantages(rewards, shuffled)
            assert abs(float(adv[idx].sum())) < 1e-9
            seen += idx
        assert sorted(seen) == list(range(len(shuffled)))
    trainer.cfg.optimizer_steps_per_epoch = 6
    with pytest.raises(ValueError, match="optimizer_steps_per_epoch=6 exceeds the 5 prompt groups"):
        trainer.plan(shuffled, torch.Generator().manual_seed(0))
    trainer.cfg.optimizer_steps_per_epoch = 2


def test_forwards_take_rows_of_samples_and_timesteps(session):
    """A step's (sample, timestep) rows are each trained once, in forwards of at most train.micro_batch rows."""
    trainer = session.trainer
    ts = trainer.timestep_plan(20, torch.Generator().manual_seed(1))
    samples = torch.tensor([3, 7, 8, 12, 19])
    for mb in (1, 4, 7, 64):
        trainer.cfg.micro_batch, kept = mb, trainer.cfg.micro_batch
        chunks = trainer.micro_batches(samples, ts)
        trainer.cfg.micro_batch = kept
        sizes = [len(s) for s, _ in chunks]
        assert max(sizes) <= mb and max(sizes) - min(sizes) <= 1     # balanced
        rows = sorted((int(s), int(t)) for si, ti in chunks for s, t in zip(si, ti, strict=True))
        assert rows == sorted((int(s), int(t)) for s in samples for t in ts[s])


def test_config_refuses_more_steps_than_prompts():
    cfg = apply_overrides(get_preset("shapes-sol-rl"), ["train.optimizer_steps_per_epoch=9"])
    with pytest.raises(ConfigError, match="optimizer_steps_per_epoch=9 exceeds rollout.prompts_per_epoch=8"):
        cfg.validate()
    with pytest.raises(ConfigError, match="optimizer_steps_per_epoch must be >= 0"):
        apply_overrides(get_preset("shapes-sol-rl"), ["train.optimizer_steps_per_epoch=-1"]).validate()
    # the shapes presets take one step per prompt group, whatever the number of prompts
    cfg = apply_overrides(get_preset("shapes-sol-rl"), ["rollout.prompts_per_epoch=2"]).validate()
    assert cfg.train.optimizer_steps_per_epoch == 0


def test_each_sample_gets_its_own_timestep_permutation(session):
    trainer = session.trainer
    kept, trainer.grid = trainer.grid, flow_sigmas(10)[:-1].float()  # the reference's 10-step grid
    grid = len(trainer.grid)
    plan = trainer.timestep_plan(64, torch.Generator().manual_seed(3))
    trainer.grid = kept
    k = max(1, int(grid * trainer.cfg.timestep_fraction))
    assert plan.shape == (64, k)
    for row in plan.tolist():
        assert len(set(row)) == k and all(0 <= j < grid for j in row)
    assert len({tuple(r) for r in plan.tolist()}) > 32      # rows differ: not one subset for the batch
    assert len(set(plan[:, 0].tolist())) == grid            # the first slot visits the whole grid


def test_old_adapter_is_decayed_once_per_epoch(session):
    """With two optimizer steps, old <- d * old + (1 - d) * new once, d = min(0.001 * global_step, 0.5)
    at the end of the epoch (the reference), while the EMA follows every step."""
    trainer = session.trainer
    old_before = [p.detach().clone() for p in session.adapters.parameters("old")]
    step_before = trainer.global_step
    rec = session.epoch(0)
    assert rec["train.optimizer_steps"] == 2 and trainer.global_step == step_before + 2
    d = trainer.old_decay(trainer.global_step)
    for o0, o1, new in zip(old_before, session.adapters.parameters("old"), trainer.params):
        torch.testing.assert_close(o1, o0.lerp(new.detach(), 1.0 - d), rtol=0, atol=0)


def test_conv_lr_trains_the_conv_lora_at_its_own_rate(tmp_path):
    """train.conv_lr puts the LoRA on convolution targets (a UNet's conv1 / conv2) in its own optimizer group: after
    an epoch those tensors have moved at most what Adam's steps at conv_lr allow, the attention LoRA much more."""
    from solrl.shapes.model import ShapesModel

    ShapesModel.random(seed=0, denoiser="unet", heads=4).save(tmp_path / "unet")
    targets = "lora.targets=to_q,to_k,to_v,to_out.0,conv1,conv2"
    cfg = tiny_cfg(tmp_path / "unet", extra=[targets, "train.conv_lr=1e-6", "train.optimizer_steps_per_epoch=0"])
    session = Session.build(cfg)
    trainer, adapters = session.trainer, session.adapters
    conv = adapters.conv_parameters("default")
    assert conv and len(conv) < len(trainer.params)
    groups = trainer.opt.param_groups
    assert [g["lr"] for g in groups] == [cfg.train.lr, 1e-6]
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in conv}
    assert {id(p) for g in groups for p in g["params"]} == {id(p) for p in trainer.params}
    before = {id(p): p.detach().clone() for p in trainer.params}
    rec = session.epoch(0)
    steps = rec["train.optimizer_steps"]
    # Adam moves an element by at most lr * (1 - b1) / sqrt(1 - b2) (about 3.2 lr) per step, plus weight decay
    bound = steps * 1e-6 * 4
    conv_ids = {id(p) for p in conv}
    moved = {id(p): float((p.detach() - before[id(p)]).abs().max()) for p in trainer.params}
    assert max(moved[i] for i in conv_ids) <= bound
    assert max(m for i, m in moved.items() if i not in conv_ids) > 20 * bound
    # and the conv factors did move: the group is trained at its rate, not frozen
    assert max(moved[i] for i in conv_ids) > 0


def test_conv_lr_is_checked():
    with pytest.raises(ConfigError, match="train.conv_lr must be a finite float >= 0"):
        apply_overrides(get_preset("shapes-sol-rl"), ["train.conv_lr=-1e-4"]).validate()


def test_conv_lr_without_a_conv_target_is_refused(random_model_dir):  # noqa: F811
    """The default targets of the transformer test model are Linears only: a conv_lr would set nothing."""
    with pytest.raises(ConfigError, match="no LoRA target is a convolution"):
        Session.build(tiny_cfg(random_model_dir, extra=["train.conv_lr=1e-4"]))
