"""End to end: `solrl up` with 2 explorers, 1 regenerator, 1 reward and 1 trainer (real processes, real
Redis, gRPC adapter pushes) gives the embedded loop's results for the same config and seed.

fp32 precision everywhere, so no result depends on which explorer took a job or what shared its batch
(the emulated NVFP4 explorer takes one amax per activation tensor, as the real recipe does, so its
proxy scores depend on the batch). The kept rollouts' rewards, the proxy-vs-final gap (a function of
which seeds were kept and their proxy scores) and the loss must match per epoch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from solrl.config import apply_overrides, get_preset
from solrl.loop import Session
from solrl.models.shapes import ShapesModel

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_solrl_up_with_two_explorers_matches_the_embedded_run(tmp_path):
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0").ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    model_dir = tmp_path / "model"
    ShapesModel.random(seed=0).save(model_dir)
    sets = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=6", "rollout.pool=6", "rollout.kept=2",
            "rollout.explore_steps=2", "rollout.steps=3", "train.micro_batch=4", "eval.every=0", "tensorboard=false",
            "lora.rank=4", "lora.alpha=8", "epochs=2", "rollout.precision.backend=fp32",
            "rollout.explore_precision.backend=fp32", f"model.path={model_dir}"]
    ns = f"solrl-test-e2e-{uuid.uuid4().hex[:10]}"
    cmd = [sys.executable, "-m", "solrl.up", "--redis-url", "redis://127.0.0.1:6379/0", "--namespace", ns,
           "--out", str(tmp_path / "run"), "--threads", "1", "--explorers", "2", "--grace-s", "10",
           *[a for s in sets for a in ("--set", s)]]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    finally:
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        keys = list(client.scan_iter(f"{ns}:*"))
        if keys:
            client.delete(*keys)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for name in ("explorer-1", "explorer-2"):
        assert re.search(rf"^\s*up \| {name} ready$", log, re.M), name
        assert re.search(rf"^\s*{name} \| .*adapter version 1 \(sha256", log, re.M), name  # both got the push
    done = re.findall(r"^\s*(explorer-\d) \| .*explorers: job \S+ done", log, re.M)
    assert len(done) == 12 and set(done) == {"explorer-1", "explorer-2"}, done  # 6 prompts x 2 epochs, shared

    cfg = apply_overrides(get_preset("shapes-sol-rl"), sets).validate()
    emb = Session.build(cfg)
    emb_recs = [emb.epoch(e) for e in range(cfg.epochs)]
    dist = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dist = [r for r in dist if r["epoch"] > 0]
    assert len(dist) == len(emb_recs) == 2
    for d, e in zip(dist, emb_recs, strict=True):
        assert d["rollout.reward_mean"] == pytest.approx(e["rollout.reward_mean"], abs=1e-4)
        assert d["rollout.reward_std"] == pytest.approx(e["rollout.reward_std"], abs=1e-4)
        assert d["proxy_gap"] == pytest.approx(e["proxy_gap"], abs=1e-4)
        assert d["train.loss"] == pytest.approx(e["train.loss"], rel=1e-5)
