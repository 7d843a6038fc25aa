"""End to end: `solrl up` with 2 explorers, 1 regenerator, 1 reward and 1 trainer (real processes, real
Redis, gRPC adapter pushes) gives the embedded loop's results for the same config and seed, with the
NVFP4-emulated explorer.

The emulated NVFP4 explorer takes one amax per activation tensor, as Transformer Engine's recipe does,
so a seed's proxy score depends on what shares its forward batch. Rollouts therefore sample one
prompt's seeds per forward batch (`solrl.rollout.passes.generate_by_prompt`): the embedded loop (all prompts
in one call) and the explorer service (one ExploreJob per prompt, on whichever explorer takes it) run
identical batches. The first test checks that in process; the second runs the whole stack.

What the services did is read from the pipeline itself: before `solrl up` starts, the test adds its own
consumer group ("observer") to the `regenerate` and `rollouts` streams, so it receives every
SeedSelection (the whole pool's proxy scores, the kept indices) and every Rollout (the regenerated
reward) that the regenerator and the trainer consumed. The embedded side is recorded by wrapping the
loop's own `explore` / `regenerate` calls (the real functions run; their results are kept).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import solrl.engine.session
from services.explorer.dataplane import ExplorerDataPlane
from solrl.config import apply_overrides, get_preset
from solrl.engine.session import Session
from solrl.models import load_model
from solrl.precision import PrecisionConfig, build_backend
from solrl.rewards import build_reward
from solrl.rollout.passes import explore, generate
from solrl.shapes.model import ShapesModel

ROOT = Path(__file__).resolve().parents[2]
REDIS_URL = "redis://127.0.0.1:6379/0"
OBSERVER = "observer"

# jpeg_compressibility: unlike the exact shapes reward it varies between any two images, so equal
# scores mean equal images and a best_worst selection has no ties to hide a difference behind.
SMALL = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=4", "rollout.pool=8", "rollout.kept=4",
         "rollout.explore_steps=2", "rollout.steps=3", "rollout.micro_batch=128", "train.micro_batch=8",
         "lora.rank=4", "lora.alpha=8", "epochs=2", "eval.every=0", "eval.prompts=2", "eval.seeds_per_prompt=1",
         "eval.steps=2", "tensorboard=false", "rollout.explore_precision.backend=nvfp4-emu"]


def test_explore_scores_do_not_depend_on_how_prompts_are_spread_over_calls():
    """nvfp4-emu: the embedded loop's explore over 3 prompts at once equals the explorer service's data plane
    called once per prompt (one job each), exactly; mixing prompts in one forward batch would not."""
    torch.set_num_threads(1)
    cfg = apply_overrides(get_preset("shapes-sol-rl"), [*SMALL, "rollout.prompts_per_epoch=3"]).validate()
    sess = Session.build(cfg)
    sess.sync()
    prompts = sess.prompts[:3]
    pools = [list(range(100 * i, 100 * i + 8)) for i in range(3)]
    r = cfg.rollout
    emb = explore(sess.model, sess.explorer.module, prompts, pools, r.explore_steps, sess.sampler, sess.scorer,
                  r.kept, r.selection, None, r.micro_batch, sess.cache)

    model = load_model("shapes")
    build_backend(cfg.rollout.precision).prepare(model.transformer)   # what `solrl serve explorer` does
    plane = ExplorerDataPlane(model, PrecisionConfig("nvfp4-emu"), sess.adapters.spec, build_reward(cfg.reward),
                              steps=r.explore_steps, kept=r.kept, micro_batch=r.micro_batch)
    try:
        for p in (2, 0, 1):  # any order, one prompt per call
            out = plane.explore([prompts[p]], [pools[p]])
            assert np.array_equal(out.scores[0], emb.scores[p]), p
            assert out.kept[0] == emb.kept[p]
    finally:
        plane.close()

    # The emulation itself stays tensor-wide (the real recipe's numerics): the same seeds sampled in one
    # mixed batch of all three prompts give other images.
    flat_p = [p for p, pool in zip(prompts, pools) for _ in pool]
    mixed = generate(sess.model, sess.explorer.module, flat_p, [s for pool in pools for s in pool], r.explore_steps,
                     sess.sampler, r.micro_batch, sess.cache)
    assert not torch.equal(mixed.x0, emb.generated.x0)


def _observe(queue, stream: str) -> list:
    """Every message the observer group has not read yet (it never acks until the end)."""
    out = []
    while batch := queue.consume(stream, OBSERVER, "test", count=256, block_ms=1):
        out += batch
    return out


def _job_position(job_id: str) -> tuple[int, int]:
    """(epoch index, prompt index) from a job id `<run>-e<epoch>-p<prompt>` (solrl.engine.queue_loop.job_id_for)."""
    m = re.search(r"-e(\d+)-p(\d+)$", job_id)
    assert m, job_id
    return int(m.group(1)), int(m.group(2))


@pytest.mark.slow
def test_solrl_up_with_two_explorers_matches_the_embedded_run(tmp_path, monkeypatch):
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    from solrl.pb.solrl.common.v1 import common_pb2
    from solrl.queue import QueueConfig, RedisStreamQueue

    # the preset's bf16 trainer / regenerator: the regenerator service serves the pushed LoRA unmerged
    # beside its bf16 base, exactly as the embedded loop's trainer model computes it.
    # A PixArt denoiser: its forward is batch-invariant on CPU, so a job per prompt (services) and all prompts
    # in one batch (embedded) agree bit for bit. The bundled UNet's convolutions are not (about 4e-6 between
    # micro-batches of 16 and 4), so on it the two runs agree to float tolerance only (docs/notes/shapes.md).
    model_dir = tmp_path / "pixart"
    ShapesModel.random(seed=0, denoiser="pixart", layers=6, heads=4).save(model_dir)
    sets = [*SMALL, f"model.path={model_dir}"]
    assert apply_overrides(get_preset("shapes-sol-rl"), sets).rollout.precision.backend == "bf16"
    cfg = apply_overrides(get_preset("shapes-sol-rl"), sets).validate()
    ns = f"solrl-test-e2e-{uuid.uuid4().hex[:10]}"
    queue = RedisStreamQueue(REDIS_URL, QueueConfig(namespace=ns))
    cmd = [sys.executable, "-m", "solrl.deploy.up", "--redis-url", REDIS_URL, "--namespace", ns,
           "--out", str(tmp_path / "run"), "--threads", "1", "--explorers", "2", "--grace-s", "10",
           *[a for s in sets for a in ("--set", s)]]
    try:
        for stream in ("regenerate", "rollouts"):
            queue.ensure_group(stream, OBSERVER)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
        selections = [common_pb2.SeedSelection.FromString(d.payload) for d in _observe(queue, "regenerate")]
        rollouts = [(d.key, common_pb2.Rollout.FromString(d.payload)) for d in _observe(queue, "rollouts")]
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{ns}:*"))
        if keys:
            client.delete(*keys)
        queue.close()
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for name in ("explorer-1", "explorer-2"):
        assert re.search(rf"^\s*up \| {name} ready$", log, re.MULTILINE), name
        assert re.search(rf"^\s*{name} \| .*adapter version 1 \(sha256", log, re.MULTILINE), name  # both got the push
    done = re.findall(r"^\s*(explorer-\d) \| .*explorers: job \S+ done", log, re.MULTILINE)
    P, K = cfg.rollout.prompts_per_epoch, cfg.rollout.kept
    assert len(done) == P * cfg.epochs and set(done) == {"explorer-1", "explorer-2"}, done  # the jobs were shared

    # the embedded run, its explore / regenerate results recorded per epoch
    calls: dict[str, list] = {"explore": [], "regenerate": []}
    for name in calls:
        real = getattr(solrl.engine.session, name)
        monkeypatch.setattr(solrl.engine.session, name, lambda *a, _real=real, _name=name, **kw:
                            calls[_name].append(_real(*a, **kw)) or calls[_name][-1])
    emb = Session.build(cfg)
    emb_recs, emb_adapters = [], []
    for e in range(cfg.epochs):
        emb_recs.append(emb.epoch(e))
        emb_adapters.append({f"{n}/{k}": v for n in ("default", "old") for k, v in emb.adapters.state_dict(n).items()})
    assert len(calls["explore"]) == len(calls["regenerate"]) == cfg.epochs

    # Each epoch's update, services (the trainer's checkpoint) against embedded. Bit for bit on the Intel Xeon
    # this test was written on; on an AMD EPYC the first update already differs in the last float32 bits (the
    # same rollouts bit for bit, checked below), and NVFP4's rounding of the merged weights then turns that into
    # other proxy scores. An epoch explored with an update that is not bit-identical is compared to float
    # tolerance through its adapter only; every epoch up to the first such update is compared bit for bit.
    exact = 1  # epochs whose rollouts were sampled with bit-identical adapters (epoch 0: no update yet)
    for e in range(cfg.epochs - 1):
        ckpt = load_file(tmp_path / "run" / "checkpoints" / f"epoch_{e + 1:04d}" / "adapters.safetensors")
        mine = {k: v for k, v in ckpt.items() if k.split("/")[0] in ("default", "old")}
        assert sorted(mine) == sorted(emb_adapters[e])
        # relative to each tensor's norm: Adam's first step moves every weight by about lr whatever its gradient's
        # size, so a gradient near zero that differs in its last bits moves its weight visibly (1.2e-4 of the
        # tensor's largest weight on the EPYC), while the tensor as a whole agrees far closer
        worst = max(float((mine[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in emb_adapters[e].items())
        assert worst <= 1e-4, (e, worst)  # the same update to float tolerance on any CPU
        if worst > 0:
            break
        exact += 1

    sel = {_job_position(s.job_id): s for s in selections}
    assert sorted(sel) == [(e, p) for e in range(cfg.epochs) for p in range(P)]
    rolls: dict[tuple[int, int, int], common_pb2.Rollout] = {}
    for key, ro in rollouts:  # key: "<job id>:<position among the kept>" (solrl.engine.queue_loop.rollout_key)
        job_id, _, position = key.rpartition(":")
        assert job_id == ro.job_id
        rolls[(*_job_position(job_id), int(position))] = ro
    assert len(rolls) == len(rollouts) == cfg.epochs * P * K

    scorer = build_reward(cfg.reward)
    for e, (ex, rg) in enumerate(zip(calls["explore"], calls["regenerate"], strict=True)):
        if e >= exact:
            break
        for p in range(P):
            s = sel[(e, p)]
            assert s.adapter_version.version == e  # explored with the adapter the trainer pushed for epoch e
            assert [int(x) for x in s.seeds] == ex.seeds[p]
            # the whole pool's proxy scores, exactly, and so the same kept seeds in the same order
            assert np.array_equal(np.asarray(s.proxy_scores, dtype=np.float32), ex.scores[p]), (e, p)
            assert list(s.kept_indices) == ex.kept[p], (e, p)
            for j, i in enumerate(ex.kept[p]):
                ro, row = rolls[(e, p, j)], p * K + j
                assert ro.seed == ex.seeds[p][i] and ro.adapter_version.version == e
                assert ro.proxy_reward == ex.scores[p][i]
                x0 = torch.from_numpy(np.frombuffer(ro.x0.data, dtype="<f4").reshape(tuple(ro.x0.shape)).copy())
                image = emb.model.decode(x0[None])
                assert ro.reward == scorer(image, [s.prompt])[0]  # the service's reward is its image's
                assert torch.equal(x0, rg.x0[row]), (e, p, j, float((x0 - rg.x0[row]).abs().max()))
                assert ro.reward == rg.rewards[row], (e, p, j)

    dist = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dist = [r for r in dist if r["epoch"] > 0]
    assert len(dist) == len(emb_recs) == cfg.epochs
    first_d, first_e = dist[0], emb_recs[0]  # epoch 1: the same rollouts bit for bit, so the same update
    for key in ("rollout.reward_mean", "rollout.reward_std", "proxy_gap", "proxy_kendall_tau"):
        assert first_d[key] == pytest.approx(first_e[key], abs=1e-7), key
    assert first_d["train.loss"] == pytest.approx(first_e["train.loss"], rel=1e-6)
    for d, e in zip(dist[1:exact], emb_recs[1:exact], strict=True):
        assert d["rollout.reward_mean"] == pytest.approx(e["rollout.reward_mean"], abs=1e-7)
        assert d["train.loss"] == pytest.approx(e["train.loss"], rel=1e-5)
