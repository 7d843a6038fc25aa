"""The KServe v2 REST door and Triton's statistics / repository index, over real sockets: tritonclient.http,
the curl binary and tritonclient.grpc against a running reward service (and the explorer's `explore` model).

Expected scores come from the core reward (`solrl.rewards.build_reward`); a REST answer must equal the gRPC
door's for the same input, and both doors feed one statistics record."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from solrl.rewards import build_reward
from solrl.shapes.world import parse, render

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def service(reward_service):
    return reward_service


@pytest.fixture(scope="module")
def url(service) -> str:
    return f"127.0.0.1:{service.http.port}"


def images() -> np.ndarray:
    """Ground-truth renders [B, 32, 32, 3] uint8 of the prompts."""
    return np.stack([render(parse(p), np.random.default_rng(i)) for i, p in enumerate(PROMPTS)]).astype(np.uint8)


def core_scores(name: str) -> np.ndarray:
    return np.asarray(build_reward(name)(images(), PROMPTS), dtype=np.float32)


def http_inputs(binary: bool) -> list[thttp.InferInput]:
    imgs = images()
    a = thttp.InferInput("IMAGES", list(imgs.shape), "UINT8")
    a.set_data_from_numpy(imgs, binary_data=binary)
    b = thttp.InferInput("PROMPTS", [len(PROMPTS)], "BYTES")
    b.set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object), binary_data=binary)
    return [a, b]


def test_tritonclient_http_works_unchanged(url) -> None:
    client = thttp.InferenceServerClient(url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("shapes") and not client.is_model_ready("no_such_reward")
        md = client.get_server_metadata()
        assert md["name"] == "solrl-reward" and "statistics" in md["extensions"]
        meta = client.get_model_metadata("shapes")
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
            ("IMAGES", "UINT8", [-1, -1, -1, 3]), ("PROMPTS", "BYTES", [-1])]
        config = client.get_model_config("shapes")
        assert config["name"] == "shapes" and config["input"][1]["data_type"] == "TYPE_STRING"
        want = core_scores("shapes")
        for binary in (True, False):  # the binary tensor extension (tritonclient's default) and JSON data
            out = client.infer("shapes", http_inputs(binary),
                               outputs=[thttp.InferRequestedOutput("SCORES", binary_data=binary)])
            np.testing.assert_array_equal(out.as_numpy("SCORES"), want)
        out = client.infer("jpeg_compressibility", http_inputs(True), request_compression_algorithm="gzip")
        np.testing.assert_array_equal(out.as_numpy("SCORES"), core_scores("jpeg_compressibility"))
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.infer("nope", http_inputs(True))
        index = client.get_model_repository_index()
        assert sorted((m["name"], m["version"], m["state"]) for m in index) == [
            ("jpeg_compressibility", "1", "READY"), ("shapes", "1", "READY")]
    finally:
        client.close()


def test_curl_and_json_errors_name_the_field(url) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl binary on this machine")

    def run(*args: str) -> tuple[int, str]:
        r = subprocess.run([curl, "-s", "-o", "-", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                           timeout=60, check=True)
        body, _, code = r.stdout.rpartition("\n")
        return int(code), body

    assert run(f"http://{url}/v2/health/ready") == (200, '{"ready":true}')   # the KServe v2 health schema
    assert run(f"http://{url}/v2/health/live") == (200, '{"live":true}')
    code, text = run(f"http://{url}/v2/models/shapes/ready")
    assert code == 200 and json.loads(text) == {"name": "shapes", "ready": True}
    imgs = images()
    body = {"inputs": [{"name": "IMAGES", "shape": list(imgs.shape), "datatype": "UINT8", "data": imgs.ravel().tolist()},
                       {"name": "PROMPTS", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]}
    code, text = run("-X", "POST", "-H", "Content-Type: application/json", "--data-binary", json.dumps(body),
                     f"http://{url}/v2/models/shapes/infer")
    assert code == 200, text
    answer = json.loads(text)
    assert answer["outputs"][0]["name"] == "SCORES" and answer["outputs"][0]["datatype"] == "FP32"
    np.testing.assert_array_equal(np.array(answer["outputs"][0]["data"], dtype=np.float32), core_scores("shapes"))
    assert run(f"http://{url}/v2/models/nope")[0] == 404
    bad = {"inputs": [{**body["inputs"][0], "shape": [1, 2, 3]}, body["inputs"][1]]}
    code, text = run("-X", "POST", "--data-binary", json.dumps(bad), f"http://{url}/v2/models/shapes/infer")
    assert code == 400 and json.loads(text)["error"].startswith("IMAGES"), text
    code, text = run("-X", "POST", "--data-binary", "{not json", f"http://{url}/v2/models/shapes/infer")
    assert code == 400 and "not JSON" in json.loads(text)["error"]
    code, text = run("-X", "POST", "--data-binary", json.dumps({"inputs": [{"shape": [1]}]}),
                     f"http://{url}/v2/models/shapes/infer")
    assert code == 400 and json.loads(text)["error"] == "inputs[0].name: required"
    assert run(f"http://{url}/v2/health/live")[0] == 200  # the service stays up


def test_binary_body_checks_and_compression(url) -> None:
    imgs = images()
    head = json.dumps({"inputs": [{"name": "IMAGES", "shape": list(imgs.shape), "datatype": "UINT8",
                                   "parameters": {"binary_data_size": imgs.nbytes + 5}},
                                  {"name": "PROMPTS", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]}).encode()
    r = httpx.post(f"http://{url}/v2/models/shapes/infer", content=head + imgs.tobytes(),
                   headers={"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and "IMAGES: binary_data_size" in r.json()["error"]
    r = httpx.post(f"http://{url}/v2/models/shapes/infer", content=b"xx", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "does not decompress" in r.json()["error"]
    ok = json.dumps({"inputs": [{"name": "IMAGES", "shape": list(imgs.shape), "datatype": "UINT8",
                                 "data": imgs.ravel().tolist()},
                                {"name": "PROMPTS", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]}).encode()
    r = httpx.post(f"http://{url}/v2/models/shapes/infer", content=gzip.compress(ok),
                   headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == core_scores("shapes").tolist()


def test_statistics_count_both_doors_as_triton_defines_them(service, url) -> None:
    grpc_client = tgrpc.InferenceServerClient(service.grpc.address)
    http_client = thttp.InferenceServerClient(url)
    try:
        def stats() -> dict:
            return http_client.get_inference_statistics("jpeg_compressibility")["model_stats"][0]

        before = stats()
        imgs = images()
        g = [tgrpc.InferInput("IMAGES", list(imgs.shape), "UINT8"), tgrpc.InferInput("PROMPTS", [2], "BYTES")]
        g[0].set_data_from_numpy(imgs)
        g[1].set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object))
        grpc_client.infer("jpeg_compressibility", g)
        http_client.infer("jpeg_compressibility", http_inputs(True))
        bad = thttp.InferInput("IMAGES", [1, 2, 2], "UINT8")  # a 3-D image batch: rejected by the model
        bad.set_data_from_numpy(np.zeros((1, 2, 2), np.uint8))
        with pytest.raises(InferenceServerException):
            http_client.infer("jpeg_compressibility", [bad, http_inputs(True)[1]])
        after = stats()
        s0, s1 = before["inference_stats"], after["inference_stats"]
        assert after["inference_count"] - before["inference_count"] == 2
        assert after["execution_count"] - before["execution_count"] == 2
        assert s1["success"]["count"] - s0["success"]["count"] == 2 and s1["fail"]["count"] - s0["fail"]["count"] == 1
        for kind in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert s1[kind]["count"] - s0[kind]["count"] == 2
        spent = s1["success"]["ns"] - s0["success"]["ns"]
        parts = sum(s1[k]["ns"] - s0[k]["ns"] for k in ("queue", "compute_input", "compute_infer", "compute_output"))
        assert 0 < parts <= spent  # the parts of a request fit inside it
        assert s1["compute_infer"]["ns"] > s0["compute_infer"]["ns"] and after["last_inference"] > 0
        # the gRPC door reports the same record
        g_stats = grpc_client.get_inference_statistics("jpeg_compressibility", as_json=True)["model_stats"][0]
        assert int(g_stats["inference_count"]) == after["inference_count"]
        everything = http_client.get_inference_statistics()["model_stats"]
        assert sorted(m["name"] for m in everything) == ["jpeg_compressibility", "shapes"]
        with pytest.raises(InferenceServerException, match="unknown model"):
            http_client.get_inference_statistics("nope")
        index = grpc_client.get_model_repository_index(as_json=True)["models"]
        assert sorted(m["name"] for m in index) == ["jpeg_compressibility", "shapes"]
    finally:
        grpc_client.close()
        http_client.close()


def test_the_reward_batcher_wait_counts_as_queue_time() -> None:
    """Requests that wait for a batch: their wait is the queue time (Triton's "queue"), not compute."""
    import threading

    from services.common.batching import DynamicBatcher, queue_timer

    release = threading.Event()
    calls = []

    def slow(items, meta):
        calls.append(len(items))
        release.wait(10)
        return items.sum(axis=1)

    b = DynamicBatcher(slow, max_batch=1, max_delay_s=0.0)
    try:
        first = b.submit(np.ones((1, 2)), [None])   # occupies the worker until released
        waits: list[float] = []

        def second() -> None:
            with queue_timer() as w:
                b(np.ones((1, 2)), [None])
            waits.extend(w)

        t = threading.Thread(target=second)
        t.start()
        import time

        time.sleep(0.2)
        release.set()
        t.join(10)
        first.result(10)
        assert len(waits) == 1 and waits[0] >= 0.15   # it waited behind the first call
    finally:
        b.close()
