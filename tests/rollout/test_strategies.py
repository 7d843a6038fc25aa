"""Rollout strategies (solrl/rollout/strategies.py): one per rollout.mode, what each explores, keeps, regenerates and
costs, and that they agree with the loop's forward counts and the planner's recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from solrl import config
from solrl.rollout.strategies import (
    BF16,
    KEEP_ALL,
    KEEP_BY_BF16,
    KEEP_BY_PROXY,
    LOW,
    MODES,
    STRATEGIES,
    DiffusionNFT,
    NaiveQuant,
    NaiveScaling,
    SolRL,
    strategy,
)


def test_one_strategy_per_mode_the_config_accepts():
    assert config.MODES is MODES == tuple(STRATEGIES)   # the config's mode names are the strategy table's
    assert {type(s) for s in STRATEGIES.values()} == {SolRL, DiffusionNFT, NaiveScaling, NaiveQuant}
    for name, s in STRATEGIES.items():
        assert strategy(name) is s and s.name == name and s.summary


def test_the_config_reads_the_strategies_without_loading_torch():
    """solrl.rollout's package imports nothing, so the config (and `solrl --help`) reach the strategies without the
    rollout passes' torch."""
    code = ("import sys, solrl.config, solrl.rollout.strategies, solrl.rollout.candidates; "
            "print(sorted(m for m in ('torch', 'solrl.rollout.passes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.strip()
    assert out == "[]"


@pytest.mark.parametrize("bad", ["sol-rl", "", None, "flow_grpo"])
def test_an_unknown_mode_names_the_valid_ones(bad):
    with pytest.raises(ValueError, match="valid modes: sol_rl, diffusion_nft, naive_scaling, naive_quant"):
        strategy(bad)


def test_what_each_mode_explores_keeps_and_regenerates():
    table = {name: (s.explores, s.keeps, s.regenerates, s.trains_on, s.selects, s.samples_bf16, s.runs_on_services)
             for name, s in STRATEGIES.items()}
    assert table == {
        "sol_rl": (True, KEEP_BY_PROXY, True, BF16, True, True, True),
        "diffusion_nft": (False, KEEP_ALL, False, BF16, False, True, False),
        "naive_scaling": (False, KEEP_BY_BF16, False, BF16, True, True, False),
        "naive_quant": (True, KEEP_BY_PROXY, False, LOW, True, False, False),
    }


def test_seeds_steps_and_forwards_are_the_loops():
    """The forward counts tests/engine/test_loop.py's test_modes_run_and_count_forwards measures on its TINY config."""
    r = SimpleNamespace(prompts_per_epoch=2, pool=6, kept=4, explore_steps=2, steps=3)
    P, n, k, es, fs = 2, 6, 4, 2, 3
    expected = {"sol_rl": (P * n * es, P * k * fs), "diffusion_nft": (0, P * k * fs),
                "naive_scaling": (0, P * n * fs), "naive_quant": (P * n * fs, 0)}
    for name, (explore, regenerate) in expected.items():
        s = strategy(name)
        assert s.forwards(r) == {"explore": explore, "regenerate": regenerate, "total": explore + regenerate}, name
        assert s.forwards(r, cfg_mult=2)["total"] == 2 * (explore + regenerate)
    assert strategy("diffusion_nft").pool(r) == k and strategy("sol_rl").pool(r) == n
    # the adaptive proxy sets the explore steps of sol_rl; naive_quant explores at full steps whatever it says
    assert strategy("sol_rl").explore_steps(r, proxy_steps=5) == 5
    assert strategy("naive_quant").explore_steps(r, proxy_steps=5) == fs
    assert strategy("naive_scaling").explore_steps(r, proxy_steps=5) == 0


@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_the_planners_recipe_explores_and_regenerates_what_the_strategy_says(preset):
    """The planner derives the same counts from rollout.mode (solrl/deploy/recipe.py recipe_from_config)."""
    from solrl.deploy.recipe import recipe_from_config
    from solrl.hardware import GPUS

    cfg = config.get_preset(preset)
    if cfg.model.name not in config.MODEL_NAMES:
        pytest.skip(f"{cfg.model.name} is not a model the planner knows")
    recipe, _ = recipe_from_config(cfg, preset, GPUS["b200"])
    r, s = cfg.rollout, strategy(cfg.rollout.mode)
    assert (recipe.explored, recipe.regenerated, recipe.kept) == (s.explored(r), s.bf16_sampled(r), r.kept)
    if s.explores and r.explore_precision.backend != "auto":
        assert recipe.explore_steps == s.explore_steps(r)
