"""Explorer service contract tests over real sockets (127.0.0.1, ephemeral ports), with adapter hot reload.

A one-layer shapes model (seeded, saved and loaded through the registry) keeps every call cheap. Expected
results come from the core: `solrl.rollout.passes.explore` on an `InferenceCopy` (the embedded loop's explorer)
synced with the same adapter, merged by peft-backed `LoraAdapters`. The reward is jpeg_compressibility:
unlike the exact shapes reward it varies between random images, so equal scores mean equal images.
"""

from __future__ import annotations

import copy
import pickle
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from diffusers import PixArtTransformer2DModel
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import CLIPTextModel
from tritonclient.utils import InferenceServerException

from services.common.metrics import ServiceMetrics
from services.explorer import server as explorer_server
from services.explorer.dataplane import ExplorerDataPlane, RemoteScorer, build_scorer
from services.explorer.server import start
from services.reward.dataplane import RewardDataPlane
from services.reward.server import start as start_reward
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.models import load_model
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
from solrl.precision import PrecisionConfig
from solrl.rewards import build_reward
from solrl.rewards.jpeg import JpegCompressibility
from solrl.rollout.passes import SamplerSpec, explore
from solrl.rollout.workers import InferenceCopy
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config

TOKEN = "s3cret-token"
PRECISION = PrecisionConfig("nvfp4-emu")
PROMPT = "a red circle"
SEEDS = [11, 22, 33, 44]
MAX_ADAPTER_BYTES = 32 << 10


def tiny_shapes(seed: int = 0) -> ShapesModel:
    """The shapes model's classes at one layer and 32 wide (the bundled one has six at 128)."""
    torch.manual_seed(seed)
    config = {**transformer_config(), "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
              "cross_attention_dim": 32}
    return ShapesModel(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))


class World:
    """The served model, the adapters pushed to it, and the core reference copy of each version."""

    def __init__(self, path) -> None:
        self.path = path
        self.model = load_model("shapes", path)
        self.lora = LoraSpec(rank=2, alpha=4.0, target_modules=self.model.spec.lora_targets)
        self.scorer = build_reward("jpeg_compressibility")
        spec = self.model.spec
        self.adapters = LoraAdapters(copy.deepcopy(self.model.transformer), self.lora, seed=1)
        self.refs = {0: InferenceCopy(self.adapters, PRECISION, spec.quant_skip, spec.quant_min_features).module}
        self.payloads: dict[int, bytes] = {}
        for version in (1, 2):
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for p in self.adapters.parameters("default"):
                    p.add_(0.5 * torch.randn(p.shape, generator=g))
            self.payloads[version] = encode_adapter(self.adapters.state_dict("default"), version, self.lora)
            ref = InferenceCopy(self.adapters, PRECISION, spec.quant_skip, spec.quant_min_features)
            ref.sync(self.adapters.merged_weights("default"), version)
            self.refs[version] = ref.module
        self.expected = {v: self.core(v) for v in self.refs}  # [PROMPT] x SEEDS, 2 steps, k = 2

    def core(self, version: int, prompts=(PROMPT,), seeds=(SEEDS,), steps: int = 2, k: int = 2):
        return explore(self.model, self.refs[version], list(prompts), [list(s) for s in seeds], steps,
                       SamplerSpec(), self.scorer, k, "best_worst")

    def served_model(self) -> ShapesModel:
        """A model for a plane of its own: the plane serves (and re-quantizes) its transformer in place."""
        return ShapesModel(copy.deepcopy(self.model.transformer), self.model.text_encoder)

    def plane(self, model: ShapesModel | None = None, **kwargs) -> ExplorerDataPlane:
        kwargs = {"steps": 2, "kept": 2, **kwargs}
        return ExplorerDataPlane(model or self.served_model(), PRECISION, self.lora, kwargs.pop("scorer", self.scorer),
                                 **kwargs)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    path = tmp_path_factory.mktemp("tiny-shapes")
    tiny_shapes().save(path)
    return World(path)


class Served:
    """A running explorer and clients for it."""

    def __init__(self, plane: ExplorerDataPlane, token: str | None = TOKEN) -> None:
        self.svc = start(plane, ServiceMetrics("explorer"), adapter_token=token, max_adapter_bytes=MAX_ADAPTER_BYTES)
        self.channel = grpc.insecure_channel(self.svc.grpc.address)
        self.stub = explorer_pb2_grpc.ExplorerStub(self.channel)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.svc.http.port}", timeout=30)

    def explore(self, **job) -> common_pb2.SeedSelection:
        n = job.pop("n", 0)
        job = {"prompt": PROMPT, "seeds": SEEDS, "steps": 2, "kept": 2, **job}
        return self.stub.Explore(explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(**job), n=n),
                                 timeout=60).selection

    def push(self, data: bytes, version: int | str, *, token: str | None = TOKEN, sha: str | None = None,
             **headers: str) -> httpx.Response:
        h = {"X-Adapter-Version": str(version), "X-Adapter-Sha256": sha or sha256_hex(data), **headers}
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        return self.http.put("/v1/adapter", content=data, headers=h)

    def version(self) -> int:
        return self.http.get("/v1/adapter").json()["version"]

    def close(self) -> None:
        self.http.close()
        self.channel.close()
        self.svc.stop(0)


@pytest.fixture
def served(world) -> Iterator[Served]:
    s = Served(world.plane())
    yield s
    s.close()


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)
    return info.value


def assert_matches(selection: common_pb2.SeedSelection, world: World, version: int) -> None:
    ref = world.expected[version]
    assert selection.adapter_version.version == version
    np.testing.assert_array_equal(np.array(selection.proxy_scores, dtype=np.float32), ref.scores[0])
    assert list(selection.kept_indices) == ref.kept[0]


# ---------------------------------------------------------------------- results equal the core

def test_explore_rpc_gives_the_core_result(world, served):
    sel = served.explore(job_id="j1")
    assert list(sel.seeds) == SEEDS and sel.job_id == "j1" and sel.prompt == PROMPT
    assert_matches(sel, world, 0)
    assert sel.adapter_version.sha256 == ""
    assert (sel.sampler.solver, sel.sampler.shift, sel.sampler.guidance) == ("euler", 1.0, 1.0)
    assert len(set(world.expected[0].scores[0].tolist())) > 1  # the scores tell the seeds apart

    drawn = served.explore(seeds=[], n=3, kept=2)  # seeds drawn by the server, reported back
    assert len(drawn.seeds) == 3 and all(0 <= s < 2**63 for s in drawn.seeds)
    ref = world.core(0, seeds=[list(drawn.seeds)])
    np.testing.assert_array_equal(np.array(drawn.proxy_scores, dtype=np.float32), ref.scores[0])
    assert list(drawn.kept_indices) == ref.kept[0]

    once, again = (served.explore(selection="random") for _ in range(2))  # a job selects the same seeds
    assert list(once.kept_indices) == list(again.kept_indices) and len(set(once.kept_indices)) == 2


def test_tritonclient_drives_the_explore_model(world, served):
    client = tgrpc.InferenceServerClient(served.svc.grpc.address)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("explore")
        assert not client.is_model_ready("nope")
        md = client.get_model_metadata("explore", as_json=True)
        assert [i["name"] for i in md["inputs"]] == ["PROMPTS", "N", "STEPS", "K", "GATE"]
        assert {o["name"]: o["datatype"] for o in md["outputs"]} == {
            "SEEDS": "INT64", "SCORES": "FP32", "KEPT": "INT32", "ADAPTER_VERSION": "INT64"}
        config = client.get_model_config("explore", as_json=True)["config"]
        assert [i["name"] for i in config["input"] if i.get("optional")] == ["K", "GATE"]

        prompts = ["a red circle", "two blue squares"]
        res = client.infer("explore", triton_inputs(prompts, n=3, steps=2, k=2))
        seeds, scores, kept = res.as_numpy("SEEDS"), res.as_numpy("SCORES"), res.as_numpy("KEPT")
        assert seeds.shape == (2, 3) and scores.shape == (2, 3) and kept.shape == (2, 2)
        assert res.as_numpy("ADAPTER_VERSION").tolist() == [0]
        ref = world.core(0, prompts, seeds.tolist())
        np.testing.assert_array_equal(scores, ref.scores)
        assert kept.tolist() == ref.kept

        no_k = client.infer("explore", triton_inputs(prompts[:1], n=4, steps=2))  # K defaults to the plane's (2)
        assert no_k.as_numpy("KEPT").shape == (1, 2)

        gate = tgrpc.InferInput("GATE", [1], "BYTES")   # the validity gate by name: a random model draws no blank
        gate.set_data_from_numpy(np.array([b"flat"], dtype=object))
        gated = client.infer("explore", [*triton_inputs(prompts, n=3, steps=2, k=2), gate])
        ref = world.core(0, prompts, gated.as_numpy("SEEDS").tolist())
        assert gated.as_numpy("KEPT").tolist() == ref.kept
        gate.set_data_from_numpy(np.array([b"blurry"], dtype=object))
        with pytest.raises(InferenceServerException, match="GATE: unknown validity gate 'blurry'"):
            client.infer("explore", [*triton_inputs(prompts, n=3, steps=2, k=2), gate])
    finally:
        client.close()


def test_the_explore_model_over_kserve_rest(world, served):
    """The same model through tritonclient.http (the REST door on the ops port): core results, and the
    statistics count the request."""
    import tritonclient.http as thttp

    client = thttp.InferenceServerClient(f"127.0.0.1:{served.svc.http.port}")
    try:
        assert client.is_server_ready() and client.is_model_ready("explore")
        assert client.get_server_metadata()["name"] == "solrl-explorer"
        assert [i["name"] for i in client.get_model_config("explore")["input"] if i.get("optional")] == ["K", "GATE"]
        before = client.get_inference_statistics("explore")["model_stats"][0]["inference_count"]
        inputs = [thttp.InferInput("PROMPTS", [1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([b"a red circle"], dtype=object))
        for name, value in (("N", 3), ("STEPS", 2), ("K", 2)):
            inputs.append(thttp.InferInput(name, [1], "INT32"))
            inputs[-1].set_data_from_numpy(np.array([value], dtype=np.int32))
        res = client.infer("explore", inputs)
        seeds = res.as_numpy("SEEDS")
        ref = world.core(0, ["a red circle"], seeds.tolist())
        np.testing.assert_array_equal(res.as_numpy("SCORES"), ref.scores)
        assert res.as_numpy("KEPT").tolist() == ref.kept
        assert client.get_inference_statistics("explore")["model_stats"][0]["inference_count"] == before + 1
    finally:
        client.close()
    # and with the curl binary, JSON in and out
    import json
    import shutil
    import subprocess

    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl binary on this machine")
    body = json.dumps({"inputs": [{"name": "PROMPTS", "shape": [1], "datatype": "BYTES", "data": ["a red circle"]},
                                  {"name": "N", "shape": [1], "datatype": "INT32", "data": [3]},
                                  {"name": "STEPS", "shape": [1], "datatype": "INT32", "data": [2]},
                                  {"name": "K", "shape": [1], "datatype": "INT32", "data": [2]}]})
    out = subprocess.run([curl, "-s", "-X", "POST", "--data-binary", body,
                          f"http://127.0.0.1:{served.svc.http.port}/v2/models/explore/infer"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    outputs = {o["name"]: o for o in json.loads(out)["outputs"]}
    seeds = np.array(outputs["SEEDS"]["data"], dtype=np.int64).reshape(outputs["SEEDS"]["shape"])
    ref = world.core(0, ["a red circle"], seeds.tolist())
    np.testing.assert_array_equal(np.array(outputs["SCORES"]["data"], dtype=np.float32), ref.scores.reshape(-1))


def triton_inputs(prompts: list[str], *, n: int, steps: int, k: int | None = None,
                  n_dtype: str = "INT32") -> list[tgrpc.InferInput]:
    p = tgrpc.InferInput("PROMPTS", [len(prompts)], "BYTES")
    p.set_data_from_numpy(np.array([s.encode() for s in prompts], dtype=object))
    out = [p]
    for name, value, dtype in (("N", n, n_dtype), ("STEPS", steps, "INT32"), ("K", k, "INT32")):
        if value is not None:
            t = tgrpc.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=np.int64 if dtype == "INT64" else np.int32))
            out.append(t)
    return out


def test_remote_reward_service_gives_the_in_process_scores(world):
    reward = start_reward(RewardDataPlane({"jpeg_compressibility": JpegCompressibility()}),
                          ServiceMetrics("reward"))
    try:
        scorer = build_scorer("jpeg_compressibility", reward.grpc.address)
        assert isinstance(scorer, RemoteScorer) and scorer.name == "jpeg_compressibility"
        plane = world.plane(scorer=scorer)
        out = plane.explore([PROMPT], [SEEDS])
        np.testing.assert_array_equal(out.scores, world.expected[0].scores)
        assert out.kept == world.expected[0].kept and out.version == 0
        with pytest.raises(ValueError, match="reward service .*INVALID_ARGUMENT"):  # the remote's own check
            scorer(np.zeros((2, 8, 8, 3), np.uint8), ["a red circle"])
        plane.close()
    finally:
        reward.stop(0)
    assert isinstance(build_scorer("jpeg_compressibility"), JpegCompressibility)


# ---------------------------------------------------------------------- hot reload

def test_pushed_adapter_serves_exactly_the_core_merge(world, served):
    assert_matches(served.explore(), world, 0)
    r = served.push(world.payloads[1], 1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == 1 and body["sha256"] == sha256_hex(world.payloads[1]) and body["swap_ms"] > 0
    assert served.http.get("/v1/adapter").json() == {"version": 1, "sha256": body["sha256"]}
    sel = served.explore()
    assert_matches(sel, world, 1)
    assert sel.adapter_version.sha256 == body["sha256"]
    assert not np.array_equal(world.expected[1].scores, world.expected[0].scores)  # the adapter matters

    # the LoadAdapter RPC is the same door
    data = world.payloads[2]
    request = common_pb2.LoadAdapterRequest(safetensors=data, version=2, sha256=sha256_hex(data))
    resp = served.stub.LoadAdapter(request, metadata=[("authorization", f"Bearer {TOKEN}")])
    assert resp.adapter_version.version == 2 and resp.adapter_version.sha256 == sha256_hex(data)
    assert_matches(served.explore(), world, 2)
    info = served.stub.Info(common_pb2.InfoRequest())
    assert info.adapter_version.version == 2
    assert "solrl_adapter_version{service=\"explorer\"} 2.0" in served.http.get("/metrics").text
    assert 'solrl_adapter_loads_total{outcome="ok",service="explorer"} 2.0' in served.http.get("/metrics").text


class GatedShapes(ShapesModel):
    """The real model; the first velocity call waits until the test releases it (to push mid-sampling)."""

    def __init__(self, base: ShapesModel) -> None:
        super().__init__(base.transformer, base.text_encoder)
        self.entered, self.release = threading.Event(), threading.Event()

    def velocity(self, transformer, x, t, cond):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60)
        return super().velocity(transformer, x, t, cond)


def test_explore_in_flight_finishes_on_the_version_it_began_with(world):
    gated = GatedShapes(world.served_model())
    s = Served(world.plane(gated))
    try:
        results: list = []
        caller = threading.Thread(target=lambda: results.append(s.explore()))
        caller.start()
        assert gated.entered.wait(30)              # step 1 of 2 is under way on version 0
        pushed: list = []
        pusher = threading.Thread(target=lambda: pushed.append(s.push(world.payloads[1], 1)))
        pusher.start()
        pusher.join(1.0)                           # the push waits for the call: the one copy is not changed under it
        assert pusher.is_alive() and not pushed and s.version() == 0
        gated.release.set()
        caller.join(60)
        pusher.join(60)
        assert pushed[0].status_code == 200 and s.version() == 1
        assert_matches(results[0], world, 0)       # both steps ran on version 0
        assert_matches(s.explore(), world, 1)      # the next call gets the new one
    finally:
        gated.release.set()
        s.close()


def test_pushes_during_concurrent_explores_never_mix_versions(world, served):
    results: list[common_pb2.SeedSelection] = []
    errors: list[BaseException] = []

    def client() -> None:
        try:
            for _ in range(3):
                results.append(served.explore())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    for version in (1, 2):
        time.sleep(0.05)
        assert served.push(world.payloads[version], version).status_code == 200
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 9
    for sel in results:
        assert_matches(sel, world, sel.adapter_version.version)
    assert served.version() == 2


def test_a_request_for_a_newer_version_waits_for_its_push(world):
    s = Served(world.plane(version_wait_s=0.2))
    try:
        err = rpc_error(s.explore, min_adapter_version=1)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and ">= 1" in err.details()
        s.svc.plane.version_wait_s = 30.0
        pusher = threading.Timer(0.3, lambda: s.push(world.payloads[1], 1))
        pusher.start()
        assert_matches(s.explore(min_adapter_version=1), world, 1)
        pusher.join()
    finally:
        s.close()


def test_rejected_pushes_keep_the_old_version(world, served):
    good = world.payloads[1]
    assert served.push(good, 1).status_code == 200
    v2 = world.payloads[2]

    def rejected(response: httpx.Response, status: int, words: str) -> None:
        assert response.status_code == status, response.text
        assert words in response.json()["detail"], response.json()
        assert served.version() == 1

    rejected(served.push(v2, 2, token=None), 401, "missing bearer token")
    assert served.push(v2, 2, token=None).headers["www-authenticate"] == "Bearer"
    rejected(served.push(v2, 2, token="wrong"), 401, "invalid bearer token")
    rejected(served.push(v2, 2, token=None, Authorization=f"Basic {TOKEN}"), 401, "missing bearer token")
    rejected(served.push(b"definitely not safetensors" * 4, 2), 400, "adapter: data")
    rejected(served.push(v2[:-40], 2), 400, "adapter: data")                       # truncated
    rejected(served.push(pickle.dumps(world.adapters.state_dict("default")), 2), 400, "adapter: data")
    rejected(served.push(v2, 2, sha="0" * 64), 400, "sha256 mismatch")
    rejected(served.push(v2, 3), 400, "metadata version 2")
    rejected(served.push(v2, "two"), 400, "X-Adapter-Version header must be an integer")
    same = served.push(good, 1)  # the served adapter again (a resumed trainer's re-push): a no-op
    assert same.status_code == 200 and same.json()["swap_ms"] == 0 and same.json()["previous_version"] == 1
    other_v1 = encode_adapter(world.adapters.state_dict("default"), 1, world.lora)  # other bytes, same version
    rejected(served.push(other_v1, 1), 409, "not newer than the served version 1")
    rejected(served.push(good, 0), 400, "version must be an integer >= 1")
    rejected(served.push(b"x" * (MAX_ADAPTER_BYTES + 1), 2), 413, "over the limit")
    chunked = served.http.put("/v1/adapter", content=iter([b"x" * 4096] * 9),
                              headers={"Authorization": f"Bearer {TOKEN}", "X-Adapter-Version": "2",
                                       "X-Adapter-Sha256": "0" * 64})
    rejected(chunked, 413, "over the limit")

    # this server was started with a pinned LoRA (--lora-rank ...): any other layout is refused
    base = copy.deepcopy(world.model.transformer)
    for spec in (LoraSpec(rank=4, alpha=8.0, target_modules=world.lora.target_modules),
                 LoraSpec(rank=2, alpha=4.0, target_modules=("to_q",)),
                 LoraSpec(rank=2, alpha=3.0, target_modules=world.lora.target_modules)):
        other = encode_adapter(LoraAdapters(copy.deepcopy(base), spec, seed=0).state_dict("default"), 2, spec)
        rejected(served.push(other, 2), 400, "differ from the LoRA this server was started with")

    metadata = [("authorization", "Bearer wrong")]
    err = rpc_error(served.stub.LoadAdapter, common_pb2.LoadAdapterRequest(
        safetensors=v2, version=2, sha256=sha256_hex(v2)), metadata=metadata)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    err = rpc_error(served.stub.LoadAdapter, common_pb2.LoadAdapterRequest(
        safetensors=other_v1, version=1, sha256=sha256_hex(other_v1)), metadata=[("authorization", f"Bearer {TOKEN}")])
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in err.details()

    assert_matches(served.explore(), world, 1)  # still serving version 1, exactly
    metrics = served.http.get("/metrics").text
    assert 'solrl_adapter_loads_total{outcome="unauthenticated",service="explorer"} 5.0' in metrics


def test_an_unpinned_server_serves_the_layout_each_adapter_declares(world):
    """Started without LoRA flags (as compose and the manifests start it), a worker takes rank, alpha and
    targets from each pushed adapter's metadata, and the result equals the core's merged copy."""
    s = Served(ExplorerDataPlane(world.served_model(), PRECISION, None, world.scorer, steps=2, kept=2))
    try:
        assert s.push(world.payloads[1], 1).status_code == 200      # rank 2 / alpha 4, all four targets
        assert_matches(s.explore(min_adapter_version=1), world, 1)
        spec = LoraSpec(rank=4, alpha=8.0, target_modules=("to_q", "to_v"))
        adapters = LoraAdapters(copy.deepcopy(world.model.transformer), spec, seed=3)
        with torch.no_grad():
            for p in adapters.parameters("default"):
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        data = encode_adapter(adapters.state_dict("default"), 2, spec)
        assert s.push(data, 2).status_code == 200                  # another layout: served as declared
        ref = InferenceCopy(adapters, PRECISION, world.model.spec.quant_skip, world.model.spec.quant_min_features)
        ref.sync(adapters.merged_weights("default"), 2)
        want = explore(world.model, ref.module, [PROMPT], [list(SEEDS)], 2, SamplerSpec(), world.scorer, 2,
                       "best_worst")
        got = s.explore(min_adapter_version=2)
        assert got.adapter_version.version == 2 and list(got.kept_indices) == want.kept[0]
        np.testing.assert_array_equal(np.array(got.proxy_scores, dtype=np.float32), want.scores[0])
        assert not np.array_equal(want.scores[0], world.expected[1].scores[0])  # the new layout changed them
        # a layout this model does not have is refused, naming why, and version 2 stays
        alien = LoraSpec(rank=2, alpha=4.0, target_modules=("to_q",))
        state = {k.replace("to_q", "to_nowhere"): v for k, v in
                 LoraAdapters(copy.deepcopy(world.model.transformer), alien, seed=0).state_dict("default").items()}
        bad = encode_adapter(state, 3, LoraSpec(rank=2, alpha=4.0, target_modules=("to_nowhere",)))
        response = s.push(bad, 3)
        assert response.status_code == 400 and "does not fit this model" in response.json()["detail"], response.text
        assert s.version() == 2
    finally:
        s.close()

def test_without_a_token_hot_reload_is_refused(world):
    s = Served(world.plane(), token=None)
    try:
        r = s.push(world.payloads[1], 1)
        assert r.status_code == 403 and "SOLRL_ADAPTER_TOKEN" in r.json()["detail"]
        err = rpc_error(s.stub.LoadAdapter, common_pb2.LoadAdapterRequest(safetensors=world.payloads[1], version=1))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert s.version() == 0 and s.http.get("/v1/info").json()["adapter_loading"] is False
    finally:
        s.close()


# ---------------------------------------------------------------------- lifecycle and bad input

def test_health_info_and_ops(world, served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", "solrl.explorer.v1.Explorer", "inference.GRPCInferenceService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    info = served.stub.Info(common_pb2.InfoRequest())
    assert (info.model, info.precision, info.reward) == ("shapes", "nvfp4-emu", "jpeg_compressibility")
    assert info.adapter_version.version == 0
    # the resident copy is smaller than the same weights in fp32, because the attention and MLP are FP4
    fp32 = sum(p.numel() * 4 for p in world.model.transformer.parameters())
    assert 0 < info.resident_weight_bytes < fp32
    assert served.http.get("/readyz").status_code == 200
    ops = served.http.get("/v1/info").json()
    assert ops["resident_weight_bytes"] == info.resident_weight_bytes and ops["adapter_loading"] is True


def test_a_job_naming_a_proxy_switches_the_explorer_to_it(world, served):
    """The adaptive proxy in services mode: the trainer names the precision and layer policy in the job; the
    explorer rebuilds the served adapter version through that backend, keeps serving it, and says which it
    used. Results equal the core explorer of that precision and policy, synced with the same adapter."""
    from solrl.precision.policy import policy_config

    for v in (1, 2):
        assert served.push(world.payloads[v], v).status_code == 200
    spec = world.model.spec
    ref = InferenceCopy(world.adapters, policy_config("fp8-e4m3-emu", "keep-projections", spec))
    ref.sync(world.adapters.merged_weights("default"), 2)  # world.adapters holds version 2
    want = explore(world.model, ref.module, [PROMPT], [SEEDS], 2, SamplerSpec(), world.scorer, 2, "best_worst")
    assert not np.array_equal(want.scores, world.expected[2].scores)  # another precision: other images
    for job in ({"precision": "fp8-e4m3-emu", "precision_policy": "keep-projections"}, {}):  # {}: it stays
        sel = served.explore(**job)
        assert sel.proxy == "fp8-e4m3-emu/keep-projections" and sel.adapter_version.version == 2
        np.testing.assert_array_equal(np.array(sel.proxy_scores, dtype=np.float32), want.scores[0])
    info = served.stub.Info(common_pb2.InfoRequest())
    assert info.precision == "fp8-e4m3-emu" and "nvfp4-emu" in info.available_precisions
    sel = served.explore(precision="nvfp4-emu")  # back to its own: bit-equal to the core NVFP4 explorer
    assert sel.proxy == "nvfp4-emu"
    assert_matches(sel, world, 2)
    before = served.stub.Info(common_pb2.InfoRequest()).precision
    rpc_error(served.explore, precision="fp3-emu")  # a bad name switches nothing
    if "nvfp4" not in info.available_precisions:  # Transformer Engine's NVFP4 without a Blackwell GPU
        err = rpc_error(served.explore, precision="nvfp4")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("job.precision: 'nvfp4' cannot run on this explorer"), err.details()
    assert served.stub.Info(common_pb2.InfoRequest()).precision == before == "nvfp4-emu"


def test_a_job_naming_the_validity_gate_ranks_its_failing_candidates_out(world, served, monkeypatch):
    """ExploreJob.gate (the run's guard.gate): the explorer ranks with the gate the job names, as the core explore
    pass does with it, and says which gate it applied and how many candidates failed. A random model draws no blank
    canvas, so the "flat" gate passes every candidate; a gate registered here fails the seed the ungated ranking
    keeps as its best."""
    from solrl.algo import guards

    plain = world.expected[0]
    best = plain.kept[0][0]
    best_image = plain.generated.images[best]
    monkeypatch.setitem(guards.GATE_CHECKS, "not-the-best",
                        lambda images: np.array([not np.array_equal(im, best_image) for im in images]))
    sel = served.explore(gate="not-the-best")
    want = explore(world.model, world.refs[0], [PROMPT], [SEEDS], 2, SamplerSpec(), world.scorer, 2, "best_worst",
                   valid=guards.GATE_CHECKS["not-the-best"])
    assert (sel.gate, sel.gate_failed, want.failed) == ("not-the-best", 1, 1)
    assert list(sel.kept_indices) == want.kept[0] and best not in sel.kept_indices
    np.testing.assert_array_equal(np.array(sel.proxy_scores, dtype=np.float32), plain.scores[0])  # scores ungated
    flat = served.explore(gate="flat")
    assert (flat.gate, flat.gate_failed) == ("flat", 0) and list(flat.kept_indices) == plain.kept[0]
    assert served.explore().gate == ""


@pytest.mark.parametrize("job, n, field", [
    ({"prompt": "a red dragon"}, 0, "job.prompt"),
    ({"prompt": ""}, 0, "job.prompt"),
    ({"kept": 5}, 0, "job.kept"),
    ({"kept": 3}, 0, "job.kept"),
    ({"steps": -1}, 0, "job.steps"),
    ({"selection": "best"}, 0, "job.selection"),
    ({"seeds": [2**63]}, 0, "job.seeds[0]"),
    ({"seeds": []}, 0, "n"),
    ({}, 3, "n"),
    ({"sampler": common_pb2.SamplerSpec(solver="sde")}, 0, "job.sampler.solver"),
    ({"sampler": common_pb2.SamplerSpec(guidance=0.5)}, 0, "job.sampler.guidance"),
    ({"precision": "fp3-emu"}, 0, "job.precision"),
    ({"precision": "fp8-e4m3-emu", "precision_policy": "keep-all"}, 0, "job.precision_policy"),
    ({"gate": "blurry"}, 0, "job.gate"),
])
def test_bad_explore_input_is_invalid_argument_naming_the_field(served, job, n, field):
    err = rpc_error(served.explore, n=n, **job)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field), err.details()


def test_bad_kserve_input_names_the_tensor(served):
    err = rpc_error(served.stub.Explore, explorer_pb2.ExploreRequest())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("job")
    client = tgrpc.InferenceServerClient(served.svc.grpc.address)
    try:
        for inputs, words in ((triton_inputs([PROMPT], n=4, steps=2, k=6), "K"),
                              (triton_inputs([PROMPT], n=4, steps=2, n_dtype="INT64"), "N: expected INT32"),
                              (triton_inputs([PROMPT], n=4, steps=2)[:2], "STEPS: missing"),
                              (triton_inputs(["a red dragon"], n=4, steps=2), "PROMPTS"),
                              (triton_inputs([PROMPT, PROMPT], n=4096, steps=2), "N: 2 prompts x 4096 seeds")):
            with pytest.raises(InferenceServerException) as info:
                client.infer("explore", inputs)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and words in info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.infer("nope", triton_inputs([PROMPT], n=4, steps=2))
        assert info.value.status() == "StatusCode.NOT_FOUND"
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_command_line_serves_the_saved_model_with_the_env_token(world):
    import argparse

    p = argparse.ArgumentParser()
    explorer_server.add_arguments(p, environ={"SOLRL_REWARD_ADDR": "", "SOLRL_BIND_HOST": "127.0.0.1"})
    grpc_port, http_port = free_port(), free_port()
    args = p.parse_args(["--model-path", str(world.path), "--lora-rank", "2", "--lora-alpha", "4",
                         "--reward", "jpeg_compressibility", "--steps", "2", "--kept", "2",
                         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--base-precision", "fp32"])
    assert args.host == "127.0.0.1" and args.precision is None   # unset: the run's, else the role default
    stop = threading.Event()
    runner = threading.Thread(target=explorer_server.run, args=(args, stop, {"SOLRL_ADAPTER_TOKEN": TOKEN}))
    runner.start()
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the explorer did not come up"
            time.sleep(0.1)
        data = world.payloads[1]
        r = http.put("/v1/adapter", content=data, headers={"Authorization": f"Bearer {TOKEN}", "X-Adapter-Version": "1",
                                                           "X-Adapter-Sha256": sha256_hex(data)})
        assert r.status_code == 200, r.text
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            sel = explorer_pb2_grpc.ExplorerStub(channel).Explore(explorer_pb2.ExploreRequest(
                job=common_pb2.ExploreJob(prompt=PROMPT, seeds=SEEDS)), timeout=60).selection
        assert_matches(sel, world, 1)  # defaults from the command line: 2 steps, k = 2
        http.close()
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()


def test_rollout_roles_take_their_settings_from_the_run_config():
    """SOLRL_PRESET + SOLRL_SET (what compose and the manifests give every role) set what the trainer
    trains and what each rollout service serves; explicit flags win; bad input names the variable."""
    import argparse

    from services.regenerator import server as regenerator_server
    from services.rollout.shell import settle_role_args
    from solrl.config import resolve

    env = {"SOLRL_PRESET": "shapes-sol-rl",
           "SOLRL_SET": "rollout.explore_steps=3 rollout.kept=4 rollout.steps=7 reward=jpeg_compressibility"}
    cfg = resolve("shapes-sol-rl", None, env["SOLRL_SET"].split())
    for module, role, want in ((explorer_server, "explorer", {"precision": cfg.rollout.explore_precision.backend,
                                                              "steps": 3, "kept": 4}),
                               (regenerator_server, "regenerator", {"precision": cfg.rollout.precision.backend,
                                                                    "steps": 7})):
        p = argparse.ArgumentParser()
        module.add_arguments(p, environ=env)
        args = settle_role_args(p.parse_args([]), role)
        got = {k: getattr(args, k) for k in want}
        assert got == want, (role, got)
        assert (args.model, args.reward, args.base_precision, args.micro_batch) == \
            (cfg.model.name, "jpeg_compressibility", cfg.rollout.precision.backend, cfg.rollout.micro_batch)
        explicit = settle_role_args(p.parse_args(["--steps", "5", "--reward", "shapes"]), role)
        assert (explicit.steps, explicit.reward) == (5, "shapes")
    p = argparse.ArgumentParser()
    explorer_server.add_arguments(p, environ={})
    plain = settle_role_args(p.parse_args([]), "explorer")
    assert (plain.precision, plain.steps, plain.kept, plain.model) == ("nvfp4-emu", 6, 24, "shapes")
    # the adaptive proxy: the explorer starts on the first candidate (each job then names the chosen one)
    p = argparse.ArgumentParser()
    explorer_server.add_arguments(p, environ={"SOLRL_SET": "rollout.explore_precision.backend=auto "
                                                           """'rollout.proxy.candidates=["fp8-e4m3-emu@4","bf16@6"]'"""})
    auto = settle_role_args(p.parse_args([]), "explorer")
    assert (auto.precision, auto.steps) == ("fp8-e4m3-emu", 4)
    p = argparse.ArgumentParser()
    explorer_server.add_arguments(p, environ={"SOLRL_SET": "rollout.kept"})
    with pytest.raises(ValueError, match="SOLRL_SET"):
        settle_role_args(p.parse_args([]), "explorer")
