"""The distributed loop over a real Redis: explorer / regenerator stream workers + the trainer's driver.

Needs a Redis server at 127.0.0.1:6379 (each test uses its own namespace, deleted afterwards).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.metrics import ServiceMetrics, TrainingMetrics
from services.explorer.consumer import explorer_worker
from services.explorer.dataplane import ExplorerDataPlane
from services.regenerator.consumer import regenerate_handler, regenerator_worker
from services.regenerator.dataplane import RegeneratorDataPlane
from solrl.adapters import LoraSpec
from solrl.config import apply_overrides, get_preset
from solrl.engine.queue_loop import (
    GROUP_EXPLORERS,
    GROUP_REGENERATORS,
    GROUP_TRAINER,
    STREAM_EXPLORE,
    STREAM_REGENERATE,
    STREAM_ROLLOUTS,
    collect_rollouts,
    ensure_pipeline,
    run_distributed,
)
from solrl.engine.session import Session
from solrl.models import load_model
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.precision import PrecisionConfig, build_backend
from solrl.queue import QueueConfig, build_queue
from solrl.rewards import build_reward
from solrl.shapes.model import ShapesModel
from solrl.telemetry import read_metrics

REDIS = "redis://127.0.0.1:6379/0"
TINY = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2",
        "rollout.explore_steps=2", "rollout.steps=3", "train.micro_batch=4", "eval.prompts=2",
        "eval.seeds_per_prompt=1", "eval.every=0", "eval.steps=2", "tensorboard=false", "lora.rank=4",
        "lora.alpha=8", "rollout.precision.backend=fp32", "rollout.explore_precision.backend=fp32"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rand_shapes")
    ShapesModel.random(seed=0, layers=6, heads=4).save(d)
    return d


@pytest.fixture
def queue():
    pytest.importorskip("redis")
    import redis

    ns = f"solrl-test-{uuid.uuid4().hex[:12]}"
    try:
        redis.Redis.from_url(REDIS).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    q = build_queue(REDIS, QueueConfig(namespace=ns, claim_idle_ms=300))
    yield q
    q.close()
    client = redis.Redis.from_url(REDIS)
    keys = list(client.scan_iter(f"{ns}:*"))
    if keys:
        client.delete(*keys)


def tiny_cfg(model_dir: Path, epochs: int):
    extra = [f"model.path={model_dir}", f"epochs={epochs}"]
    return apply_overrides(get_preset("shapes-sol-rl"), TINY + extra).validate()


def planes(cfg) -> tuple[ExplorerDataPlane, RegeneratorDataPlane]:
    """Explorer and regenerator planes as the services build them (own model copies, base in fp32)."""
    out = []
    r = cfg.rollout
    for cls, precision in ((ExplorerDataPlane, r.explore_precision), (RegeneratorDataPlane, r.precision)):
        model = load_model(cfg.model.name, cfg.model.path)
        build_backend(cfg.rollout.precision).prepare(model.transformer)
        lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=model.spec.lora_targets)
        out.append(cls(model, PrecisionConfig(precision.backend), lora, build_reward(cfg.reward),
                       micro_batch=cfg.rollout.micro_batch, version_wait_s=10.0))
    return out[0], out[1]


def test_distributed_run_matches_the_embedded_loop(model_dir, queue, tmp_path):
    cfg = tiny_cfg(model_dir, epochs=2)
    explorer, regenerator = planes(cfg)
    pushed: list[int] = []

    def push(data: bytes, version: int, sha256: str) -> None:  # what the trainer service does over gRPC
        for plane in (explorer, regenerator):
            plane.hot.load(data, version=version, sha256=sha256)
        pushed.append(version)

    workers = [explorer_worker(queue, explorer, block_ms=100), regenerator_worker(queue, regenerator, block_ms=100)]
    for w in workers:
        w.start()
    try:
        t0 = time.monotonic()
        sessions = []
        metrics = ServiceMetrics("trainer")  # what the trainer service exports on /metrics
        training = TrainingMetrics(metrics, "t1", cfg.epochs)
        training.watch_queue([STREAM_EXPLORE, STREAM_ROLLOUTS], queue.length)
        summary = run_distributed(cfg, tmp_path / "dist", queue, push, run_id="t1", rollout_timeout_s=120,
                                  log=lambda s: None, on_session=sessions.append, on_record=training.observe_epoch)
        elapsed = time.monotonic() - t0
    finally:
        for w in workers:
            w.stop()
    assert elapsed < 120
    assert summary["adapter_version"] == 2 and pushed == [1]  # version 0 is the base: nothing to push
    assert [w.processed for w in workers] == [4, 4]  # 2 prompts x 2 epochs, each stage once per job
    assert queue.pending(STREAM_ROLLOUTS, GROUP_TRAINER) == 0 and queue.length(STREAM_ROLLOUTS) == 0
    status = trainer_status(sessions[0])
    assert (status.run_id, status.state, status.epoch, status.adapter_version.version) == ("t1", "finished", 2, 2)
    assert status.rollouts_consumed == 8 and status.optimizer_step == sessions[0].sess.trainer.global_step > 0

    # the Prometheus series are the run's own numbers
    recs = read_metrics(tmp_path / "dist" / "metrics.jsonl")
    series = scrape(metrics)
    assert series[("solrl_train_epoch", (("run", "t1"),))] == 2 == series[("solrl_train_epochs", (("run", "t1"),))]
    assert series[("solrl_train_adapter_version", (("run", "t1"),))] == 2
    assert series[("solrl_train_reward", (("kind", "rollout"), ("run", "t1")))] == pytest.approx(recs[-1]["rollout.reward_mean"])
    assert series[("solrl_train_reward", (("kind", "heldout"), ("run", "t1")))] == pytest.approx(recs[-1]["eval.mean_reward"])
    assert series[("solrl_train_loss", (("run", "t1"),))] == pytest.approx(recs[-1]["train.loss"])
    # the evaluations' summary (attribute accuracies, exact match, the reward per caption form) as the embedded
    # loop records it, equal to the run's eval.json
    for rec, epoch in ((recs[0], 0), (recs[-1], 2)):
        ev = json.loads((tmp_path / "dist" / "eval" / f"epoch_{epoch:04d}" / "eval.json").read_text())
        assert rec["eval.exact_match"] == ev["exact_match"] and rec["eval.shape_accuracy"] == ev["shape_accuracy"]
        forms = ev["results"][str(ev["steps"][0])]["by_form"]
        assert forms and {k: rec[f"eval.form_{k}"] for k in forms} == forms
    assert series[("solrl_train_stage_seconds_count", (("run", "t1"), ("stage", "train")))] == 2
    assert series[("solrl_train_stage_seconds_count", (("run", "t1"), ("stage", "eval")))] == 2  # base + final
    assert series[("solrl_queue_depth", (("stream", STREAM_ROLLOUTS),))] == queue.length(STREAM_ROLLOUTS)
    assert any(name == "process_resident_memory_bytes" for name, _ in series)

    # the embedded loop, same config and seed
    emb = Session.build(cfg)
    emb_recs = [emb.epoch(e) for e in range(cfg.epochs)]
    dist_recs = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["epoch"] > 0]
    for d, e in zip(dist_recs, emb_recs, strict=True):
        # same kept seeds regenerated -> the same BF16 (here fp32) rewards, up to merge rounding
        assert d["rollout.reward_mean"] == pytest.approx(e["rollout.reward_mean"], abs=1e-4)
        assert d["train.loss"] == pytest.approx(e["train.loss"], rel=1e-6)
        assert d["proxy_gap"] == pytest.approx(e["proxy_gap"], abs=1e-6)

    from solrl.engine.checkpoint import latest_checkpoint, load_adapters

    dist = Session.build(cfg)
    load_adapters(latest_checkpoint(tmp_path / "dist"), dist.adapters)
    for name in ("default", "old", "ema"):
        a, b = dist.adapters.state_dict(name), emb.adapters.state_dict(name)
        assert a.keys() == b.keys()
        moved = max((b[k] - Session.build(cfg).adapters.state_dict(name)[k]).abs().max().item() for k in list(b)[:4])
        assert moved > 0  # training changed the adapter, so the comparison means something
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 1e-3 * moved, (name, worst, moved)  # merged vs unmerged LoRA rounding only


def run_on_services(cfg, queue, out: Path, run_id: str, rollout_planes=None) -> dict:
    """`cfg` trained by the driver over `queue` with an explorer and a regenerator stream worker in this process
    (`rollout_planes`: their planes, else `planes(cfg)`)."""
    explorer, regenerator = rollout_planes or planes(cfg)

    def push(data: bytes, version: int, sha256: str) -> None:
        for plane in (explorer, regenerator):
            plane.hot.load(data, version=version, sha256=sha256)

    workers = [explorer_worker(queue, explorer, block_ms=100), regenerator_worker(queue, regenerator, block_ms=100)]
    for w in workers:
        w.start()
    try:
        return run_distributed(cfg, out, queue, push, run_id=run_id, rollout_timeout_s=120, log=lambda s: None)
    finally:
        for w in workers:
            w.stop()


def test_a_guarded_run_on_the_services_matches_the_embedded_one(queue, tmp_path):
    """The guards against reward hacking on the services: the driver names the run's validity gate in every
    ExploreJob, the explorers rank with it and the regenerators pass on which gate ranked each seed (the driver
    checks it), and the trainer decodes the trained latents for the constrained reward, the gate's demotion and the
    rollout monitors, as the embedded loop does. On the bundled base (it draws shapes, so the shapes reward splits
    its samples at the floor), the two runs record the same guards, rewards and loss."""
    guarded = ["epochs=1", "guard.gate=flat", "guard.reference=shapes", "guard.reference_floor=0.5"]
    cfg = apply_overrides(get_preset("shapes-sol-rl"), TINY + guarded).validate()
    run_on_services(cfg, queue, tmp_path / "dist", "g1")
    dist = read_metrics(tmp_path / "dist" / "metrics.jsonl")[1]
    emb = Session.build(cfg).epoch(0)
    keys = ("guard.failed_share", "guard.gate_trained_share", "guard.reference_mean", "guard.reference_below_share",
            "guard.demoted_share", "rollout.flat_share", "rollout.best_flat_share", "rollout.reward_mean")
    for key in keys:
        assert dist[key] == pytest.approx(emb[key], abs=1e-5), key
    assert 0 < dist["guard.demoted_share"] < 1   # the floor split the trained samples: the guard acted
    assert dist["train.loss"] == pytest.approx(emb["train.loss"], rel=1e-5)


def test_the_trainer_refuses_rollouts_ranked_without_the_runs_gate(model_dir, queue):
    """A rollout whose explorer ignored ExploreJob.gate (an older one) says it was ranked without the gate: the
    driver stops the run with an error naming both, before training on it."""
    from solrl.engine.queue_loop import RemoteSession

    cfg = apply_overrides(get_preset("shapes-sol-rl"), TINY + [f"model.path={model_dir}", "guard.gate=flat"]).validate()
    remote = RemoteSession(Session.build(cfg, local_explorer=False), queue, lambda *a: None, run_id="g2")
    rolls = [common_pb2.Rollout(job_id="j", seed=s) for s in (1, 2)]
    with pytest.raises(RuntimeError, match=r"validity gate \[''\], the run's guard.gate is 'flat' .*ExploreJob.gate"):
        remote.screen(rolls, [(0, 0), (0, 1)], torch.zeros(2, 3, 32, 32), np.zeros(2, np.float32),
                      ["a red circle"] * 2, {})


def scrape(metrics) -> dict:
    """(sample name, sorted labels) -> value, parsed from the Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}


def test_the_grafana_dashboard_reads_series_the_services_export():
    """Every metric a panel of k8s/components/grafana queries is one the trainer or a rollout service exports."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    dash = json.loads((Path(__file__).parents[2] / "k8s/components/grafana/solrl-training.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    wanted = {m for e in exprs for m in re.findall(r"\b((?:solrl|process|python)_[a-z_]+)", e)}
    metrics = ServiceMetrics("trainer")
    TrainingMetrics(metrics, "r", 1)
    exported = set()
    for fam in text_string_to_metric_families(metrics.render().decode()):
        exported.add(fam.name)
        exported.update({fam.name + s for s in ("_total", "_bucket", "_sum", "_count", "_created")})
    assert wanted and wanted <= exported, wanted - exported
    assert dash["templating"]["list"][1]["query"] == "label_values(solrl_train_epochs, run)"


def trainer_status(remote):
    """The trainer service's Status RPC over a real gRPC server, for a finished RemoteSession."""
    import grpc

    from services.common.grpc_server import GrpcService, build_grpc_server, service_name
    from services.trainer.server import TrainerServicer
    from solrl.pb.solrl.trainer.v1 import trainer_pb2, trainer_pb2_grpc

    servicer = TrainerServicer("t1")
    servicer.remote = remote
    server = build_grpc_server([GrpcService(service_name(trainer_pb2, "Trainer"),
                                            trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)])
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            return trainer_pb2_grpc.TrainerStub(channel).Status(trainer_pb2.StatusRequest(), timeout=10)
    finally:
        server.stop(0)


def test_adapter_pusher_needs_a_token():
    from services.trainer.server import AdapterPusher, parse_addrs

    with pytest.raises(ValueError, match="SOLRL_ADAPTER_TOKEN"):
        AdapterPusher(["127.0.0.1:1"], [], token=None)
    with pytest.raises(ValueError, match="--explorer-addrs"):
        parse_addrs("127.0.0.1:1,nohost", "--explorer-addrs")
    assert parse_addrs(" a:1, ,b:2 ", "x") == ["a:1", "b:2"]


def test_redelivered_job_is_not_double_counted(model_dir, queue):
    cfg = tiny_cfg(model_dir, epochs=1)
    _, regenerator = planes(cfg)
    ensure_pipeline(queue)
    sel = common_pb2.SeedSelection(job_id="job-a", prompt="a red circle", seeds=[11, 22, 33, 44],
                                   proxy_scores=[0.1, 0.4, 0.2, 0.3], kept_indices=[1, 0],
                                   sampler=common_pb2.SamplerSpec(steps=3))
    queue.publish(STREAM_REGENERATE, sel.SerializeToString(), key="job-a")

    # a worker that publishes its results and dies before acking
    (dead,) = queue.consume(STREAM_REGENERATE, GROUP_REGENERATORS, "dead", count=1)
    first = regenerate_handler(regenerator)(dead.payload)
    for key, payload in first:
        queue.publish(STREAM_ROLLOUTS, payload, key=key)

    live = regenerator_worker(queue, regenerator, consumer="live", block_ms=100)
    time.sleep(0.4)  # past claim_idle_ms: the live worker takes the job over and publishes it again
    assert live.step() == 2 and live.processed == 1
    assert queue.length(STREAM_ROLLOUTS) == 4

    # the same job published again (an upstream redelivery): skipped, nothing published
    queue.publish(STREAM_REGENERATE, sel.SerializeToString(), key="job-a")
    assert live.step() == 0 and live.skipped == 1
    assert queue.pending(STREAM_REGENERATE, GROUP_REGENERATORS) == 0 and queue.length(STREAM_REGENERATE) == 0
    assert queue.length(STREAM_ROLLOUTS) == 4

    got = collect_rollouts(queue, {"job-a": 0}, kept=2, timeout_s=10, block_ms=100)
    assert sorted(got) == [(0, 0), (0, 1)]
    assert [got[(0, j)].seed for j in range(2)] == [22, 11]  # kept order, proxy rewards carried over
    assert [got[(0, j)].proxy_reward for j in range(2)] == pytest.approx([0.4, 0.1])
    direct = regenerator.regenerate("a red circle", [22, 11], steps=3)
    for j in range(2):
        msg = got[(0, j)].x0
        x0 = torch.from_numpy(np.frombuffer(msg.data, dtype="<f4").reshape(tuple(msg.shape)).copy())
        torch.testing.assert_close(x0, direct.x0[j])
        assert got[(0, j)].reward == pytest.approx(float(direct.rewards[j]))
    assert queue.length(STREAM_ROLLOUTS) == 0  # duplicates acked and dropped too


def test_collect_times_out_with_a_clear_error(queue):
    ensure_pipeline(queue)
    with pytest.raises(TimeoutError, match="collected 0 of 4 rollouts"):
        collect_rollouts(queue, {"j1": 0, "j2": 1}, kept=2, timeout_s=0.3, block_ms=100)


def test_jobs_no_explorer_takes_fail_early_naming_them(queue):
    """A restarted trainer whose jobs nobody takes (no explorer on this namespace, or job ids the
    workers skip) fails after pickup_timeout_s naming the jobs, not after the rollout timeout."""
    ensure_pipeline(queue)
    published = {f"run-e000000-p0000{i}": queue.publish(STREAM_EXPLORE, b"job", key=f"run-e000000-p0000{i}")
                 for i in range(3)}
    jobs = {j: i for i, j in enumerate(published)}
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no explorer took any of this epoch's 3 jobs within 0.5s "
                                           r"\(run-e000000-p00000 \.\.\. run-e000000-p00002\)"):
        collect_rollouts(queue, jobs, kept=1, timeout_s=60, block_ms=100, published=published, pickup_timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    # once an explorer has taken one, only the overall timeout applies
    queue.consume(STREAM_EXPLORE, GROUP_EXPLORERS, "explorer-1", count=1)
    with pytest.raises(TimeoutError, match="collected 0 of 3 rollouts within 1.5s"):
        collect_rollouts(queue, jobs, kept=1, timeout_s=1.5, block_ms=100, published=published, pickup_timeout_s=0.3)


def test_a_fresh_attempt_never_reuses_job_ids_and_restarts_metrics(model_dir, queue, tmp_path):
    """Two attempts of the same run id (a trainer restarted on a directory without a checkpoint) publish
    different job ids, and metrics.jsonl holds one attempt's lines, not both."""
    cfg = tiny_cfg(model_dir, epochs=1)
    seen = []

    def no_rollouts(remote):
        seen.append(remote.run_id)
        remote.collect = lambda jobs, kept, published=None: (_ for _ in ()).throw(RuntimeError("stop here"))

    for _ in range(2):
        with pytest.raises(RuntimeError, match="stop here"):
            run_distributed(cfg, tmp_path, queue, lambda *a: None, run_id="same", on_session=no_rollouts)
    assert len(set(seen)) == 2 and all(s.startswith("same-a") for s in seen)
    assert [r["epoch"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0]


def test_the_adaptive_proxy_in_services_mode_follows_the_embedded_run(model_dir, queue, tmp_path):
    """rollout.explore_precision.backend=auto over the queue: the trainer calibrates on its own device, names
    the chosen proxy (precision and steps) in every ExploreJob, and the explorer (started with another
    precision) samples with it. Choices, controller state and results equal the embedded run's; the
    rollouts say which proxy ranked them."""
    from solrl.engine.loop import train

    sets = ["rollout.explore_precision.backend=auto", "rollout.proxy.prompts=2", "rollout.proxy.seeds=6",
            'rollout.proxy.candidates=["nvfp4-emu@1", "fp32@3"]', "rollout.proxy.target=0.95",
            "rollout.proxy.patience=1", "checkpoint_every=1"]
    cfg = apply_overrides(tiny_cfg(model_dir, epochs=2), sets).validate()
    train(cfg, tmp_path / "emb", progress=False, log=lambda *_: None)
    explorer, regenerator = planes(apply_overrides(tiny_cfg(model_dir, 2), ["rollout.explore_precision.backend=bf16"]))
    assert explorer.hot.label == "bf16"
    labels: list[str] = []
    original = explorer.explore

    def explore(*a, **kw):  # what each job asked for and got
        out = original(*a, **kw)
        labels.append(out.proxy)
        return out

    explorer.explore = explore
    run_on_services(cfg, queue, tmp_path / "dist", "auto", (explorer, regenerator))
    emb = read_metrics(tmp_path / "emb" / "metrics.jsonl")
    dist = read_metrics(tmp_path / "dist" / "metrics.jsonl")
    keys = ("proxy.chosen", "proxy.candidate", "proxy.below_target_epochs", "explore.proxy", "proxy.switch")
    assert [[r.get(k) for k in keys] for r in dist] == [[r.get(k) for k in keys] for r in emb]
    assert emb[0]["proxy.chosen"] in ("nvfp4-emu@1", "fp32@3") and all("explore.proxy" in r for r in emb[1:])
    for d, e in zip(dist[1:], emb[1:], strict=True):
        assert d["rollout.reward_mean"] == pytest.approx(e["rollout.reward_mean"], abs=1e-4)
        assert d["train.loss"] == pytest.approx(e["train.loss"], rel=1e-5)
    cal_e = json.loads((tmp_path / "emb" / "calibration.json").read_text())
    cal_d = json.loads((tmp_path / "dist" / "calibration.json").read_text())
    assert [c["chosen"] for c in cal_d] == [c["chosen"] for c in cal_e]
    # every job sampled with the proxy its epoch named (2 prompts per epoch), not the explorer's own bf16
    used = [r["explore.proxy"].split("@")[0] for r in emb[1:] for _ in range(2)]
    assert labels == used and "bf16" not in labels
