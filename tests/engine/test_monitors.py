"""Reward-hacking monitors (solrl/engine/monitors.py): the measures on image batches, the alarms and their config,
a run that records them and stops on one, and the trainer's Prometheus series."""

from __future__ import annotations

import json

import numpy as np
import pytest

from solrl.config import ConfigError, MonitorConfig, apply_overrides, get_preset
from solrl.engine.loop import train
from solrl.engine.monitors import DUPLICATE_RMS, alarms, reference_drift, seed_spread
from solrl.engine.session import rollout_monitors
from solrl.telemetry import read_metrics
from tests.engine.test_loop import random_model_dir, tiny_cfg  # noqa: F401  (a fixture)


def _images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8)


def test_seed_spread_finds_duplicates_and_measures_diversity():
    distinct = _images(6, 0)   # 3 prompts x 2 seeds, all different
    got = seed_spread(distinct, 2)
    assert got["duplicate_share"] == 0.0 and 0.3 < got["diversity"] < 0.5   # uniform noise: RMS about 104 of 255
    collapsed = distinct.copy()
    collapsed[1] = np.clip(collapsed[0].astype(int) + 3, 0, 255)   # prompt 0 drew one picture for both seeds
    got = seed_spread(collapsed, 2)
    assert got["duplicate_share"] == pytest.approx(2 / 6) and got["diversity"] < seed_spread(distinct, 2)["diversity"]
    same = np.repeat(distinct[:1], 4, axis=0)
    assert seed_spread(same, 4) == {"diversity": 0.0, "duplicate_share": 1.0}
    moved = same.copy()
    moved[1] = np.clip(moved[1].astype(int) + int(DUPLICATE_RMS) + 1, 0, 255)   # farther than a duplicate
    assert seed_spread(moved[:2], 2)["duplicate_share"] == 0.0
    assert seed_spread(distinct, 1) == {"diversity": None, "duplicate_share": None}
    with pytest.raises(ValueError, match="whole groups of 4"):
        seed_spread(distinct, 4)


def test_rollout_monitors_count_blank_canvases_among_the_better_half():
    images = _images(8, 1)
    images[[0, 7]] = 200   # blank canvases: prompt 0's best and prompt 1's worst
    rewards = np.array([[0.9, 0.1, 0.5, 0.4], [0.8, 0.7, 0.6, 0.0]])
    assert rollout_monitors(images, rewards) == {"rollout.flat_share": 0.25, "rollout.best_flat_share": 0.25}
    rewards[1] = [0.8, 0.6, 0.5, 0.9]   # prompt 1's blank now ranks first: both blanks among the better halves
    assert rollout_monitors(images, rewards) == {"rollout.flat_share": 0.25, "rollout.best_flat_share": 0.5}


def test_alarms_name_the_monitor_its_value_and_its_threshold():
    cfg = MonitorConfig(flat_share_max=0.05, diversity_min=0.1, reference_drop_max=0.02, duplicate_share_max=0.5)
    quiet = {"eval.flat_share": 0.05, "eval.diversity": 0.2, "eval.ref_drift.shapes": -0.01, "eval.duplicate_share": 0.5}
    assert alarms(cfg, quiet) == [] and alarms(MonitorConfig(), {"eval.flat_share": 1.0}) == []   # 0: off
    loud = {"eval.flat_share": 0.125, "eval.diversity": 0.05, "eval.ref_drift.shapes": -0.03,
            "rollout.flat_share": 0.2, "eval.duplicate_share": 0.75}
    lines = alarms(cfg, loud)
    assert len(lines) == 5
    assert lines[0] == "eval.flat_share 0.125 > 0.05 (monitor.flat_share_max: blank canvases)"
    assert any(x.startswith("eval.ref_drift.shapes -0.030 < -0.02") for x in lines)
    assert any(x.startswith("eval.diversity 0.050 < 0.1") for x in lines)
    assert reference_drift({"eval.ref.shapes": 0.70, "eval.mean_reward": 0.9}, {"eval.ref.shapes": 0.75}) == {
        "eval.ref_drift.shapes": pytest.approx(-0.05)}
    assert reference_drift({"eval.ref.shapes": 0.7}, None) == {}


@pytest.mark.parametrize("override, message", [
    ("monitor.flat_share_max=-0.1", "monitor.flat_share_max must be a finite number >= 0"),
    ("monitor.duplicate_share_max=2", "monitor.duplicate_share_max is a share in [0, 1]"),
    ('monitor.reference_rewards=["nope"]', "monitor.reference_rewards: unknown reward 'nope'"),
    ("monitor.reference_drop_max=0.05", "name them in monitor.reference_rewards"),
])
def test_monitor_config_is_checked(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        apply_overrides(get_preset("shapes-sol-rl"), [override]).validate()


def test_a_run_records_the_monitors_and_stops_at_an_alarm(random_model_dir, tmp_path):  # noqa: F811
    # diversity_min 0.99 (RMS distance of 252 of 255 between seeds) cannot hold: the first evaluation raises it
    cfg = tiny_cfg(random_model_dir, epochs=3, extra=[
        "eval.every=1", "eval.seeds_per_prompt=2", 'monitor.reference_rewards=["shapes"]',
        "monitor.reference_drop_max=0.5", "monitor.diversity_min=0.99", "monitor.stop=true"])
    lines: list[str] = []
    summary = train(cfg, tmp_path, progress=False, log=lines.append)
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in recs] == [0, 1]   # stopped after epoch 1 of 3
    base, first = recs
    for key in ("eval.diversity", "eval.duplicate_share", "eval.ref.shapes"):
        assert isinstance(base[key], float) and isinstance(first[key], float), key
    assert first["eval.ref_drift.shapes"] == pytest.approx(first["eval.ref.shapes"] - base["eval.ref.shapes"])
    assert 0 <= first["rollout.flat_share"] <= 1 and 0 <= first["rollout.best_flat_share"] <= 1
    assert first["monitor.alarms"] == 1
    assert any(x.startswith("monitor alarm, epoch 1: eval.diversity ") for x in lines)
    assert summary["stopped_by_monitor"].startswith("epoch 1: eval.diversity") and summary["monitor_alarms"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_by_monitor"] == summary["stopped_by_monitor"]
    assert (tmp_path / "checkpoints").exists() and any((tmp_path / "checkpoints").iterdir())   # resumable from it


def test_the_trainer_exports_the_monitors():
    from services.common.metrics import ServiceMetrics, TrainingMetrics

    metrics = ServiceMetrics("trainer")
    t = TrainingMetrics(metrics, "r1", 3)
    t.observe_epoch({"epoch": 2, "eval.flat_share": 0.125, "eval.diversity": 0.2, "rollout.flat_share": 0.25,
                     "eval.ref.shapes": 0.71, "eval.ref_drift.shapes": -0.04, "monitor.alarms": 2})
    text = metrics.render().decode()
    assert 'solrl_monitor{monitor="eval_flat_share",run="r1"} 0.125' in text
    assert 'solrl_monitor{monitor="rollout_flat_share",run="r1"} 0.25' in text
    assert 'solrl_monitor_reference_reward{kind="drift",reward="shapes",run="r1"} -0.04' in text
    assert 'solrl_monitor_alarms_total{run="r1"} 2.0' in text
