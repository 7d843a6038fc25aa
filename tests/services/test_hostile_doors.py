"""Hostile clients against a reward service process, on real sockets: compression bombs (gzip, deflate, and
inside the binary tensor extension), lying lengths, huge declared shapes, deep JSON, a trickled body, oversized
and compressed gRPC messages, and the data token (SOLRL_DATA_TOKEN) with real tritonclient.

Each attack asserts its status, that the service still answers its health checks, and that the process's peak
resident memory (VmHWM in its /proc/<pid>/status) stays within BOUND_MB of what it peaked at serving ordinary
requests. The process runs with --max-request-bytes LIMIT (16 MiB): a body may decompress to LIMIT + 1 MiB
before it is refused, well inside the bound; a door that decompresses first and checks after (or reads the
whole body before checking its length) goes past it on the first bomb."""

from __future__ import annotations

import gzip
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from services.common.bodies import read_body
from services.common.grpc_server import MAX_GRPC_MESSAGE_SIZE
from services.common.ops import HttpServer
from services.common.tensors import numpy_to_tensor
from services.kserve.http import _error
from services.rollout.plane import RemoteScorer
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "data-tok-5b1e08c3d7a94f62"   # what must never show up in a log line
AUTH = {"Authorization": f"Bearer {TOKEN}"}   # (tritonclient adds to the headers it is given: pass it copies)
AUTH_MD = (("authorization", f"Bearer {TOKEN}"),)   # the same as gRPC metadata (keys are lower case)
LIMIT = 16 << 20        # the process's --max-request-bytes
BOMB = 512 << 20        # what each bomb decompresses to: 32 x the limit
BOUND_MB = 200          # the peak may grow this much over the warm baseline, whatever a client sends
IMAGES = np.zeros((2, 32, 32, 3), np.uint8)
PROMPTS = ["a red circle", "two blue squares"]


def zeros_stream(n: int, wbits: int) -> bytes:
    """`n` zero bytes compressed as gzip (wbits 31) or zlib / HTTP deflate (wbits 15), built from one
    compressed MiB repeated: a full flush after each MiB makes every MiB compress to the same bytes."""
    mib = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    raw = block * (n >> 20) + c.flush()
    if wbits == 31:
        crc = 0
        for _ in range(n >> 20):
            crc = zlib.crc32(mib, crc)
        return gzip.compress(b"")[:10] + raw + crc.to_bytes(4, "little") + (n & 0xFFFFFFFF).to_bytes(4, "little")
    adler = 1
    for _ in range(n >> 20):
        adler = zlib.adler32(mib, adler)
    return b"\x78\xda" + raw + adler.to_bytes(4, "big")


def peak_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


class Service:
    def __init__(self, proc: subprocess.Popen, grpc_addr: str, http_addr: str, log: Path) -> None:
        self.proc, self.grpc_addr, self.http_addr, self.log = proc, grpc_addr, http_addr, log
        self.http = httpx.Client(base_url=f"http://{http_addr}", timeout=30)
        self.channel = grpc.insecure_channel(grpc_addr, options=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE)])
        self.baseline = 0.0
        self.seen: list[str] = []   # responses, checked for the token at the end

    def infer(self, body: bytes, headers: dict[str, str] | None = None, model: str = "shapes") -> httpx.Response:
        r = self.http.post(f"/v2/models/{model}/infer", content=body, headers={**AUTH, **(headers or {})})
        self.seen.append(r.text)
        return r

    def assert_unharmed(self, what: str) -> None:
        """Health answers on both doors, and the peak memory stayed within the bound."""
        assert self.proc.poll() is None, f"{what}: the service died"
        live = self.http.get("/v2/health/live", timeout=10)
        check = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        peak = peak_mb(self.proc.pid)
        print(f"{what}: peak {peak:.0f} MB (baseline {self.baseline:.0f} MB)")
        assert peak <= self.baseline + BOUND_MB, \
            f"{what}: peak resident memory {peak:.0f} MB, over the warm baseline {self.baseline:.0f} MB + {BOUND_MB}"
        assert live.status_code == 200 and live.json() == {"live": True}


def json_body(images: np.ndarray = IMAGES) -> bytes:
    return json.dumps({"inputs": [
        {"name": "IMAGES", "shape": list(images.shape), "datatype": "UINT8", "data": images.ravel().tolist()},
        {"name": "PROMPTS", "shape": [len(PROMPTS)], "datatype": "BYTES", "data": PROMPTS}]}).encode()


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> Service:
    """One reward process (shapes) with the data token set and a 16 MiB request limit, warmed up."""
    log = tmp_path_factory.mktemp("hostile") / "reward.log"
    env = {**os.environ, "SOLRL_DATA_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "services.reward.server", "--rewards", "shapes",
                             "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                             "--max-request-bytes", str(LIMIT)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    line, deadline = "", time.monotonic() + 120
    while not line.startswith("solrl reward:") and time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
    assert line.startswith("solrl reward:"), log.read_text()
    s = Service(proc, line.split("grpc ")[1].split(",")[0], line.split("http ")[1].split(",")[0], log)
    # warm: ordinary requests over both doors (a JSON one, a gzip binary one at the size limit, gRPC Score)
    assert s.infer(json_body()).status_code == 200
    big = np.zeros((LIMIT // (256 * 256 * 3) - 1, 256, 256, 3), np.uint8)
    client = thttp.InferenceServerClient(s.http_addr)
    a = thttp.InferInput("IMAGES", list(big.shape), "UINT8")
    a.set_data_from_numpy(big)
    b = thttp.InferInput("PROMPTS", [len(big)], "BYTES")
    b.set_data_from_numpy(np.array([b"a red circle"] * len(big), dtype=object))
    assert client.infer("shapes", [a, b], headers=dict(AUTH), request_compression_algorithm="gzip").as_numpy("SCORES").shape \
        == (len(big),)
    client.close()
    RemoteScorer(s.grpc_addr, "shapes", token=TOKEN)(IMAGES, PROMPTS)
    s.baseline = peak_mb(proc.pid)
    yield s
    s.http.close()
    s.channel.close()
    if proc.poll() is None:   # (the last test stops it itself, to read all it logged)
        proc.terminate()
        proc.communicate(timeout=30)


# ---------------------------------------------------------------------- bodies


@pytest.mark.parametrize("encoding,binary", [("gzip", False), ("deflate", False), ("gzip", True)])
def test_compression_bombs_are_refused_while_decompressing(svc, encoding, binary):
    """~0.5 MB on the wire that inflates to 512 MiB: 413 once the output passes the limit, not after."""
    if binary:   # the binary tensor extension: a JSON header, then 512 MiB of "image" bytes
        shape = [BOMB // (1024 * 1024 * 3), 1024, 1024, 3]
        head = json.dumps({"inputs": [
            {"name": "IMAGES", "shape": shape, "datatype": "UINT8", "parameters": {"binary_data_size": BOMB}},
            {"name": "PROMPTS", "shape": [shape[0]], "datatype": "BYTES", "data": ["x"] * shape[0]}]}).encode()
        c = zlib.compressobj(9, zlib.DEFLATED, 31)
        body = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
        body += zeros_stream(BOMB, 31)[10:]   # (the CRC is of the zeros only: refused long before it is checked)
        headers = {"Inference-Header-Content-Length": str(len(head))}
    else:
        body, headers = zeros_stream(BOMB, 31 if encoding == "gzip" else 15), {}
    assert len(body) < 1 << 20
    r = svc.infer(body, {"Content-Encoding": encoding, "Content-Type": "application/octet-stream", **headers})
    svc.assert_unharmed(f"{encoding} bomb{' (binary extension)' if binary else ''}")
    assert r.status_code == 413, r.text
    assert "decompresses to over the limit" in r.json()["error"]


def test_the_bomb_inflates_to_what_it_says():
    """The test's own bomb is a valid stream of BOMB zeros (so a door that decompresses it whole holds 512 MiB)."""
    for wbits in (31, 15):
        d = zlib.decompressobj(wbits)
        n = 0
        data = zeros_stream(64 << 20, wbits)
        while data:
            n += len(d.decompress(data, 1 << 24))
            data = d.unconsumed_tail
        assert n == 64 << 20 and d.eof and not d.unused_data


def raw_request(addr: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send `head` (request line and headers; the connection closes after the answer) and `body` on a fresh
    socket; the status and body of the answer."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"{head}Connection: close\n".replace("\n", "\r\n").encode() + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def test_lying_lengths(svc):
    """A declared Content-Length over the limit is refused before a byte of the body is sent; a JSON header
    length past the body, not a number, or over the JSON bound is refused too."""
    t0 = time.monotonic()
    status, body = raw_request(svc.http_addr, f"POST /v2/models/shapes/infer HTTP/1.1\nHost: x\n"
                                              f"Authorization: Bearer {TOKEN}\nContent-Length: {10 ** 12}\n")
    assert status == 413 and "Content-Length" in json.loads(body)["error"]
    assert time.monotonic() - t0 < 5   # answered without waiting for the terabyte
    good = json_body()
    for length, status, words in ((str(len(good) + 10), 400, "not a length within"), ("-1", 400, "not a length"),
                                  ("12abc", 400, "not a length"), (str(1 << 30), 413, "over the limit")):
        r = svc.infer(good, {"Inference-Header-Content-Length": length})
        assert r.status_code == status and words in r.json()["error"], (length, r.text)
    # a body longer than its Content-Length: the declared bytes are the request (not JSON here), the rest is
    # garbage on the connection
    status, body = raw_request(svc.http_addr, f"POST /v2/models/shapes/infer HTTP/1.1\nHost: x\n"
                                              f"Authorization: Bearer {TOKEN}\nContent-Length: 10\n", good)
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    svc.assert_unharmed("lying lengths")


def test_huge_declared_shapes_are_refused_from_the_shape(svc):
    huge = [1 << 20, 1 << 20, 1 << 20, 3]
    head = json.dumps({"inputs": [
        {"name": "IMAGES", "shape": huge, "datatype": "UINT8", "parameters": {"binary_data_size": 12}},
        {"name": "PROMPTS", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}).encode()
    r = svc.infer(head + bytes(12), {"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 413 and r.json()["error"].startswith("IMAGES") and "over the limit" in r.json()["error"]
    r = svc.infer(json.dumps({"inputs": [{"name": "IMAGES", "shape": huge, "datatype": "UINT8", "data": [0]}]}).encode())
    assert r.status_code == 400 and "data holds 1 elements" in r.json()["error"]
    stub = reward_pb2_grpc.RewardStub(svc.channel)
    images = numpy_to_tensor(IMAGES)
    del images.shape[:]
    images.shape.extend(huge)
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(reward_pb2.ScoreRequest(reward="shapes", images=images, prompts=["x"]), metadata=AUTH_MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "over the limit" in info.value.details()
    infer = service_pb2_grpc.GRPCInferenceServiceStub(svc.channel)
    request = service_pb2.ModelInferRequest(model_name="shapes", raw_input_contents=[b"", b""])
    request.inputs.add(name="IMAGES", datatype="UINT8", shape=huge)
    request.inputs.add(name="PROMPTS", datatype="BYTES", shape=[1 << 40])
    with pytest.raises(grpc.RpcError) as info:
        infer.ModelInfer(request, metadata=AUTH_MD, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    svc.assert_unharmed("huge shapes")


def test_deep_and_malformed_json_is_a_400_naming_the_problem(svc):
    deep = b"[" * 100_000 + b"]" * 100_000
    r = svc.infer(deep)
    assert r.status_code == 400 and "JSON nested deeper than" in r.json()["error"], r.text
    r = svc.infer(b'{"inputs": ' + deep + b"}")
    assert r.status_code == 400 and "JSON nested deeper than" in r.json()["error"], r.text
    r = svc.http.post("/v2/repository/index", content=b"[" * 30_000 + b"]" * 30_000, headers=AUTH)
    assert r.status_code == 400 and "JSON nested deeper than" in r.json()["error"], r.text
    assert svc.http.post("/v2/repository/index", content=b"[1]", headers=AUTH).status_code == 400
    assert svc.http.post("/v2/repository/index", content=b"x" * (1 << 20), headers=AUTH).status_code == 413
    r = svc.infer(b"\xff\xfe{")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]
    r = svc.infer(b"{}", {"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "does not decompress" in r.json()["error"]
    r = svc.infer(gzip.compress(json_body())[:-12], {"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "truncated" in r.json()["error"]
    r = svc.infer(json_body(), {"Content-Encoding": "br"})
    assert r.status_code == 400 and "not supported" in r.json()["error"]
    big_json = b"[" + b"0," * ((8 << 20) + (1 << 18)) + b"0]"   # 16.5 MiB: within the body limit, over the JSON one
    r = svc.infer(big_json)
    assert r.status_code == 413 and "bytes of JSON" in r.json()["error"]
    svc.assert_unharmed("deep and malformed JSON")


def test_a_trickled_body_holds_up_no_one_else(svc):
    """A client that sends its body a byte at a time: health checks and other clients' requests are answered
    meanwhile (the body is read on the event loop without blocking it, and the model call runs in a thread)."""
    host, port = svc.http_addr.rsplit(":", 1)
    slow = socket.create_connection((host, int(port)), timeout=30)
    slow.sendall(f"POST /v2/models/shapes/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Length: 100000\r\n\r\n".encode())
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                slow.send(b" ")
            except OSError:
                return
            time.sleep(0.05)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            assert svc.http.get("/v2/health/ready", timeout=5).status_code == 200
            assert svc.infer(json_body()).status_code == 200
            assert time.monotonic() - t0 < 5
            time.sleep(0.3)
        assert thread.is_alive()   # still trickling
    finally:
        stop.set()
        thread.join(5)
        slow.close()
    svc.assert_unharmed("trickled body")


@pytest.mark.parametrize("pace", ["stalled", "trickled"])
def test_a_body_that_does_not_arrive_in_time_is_a_408_and_the_connection_freed(pace):
    """The doors' body reader (services.common.bodies.read_body, with a 1 s deadline instead of the doors'
    BODY_TIMEOUT_S) under the real uvicorn server: a client that sends its headers and then nothing, or a byte
    every 0.1 s, gets 408 once the deadline passes, and the server closes its connection."""
    app = FastAPI()

    @app.post("/body")
    async def body(request: Request):
        try:
            return JSONResponse({"bytes": len(await read_body(request, 1 << 20, timeout_s=1.0))})
        except Exception as exc:
            return _error(exc)

    server = HttpServer(app)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            conn.sendall(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc")
            t0, reply = time.monotonic(), b""
            while not reply.endswith(b"}") and time.monotonic() - t0 < 30:
                if pace == "trickled":
                    conn.send(b"x")
                if select.select([conn], [], [], 0.1)[0]:
                    reply += conn.recv(65536)
            took = time.monotonic() - t0
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert b"not received within 1 s" in reply and 0.9 < took < 20   # generous: a loaded 2-core machine
            conn.settimeout(20)
            # closed by the server: the half-read request cannot go on. An orderly close reads as EOF; where the
            # trickled bytes were still unread when the server closed, its kernel answers with a reset instead
            try:
                assert conn.recv(65536) == b""
            except ConnectionResetError:
                assert pace == "trickled"
        assert httpx.post(f"http://127.0.0.1:{server.port}/body", content=b"y" * 500).json() == {"bytes": 500}
    finally:
        server.stop()


# ---------------------------------------------------------------------- gRPC


def test_oversized_grpc_messages_are_resource_exhausted_and_compressed_ones_refused_unread(svc):
    """Over the limit: RESOURCE_EXHAUSTED. Compressed (gRPC's per-message gzip): refused from its grpc-encoding,
    before it is inflated (gRPC core would inflate it whole before checking its size), with the tritonclient
    option that sends it too."""
    stub = reward_pb2_grpc.RewardStub(svc.channel)
    over = np.zeros((LIMIT // (64 * 64 * 3) + 128, 64, 64, 3), np.uint8)   # past the limit + its 1 MiB margin
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(over), prompts=["x"] * len(over)),
                   metadata=AUTH_MD, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    bomb = reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(np.zeros((BOMB // 3072, 32, 32, 3),
                                                                                    np.uint8)), prompts=["x"])
    with pytest.raises(grpc.RpcError) as info:
        stub.Score(bomb, metadata=AUTH_MD, timeout=60, compression=grpc.Compression.Gzip)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "is disabled" in info.value.details()
    del bomb
    g = tgrpc.InferenceServerClient(svc.grpc_addr)
    try:
        inputs = [tgrpc.InferInput("IMAGES", list(IMAGES.shape), "UINT8"), tgrpc.InferInput("PROMPTS", [2], "BYTES")]
        inputs[0].set_data_from_numpy(IMAGES)
        inputs[1].set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object))
        with pytest.raises(InferenceServerException, match="is disabled"):
            g.infer("shapes", inputs, headers=dict(AUTH_MD), compression_algorithm="gzip")
    finally:
        g.close()
    ok = stub.Score(reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(IMAGES), prompts=PROMPTS),
                    metadata=AUTH_MD, timeout=30)
    assert len(ok.scores) == 2
    svc.assert_unharmed("oversized and compressed gRPC messages")


# ---------------------------------------------------------------------- the data token


def test_the_data_token_with_tritonclient_and_the_reward_client(svc):
    """REST and gRPC: with the token tritonclient works as ever, without it 401 / UNAUTHENTICATED; the health
    probes (REST /v2/health/*, grpc.health.v1) and reflection stay open."""
    inputs = [thttp.InferInput("IMAGES", list(IMAGES.shape), "UINT8"), thttp.InferInput("PROMPTS", [2], "BYTES")]
    inputs[0].set_data_from_numpy(IMAGES)
    inputs[1].set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object))
    client = thttp.InferenceServerClient(svc.http_addr)
    try:
        assert client.is_server_live() and client.is_server_ready()   # probes need no token
        assert client.infer("shapes", inputs, headers=dict(AUTH)).as_numpy("SCORES").shape == (2,)
        assert client.get_model_metadata("shapes", headers=dict(AUTH))["name"] == "shapes"
        for headers in (None, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"}):
            with pytest.raises(InferenceServerException) as info:
                client.infer("shapes", inputs, headers=headers)
            assert info.value.status() == "401" and "bearer token" in info.value.message()
            svc.seen.append(str(info.value))
        with pytest.raises(InferenceServerException, match="bearer token"):
            client.get_server_metadata()
    finally:
        client.close()
    for path in ("/v2", "/v2/models/shapes", "/v2/models/stats"):
        r = svc.http.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert svc.http.get(path, headers=AUTH).status_code == 200, path

    g = tgrpc.InferenceServerClient(svc.grpc_addr)
    try:
        ginputs = [tgrpc.InferInput("IMAGES", list(IMAGES.shape), "UINT8"), tgrpc.InferInput("PROMPTS", [2], "BYTES")]
        ginputs[0].set_data_from_numpy(IMAGES)
        ginputs[1].set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object))
        # gRPC metadata keys are lower case (HTTP/2): the header the REST client sends as Authorization
        assert g.infer("shapes", ginputs, headers={"authorization": f"Bearer {TOKEN}"}).as_numpy("SCORES").shape == (2,)
        for headers in (None, {"authorization": f"Bearer {TOKEN[:-1]}"}):
            with pytest.raises(InferenceServerException) as info:
                g.infer("shapes", ginputs, headers=headers)
            assert info.value.status() == "StatusCode.UNAUTHENTICATED", info.value
    finally:
        g.close()
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):   # the rollout services' reward client
        RemoteScorer(svc.grpc_addr, "shapes")(IMAGES, PROMPTS)
    assert RemoteScorer(svc.grpc_addr, "shapes", token=TOKEN)(IMAGES, PROMPTS).shape == (2,)
    check = health_pb2_grpc.HealthStub(svc.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert check.status == health_pb2.HealthCheckResponse.SERVING   # no token needed by probes
    svc.assert_unharmed("data token")


def test_the_token_never_appears_in_the_logs(svc):
    svc.proc.send_signal(15)
    out, _ = svc.proc.communicate(timeout=30)
    svc.seen.append(out)
    logs = svc.log.read_text()
    for text in [logs, *svc.seen]:
        assert TOKEN not in text and TOKEN[:10] not in text
    cmdline = " ".join(svc.proc.args)
    assert TOKEN not in cmdline


def test_the_data_token_on_the_explorer_and_regenerator_doors():
    """In process: Explore, Regenerate, Info and the explorer's KServe doors need the token; LoadAdapter keeps
    its own (the adapter token), and the trainer's pusher reaches both with the two tokens it is given."""
    from services.common.metrics import ServiceMetrics
    from services.explorer.server import start as start_explorer
    from services.regenerator.dataplane import RegeneratorDataPlane
    from services.regenerator.server import start as start_regenerator
    from services.trainer.server import AdapterPusher, check_workers
    from solrl.adapters import sha256_hex
    from solrl.config import apply_overrides, get_preset
    from solrl.pb.solrl.common.v1 import common_pb2
    from solrl.pb.solrl.explorer.v1 import explorer_pb2, explorer_pb2_grpc
    from solrl.pb.solrl.regenerator.v1 import regenerator_pb2, regenerator_pb2_grpc
    from solrl.precision import PrecisionConfig
    from solrl.rewards import build_reward
    from tests.services.test_adapter_distribution import adapter, plane, tiny_model

    # each plane serves its own model in place (the explorer quantizes its copy): copies of the same weights
    regen = RegeneratorDataPlane(tiny_model(), PrecisionConfig("bf16"), None, build_reward("shapes"), steps=2)
    regen.model_name, regen.base_precision = "shapes", "bf16"
    adapter_token = "adapter-tok-0c9e"
    explorer = start_explorer(plane(tiny_model()), ServiceMetrics("explorer"), adapter_token=adapter_token, data_token=TOKEN)
    regenerator = start_regenerator(regen, ServiceMetrics("regenerator"), adapter_token=adapter_token,
                                    data_token=TOKEN)
    try:
        with grpc.insecure_channel(explorer.grpc.address) as ech, grpc.insecure_channel(regenerator.grpc.address) as rch:
            explore = explorer_pb2_grpc.ExplorerStub(ech).Explore
            request = explorer_pb2.ExploreRequest(job=common_pb2.ExploreJob(prompt="a red circle", seeds=[1, 2, 3],
                                                                          steps=2, kept=2))
            regenerate = regenerator_pb2_grpc.RegeneratorStub(rch).Regenerate
            selection = regenerator_pb2.RegenerateRequest(selection=common_pb2.SeedSelection(
                prompt="a red circle", seeds=[1, 2], sampler=common_pb2.SamplerSpec(steps=2)))
            for rpc, req in ((explore, request), (regenerate, selection)):
                with pytest.raises(grpc.RpcError) as info:
                    rpc(req, timeout=30)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert rpc(req, metadata=AUTH_MD, timeout=60).ByteSize() > 0
            for ch in (ech, rch):
                check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
        http = f"http://127.0.0.1:{explorer.http.port}"
        assert httpx.get(f"{http}/v2/models/explore").status_code == 401
        assert httpx.get(f"{http}/v2/models/explore", headers=AUTH).status_code == 200
        assert httpx.get(f"{http}/v2/health/ready").json() == {"ready": True}
        # the trainer: Info with the data token, LoadAdapter with the adapter token
        data = adapter(tiny_model(), 1)
        cfg = apply_overrides(get_preset("shapes-sol-rl"), ["rollout.explore_precision.backend=nvfp4-emu"]).validate()
        addrs = ([explorer.grpc.address], [regenerator.grpc.address])
        without = AdapterPusher(*addrs, adapter_token, retry_s=0.5)
        with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
            check_workers(without, cfg, timeout_s=10)
        pusher = AdapterPusher(*addrs, adapter_token, data_token=TOKEN)
        assert {w["role"] for w in check_workers(pusher, cfg, timeout_s=10)} == {"explorer", "regenerator"}
        pusher(data, 1, sha256_hex(data))
        assert [w["adapter_version"] for w in check_workers(pusher, cfg, timeout_s=10, version=1)] == [1, 1]
        without.close()
        pusher.close()
    finally:
        explorer.stop(0)
        regenerator.stop(0)
