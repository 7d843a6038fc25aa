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

import numpy as np
import tritonclient.http as thttp

from services.common.batching import DynamicBatcher, queue_timer

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
    conn.connect()
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
    assert statistics.median(waits[2:]) < 0.030, f"median {statistics.median(waits[2:]) * 1000:.1f} ms an infer"


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

        def client() -> None:
            barrier.wait()
            for _ in range(6):
                batcher(np.ones((1, 3), np.float32), ["m"])

        threads = [threading.Thread(target=client) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(calls) == 48 and len(calls) <= 24, f"48 requests in {len(calls)} calls: {calls}"
        # load gone: at most the first lone request waits (for the company the last call had), then none
        assert max(lone(4)[1:]) < 0.1
    finally:
        batcher.close()
