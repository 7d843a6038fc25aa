"""Config: presets, overrides, file round trip, and bad input rejected before any work starts."""

from __future__ import annotations

import pytest

from solrl.cli.app import main
from solrl.config import (
    PRESETS,
    ConfigError,
    RunConfig,
    apply_overrides,
    get_preset,
    resolve,
)


def test_presets_are_valid_and_differ_in_mode():
    real = ["prompts.train=/data/train.txt", "prompts.eval=/data/test.txt"]  # real presets ask for prompt files
    modes = {name: apply_overrides(get_preset(name), [] if name.startswith("shapes-") else real).validate().rollout.mode
             for name in PRESETS}
    shapes = {k: v for k, v in modes.items() if k.startswith("shapes-")}  # the real-model presets: test_real_models
    assert shapes == {"shapes-sol-rl": "sol_rl", "shapes-diffusion-nft": "diffusion_nft",
                      "shapes-naive-scaling": "naive_scaling", "shapes-naive-quant": "naive_quant",
                      "shapes-flow-grpo": "diffusion_nft", "shapes-sol-flow-grpo": "sol_rl"}
    nft = get_preset("shapes-diffusion-nft")
    assert nft.rollout.pool == nft.rollout.kept  # k-in-k


def test_overrides_are_typed():
    cfg = apply_overrides(get_preset("shapes-sol-rl"), [
        "rollout.pool=48", "train.lr=1e-4", "tensorboard=false", "eval.steps=10,40",
        "rollout.explore_precision.backend=mxfp4-emu", "train.betas=[0.8, 0.9]", "model.path=none"])
    assert cfg.rollout.pool == 48 and isinstance(cfg.rollout.pool, int)
    assert cfg.train.lr == 1e-4 and cfg.tensorboard is False
    assert cfg.eval.steps == (10, 40) and cfg.train.betas == (0.8, 0.9)
    assert cfg.rollout.explore_precision.backend == "mxfp4-emu" and cfg.model.path is None


def test_file_round_trip(tmp_path):
    cfg = apply_overrides(get_preset("shapes-naive-quant"), ["rollout.kept=6", "eval.steps=10,40"])
    cfg.save(tmp_path / "c.json")
    back = RunConfig.load(tmp_path / "c.json")
    assert back == cfg
    assert resolve(config_file=str(tmp_path / "c.json")) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["rollout.pooll=3"], "unknown config key 'rollout.pooll'"),
    (["nosuch.key=3"], "unknown config key 'nosuch.key'"),
    (["rollout.pool=-4"], "rollout.pool must be positive"),
    (["rollout.kept=40"], r"rollout.kept \(k=40\) must not exceed rollout.pool \(n=16\)"),
    (["rollout.kept=7"], "must be even for best_worst"),
    (["rollout.pool=abc"], "rollout.pool must be an integer"),
    (["epochs=-1"], "epochs and seed must be >= 0"),
    (["rollout.mode=fast"], "rollout.mode must be one of"),
    (["rollout"], "must look like key=value"),
    (["rollout=3"], "is a section"),
    (["train.timestep_fraction=1.5"], "timestep_fraction must be in"),
])
def test_bad_values_are_rejected_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve("shapes-sol-rl", None, overrides)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'nope'; available"):
        get_preset("nope")


def test_cli_fails_fast_before_any_work(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--preset", "nope", "--out", str(out)]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--set", "rollout.kept=9"]) == 2
    assert "even" in capsys.readouterr().err
    assert main(["train", "--out", str(out), "--set", "rollout.kept=64"]) == 2
    assert "must not exceed" in capsys.readouterr().err
    assert not out.exists()  # nothing was started
