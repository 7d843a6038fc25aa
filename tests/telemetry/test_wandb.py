"""Weights & Biases logging (RunConfig.wandb), in its offline mode: a run's metrics, config and evaluation grids
land in the offline run files, read back here record by record."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from solrl.config import ConfigError, apply_overrides, get_preset

pytest.importorskip("wandb")

TINY = ["epochs=2", "eval.every=1", "tensorboard=false", "rollout.prompts_per_epoch=2", "rollout.pool=6",
        "rollout.kept=4", "eval.prompts=2", "eval.seeds_per_prompt=1", "lora.rank=4", "lora.alpha=8",
        "train.micro_batch=8", "threads=1", "wandb=offline", "wandb_project=solrl-test"]


def wandb_records(path: Path) -> list:
    """The protobuf Records of a .wandb transaction log. Written by hand: wandb 0.31 ships no Python reader.
    The format (wandb's datastore): a 7-byte header (":W&B", magic 0xBEE1, version), then LevelDB-log style
    32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = payload if kind in (1, 2) else parts + payload
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
    return out


def test_an_offline_run_holds_the_metrics_config_and_grids(tmp_path) -> None:
    from solrl.engine.loop import train

    cfg = apply_overrides(get_preset("shapes-sol-rl"), TINY).validate()
    train(cfg, tmp_path / "run", progress=False, log=lambda *_: None)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = wandb_records(next(runs[0].glob("run-*.wandb")))
    kinds = [r.WhichOneof("record_type") for r in records]
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "solrl-test" and run.display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    config.update({i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "config"
                   for i in r.config.update})
    assert config["rollout"]["mode"] == "sol_rl" and config["epochs"] == 2 and config["lora"]["rank"] == 4
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(row["_step"], {}).update(row)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(history) == [0, 1, 2] and "history" in kinds
    for m in metrics:
        h = history[m["epoch"]]
        assert h["eval.mean_reward"] == pytest.approx(m["eval.mean_reward"])
        if m["epoch"]:
            assert h["train.loss"] == pytest.approx(m["train.loss"]) and h["rollout.reward_mean"] == pytest.approx(
                m["rollout.reward_mean"])
        grid = {k.rpartition("/")[2]: v for k, v in h.items() if k.startswith("eval/grid_10steps/")}  # nested keys
        assert grid["_type"] == "image-file" and (runs[0] / "files" / grid["path"]).stat().st_size == grid["size"] > 1000
    assert (tmp_path / "run" / "wandb_id").read_text().strip() == run.run_id


def test_bad_wandb_mode_fails_at_validation() -> None:
    with pytest.raises(ConfigError, match="wandb must be"):
        apply_overrides(get_preset("shapes-sol-rl"), ["wandb=yes"]).validate()
