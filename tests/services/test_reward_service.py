"""Reward service contract tests over real sockets (127.0.0.1, ephemeral ports), and the shared plumbing.

Expected scores come from the core scorers called directly on the same images; ground-truth renders
of the shapes world score exactly 1 against their own prompt.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from services.common.batching import DynamicBatcher
from services.common.env import Addresses
from services.common.errors import UnavailableError
from services.common.metrics import ServiceMetrics
from services.common.ops import create_ops_app
from services.common.tensors import (
    numpy_to_tensor,
    tensor_to_numpy,
    tensor_to_torch,
    torch_to_tensor,
)
from services.reward.dataplane import RewardDataPlane
from services.reward.server import start
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from solrl.rewards.jpeg import JpegCompressibility
from solrl.shapes.reward import ShapesReward
from solrl.shapes.world import parse, render

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red circle", "two blue squares", "a green triangle on the left",
           "a yellow square above a purple circle"]


def rendered(prompts: list[str], seed: int = 0) -> np.ndarray:
    """Ground-truth images [B, 32, 32, 3] uint8 of the prompts."""
    return np.stack([render(parse(p), np.random.default_rng(seed + i)) for i, p in enumerate(prompts)])


def triton_inputs(images: np.ndarray, prompts: list[str]) -> list[tgrpc.InferInput]:
    a = tgrpc.InferInput("IMAGES", list(images.shape), "UINT8")
    a.set_data_from_numpy(images)
    b = tgrpc.InferInput("PROMPTS", [len(prompts)], "BYTES")
    b.set_data_from_numpy(np.array([p.encode() for p in prompts], dtype=object))
    return [a, b]


class CountingScorer:
    """A real scorer that also records the batch size of every call it gets."""

    def __init__(self, scorer) -> None:
        self.scorer, self.batches, self._lock = scorer, [], threading.Lock()

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        with self._lock:
            self.batches.append(len(images))
        return self.scorer(images, prompts)


class FailingScorer:
    """A scorer with a bug: every call raises RuntimeError (the INTERNAL path)."""

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        raise RuntimeError("scorer bug: boom")


@pytest.fixture(scope="module")
def service(reward_service):
    return reward_service


@pytest.fixture(scope="module")
def channel(service):
    with grpc.insecure_channel(service.grpc.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def triton(service):
    client = tgrpc.InferenceServerClient(service.grpc.address)
    yield client
    client.close()


def rpc_error(fn, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)
    return info.value


# ---------------------------------------------------------------------------- contract: Triton / KServe v2


def test_triton_client_gets_the_core_scores(service, triton) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("shapes") and triton.is_model_ready("jpeg_compressibility")
    assert not triton.is_model_ready("no_such_reward")
    md = triton.get_model_metadata("shapes")
    assert md.name == "shapes" and list(md.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in md.inputs] == [
        ("IMAGES", "UINT8", [-1, -1, -1, 3]), ("PROMPTS", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in md.outputs] == [("SCORES", "FP32", [-1])]
    cfg = triton.get_model_config("shapes").config
    assert cfg.name == "shapes" and [i.name for i in cfg.input] == ["IMAGES", "PROMPTS"]
    assert triton.get_server_metadata().name == "solrl-reward"

    images = rendered(PROMPTS)
    prompts = [*PROMPTS[:2], PROMPTS[3], PROMPTS[2]]  # the last two images scored against the wrong prompt
    result = triton.infer("shapes", triton_inputs(images, prompts), outputs=[tgrpc.InferRequestedOutput("SCORES")],
                          request_id="req-7")
    scores = result.as_numpy("SCORES")
    assert scores.dtype == np.float32 and scores.shape == (4,)
    np.testing.assert_array_equal(scores, ShapesReward()(images, prompts))
    np.testing.assert_array_equal(scores[:2], [1.0, 1.0])  # ground truth matches its own prompt exactly
    assert (scores[2:] < 1.0).all()
    assert result.get_response().id == "req-7" and result.get_response().model_version == "1"

    jpeg = triton.infer("jpeg_compressibility", triton_inputs(images, prompts)).as_numpy("SCORES")
    np.testing.assert_array_equal(jpeg, JpegCompressibility()(images, prompts))


def test_typed_contents_give_the_same_scores_as_raw(channel) -> None:
    images, prompts = rendered(PROMPTS[:3], seed=5), PROMPTS[:3]
    req = service_pb2.ModelInferRequest(model_name="shapes", model_version="1")
    req.inputs.add(name="IMAGES", datatype="UINT8", shape=list(images.shape)).contents.uint_contents.extend(
        images.ravel().tolist())
    req.inputs.add(name="PROMPTS", datatype="BYTES", shape=[3]).contents.bytes_contents.extend(
        p.encode() for p in prompts)
    resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req)
    assert [(o.name, o.datatype, list(o.shape)) for o in resp.outputs] == [("SCORES", "FP32", [3])]
    scores = np.frombuffer(resp.raw_output_contents[0], dtype="<f4")
    np.testing.assert_array_equal(scores, ShapesReward()(images, prompts))


# ---------------------------------------------------------------------------- contract: solrl.reward.v1


def test_score_rpc_matches_the_core_and_the_triton_door(channel, triton) -> None:
    stub = reward_pb2_grpc.RewardStub(channel)
    listing = stub.ListRewards(reward_pb2.ListRewardsRequest())
    assert list(listing.names) == ["shapes", "jpeg_compressibility"] and listing.default_name == ""  # no default
    images, prompts = rendered(PROMPTS, seed=11), [PROMPTS[1], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    for reward, core in (("shapes", ShapesReward()), ("jpeg_compressibility", JpegCompressibility())):
        resp = stub.Score(reward_pb2.ScoreRequest(reward=reward, images=numpy_to_tensor(images), prompts=prompts))
        assert resp.reward == reward
        np.testing.assert_array_equal(np.array(resp.scores, dtype=np.float32), core(images, prompts))
        door = triton.infer(resp.reward, triton_inputs(images, prompts)).as_numpy("SCORES")
        np.testing.assert_array_equal(np.array(resp.scores, dtype=np.float32), door)


def test_health_and_reflection(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", "solrl.reward.v1.Reward", "inference.GRPCInferenceService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert rpc_error(health.Check, health_pb2.HealthCheckRequest(service="nope")).code() == grpc.StatusCode.NOT_FOUND
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"solrl.reward.v1.Reward", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services


# ---------------------------------------------------------------------------- bad input


def test_bad_input_maps_to_status_codes_naming_the_field(channel, triton) -> None:
    images, prompts = rendered(PROMPTS[:2]), PROMPTS[:2]
    bad = {
        "wrong dtype": ("shapes", lambda: [_input("IMAGES", images.astype(np.float32), "FP32"), _prompts(prompts)],
                        "INVALID_ARGUMENT", ["IMAGES", "UINT8", "FP32"]),
        "wrong shape": ("shapes", lambda: [_input("IMAGES", images[..., 0], "UINT8"), _prompts(prompts)],
                        "INVALID_ARGUMENT", ["IMAGES", "shape"]),
        "unknown word": ("shapes", lambda: triton_inputs(images, ["a red dog", prompts[1]]),
                         "INVALID_ARGUMENT", ["PROMPTS", "'dog'"]),
        "unknown model": ("no_such_reward", lambda: triton_inputs(images, prompts),
                          "NOT_FOUND", ["model_name", "no_such_reward"]),
        "mismatched batch": ("shapes", lambda: triton_inputs(images, [*prompts, prompts[0]]),
                             "INVALID_ARGUMENT", ["PROMPTS", "3 prompts for 2 images"]),
        "missing input": ("shapes", lambda: triton_inputs(images, prompts)[:1], "INVALID_ARGUMENT", ["PROMPTS"]),
    }
    for case, (model, inputs, code, words) in bad.items():
        with pytest.raises(InferenceServerException) as info:
            triton.infer(model, inputs())
        assert info.value.status() == f"StatusCode.{code}", case
        assert all(w in info.value.message() for w in words), (case, info.value.message())
    with pytest.raises(InferenceServerException, match="model_version"):
        triton.infer("shapes", triton_inputs(images, prompts), model_version="7")
    with pytest.raises(InferenceServerException, match="no_such_reward") as info:
        triton.get_model_metadata("no_such_reward")
    assert info.value.status() == "StatusCode.NOT_FOUND"

    infer = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer
    raw_cases = {  # malformed wire data, sent without tritonclient's own checks
        "short raw bytes": (_raw_request(images.tobytes()[:-1], prompts), "IMAGES: raw data holds"),
        "raw count": (_raw_request(images.tobytes(), prompts, drop_raw=True), "raw_input_contents"),
        "bytes framing": (_raw_request(images.tobytes(), prompts, prompt_raw=b"\x09\x00\x00\x00abc"),
                          "PROMPTS: malformed BYTES"),
    }
    typed = service_pb2.ModelInferRequest(model_name="shapes")
    typed.inputs.add(name="IMAGES", datatype="UINT8", shape=[1, 4, 4, 3]).contents.uint_contents.extend([300] * 48)
    typed.inputs.add(name="PROMPTS", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a red circle")
    raw_cases["typed out of range"] = (typed, "IMAGES: values outside the range of UINT8")
    for case, (req, words) in raw_cases.items():
        err = rpc_error(infer, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details(), (case, err.details())

    score = reward_pb2_grpc.RewardStub(channel).Score
    t = numpy_to_tensor(images)
    score_cases = {
        "dtype": (reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(images.astype(np.float32)), prompts=prompts),
                  grpc.StatusCode.INVALID_ARGUMENT, "images must have dtype uint8, got float32"),
        "bytes": (reward_pb2.ScoreRequest(reward="shapes",
                                          images=common_pb2.Tensor(dtype="uint8", shape=t.shape, data=t.data[:-3]),
                                          prompts=prompts), grpc.StatusCode.INVALID_ARGUMENT, "images.data holds"),
        "unknown dtype": (reward_pb2.ScoreRequest(reward="shapes", images=common_pb2.Tensor(dtype="complex64", shape=[1]),
                                                  prompts=prompts), grpc.StatusCode.INVALID_ARGUMENT, "images.dtype"),
        "missing": (reward_pb2.ScoreRequest(reward="shapes", prompts=prompts), grpc.StatusCode.INVALID_ARGUMENT,
                    "images: required"),
        "batch": (reward_pb2.ScoreRequest(reward="shapes", images=t, prompts=prompts[:1]), grpc.StatusCode.INVALID_ARGUMENT,
                  "images: got 2 images but 1 prompts"),
        "word": (reward_pb2.ScoreRequest(reward="shapes", images=t, prompts=["a red circle", "a pink circle"]),
                 grpc.StatusCode.INVALID_ARGUMENT, "prompts: unknown word 'pink'"),
        "no reward": (reward_pb2.ScoreRequest(images=t, prompts=prompts), grpc.StatusCode.INVALID_ARGUMENT,
                      "reward: required (one of ['shapes', 'jpeg_compressibility'])"),
        "reward": (reward_pb2.ScoreRequest(reward="nope", images=t, prompts=prompts), grpc.StatusCode.NOT_FOUND,
                   "reward: unknown model 'nope'"),
    }
    for case, (req, code, words) in score_cases.items():
        err = rpc_error(score, req)
        assert err.code() == code and words in err.details(), (case, err.code(), err.details())

    # still serving, with the right answers
    assert triton.is_server_ready()
    np.testing.assert_array_equal(triton.infer("shapes", triton_inputs(images, prompts)).as_numpy("SCORES"), [1, 1])
    assert list(score(reward_pb2.ScoreRequest(reward="shapes", images=t, prompts=prompts)).scores) == [1.0, 1.0]


def _input(name: str, array: np.ndarray, datatype: str) -> tgrpc.InferInput:
    i = tgrpc.InferInput(name, list(array.shape), datatype)
    i.set_data_from_numpy(array)
    return i


def _prompts(prompts: list[str]) -> tgrpc.InferInput:
    return _input("PROMPTS", np.array([p.encode() for p in prompts], dtype=object), "BYTES")


def _raw_request(image_raw: bytes, prompts: list[str], drop_raw: bool = False,
                 prompt_raw: bytes | None = None) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="shapes")
    req.inputs.add(name="IMAGES", datatype="UINT8", shape=[len(prompts), 32, 32, 3])
    req.inputs.add(name="PROMPTS", datatype="BYTES", shape=[len(prompts)])
    req.raw_input_contents.append(image_raw)
    if not drop_raw:  # the BYTES wire format by hand: 4-byte little-endian length, then the bytes
        req.raw_input_contents.append(prompt_raw if prompt_raw is not None else
                                      b"".join(struct.pack("<I", len(p)) + p.encode() for p in prompts))
    return req


def test_internal_errors_are_logged_and_unknown_rpcs_unimplemented(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServiceMetrics("reward")
    svc = start(RewardDataPlane({"broken": FailingScorer()}, max_delay_ms=0), metrics, host="127.0.0.1")
    try:
        with grpc.insecure_channel(svc.grpc.address) as ch, caplog.at_level(logging.ERROR):
            req = reward_pb2.ScoreRequest(reward="broken", images=numpy_to_tensor(rendered(PROMPTS[:1])),
                                          prompts=PROMPTS[:1])
            err = rpc_error(reward_pb2_grpc.RewardStub(ch).Score, req)
            assert err.code() == grpc.StatusCode.INTERNAL and "boom" in err.details()
            unload = rpc_error(service_pb2_grpc.GRPCInferenceServiceStub(ch).RepositoryModelUnload,
                               service_pb2.RepositoryModelUnloadRequest(model_name="broken"))
            assert unload.code() == grpc.StatusCode.UNIMPLEMENTED  # the models are fixed at start-up
        assert any("Score failed" in r.getMessage() and r.exc_info for r in caplog.records)
        text = metrics.render().decode()
        assert 'code="INTERNAL",method="/solrl.reward.v1.Reward/Score"' in text
    finally:
        svc.stop(grace=0.2)


# ---------------------------------------------------------------------------- batching


def _concurrently(address: str, requests: list[tuple[np.ndarray, list[str]]]) -> list[object]:
    """Send every request at once from its own thread, alternating the two front doors; results or errors."""
    results: list[object] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def call(i: int) -> None:
        images, prompts = requests[i]
        try:
            barrier.wait()
            if i % 2:
                with grpc.insecure_channel(address) as ch:
                    resp = reward_pb2_grpc.RewardStub(ch).Score(
                        reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(images), prompts=prompts))
                results[i] = np.array(resp.scores, dtype=np.float32)
            else:
                client = tgrpc.InferenceServerClient(address)
                try:
                    results[i] = client.infer("shapes", triton_inputs(images, prompts)).as_numpy("SCORES")
                finally:
                    client.close()
        except Exception as exc:  # returned to the test
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_concurrent_requests_are_batched_and_answered_to_their_caller() -> None:
    counting = CountingScorer(ShapesReward())
    metrics = ServiceMetrics("reward")
    plane = RewardDataPlane({"shapes": counting}, max_batch=64, max_delay_ms=400, observe=metrics.observe_batch)
    svc = start(plane, metrics, host="127.0.0.1", max_workers=16)
    requests = []
    for i in range(8):  # distinct images and (sometimes mismatched) prompts, 1-2 images each
        k = 1 + i % 2
        prompts = [PROMPTS[(i + j) % 4] for j in range(k)]
        images = rendered([PROMPTS[(i + j + i // 4) % 4] for j in range(k)], seed=100 + 10 * i)
        requests.append((images, prompts))
    core = ShapesReward()
    try:
        results = _concurrently(svc.grpc.address, requests)
        for i, (images, prompts) in enumerate(requests):
            assert isinstance(results[i], np.ndarray), (i, results[i])
            np.testing.assert_array_equal(results[i], core(images, prompts))
        assert len(counting.batches) < len(requests) and max(counting.batches) > 2, counting.batches
        assert sum(counting.batches) == sum(len(im) for im, _ in requests)
        text = metrics.render().decode()
        assert f'solrl_batch_calls_total{{model="shapes",service="reward"}} {float(len(counting.batches))}' in text

        # a bad request batched with good ones fails alone; the others still get their own scores
        bad = (rendered(PROMPTS[:1]), ["a red unicorn"])
        results = _concurrently(svc.grpc.address, [requests[0], bad, requests[1], requests[2]])
        assert isinstance(results[1], grpc.RpcError) and results[1].code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompts: unknown word 'unicorn'" in results[1].details()
        for got, (images, prompts) in zip([results[0], *results[2:]], requests[:3], strict=True):
            np.testing.assert_array_equal(got, core(images, prompts))
    finally:
        svc.stop(grace=0.5)


def test_dynamic_batcher_groups_by_shape_and_respects_max_batch() -> None:
    calls: list[tuple[int, ...]] = []

    def fn(items: np.ndarray, meta: list) -> np.ndarray:
        calls.append(items.shape)
        return items.reshape(len(items), -1).sum(axis=1) + np.asarray(meta)

    batcher = DynamicBatcher(fn, max_batch=4, max_delay_s=0.3)
    a = np.arange(6).reshape(2, 3)               # sums 3, 12
    b = np.arange(8).reshape(2, 4)               # another item shape: sums 6, 22
    c = np.ones((3, 3), dtype=np.int64)          # would exceed max_batch with a
    futures = [batcher.submit(a, [100, 200]), batcher.submit(b, [0, 1]), batcher.submit(c, [0, 0, 0])]
    np.testing.assert_array_equal(futures[0].result(5), [103, 212])
    np.testing.assert_array_equal(futures[1].result(5), [6, 23])
    np.testing.assert_array_equal(futures[2].result(5), [3, 3, 3])
    assert sorted(calls) == sorted([(2, 3), (2, 4), (3, 3)])
    with pytest.raises(ValueError, match="2 items but 1 meta"):
        batcher.submit(a, [1])
    batcher.close()
    assert not batcher.alive
    with pytest.raises(UnavailableError):
        batcher.submit(a, [1, 2])
    with pytest.raises(ValueError, match="max_batch"):
        DynamicBatcher(fn, max_batch=0)


# ---------------------------------------------------------------------------- ops plane


def test_ops_http_endpoints(service, channel) -> None:
    reward_pb2_grpc.RewardStub(channel).ListRewards(reward_pb2.ListRewardsRequest())
    base = f"http://127.0.0.1:{service.http.port}"
    assert httpx.get(f"{base}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{base}/readyz")
    assert ready.status_code == 200 and ready.json() == {"ready": True}
    info = httpx.get(f"{base}/v1/info").json()
    assert info["models"] == ["shapes", "jpeg_compressibility"] and info["grpc_port"] == service.grpc.port
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert ('solrl_grpc_requests_total{code="OK",method="/solrl.reward.v1.Reward/ListRewards",service="reward"}'
            in metrics.text)

    client = TestClient(create_ops_app(metrics=ServiceMetrics("x"), ready=lambda: False, info=lambda: {"a": 1}))
    assert client.get("/readyz").status_code == 503 and client.get("/v1/info").json() == {"a": 1}


def test_addresses_from_env() -> None:
    env = {"SOLRL_BIND_HOST": "127.0.0.1", "SOLRL_GRPC_PORT": "9001"}
    assert Addresses.from_env(env, grpc_port=1, http_port=2) == Addresses("127.0.0.1", 9001, 2)
    assert Addresses.from_env({}, grpc_port=1, http_port=2) == Addresses("0.0.0.0", 1, 2)
    with pytest.raises(ValueError, match="SOLRL_HTTP_PORT must be a port number"):
        Addresses.from_env({"SOLRL_HTTP_PORT": "eighty"}, grpc_port=1, http_port=2)
    with pytest.raises(ValueError, match="SOLRL_GRPC_PORT must be in"):
        Addresses.from_env({"SOLRL_GRPC_PORT": "70000"}, grpc_port=1, http_port=2)


def test_server_process_starts_from_env_and_stops_on_sigterm() -> None:
    env = {**os.environ, "SOLRL_BIND_HOST": "127.0.0.1", "SOLRL_GRPC_PORT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "services.reward.server", "--http-port", "0", "--rewards", "shapes"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line, deadline = "", time.monotonic() + 90
        while not line.startswith("solrl reward:") and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        assert line.startswith("solrl reward:"), proc.stderr.read() if proc.poll() is not None else line
        grpc_addr = line.split("grpc ")[1].split(",")[0]
        http_addr = line.split("http ")[1].split(",")[0]
        with grpc.insecure_channel(grpc_addr) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status == \
                health_pb2.HealthCheckResponse.SERVING
            names = reward_pb2_grpc.RewardStub(ch).ListRewards(reward_pb2.ListRewardsRequest()).names
            assert list(names) == ["shapes"]
        assert httpx.get(f"http://{http_addr}/readyz").json() == {"ready": True}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- tensor wire format


def test_tensor_round_trips_and_wire_bytes() -> None:
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"):
        a = (rng.standard_normal((2, 3)) * 50).astype(dtype)
        back = tensor_to_numpy(numpy_to_tensor(a))
        assert back.dtype == a.dtype and back.shape == (2, 3)
        np.testing.assert_array_equal(back, a)
        t = tensor_to_torch(numpy_to_tensor(a))
        assert str(t.dtype) == f"torch.{dtype}"
        np.testing.assert_array_equal(t.numpy(), a)
    # little-endian on the wire whatever the source byte order; non-contiguous sources are packed
    msg = numpy_to_tensor(np.arange(6, dtype=">i4").reshape(2, 3).T)
    assert msg.data == struct.pack("<6i", 0, 3, 1, 4, 2, 5) and list(msg.shape) == [3, 2]
    # bfloat16 travels as the top 16 bits of the float32 value
    x = torch.tensor([1.0, -2.5, 3.140625, 0.0], dtype=torch.bfloat16)
    msg = torch_to_tensor(x)
    f32_bits = np.frombuffer(x.float().numpy().astype("<f4").tobytes(), dtype="<u4")
    assert msg.dtype == "bfloat16" and msg.data == (f32_bits >> 16).astype("<u2").tobytes()
    back = tensor_to_torch(msg)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)
    empty = tensor_to_torch(numpy_to_tensor(np.zeros((0, 4), dtype=np.float32)))
    assert empty.shape == (0, 4)


def test_tensor_checks_name_the_field() -> None:
    good = numpy_to_tensor(np.zeros((2, 2), dtype=np.float32))
    cases = [
        (common_pb2.Tensor(dtype="complex64", shape=[1], data=bytes(8)), TypeError, "x.dtype must be one of"),
        (common_pb2.Tensor(dtype="float32", shape=[2, -1], data=b""), ValueError, "x.shape must have non-negative"),
        (common_pb2.Tensor(dtype="float32", shape=[2, 2], data=good.data[:-1]), ValueError,
         "x.data holds 15 bytes but float32 [2, 2] needs 16"),
    ]
    for msg, exc, words in cases:
        with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
            tensor_to_numpy(msg, "x")
    with pytest.raises(ValueError, match="over the limit of 8"):
        tensor_to_numpy(good, "x", max_bytes=8)
    with pytest.raises(TypeError, match="use tensor_to_torch"):
        tensor_to_numpy(torch_to_tensor(torch.zeros(2, dtype=torch.bfloat16)), "x")
    with pytest.raises(TypeError, match=r"tensor must be a solrl\.common\.v1\.Tensor"):
        tensor_to_numpy(np.zeros(2))
    with pytest.raises(TypeError, match="array dtype must be one of"):
        numpy_to_tensor(np.zeros(2, dtype=np.complex64))


def test_start_up_fails_naming_every_reward_it_cannot_build(tmp_path) -> None:
    """--rewards is what the service serves: one that cannot be built stops start-up with its name and
    why (no healthy service silently missing a reward), and the process exits non-zero."""
    with pytest.raises(ValueError) as err:
        RewardDataPlane.build(["shapes", "nope", "pickscor:1+shapes:1"])
    text = str(err.value)
    assert "nope (ValueError: unknown reward 'nope'" in text and "pickscor:1+shapes:1 (ValueError" in text
    assert "shapes (" not in text.replace("pickscor:1+shapes:1 (", "")
    proc = subprocess.run([sys.executable, "-m", "services.reward.server", "--rewards", "shapes,nope",
                           "--grpc-port", "0", "--http-port", "0"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode != 0 and "cannot serve reward(s) nope" in proc.stderr, proc.stderr[-2000:]
    from services.reward import server as reward_server

    p = argparse.ArgumentParser()
    reward_server.add_arguments(p, {})
    assert p.parse_args([]).rewards == "shapes,shapes_dense,jpeg_compressibility"
