"""The explorer's stream consumer (the distributed loop): ExploreJob messages from the stream "explore"
(group "explorers") -> one SeedSelection each on "regenerate" (key: the job id). The consuming, publishing and
acking are services.rollout.consumers.StreamWorker's."""

from __future__ import annotations

from collections.abc import Callable

from services.explorer.dataplane import JOB_FIELDS, ExplorerDataPlane
from services.rollout.consumers import Results, StreamWorker
from services.rollout.plane import resolve_sampler
from solrl.engine.queue_loop import GROUP_EXPLORERS, STREAM_EXPLORE, STREAM_REGENERATE
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.queue import Queue


def explore_handler(plane: ExplorerDataPlane) -> Callable[[bytes], Results]:
    """ExploreJob bytes -> one SeedSelection (key: the job id)."""

    def handle(payload: bytes) -> Results:
        job = common_pb2.ExploreJob.FromString(payload)
        sampler = resolve_sampler(plane.sampler, job.sampler.solver, job.sampler.shift, job.sampler.guidance,
                                  field="job.sampler")
        out = plane.explore([job.prompt], [list(job.seeds)], steps=job.steps or None, kept=job.kept or None,
                            selection=job.selection or None, sampler=sampler, min_version=job.min_adapter_version,
                            precision=job.precision, policy=job.precision_policy, gate=job.gate,
                            fields=JOB_FIELDS)
        sel = common_pb2.SeedSelection(job_id=job.job_id, prompt=job.prompt, seeds=out.seeds[0],
                                       proxy_scores=out.scores[0].tolist(), kept_indices=out.kept[0],
                                       adapter_version=common_pb2.AdapterVersion(version=out.version,
                                                                                 sha256=out.sha256),
                                       sampler=job.sampler, proxy=out.proxy, gate=out.gate,
                                       gate_failed=out.gate_failed)
        return [(job.job_id, sel.SerializeToString())]

    return handle


def explorer_worker(queue: Queue, plane: ExplorerDataPlane, **kwargs) -> StreamWorker:
    return StreamWorker(queue, STREAM_EXPLORE, GROUP_EXPLORERS, STREAM_REGENERATE, explore_handler(plane), **kwargs)
