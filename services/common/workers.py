"""Stream consumers that feed the rollout services from the work queue (the distributed loop).

A `StreamWorker` thread takes messages from one stream as a member of a consumer group, turns each
into result messages, publishes them, and only then marks the job done (idempotency key recorded,
XACK). A job redelivered after its results were published is skipped by the `Deduplicator`; a job
that fails is left un-acked, so the queue redelivers it (and dead-letters it after max_deliveries).

  explorer     explore (ExploreJob, group "explorers")          -> regenerate (SeedSelection, key job_id)
  regenerator  regenerate (SeedSelection, group "regenerators") -> rollouts (Rollout, key job_id:position)
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
from services.common.rollout_plane import resolve_sampler, sde_rollout_fields
from services.common.tensors import torch_to_tensor
from services.explorer.dataplane import JOB_FIELDS, ExplorerDataPlane
from services.regenerator.dataplane import RegeneratorDataPlane
from solrl.engine.queue_loop import (
    GROUP_EXPLORERS,
    GROUP_REGENERATORS,
    STREAM_EXPLORE,
    STREAM_REGENERATE,
    STREAM_ROLLOUTS,
    ensure_pipeline,
    rollout_key,
)
from solrl.pb.solrl.common.v1 import common_pb2
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


def explore_handler(plane: ExplorerDataPlane) -> Callable[[bytes], Results]:
    """ExploreJob bytes -> one SeedSelection (key: the job id)."""

    def handle(payload: bytes) -> Results:
        job = common_pb2.ExploreJob.FromString(payload)
        sampler = resolve_sampler(plane.sampler, job.sampler.solver, job.sampler.shift, job.sampler.guidance,
                                  field="job.sampler")
        out = plane.explore([job.prompt], [list(job.seeds)], steps=job.steps or None, kept=job.kept or None,
                            selection=job.selection or None, sampler=sampler, min_version=job.min_adapter_version,
                            precision=job.precision, policy=job.precision_policy, fields=JOB_FIELDS)
        sel = common_pb2.SeedSelection(job_id=job.job_id, prompt=job.prompt, seeds=out.seeds[0],
                                       proxy_scores=out.scores[0].tolist(), kept_indices=out.kept[0],
                                       adapter_version=common_pb2.AdapterVersion(version=out.version,
                                                                                 sha256=out.sha256),
                                       sampler=job.sampler, proxy=out.proxy)
        return [(job.job_id, sel.SerializeToString())]

    return handle


def regenerate_handler(plane: RegeneratorDataPlane) -> Callable[[bytes], Results]:
    """SeedSelection bytes -> one Rollout per kept seed (key: job_id:position among the kept)."""

    def handle(payload: bytes) -> Results:
        sel = common_pb2.SeedSelection.FromString(payload)
        kept = list(sel.kept_indices)
        if not kept or any(not 0 <= i < len(sel.seeds) for i in kept):
            raise ValueError(f"selection.kept_indices {kept} must index selection.seeds ({len(sel.seeds)} seeds)")
        if len(sel.proxy_scores) != len(sel.seeds):
            raise ValueError(f"selection.proxy_scores: {len(sel.proxy_scores)} scores for {len(sel.seeds)} seeds")
        sampler = resolve_sampler(plane.sampler, sel.sampler.solver, sel.sampler.shift, sel.sampler.guidance,
                                  field="selection.sampler", sde_eta=sel.sampler.sde_eta)
        out = plane.regenerate(sel.prompt, [sel.seeds[i] for i in kept], steps=sel.sampler.steps or None,
                               sampler=sampler, min_version=sel.adapter_version.version,
                               fields={"prompt": "selection.prompt", "seeds": "selection.seeds",
                                       "steps": "selection.sampler.steps",
                                       "min_version": "selection.adapter_version.version"})
        version = common_pb2.AdapterVersion(version=out.version, sha256=out.sha256)
        return [(rollout_key(sel.job_id, j),
                 common_pb2.Rollout(job_id=sel.job_id, prompt=sel.prompt, seed=seed, x0=torch_to_tensor(x0),
                                    reward=float(reward), proxy_reward=sel.proxy_scores[i],
                                    adapter_version=version, proxy=sel.proxy,
                                    explore_adapter_version=sel.adapter_version,
                                    **sde_rollout_fields(out, j, sampler)).SerializeToString())
                for j, (i, seed, x0, reward) in enumerate(zip(kept, out.seeds, out.x0, out.rewards))]

    return handle


def explorer_worker(queue: Queue, plane: ExplorerDataPlane, **kwargs) -> StreamWorker:
    return StreamWorker(queue, STREAM_EXPLORE, GROUP_EXPLORERS, STREAM_REGENERATE, explore_handler(plane), **kwargs)


def regenerator_worker(queue: Queue, plane: RegeneratorDataPlane, **kwargs) -> StreamWorker:
    return StreamWorker(queue, STREAM_REGENERATE, GROUP_REGENERATORS, STREAM_ROLLOUTS, regenerate_handler(plane),
                        **kwargs)


def start_consumer(role: str, plane: ExplorerDataPlane | RegeneratorDataPlane, redis_url: str,
                   namespace: str = DEFAULT_NAMESPACE, claim_idle_ms: int = QueueConfig.claim_idle_ms, *,
                   password: str | None = None, signing_key: str | None = None,
                   on_reject: Callable[[Delivery, str], None] | None = None) -> StreamWorker:
    """For a service shell: connect to the queue and start `role`'s ("explorer" | "regenerator") consumer;
    its stop() also closes the connection. password: the Redis password (env SOLRL_REDIS_PASSWORD);
    signing_key: the run's queue key (env SOLRL_QUEUE_KEY): jobs must verify, results are signed."""
    factories = {"explorer": explorer_worker, "regenerator": regenerator_worker}
    if role not in factories:
        raise ValueError(f"role must be one of {sorted(factories)}, got {role!r}")
    if not isinstance(redis_url, str) or not redis_url:
        raise ValueError(f"redis_url must be a redis:// URL, got {redact_url(redis_url)!r}")
    queue = build_queue(redis_url, QueueConfig(namespace=namespace, claim_idle_ms=claim_idle_ms), password=password,
                        signing_key=signing_key, on_reject=on_reject)
    worker = factories[role](queue, plane)
    worker.owns_queue = True
    log.info("%s: consuming %s at %s (namespace %s, messages %s)", role, worker.stream, redact_url(redis_url),
             namespace, "signed" if signing_key else f"unsigned: {ENV_QUEUE_KEY} is not set")
    return worker.start()
