"""The doors under load, over real sockets (issue 58): REST answers on kept-alive connections without the
~40 ms Nagle / delayed-ACK stall, a lone request goes through the batcher at once while concurrent ones still
share calls, and one memory budget bounds the requests in flight on both doors together (REST 503 with
Retry-After, gRPC RESOURCE_EXHAUSTED with a retry-after trailer), the service answering a valid request right
after. The 64-request burst on a service process and the soak are in the slow tier."""

from __future__ import annotations

import http.client
import os
import socket
import statistics
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.http as thttp

from services.common.batching import DynamicBatcher, queue_timer
from services.common.metrics import ServiceMetrics
from services.common.tensors import numpy_to_tensor
from services.reward.dataplane import RewardDataPlane
from services.reward.server import start
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from tests.services.test_hostile_doors import zeros_stream

PROMPTS = ["a red circle", "two blue squares"]
IMAGES = np.zeros((2, 32, 32, 3), np.uint8)


# ---------------------------------------------------------------------- REST on kept-alive connections

def server_socket_of(client: socket.socket) -> socket.socket:
    """The server's end of `client`'s connection, found among this process's descriptors (the service runs in
    this process): a duplicate to read its options from."""
    me, deadline = client.getsockname(), time.monotonic() + 5
    while time.monotonic() < deadline:   # (the server's event loop accepts it a moment after connect returns)
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.type == socket.SOCK_STREAM and s.getpeername() == me:
                    return s
            except OSError:
                pass
            s.close()
        time.sleep(0.05)
    raise AssertionError(f"no server socket connected to {me}")


def test_rest_connections_have_nodelay_and_answer_without_the_delayed_ack_stall(reward_service) -> None:
    port = reward_service.http.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v2/health/live")   # answered: the server has set up its end of the connection
    assert conn.getresponse().read() == b'{"live":true}'
    server = server_socket_of(conn.sock)
    try:   # uvicorn writes headers and body in two sends: without TCP_NODELAY the body waits for the client's ACK
        assert server.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        server.close()
    waits = []
    for _ in range(30):   # one kept-alive connection; a stalled answer takes >= 40 ms (Linux's delayed ACK)
        t0 = time.perf_counter()
        conn.request("GET", "/v2/health/ready")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b'{"ready":true}'
        waits.append(time.perf_counter() - t0)
    conn.close()
    assert statistics.median(waits) < 0.020, f"median {statistics.median(waits) * 1000:.1f} ms a request"
    # and an infer through tritonclient.http (geventhttpclient, kept alive), the binary extension
    client = thttp.InferenceServerClient(f"127.0.0.1:{port}")
    a = thttp.InferInput("IMAGES", list(IMAGES.shape), "UINT8")
    a.set_data_from_numpy(IMAGES)
    b = thttp.InferInput("PROMPTS", [2], "BYTES")
    b.set_data_from_numpy(np.array([p.encode() for p in PROMPTS], dtype=object))
    waits = []
    for _ in range(20):
        t0 = time.perf_counter()
        assert client.infer("shapes", [a, b]).as_numpy("SCORES").shape == (2,)
        waits.append(time.perf_counter() - t0)
    client.close()
    assert statistics.median(waits[2:]) < 0.035, f"median {statistics.median(waits[2:]) * 1000:.1f} ms an infer"


# ---------------------------------------------------------------------- the batcher

def test_a_lone_request_goes_at_once_and_concurrent_ones_still_share_calls() -> None:
    calls: list[int] = []

    def fn(items, meta):
        calls.append(len(items))
        time.sleep(0.02)
        return items.sum(axis=1)

    batcher = DynamicBatcher(fn, max_batch=64, max_delay_s=0.2)   # a long delay: any wait for company shows
    try:
        def lone(n: int) -> list[float]:
            out = []
            for i in range(n):
                with queue_timer() as waits:
                    assert batcher(np.full((1, 3), i, np.float32), ["m"])[0] == 3 * i
                out.append(sum(waits))
            return out

        assert max(lone(5)) < 0.1   # each alone: no 0.2 s wait for requests that cannot come
        calls.clear()
        barrier = threading.Barrier(8)

        def client(i: int) -> None:
            barrier.wait()
            time.sleep(0.0 if i < 4 else 0.01)   # half of them arrive while the first call runs
            for _ in range(6):
                batcher(np.ones((1, 3), np.float32), ["m"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # 8 clients, each sending its next request as soon as it is answered: the calls hold (nearly) all 8, not
        # two halves taking turns (what waiting for as many as the previous call served settles into)
        assert sum(calls) == 48 and len(calls) <= 9, f"48 requests in {len(calls)} calls: {calls}"
        # load gone: at most the first lone request waits (for the company the last call had), then none
        assert max(lone(4)[1:]) < 0.1
    finally:
        batcher.close()


# ---------------------------------------------------------------------- the memory budget

LIMIT = 4 << 20        # --max-request-bytes of the service below
BUDGET = 6 << 20       # its budget for the requests in flight, both doors


@pytest.fixture(scope="module")
def budgeted():
    metrics = ServiceMetrics("reward")
    plane = RewardDataPlane.build(["shapes"], max_delay_ms=1.0, observe=metrics.observe_batch)
    svc = start(plane, metrics, host="127.0.0.1", max_request_bytes=LIMIT, max_inflight_bytes=BUDGET)
    yield svc
    svc.stop(grace=0.5)


def raw_head(port: int, length: int, extra: str = "") -> socket.socket:
    """A connection that sent an infer request's headers declaring `length` body bytes, and no body yet."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST /v2/models/shapes/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
              f"Content-Length: {length}\r\n{extra}\r\n".encode())
    return s


def read_answer(s: socket.socket) -> tuple[int, str]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length"))
    while len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return int(head.split()[1]), head.decode() + "\n" + rest.decode(errors="replace")


def drained(budget, timeout_s: float = 5.0) -> bool:
    """Whether every lease comes back (a lease is given back just after its answer is sent)."""
    deadline = time.monotonic() + timeout_s
    while budget.used and time.monotonic() < deadline:
        time.sleep(0.01)
    return budget.used == 0


def big_valid() -> tuple[np.ndarray, list[str]]:
    images = np.zeros((9, 256, 256, 3), np.uint8)   # 1.7 MiB: fits the budget's room only when it is free
    return images, ["a red circle"] * len(images)


def test_the_budget_bounds_both_doors_together_and_refuses_at_once(budgeted) -> None:
    port, budget = budgeted.http.port, budgeted.budget
    assert budget.limit == BUDGET and budget.used == 0
    holder = raw_head(port, 5 << 20)   # holds 5 MiB of the 6 (declared, charged before a byte is read)
    try:
        deadline = time.monotonic() + 5
        while budget.used < 5 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 5 << 20
        # REST: a 2 MiB body does not fit: 503 with Retry-After at once, before its body is sent
        s = raw_head(port, 2 << 20)
        t0 = time.perf_counter()
        status, text = read_answer(s)
        s.close()
        assert status == 503 and "retry-after: 1" in text.lower() and "requests in flight" in text, text
        assert time.perf_counter() - t0 < 1.0
        # gRPC: the same budget; RESOURCE_EXHAUSTED with a retry-after trailer
        images, prompts = big_valid()
        with grpc.insecure_channel(budgeted.grpc.address) as ch:
            stub = reward_pb2_grpc.RewardStub(ch)
            request = reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(images), prompts=prompts)
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "requests in flight" in err.value.details()
            assert ("retry-after", "1") in tuple(err.value.trailing_metadata())
            # a small request still fits beside the holder (the budget is bytes, not requests)
            small = reward_pb2.ScoreRequest(reward="shapes", images=numpy_to_tensor(IMAGES), prompts=PROMPTS)
            assert len(stub.Score(small, timeout=10).scores) == 2
            holder.close()   # the held request goes: its lease is given back
            assert drained(budget)
            assert len(stub.Score(request, timeout=30).scores) == len(images)
        r = httpx.post(f"http://127.0.0.1:{port}/v2/models/shapes/infer", timeout=30, json={"inputs": [
            {"name": "IMAGES", "shape": [2, 32, 32, 3], "datatype": "UINT8", "data": IMAGES.ravel().tolist()},
            {"name": "PROMPTS", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]})
        assert r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == 2
    finally:
        holder.close()
    assert drained(budget)


def test_concurrent_bombs_share_the_budget_and_a_valid_request_follows(budgeted) -> None:
    port, budget = budgeted.http.port, budgeted.budget
    bomb = zeros_stream(64 << 20, 31)   # ~64 KB of gzip that inflates to 16 x the request limit
    statuses: list[tuple[int, str | None]] = []
    barrier = threading.Barrier(8)

    def send() -> None:
        barrier.wait()
        r = httpx.post(f"http://127.0.0.1:{port}/v2/models/shapes/infer", content=bomb, timeout=60,
                       headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        statuses.append((r.status_code, r.headers.get("retry-after")))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 8
    for status, retry in statuses:   # over its own limit (413), or refused while the budget was full (503)
        assert status in (413, 503) and (status == 413 or retry == "1"), statuses
    assert drained(budget)
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v2/models/shapes/infer", timeout=30, json={"inputs": [
        {"name": "IMAGES", "shape": [2, 32, 32, 3], "datatype": "UINT8", "data": IMAGES.ravel().tolist()},
        {"name": "PROMPTS", "shape": [2], "datatype": "BYTES", "data": PROMPTS}]})
    assert r.status_code == 200 and time.perf_counter() - t0 < 1.0


def test_the_reward_client_retries_a_refusal_of_the_budget(budgeted) -> None:
    from services.rollout.plane import RemoteScorer

    port, budget = budgeted.http.port, budgeted.budget
    holder = raw_head(port, 5 << 20)
    deadline = time.monotonic() + 5
    while budget.used < 5 << 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    images, prompts = big_valid()
    scorer = RemoteScorer(budgeted.grpc.address, "shapes", timeout_s=30)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(scorer(images, prompts)))
    try:
        worker.start()
        time.sleep(1.5)   # refused (retry-after 1 s) at least once while the holder holds the budget
        assert not got and budget.refused >= 1
        holder.close()
        worker.join(30)
        assert len(got) == 1 and got[0].shape == (len(images),)
    finally:
        holder.close()
        scorer.close()
    assert drained(budget)
