"""Regenerator service contract tests over real sockets (127.0.0.1, ephemeral ports), with adapter hot reload.

A one-layer shapes model (seeded, saved and loaded through the registry) keeps every call cheap. Expected
results come from the core: `solrl.rollout.passes.regenerate` on a BF16 `InferenceCopy` synced with the same
adapter, merged by peft-backed `LoraAdapters`. The explorer's tests cover the hot-reload door in depth
(the same services.rollout.adapter_endpoint code); here it is checked as the regenerator mounts it.
"""

from __future__ import annotations

import argparse
import copy
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import torch
from diffusers import PixArtTransformer2DModel
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import CLIPTextModel

from services.common.metrics import ServiceMetrics
from services.common.tensors import tensor_to_numpy, tensor_to_torch
from services.regenerator import server as regenerator_server
from services.regenerator.dataplane import RegeneratorDataPlane
from services.regenerator.server import start
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.models import load_model
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2, regenerator_pb2_grpc
from solrl.precision import PrecisionConfig, build_backend
from solrl.rewards import build_reward
from solrl.rollout.passes import SamplerSpec, regenerate
from solrl.rollout.workers import InferenceCopy
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config

TOKEN = "another-s3cret"
PRECISION = PrecisionConfig("bf16")
PROMPT = "two blue squares"
SEEDS = [5, 6, 7, 8]
KEPT = [3, 0]
PROXY = [0.1, 0.2, 0.3, 0.4]


def tiny_shapes(seed: int = 0) -> ShapesModel:
    """The shapes model's classes at one layer and 32 wide (the bundled one has six at 128)."""
    torch.manual_seed(seed)
    config = {**transformer_config(), "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
              "cross_attention_dim": 32}
    return ShapesModel(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))


class World:
    """The served model, the adapters pushed to it and the core reference result of each version.

    The reference is what the embedded loop regenerates with: the trainer's own peft model (base
    rounded to bf16, LoRA unmerged in fp32). Version 2 is a small step from version 1, the size of an
    RL update, which merging into bf16 weights would mostly round away (`merged` keeps that result).
    """

    def __init__(self, path) -> None:
        self.path = path
        self.model = load_model("shapes", path)
        self.lora = LoraSpec(rank=2, alpha=4.0, target_modules=self.model.spec.lora_targets)
        self.scorer = build_reward("jpeg_compressibility")
        base = build_backend(PRECISION).prepare(copy.deepcopy(self.model.transformer))
        self.adapters = LoraAdapters(base, self.lora, seed=1)
        self.refs = {0: InferenceCopy(self.adapters, PRECISION).module}
        self.payloads: dict[int, bytes] = {}
        kept_seeds = [SEEDS[i] for i in KEPT]
        self.expected = {0: self._regenerate(self.refs[0], kept_seeds)}
        self.merged = {}
        for version, scale in ((1, 0.5), (2, 1e-3)):
            g = torch.Generator().manual_seed(10 + version)
            with torch.no_grad():
                for p in self.adapters.parameters("default"):
                    p.add_(scale * torch.randn(p.shape, generator=g))
            self.payloads[version] = encode_adapter(self.adapters.state_dict("default"), version, self.lora)
            with self.adapters.use("default"):
                self.expected[version] = self._regenerate(self.adapters.model, kept_seeds)
            ref = InferenceCopy(self.adapters, PRECISION)
            ref.sync(self.adapters.merged_weights("default"), version)
            self.merged[version] = self._regenerate(ref.module, kept_seeds)

    def served_model(self) -> ShapesModel:
        """A model for a plane of its own: the plane rounds and serves its transformer in place."""
        return ShapesModel(copy.deepcopy(self.model.transformer), self.model.text_encoder)

    def _regenerate(self, denoiser, seeds):
        return regenerate(self.model, denoiser, [PROMPT], [seeds], 2, SamplerSpec(), self.scorer)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    path = tmp_path_factory.mktemp("tiny-shapes")
    tiny_shapes().save(path)
    return World(path)


class Served:
    def __init__(self, plane: RegeneratorDataPlane) -> None:
        self.svc = start(plane, ServiceMetrics("regenerator"), adapter_token=TOKEN)
        self.channel = grpc.insecure_channel(self.svc.grpc.address)
        self.stub = regenerator_pb2_grpc.RegeneratorStub(self.channel)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.svc.http.port}", timeout=30)

    def regenerate(self, return_images: bool = False, **selection) -> regenerator_pb2.RegenerateResponse:
        sel = {"job_id": "job-7", "prompt": PROMPT, "seeds": SEEDS, "proxy_scores": PROXY, "kept_indices": KEPT,
               "sampler": common_pb2.SamplerSpec(steps=2), **selection}
        return self.stub.Regenerate(regenerator_pb2.RegenerateRequest(
            selection=common_pb2.SeedSelection(**sel), return_images=return_images), timeout=60)

    def push(self, data: bytes, version: int, token: str = TOKEN) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}", "X-Adapter-Version": str(version),
                   "X-Adapter-Sha256": sha256_hex(data)}
        return self.http.put("/v1/adapter", content=data, headers=headers)

    def close(self) -> None:
        self.http.close()
        self.channel.close()
        self.svc.stop(0)


@pytest.fixture
def served(world) -> Iterator[Served]:
    s = Served(RegeneratorDataPlane(world.served_model(), PRECISION, world.lora, world.scorer, steps=2))
    yield s
    s.close()


def assert_matches(response: regenerator_pb2.RegenerateResponse, world: World, version: int) -> None:
    ref = world.expected[version]
    assert [r.seed for r in response.rollouts] == [SEEDS[i] for i in KEPT]
    for j, rollout in enumerate(response.rollouts):
        assert rollout.adapter_version.version == version
        x0 = tensor_to_torch(rollout.x0, "x0")
        assert x0.dtype == torch.float32 and tuple(x0.shape) == tuple(ref.x0.shape[1:])
        assert torch.equal(x0, ref.x0[j]), (version, j, float((x0 - ref.x0[j]).abs().max()))
        assert rollout.reward == float(ref.rewards[j])


def test_regenerate_rpc_gives_the_core_result(world, served):
    response = served.regenerate(return_images=True)
    assert_matches(response, world, 0)
    assert [r.proxy_reward for r in response.rollouts] == pytest.approx([PROXY[i] for i in KEPT])
    assert {(r.job_id, r.prompt) for r in response.rollouts} == {("job-7", PROMPT)}
    images = tensor_to_numpy(response.images, "images")
    assert images.dtype == np.uint8
    np.testing.assert_array_equal(images, world.expected[0].images)
    assert not served.regenerate().HasField("images")  # only when asked for

    everything = served.regenerate(kept_indices=[], proxy_scores=[])  # no selection: every seed
    assert [r.seed for r in everything.rollouts] == SEEDS
    alone = regenerate(world.model, world.refs[0], [PROMPT], [[SEEDS[3]]], 2, SamplerSpec(), world.scorer)
    torch.testing.assert_close(tensor_to_torch(everything.rollouts[3].x0), alone.x0[0], rtol=0, atol=1e-5)


def test_regenerate_with_the_sde_sends_trajectories_and_log_probs(world, served):
    """flow_grpo: SamplerSpec.sde_eta > 0 regenerates the kept seeds with the SDE (seeded per seed), and each
    Rollout carries the trajectory and per-step log-probs the core's SDE regeneration gives; an ODE request has
    none."""
    kept = [SEEDS[i] for i in KEPT]
    response = served.regenerate(sampler=common_pb2.SamplerSpec(steps=2, sde_eta=0.7))
    ref = regenerate(world.model, world.refs[0], [PROMPT], [kept], 2,
                     SamplerSpec("sde", world.model.spec.default_shift, 1.0, 0.7), world.scorer)
    assert [r.seed for r in response.rollouts] == kept
    for j, rollout in enumerate(response.rollouts):
        traj, lp = tensor_to_torch(rollout.trajectory, "trajectory"), tensor_to_torch(rollout.log_probs, "log_probs")
        assert traj.shape == (3, *world.model.spec.latent_shape) and lp.shape == (2,) and rollout.sde_eta == 0.7
        assert torch.equal(traj, ref.trajectory[j]) and torch.equal(lp, ref.log_probs[j])
        assert torch.equal(tensor_to_torch(rollout.x0, "x0"), traj[-1])
    ode = served.regenerate()
    assert not ode.rollouts[0].HasField("trajectory") and not ode.rollouts[0].HasField("log_probs")
    assert not torch.equal(tensor_to_torch(ode.rollouts[0].x0, "x0"), ref.x0[0])  # the SDE sample is another one


def test_pushed_adapters_serve_exactly_what_the_trainer_computes(world, served):
    r = served.push(world.payloads[1], 1)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == 1 and r.json()["sha256"] == sha256_hex(world.payloads[1])
    response = served.regenerate()
    assert_matches(response, world, 1)
    assert response.rollouts[0].adapter_version.sha256 == sha256_hex(world.payloads[1])
    assert (world.expected[1].x0 - world.expected[0].x0).abs().max() > 1e-3  # the adapter matters

    data = world.payloads[2]
    loaded = served.stub.LoadAdapter(common_pb2.LoadAdapterRequest(safetensors=data, version=2,
                                                                        sha256=sha256_hex(data)),
                                     metadata=[("authorization", f"Bearer {TOKEN}")])
    assert loaded.adapter_version.version == 2
    assert_matches(served.regenerate(), world, 2)
    # the small step survives: merged into bf16 weights it would be largely rounded away
    step = (world.expected[2].x0 - world.expected[1].x0).abs().max()
    merged_error = (world.merged[2].x0 - world.expected[2].x0).abs().max()
    assert step > 0 and merged_error > 0.5 * step, (float(step), float(merged_error))
    assert served.stub.Info(common_pb2.InfoRequest()).adapter_version.version == 2

    # refused pushes leave version 2 in place
    assert served.push(data, 3, token="wrong").status_code == 401
    assert served.push(world.payloads[1], 1).status_code == 409
    assert served.push(data[: len(data) // 2], 3).status_code == 400
    assert served.http.get("/v1/adapter").json()["version"] == 2
    assert_matches(served.regenerate(), world, 2)


def test_regenerate_waits_for_the_explorers_adapter_version(world):
    plane = RegeneratorDataPlane(world.served_model(), PRECISION, world.lora, world.scorer, steps=2,
                                 version_wait_s=0.1)
    s = Served(plane)
    try:
        with pytest.raises(grpc.RpcError) as info:
            s.regenerate(adapter_version=common_pb2.AdapterVersion(version=1))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert s.push(world.payloads[1], 1).status_code == 200
        assert_matches(s.regenerate(adapter_version=common_pb2.AdapterVersion(version=1)), world, 1)
    finally:
        s.close()


def test_health_and_info(world, served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", "solrl.regenerator.v1.Regenerator"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    info = served.stub.Info(common_pb2.InfoRequest())
    assert (info.model, info.precision, info.reward) == ("shapes", "bf16", "jpeg_compressibility")
    assert info.resident_weight_bytes == served.svc.plane.hot.weight_bytes()["total"] > 0
    assert served.http.get("/readyz").status_code == 200
    assert served.http.get("/v1/info").json()["service"] == "regenerator"


@pytest.mark.parametrize("selection, field", [
    ({"prompt": "a blue dragon"}, "selection.prompt"),
    ({"seeds": [], "kept_indices": [], "proxy_scores": []}, "selection.seeds"),
    ({"kept_indices": [4]}, "selection.kept_indices[0]"),
    ({"proxy_scores": [0.5]}, "selection.proxy_scores"),
    ({"sampler": common_pb2.SamplerSpec(steps=-2)}, "selection.sampler.steps"),
    ({"sampler": common_pb2.SamplerSpec(solver="heun")}, "selection.sampler.solver"),
    ({"sampler": common_pb2.SamplerSpec(sde_eta=-0.5)}, "selection.sampler.sde_eta"),
])
def test_bad_regenerate_input_is_invalid_argument_naming_the_field(served, selection, field):
    with pytest.raises(grpc.RpcError) as info:
        served.regenerate(**selection)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        served.stub.Regenerate(regenerator_pb2.RegenerateRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("selection")


def test_command_line_serves_the_saved_model(world):
    p = argparse.ArgumentParser()
    regenerator_server.add_arguments(p, environ={"SOLRL_BIND_HOST": "127.0.0.1"})
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    args = p.parse_args(["--model-path", str(world.path), "--lora-rank", "2", "--lora-alpha", "4", "--reward",
                         "jpeg_compressibility", "--base-precision", "fp32", "--grpc-port", str(ports[0]),
                         "--http-port", str(ports[1])])
    from services.rollout.shell import settle_role_args

    assert (args.precision, args.steps, args.host) == (None, None, "127.0.0.1")   # unset: settled at start
    assert (settle_role_args(argparse.Namespace(**vars(args)), "regenerator").precision,) == ("bf16",)
    stop = threading.Event()
    runner = threading.Thread(target=regenerator_server.run, args=(args, stop, {}))
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{ports[1]}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the regenerator did not come up"
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{ports[1]}/v1/info").json()["adapter_loading"] is False  # no token
        with grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as channel:
            response = regenerator_pb2_grpc.RegeneratorStub(channel).Regenerate(regenerator_pb2.RegenerateRequest(
                selection=common_pb2.SeedSelection(prompt=PROMPT, seeds=SEEDS, kept_indices=KEPT,
                                                   sampler=common_pb2.SamplerSpec(steps=2))), timeout=60)
        assert_matches(response, world, 0)
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()


def test_the_regenerator_holds_one_base_and_pushes_add_only_the_lora(world):
    """The bf16 regenerator serves the model it was given, rounded in place (no second copy of the base);
    a push adds only the fp32 LoRA layers, the next push reuses them, and the output stays the core's."""
    from services.rollout.hot_swap import HotSwapModel, storages

    given = world.served_model().transformer
    hot = HotSwapModel(given, world.lora, PRECISION)
    assert not hot.merges and hot.current().module is given
    base = storages([*given.parameters(), *given.buffers()])
    assert storages(hot.resident_tensors()) == base   # version 0: the base alone, nothing kept beside it
    sizes = []
    for version in (1, 2):
        hot.load(world.payloads[version], version=version, sha256=sha256_hex(world.payloads[version]))
        with hot.serving() as cur:
            assert cur.module is given and cur.version == version
            got = world._regenerate(cur.module, [SEEDS[i] for i in KEPT])
        np.testing.assert_array_equal(got.rewards, world.expected[version].rewards)
        torch.testing.assert_close(got.x0, world.expected[version].x0, rtol=0, atol=0)
        resident = storages(hot.resident_tensors())
        lora = storages([p for n, p in given.named_parameters() if ".lora_" in n])
        pushed = storages(list(hot._adapter[0].values()))   # the adapter as pushed (re-applied on a failed push)
        assert lora and base.keys() <= resident.keys() and resident.keys() - base.keys() == lora.keys() | pushed.keys()
        sizes.append(sum(resident.values()))
    assert sizes[0] == sizes[1]
