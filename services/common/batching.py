"""A small dynamic batcher: concurrent requests share one call of a batch function.

Written by hand (no library here does request batching for a plain callable): a worker thread takes
the first waiting request and every request already waiting behind it; it waits for more (up to `max_delay_s`,
or until `max_batch` items) only while it holds fewer requests than were in flight at once (submitted, not yet
answered) since the last call began: under load the clients just answered are sending their next requests,
while a lone client has no company to wait for and goes at once (issue 58: it waited the whole delay, 5 ms a
request). (Waiting for as many as the previous call served instead splits a steady load into two half batches
that alternate for ever.)
It makes one call on the concatenated batch and hands each caller its slice. Only requests whose items
have the same trailing shape are concatenated; the others wait for the next call. A request larger
than `max_batch` is called alone, never split. If a batched call fails, each request in it is
retried alone so that one bad request fails only its own caller.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import UnavailableError

log = logging.getLogger(__name__)

BatchFn = Callable[[np.ndarray, list], np.ndarray]

# seconds the calls made in this context spent waiting in a batcher's queue (a list to add to), for the
# front door's statistics (Triton's "queue" duration); None: nobody is counting
_QUEUED: ContextVar[list[float] | None] = ContextVar("solrl_batcher_queued", default=None)


@contextlib.contextmanager
def queue_timer() -> Iterator[list[float]]:
    """Collect the queue waits of the batcher calls made inside the block (sum them after it)."""
    waits: list[float] = []
    token = _QUEUED.set(waits)
    try:
        yield waits
    finally:
        _QUEUED.reset(token)


@dataclass
class _Request:
    items: np.ndarray                 # [n, ...]
    meta: list                        # n per-item values (e.g. prompts)
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None      # when the call that serves it began


class DynamicBatcher:
    """Batches calls of `fn(items [N, ...], meta list[N]) -> results [N, ...]` across threads.

    observe(n_requests, n_items, seconds) is called after every call of fn (for metrics).
    """

    def __init__(self, fn: BatchFn, *, max_batch: int = 64, max_delay_s: float = 0.005, name: str = "batcher",
                 observe: Callable[[int, int, float], None] | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if not max_delay_s >= 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s!r}")
        self.fn, self.max_batch, self.max_delay_s, self.observe = fn, max_batch, float(max_delay_s), observe
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._carry: deque[_Request] = deque()
        self._inflight = 0   # requests submitted and not yet answered
        self._company = 1    # the most in flight at once since the last call began: how many to wait for
        self._closed = threading.Event()
        self._lock = threading.Lock()  # orders submit() against close(): nothing is queued after the sentinel
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed.is_set()

    def submit(self, items: np.ndarray, meta: Sequence) -> Future:
        """Queue one request; the future resolves to fn's results for exactly these items."""
        return self._enqueue(items, meta).future

    def _enqueue(self, items: np.ndarray, meta: Sequence) -> _Request:
        if not isinstance(items, np.ndarray) or items.ndim < 1:
            raise TypeError(f"items must be a numpy array with a leading batch axis, got {type(items).__name__}")
        if len(meta) != len(items):
            raise ValueError(f"got {len(items)} items but {len(meta)} meta values")
        req = _Request(items, list(meta))
        with self._lock:
            if self._closed.is_set():
                raise UnavailableError("the batcher is shut down")
            self._queue.put(req)
            self._inflight += 1
            self._company = max(self._company, self._inflight)
        return req

    def __call__(self, items: np.ndarray, meta: Sequence) -> np.ndarray:
        """Submit and wait for the result (re-raises the call's exception). The wait before the call that
        serves it began counts as queue time for a surrounding `queue_timer`."""
        req = self._enqueue(items, meta)
        try:
            return req.future.result()
        finally:
            waits = _QUEUED.get()
            if waits is not None:
                waits.append((req.started or time.perf_counter()) - req.submitted)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the worker; requests still waiting fail with UnavailableError."""
        with self._lock:
            self._closed.set()
            self._queue.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _next(self, timeout: float | None) -> _Request | None:
        if self._carry:
            return self._carry.popleft()
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _collect(self, first: _Request) -> list[_Request]:
        with self._lock:   # from here on, count who comes while this call collects and runs
            expect, self._company = self._company, self._inflight
        batch, n = [first], len(first.items)
        deadline = time.monotonic() + self.max_delay_s
        skipped: list[_Request] = []
        while n < self.max_batch and not self._closed.is_set():
            wait = len(batch) + len(skipped) < expect   # others are on their way: wait for them
            req = self._next(max(0.0, deadline - time.monotonic()) if wait else 0.0)
            if req is None:
                if not wait or time.monotonic() >= deadline or self._closed.is_set():
                    break
                continue
            if req.items.shape[1:] != first.items.shape[1:] or n + len(req.items) > self.max_batch:
                skipped.append(req)
                if n + len(req.items) > self.max_batch:
                    break
                continue
            batch.append(req)
            n += len(req.items)
        self._carry.extendleft(reversed(skipped))
        return batch

    def _call(self, batch: list[_Request]) -> None:
        items = batch[0].items if len(batch) == 1 else np.concatenate([r.items for r in batch])
        meta = [m for r in batch for m in r.meta]
        t0 = time.perf_counter()
        for r in batch:
            if r.started is None:  # a request retried alone keeps its first start
                r.started = t0
        try:
            out = np.asarray(self.fn(items, meta))
            if out.shape[:1] != (len(items),):
                raise RuntimeError(f"batch function returned shape {list(out.shape)} for {len(items)} items")
        except Exception as exc:  # handed to the callers, not swallowed
            if len(batch) == 1:
                self._answered(1)
                batch[0].future.set_exception(exc)
            else:  # find the culprit(s): every request alone
                for r in batch:
                    self._call([r])
            return
        finally:
            if self.observe is not None:
                self.observe(len(batch), len(items), time.perf_counter() - t0)
        start = 0
        self._answered(len(batch))
        for r in batch:
            r.future.set_result(out[start:start + len(r.items)])
            start += len(r.items)

    def _answered(self, n: int) -> None:
        with self._lock:
            self._inflight -= n

    def _run(self) -> None:
        while not self._closed.is_set():
            first = self._next(None)
            if first is None:  # the close() sentinel
                break
            self._call(self._collect(first))
        for req in [*self._carry, *_drain(self._queue)]:
            if req is not None:
                req.future.set_exception(UnavailableError("the server is shutting down"))


def _drain(q: queue.Queue) -> list:
    """Everything left in a queue, without blocking."""
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
