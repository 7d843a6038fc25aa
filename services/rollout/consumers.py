"""Stream consumers that feed the rollout services from the work queue (the distributed loop).

A `StreamWorker` thread takes messages from one stream as a member of a consumer group, turns each
into result messages, publishes them, and only then marks the job done (idempotency key recorded,
XACK). A job redelivered after its results were published is skipped by the `Deduplicator`; a job
that fails is left un-acked, so the queue redelivers it (and dead-letters it after max_deliveries).
What a message becomes is the role's (it passes its worker in):

  explorer     explore (ExploreJob, group "explorers")          -> regenerate (SeedSelection, key job_id)
               services/explorer/consumer.py
  regenerator  regenerate (SeedSelection, group "regenerators") -> rollouts (Rollout, key job_id:position)
               services/regenerator/consumer.py
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence

from services.common.args import (  # noqa: F401 (re-exported: the options and names live there, light)
    DEFAULT_NAMESPACE,
    add_consumer_arguments,
)
from services.common.env import (  # noqa: F401 (re-exported)
    ENV_QUEUE_KEY,
    ENV_QUEUE_NAMESPACE,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_URL,
)
from solrl.engine.queue_loop import ensure_pipeline
from solrl.queue import (
    Deduplicator,
    Delivery,
    Queue,
    QueueConfig,
    build_queue,
    redact_url,
)

log = logging.getLogger("solrl.services.workers")

# (key, serialized message) pairs to publish for one consumed message
Results = Sequence[tuple[str, bytes]]


class StreamWorker:
    """Consume `stream` in `group`, publish `handle(message)`'s results to `out_stream`, then ack."""

    def __init__(self, queue: Queue, stream: str, group: str, out_stream: str, handle: Callable[[bytes], Results], *,
                 consumer: str | None = None, block_ms: int = 500, publish_timeout_s: float = 60.0) -> None:
        if not isinstance(queue, Queue):
            raise TypeError(f"queue must be a solrl.queue.Queue, got {type(queue).__name__}")
        if not callable(handle):
            raise TypeError(f"handle must be callable, got {type(handle).__name__}")
        if not isinstance(block_ms, int) or block_ms < 1:
            raise ValueError(f"block_ms must be an int >= 1, got {block_ms!r}")
        self.queue, self.stream, self.group, self.out_stream, self.handle = queue, stream, group, out_stream, handle
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{group}"
        self.block_ms, self.publish_timeout_s = block_ms, float(publish_timeout_s)
        self.dedup = Deduplicator(queue, group)
        self.processed = 0   # jobs whose results were published
        self.skipped = 0     # redelivered jobs already processed
        self.failed = 0      # jobs left un-acked after an error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.owns_queue = False  # stop() closes the queue (set by start_consumer, which opened it)
        ensure_pipeline(queue)

    def step(self) -> int:
        """Take and process at most one message; returns how many results were published."""
        published = 0
        for d in self.queue.consume(self.stream, self.group, self.consumer, count=1, block_ms=self.block_ms):
            if self.dedup.skip(d):
                self.skipped += 1
                log.info("%s: job %s already processed; skipped (delivery %d)", self.group, d.key, d.deliveries)
                continue
            published += self._process(d)
        return published

    def _process(self, d: Delivery) -> int:
        try:
            results = self.handle(d.payload)
            for key, payload in results:
                self.queue.publish(self.out_stream, payload, key=key, timeout_s=self.publish_timeout_s)
        except Exception:  # left un-acked: redelivered after claim_idle_ms, dead-lettered after max_deliveries
            self.failed += 1
            log.exception("%s: job %s failed (delivery %d); left for redelivery", self.group, d.key, d.deliveries)
            return 0
        self.dedup.done(d)  # ack only after every result is published
        self.processed += 1
        log.info("%s: job %s done by %s (delivery %d)", self.group, d.key, self.consumer, d.deliveries)
        return len(results)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the queue itself failed (e.g. Redis gone past its retry budget): keep trying
                log.exception("%s: consuming %s failed", self.group, self.stream)
                self._stop.wait(1.0)

    def start(self) -> StreamWorker:
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._thread = threading.Thread(target=self.run, name=f"consume-{self.stream}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop taking jobs; the job in progress finishes (up to `timeout` seconds)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.owns_queue:
            self.queue.close()


def start_consumer(role: str, worker: Callable[[Queue], StreamWorker], redis_url: str,
                   namespace: str = DEFAULT_NAMESPACE, claim_idle_ms: int = QueueConfig.claim_idle_ms, *,
                   password: str | None = None, signing_key: str | None = None,
                   on_reject: Callable[[Delivery, str], None] | None = None) -> StreamWorker:
    """For a service shell: connect to the queue and start `role`'s consumer, `worker(queue)` (the role's own:
    services/<role>/consumer.py); its stop() also closes the connection. password: the Redis password (env
    SOLRL_REDIS_PASSWORD); signing_key: the run's queue key (env SOLRL_QUEUE_KEY): jobs must verify, results are
    signed."""
    if not callable(worker):
        raise TypeError(f"worker must be callable (queue -> StreamWorker), got {type(worker).__name__}")
    if not isinstance(redis_url, str) or not redis_url:
        raise ValueError(f"redis_url must be a redis:// URL, got {redact_url(redis_url)!r}")
    queue = build_queue(redis_url, QueueConfig(namespace=namespace, claim_idle_ms=claim_idle_ms), password=password,
                        signing_key=signing_key, on_reject=on_reject)
    consumer = worker(queue)
    consumer.owns_queue = True
    log.info("%s: consuming %s at %s (namespace %s, messages %s)", role, consumer.stream, redact_url(redis_url),
             namespace, "signed" if signing_key else f"unsigned: {ENV_QUEUE_KEY} is not set")
    return consumer.start()
