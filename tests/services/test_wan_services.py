"""Wan2.2 video runs in services mode: the explorer, regenerator, reward and trainer services over real Redis and
real gRPC give the embedded loop's run.

The tiny seeded Wan pipelines of tests/models/test_wan.py (solrl/models/wan_tiny.py, saved in the diffusers layout) are
served by the rollout services' own shells (`services.<role>.server.run`, in threads of this process), which take
the model, its clip (model.frames / height / width) and reward_frames from the run's preset and overrides, as
`solrl serve` does; they consume the Redis streams and score through a reward service over gRPC. The trainer
service (`services.trainer.server.run`) checks them with Info, pushes each adapter with LoadAdapter and trains on
the video rollouts (x0 [C, F, H, W], FlowGRPO's trajectories [S + 1, C, F, H, W]). Compared with the embedded run
of the same config: the explorer's proxy scores and kept seeds, each rollout's latents and reward, the metrics and
the final adapters. TI2V-5B runs DiffusionNFT scoring the mean over frames; A14B runs FlowGRPO on frame 0, its
explorer hot-reloading both experts' LoRA (the explore steps straddle the expert boundary). Then the bad input:
clips a model cannot make (refused before anything is loaded), services serving another clip than the run's
(refused by the trainer, naming each), and bad requests (their gRPC status).
"""

from __future__ import annotations

import argparse
import re
import socket
import threading
import time
import urllib.request
import uuid

import grpc
import numpy as np
import pytest
import torch

import solrl.engine.session
from services.common.metrics import ServiceMetrics
from services.explorer import server as explorer_server
from services.explorer.dataplane import ExplorerDataPlane
from services.regenerator import server as regenerator_server
from services.regenerator.dataplane import RegeneratorDataPlane
from services.rollout.shell import load_served_model, settle_role_args
from services.trainer import server as trainer_server
from solrl.adapters import encode_adapter, sha256_hex
from solrl.config import ConfigError, apply_overrides, get_preset
from solrl.engine.checkpoint import latest_checkpoint, load_adapters
from solrl.engine.session import Session
from solrl.models.wan_tiny import save_tiny_wan
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2, regenerator_pb2_grpc
from solrl.precision import PrecisionConfig
from solrl.queue import QueueConfig, build_queue
from solrl.rewards import build_reward
from solrl.telemetry import read_metrics
from tests.models.test_wan import FAMILY, FRAMES, SIDE, TINY_RUN

REDIS = "redis://127.0.0.1:6379/0"
TOKEN = "wan-services-test-token"
OBSERVER = "observer"
# the tiny video run of tests/models/test_wan.py for 2 epochs (the second samples with the pushed adapter), evaluated on
# one prompt at the start and the end
RUN = [*TINY_RUN, "epochs=2", "eval.every=0", "eval.prompts=1", "eval.seeds_per_prompt=1", "eval.steps=2"]
CASES = {"wan2.2-ti2v-5b": ("sol-rl", "mean"), "wan2.2-t2v-a14b": ("sol-flow-grpo", "first")}


def quiet(*_):
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return {n: save_tiny_wan(n, tmp_path_factory.mktemp(n.replace(".", "_"))) for n in CASES}


@pytest.fixture
def namespace():
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    ns = f"solrl-test-wan-{uuid.uuid4().hex[:10]}"
    yield ns
    client = redis.Redis.from_url(REDIS)
    keys = list(client.scan_iter(f"{ns}:*"))
    if keys:
        client.delete(*keys)


def run_sets(name, dirs, extra=()):
    """The run's overrides (what SOLRL_SET / --set give every role)."""
    return [*RUN, f"model.path={dirs[name]}", f"model.height={SIDE[name]}", f"model.width={SIDE[name]}", *extra]


def role_args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p, environ={})
    return p.parse_args(argv)


def sets_argv(sets):
    return [a for s in sets for a in ("--set", s)]


def wait_ready(thread, http_port, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=1.0) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert thread.is_alive(), f"{thread.name} ended before it was ready"
        assert time.monotonic() < deadline, f"{thread.name} not ready after {timeout_s} s"
        time.sleep(0.05)


def observed(queue, stream):
    out = []
    while batch := queue.consume(stream, OBSERVER, "test", count=256, block_ms=1):
        out += batch
    return out


def job_position(job_id):
    m = re.search(r"-e(\d+)-p(\d+)$", job_id)
    assert m, job_id
    return int(m.group(1)), int(m.group(2))


def tensor(msg):
    assert msg.dtype == "float32"
    return torch.from_numpy(np.frombuffer(msg.data, dtype="<f4").reshape(tuple(msg.shape)).copy())


@pytest.mark.parametrize("name", list(CASES))
def test_services_run_equals_the_embedded_run(name, tiny_dirs, namespace, reward_service, tmp_path, monkeypatch):
    mode, frames = CASES[name]
    preset = f"{FAMILY[name]}-{mode}"
    sets = run_sets(name, tiny_dirs, [f"reward_frames={frames}"])
    cfg = apply_overrides(get_preset(preset), sets).validate()
    two, grpo = name == "wan2.2-t2v-a14b", cfg.train.algo == "flow_grpo"
    assert cfg.model_options()["reward_frames"] == frames and cfg.rollout.mode == "sol_rl"

    queue = build_queue(REDIS, QueueConfig(namespace=namespace))
    for stream in ("regenerate", "rollouts"):   # sees every SeedSelection and Rollout the pipeline carried
        queue.ensure_group(stream, OBSERVER)
    ports = {role: (free_port(), free_port()) for role in ("explorer", "regenerator")}
    common = ["--preset", preset, *sets_argv(sets), "--host", "127.0.0.1", "--redis-url", REDIS,
              "--queue-namespace", namespace, "--reward-addr", reward_service.grpc.address, "--threads", "1"]
    stop, threads, env = threading.Event(), [], {"SOLRL_ADAPTER_TOKEN": TOKEN}
    for role, module in (("explorer", explorer_server), ("regenerator", regenerator_server)):
        args = role_args(module, [*common, "--grpc-port", str(ports[role][0]), "--http-port", str(ports[role][1])])
        threads.append(threading.Thread(target=module.run, args=(args, stop, env), name=f"test-{role}"))
    targs = role_args(trainer_server, [
        "--preset", preset, *sets_argv(sets), "--out", str(tmp_path / "dist"), "--redis-url", REDIS,
        "--queue-namespace", namespace, "--explorer-addrs", f"127.0.0.1:{ports['explorer'][0]}",
        "--regenerator-addrs", f"127.0.0.1:{ports['regenerator'][0]}", "--host", "127.0.0.1", "--grpc-port", "0",
        "--http-port", "0", "--workers-timeout-s", "60", "--rollout-timeout-s", "120", "--pickup-timeout-s", "60"])
    infos = {}
    try:
        for t, role in zip(threads, ("explorer", "regenerator")):
            # one at a time: diffusers' loader builds modules on the meta device through a process-wide patch, which
            # concurrent loads in threads of one process would share (each service is its own process in a run)
            t.start()
            wait_ready(t, ports[role][1])
        assert trainer_server.run(targs, None, env) == 0
        for role, stub in (("explorer", explorer_pb2_grpc.ExplorerStub),
                           ("regenerator", regenerator_pb2_grpc.RegeneratorStub)):
            with grpc.insecure_channel(f"127.0.0.1:{ports[role][0]}") as channel:
                infos[role] = stub(channel).Info(common_pb2.InfoRequest(), timeout=30)
        selections = [common_pb2.SeedSelection.FromString(d.payload) for d in observed(queue, "regenerate")]
        rollouts = [(d.key, common_pb2.Rollout.FromString(d.payload)) for d in observed(queue, "rollouts")]
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        queue.close()
    assert not any(t.is_alive() for t in threads)
    for info in infos.values():   # the run's clip, and the adapter pushed for epoch 2
        assert (info.model, info.frames, info.height, info.width, info.reward_frames) == \
            (name, FRAMES, SIDE[name], SIDE[name], frames)
        assert info.adapter_version.version == 1
    assert infos["explorer"].precision == "nvfp4-emu"

    # the embedded run of the same config, its explore / regenerate results recorded
    calls = {"explore": [], "regenerate": []}
    for fn in calls:
        real = getattr(solrl.engine.session, fn)
        monkeypatch.setattr(solrl.engine.session, fn, lambda *a, _real=real, _fn=fn, **kw:
                            calls[_fn].append(_real(*a, **kw)) or calls[_fn][-1])
    emb = Session.build(cfg)
    base = emb.adapters.state_dict("default")
    emb_recs = [emb.epoch(e) for e in range(cfg.epochs)]
    keys = list(base)
    if two:   # epoch 1's update moved both experts' LoRA, so epoch 2's explore (1.0 -> 0.75) needs both pushed
        moved = {k.split(".")[1] for k in keys if not torch.equal(emb.adapters.state_dict("old")[k], base[k])}
        assert moved == {"transformer", "transformer_2"}

    P, K = cfg.rollout.prompts_per_epoch, cfg.rollout.kept
    sel = {job_position(s.job_id): s for s in selections}
    assert sorted(sel) == [(e, p) for e in range(cfg.epochs) for p in range(P)]
    rolls = {}
    for key, ro in rollouts:
        job_id, _, position = key.rpartition(":")
        rolls[(*job_position(job_id), int(position))] = ro
    assert len(rolls) == len(rollouts) == cfg.epochs * P * K
    latent = list(emb.model.spec.latent_shape)
    assert len(latent) == 4 and latent[1] == (FRAMES - 1) // 4 + 1   # [C, F, H, W]
    scorer = build_reward(cfg.reward)
    for e, (ex, rg) in enumerate(zip(calls["explore"], calls["regenerate"], strict=True)):
        for p in range(P):
            s = sel[(e, p)]
            assert s.adapter_version.version == e and [int(x) for x in s.seeds] == ex.seeds[p]
            assert np.array_equal(np.asarray(s.proxy_scores, dtype=np.float32), ex.scores[p]), (e, p)
            assert list(s.kept_indices) == ex.kept[p]
            for j, i in enumerate(ex.kept[p]):
                ro, row = rolls[(e, p, j)], p * K + j
                assert ro.seed == ex.seeds[p][i] and ro.adapter_version.version == e
                assert list(ro.x0.shape) == latent
                x0 = tensor(ro.x0)
                assert torch.equal(x0, rg.x0[row]), (e, p, j, float((x0 - rg.x0[row]).abs().max()))
                assert ro.reward == rg.rewards[row]
                clip = emb.model.decode(x0[None])   # the frames reward_frames names: all of them, or frame 0
                assert clip.shape[1] == (FRAMES if frames == "mean" else 1)
                assert ro.reward == pytest.approx(float(np.mean(scorer(clip[0], [s.prompt] * clip.shape[1]))),
                                                  rel=1e-6)
                if grpo:   # the SDE's states [S + 1, C, F, H, W] and log-probs, as the embedded regeneration's
                    assert list(ro.trajectory.shape) == [cfg.rollout.steps + 1, *latent]
                    assert torch.equal(tensor(ro.trajectory), rg.trajectory[row])
                    assert torch.equal(tensor(ro.log_probs), rg.log_probs[row])
                else:
                    assert not ro.HasField("trajectory")

    dist = [r for r in read_metrics(tmp_path / "dist" / "metrics.jsonl") if r["epoch"] > 0]
    assert len(dist) == len(emb_recs) == cfg.epochs
    train_keys = ("train.loss", "train.grad_norm") + (("train.kl", "train.clip_frac") if grpo else ())
    for d, r in zip(dist, emb_recs, strict=True):
        assert d["adapter_version"] == r["adapter_version"]
        for key in ("rollout.reward_mean", "rollout.reward_std", "proxy_gap", "proxy_kendall_tau", *train_keys):
            assert d[key] == r[key], key
    got = Session.build(cfg)
    load_adapters(latest_checkpoint(tmp_path / "dist"), got.adapters)
    for which in ("default", "old", "ema"):
        a, b = got.adapters.state_dict(which), emb.adapters.state_dict(which)
        assert max((b[k] - base[k]).abs().max().item() for k in keys) > 0
        assert all(torch.equal(a[k], b[k]) for k in keys), which


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("argv, message", [
    (["--frames", "80"], r"model.frames=80: wan2.2-t2v-a14b's VAE makes clips of 4k \+ 1 frames \(e.g. 77 or 81\)"),
    (["--frames", "9", "--height", "500"], "model.height=500 must be a positive multiple of 16"),
    (["--width", "-16"], "model.width=-16 must be a positive multiple of 16"),
])
def test_a_clip_the_model_cannot_make_is_refused_before_loading(argv, message, tmp_path, capsys):
    """Flags (or the run's settings) naming a clip the model's VAE cannot make: a ConfigError naming the setting from
    the role's start-up, before any weights are read (the weights path does not even exist); `solrl serve` prints it
    and exits 2."""
    from solrl.cli.app import main

    missing = str(tmp_path / "no-weights")
    for module in (explorer_server, regenerator_server):
        args = role_args(module, ["--model", "wan2.2-t2v-a14b", "--model-path", missing, *argv])
        with pytest.raises(ConfigError, match=message):
            module.run(args, threading.Event(), {})
    assert main(["serve", "regenerator", "--model", "wan2.2-t2v-a14b", "--model-path", missing, *argv]) == 2
    assert re.search(message, capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"model.frames=80"):   # the same from the run config (SOLRL_SET)
        settle_role_args(role_args(explorer_server, ["--preset", "wan22-a14b-sol-rl", "--set", "model.frames=80",
                                                     "--set", "prompts.train=/p.txt", "--set", "prompts.eval=/p.txt"]),
                         "explorer")
    with pytest.raises(ConfigError, match=r"--frames=9, --reward-frames=mean .*apply to the video models"):
        settle_role_args(role_args(explorer_server, ["--frames", "9", "--reward-frames", "mean"]), "explorer")
    # the run's clip is what the rollout roles serve when no flag says otherwise; flags win
    run = ["--preset", "wan22-ti2v5b-sol-rl", "--set", "prompts.train=/p.txt", "--set", "prompts.eval=/p.txt",
           "--set", "reward_frames=mean"]
    args = settle_role_args(role_args(regenerator_server, run), "regenerator")
    assert (args.model, args.frames, args.height, args.width, args.reward_frames) == \
        ("wan2.2-ti2v-5b", 121, 704, 1280, "mean")
    args = settle_role_args(role_args(regenerator_server, [*run, "--frames", "17"]), "regenerator")
    assert args.frames == 17


@pytest.fixture(scope="module")
def served(tiny_dirs):
    """An A14B explorer and regenerator on gRPC, built by the services' own loader from flags: 5 frames (the run
    below has 9) and, for the regenerator, the mean over frames."""
    out = {}
    for role, module, plane_cls, extra in (
            ("explorer", explorer_server, ExplorerDataPlane, []),
            ("regenerator", regenerator_server, RegeneratorDataPlane, ["--reward-frames", "mean"])):
        args = settle_role_args(role_args(module, [
            "--model", "wan2.2-t2v-a14b", "--model-path", str(tiny_dirs["wan2.2-t2v-a14b"]), "--frames", "5",
            "--height", "16", "--width", "16", "--reward", "jpeg_compressibility", "--steps", "2", *extra]), role)
        model, lora = load_served_model(args)
        assert model.frames == 5 and model.reward_frames == ("mean" if extra else "first")
        plane = plane_cls(model, PrecisionConfig(args.precision), lora, build_reward(args.reward), steps=2,
                          micro_batch=4, version_wait_s=0.5)
        out[role] = module.start(plane, ServiceMetrics(role), adapter_token=TOKEN)
    yield out
    for svc in out.values():
        svc.stop(grace=0.5)


def test_the_trainer_refuses_services_of_another_clip(served, tiny_dirs):
    cfg = apply_overrides(get_preset("wan22-a14b-sol-rl"), run_sets("wan2.2-t2v-a14b", tiny_dirs)).validate()
    pusher = trainer_server.AdapterPusher([served["explorer"].grpc.address], [served["regenerator"].grpc.address],
                                          TOKEN)
    try:
        with pytest.raises(RuntimeError) as err:
            trainer_server.check_workers(pusher, cfg, timeout_s=30)
    finally:
        pusher.close()
    msg = str(err.value)
    for role, address in (("explorer", served["explorer"].grpc.address),
                          ("regenerator", served["regenerator"].grpc.address)):
        assert f"{role} {address} serves frames=5, the run has model.frames=9" in msg
    assert f"regenerator {served['regenerator'].grpc.address} serves reward_frames='mean', the run has " \
           f"reward_frames='first'" in msg
    assert f"explorer {served['explorer'].grpc.address} serves reward_frames" not in msg   # it scores frame 0
    assert "height" not in msg and "width" not in msg


def test_bad_requests_get_their_grpc_status(served, tiny_dirs):
    """An adapter of the one-transformer TI2V-5B layout pushed to the two-expert A14B explorer does not fit
    (INVALID_ARGUMENT, naming it); an A14B adapter without the low-noise expert's LoRA neither; bad seeds and steps
    are INVALID_ARGUMENT naming the field; a request for an adapter version never pushed is UNAVAILABLE."""
    ti2v = Session.build(apply_overrides(get_preset("wan22-ti2v5b-sol-rl"),
                                         run_sets("wan2.2-ti2v-5b", tiny_dirs)).validate())
    wrong = encode_adapter(ti2v.adapters.state_dict("default"), 1, ti2v.adapters.spec)
    a14b = Session.build(apply_overrides(get_preset("wan22-a14b-sol-rl"),
                                         run_sets("wan2.2-t2v-a14b", tiny_dirs, ["model.frames=5"])).validate())
    state = a14b.adapters.state_dict("default")
    high_only = encode_adapter({k: v for k, v in state.items() if ".transformer_2." not in k}, 1, a14b.adapters.spec)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(served["explorer"].grpc.address) as channel:
        stub = explorer_pb2_grpc.ExplorerStub(channel)
        for data, what in ((wrong, "does not fit this model"), (high_only, "does not fit this model")):
            with pytest.raises(grpc.RpcError) as err:
                stub.LoadAdapter(common_pb2.LoadAdapterRequest(safetensors=data, version=1, sha256=sha256_hex(data)),
                                 metadata=auth, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Explore(explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(prompt="a clip", seeds=[1, 2],
                                                                               steps=100_000)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job.steps" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Explore(explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(prompt="a clip", seeds=[1, 2],
                                                                               min_adapter_version=3)), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        ok = stub.Explore(explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(prompt="a clip", seeds=[1, 2],
                                                                                kept=2)), timeout=60)
        assert len(ok.selection.proxy_scores) == 2 and ok.selection.adapter_version.version == 0
    with grpc.insecure_channel(served["regenerator"].grpc.address) as channel:
        stub = regenerator_pb2_grpc.RegeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Regenerate(regenerator_pb2.RegenerateRequest(selection=common_pb2.SeedSelection(
                prompt="a clip", seeds=[1], kept_indices=[3])), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kept_indices" in err.value.details()
        out = stub.Regenerate(regenerator_pb2.RegenerateRequest(selection=common_pb2.SeedSelection(
            prompt="a clip", seeds=[1]), return_images=True), timeout=60)
    # a clip's latents [C, F, H, W] and, scoring the mean over frames, every frame of it
    assert list(out.rollouts[0].x0.shape) == [16, 2, 2, 2] and list(out.images.shape) == [1, 5, 16, 16, 3]


def test_the_reward_service_scores_clips_as_the_mean_over_their_frames(reward_service):
    """Score takes clips [B, F, H, W, 3] beside images: each clip's score is the mean of its frames' (frame 0 alone:
    [B, 1, H, W, 3]); a reward that cannot score video frames refuses clips, and malformed clips are
    INVALID_ARGUMENT naming the field."""
    from services.common.tensors import numpy_to_tensor
    from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc

    clips = np.random.default_rng(0).integers(0, 256, size=(2, 3, 16, 16, 3), dtype=np.uint8)
    clips[1, 1:] //= 4   # frames of one clip that compress differently
    prompts = ["a red circle", "two blue squares"]
    with grpc.insecure_channel(reward_service.grpc.address) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)

        def score(images, texts, reward="jpeg_compressibility"):
            return np.asarray(stub.Score(reward_pb2.ScoreRequest(reward=reward, images=numpy_to_tensor(images),
                                                                 prompts=texts), timeout=30).scores, np.float32)

        frames = score(clips.reshape(6, 16, 16, 3), [p for p in prompts for _ in range(3)]).reshape(2, 3)
        np.testing.assert_allclose(score(clips, prompts), frames.mean(axis=1), rtol=1e-6)
        assert np.array_equal(score(clips[:, :1], prompts), frames[:, 0])
        for images, texts, reward, message in (
                (clips, prompts, "shapes", "cannot score video frames"),
                (clips, prompts[:1], "jpeg_compressibility", "images: got 2 clips but 1 prompts"),
                (clips[..., :2], prompts, "jpeg_compressibility", "images: clips must have shape [B, F, H, W, 3]"),
                (clips[:, :0], prompts, "jpeg_compressibility", "(F >= 1, H, W >= 4), got [2, 0, 16, 16, 3]")):
            with pytest.raises(grpc.RpcError) as err:
                score(np.ascontiguousarray(images), texts, reward)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details(), \
                err.value.details()


def test_a_remote_scorer_splits_what_is_over_the_request_limit(reward_service):
    """Every frame of a clip scored over gRPC (reward_frames=mean at Wan's own clips: 32 clips x 121 frames at
    704x1280 are 10 GB) goes in slices within the reward service's tensor limit; the scores are the one call's."""
    from services.rollout.plane import RemoteScorer

    images = np.random.default_rng(1).integers(0, 256, size=(7, 16, 16, 3), dtype=np.uint8)
    prompts = [f"prompt {i}" for i in range(7)]
    whole, split = (RemoteScorer(reward_service.grpc.address, "jpeg_compressibility", max_request_bytes=b)
                    for b in (1 << 30, 3 * images[0].nbytes))
    calls = []
    real = split._score
    split._score = lambda im, pr: calls.append(len(im)) or real(im, pr)
    try:
        assert np.array_equal(split(images, prompts), whole(images, prompts))
    finally:
        whole.close()
        split.close()
    assert calls == [3, 3, 1]


def test_solrl_up_gives_the_rollout_services_the_clip(tiny_dirs, tmp_path):
    from solrl.deploy.up import plan

    ports = iter(range(20000, 20100))
    for name, want in (("wan2.2-t2v-a14b", ["--frames", str(FRAMES), "--height", "16", "--width", "16",
                                            "--reward-frames", "mean"]), ("shapes", [])):
        sets = run_sets(name, tiny_dirs, ["reward_frames=mean"]) if name != "shapes" else []
        cfg = apply_overrides(get_preset(f"{FAMILY[name]}-sol-rl" if sets else "shapes-sol-rl"), sets).validate()
        stages = plan(cfg, redis_url=REDIS, namespace="ns", run_dir=tmp_path, trainer_args=[], token="t",
                      port=lambda: next(ports))
        for spec in stages[1]:   # the explorer and the regenerator
            got = [a for i, a in enumerate(spec.argv) if a in ("--frames", "--height", "--width", "--reward-frames")
                   or i and spec.argv[i - 1] in ("--frames", "--height", "--width", "--reward-frames")]
            assert got == want, (name, spec.role, spec.argv)
