"""The regenerator's stream consumer (the distributed loop): SeedSelection messages from the stream
"regenerate" (group "regenerators") -> one Rollout per kept seed on "rollouts" (key: job_id:position among the
kept). The consuming, publishing and acking are services.rollout.consumers.StreamWorker's."""

from __future__ import annotations

from collections.abc import Callable

from services.common.tensors import torch_to_tensor
from services.regenerator.dataplane import RegeneratorDataPlane
from services.rollout.consumers import Results, StreamWorker
from services.rollout.plane import resolve_sampler, sde_rollout_fields
from solrl.engine.queue_loop import GROUP_REGENERATORS, STREAM_REGENERATE, STREAM_ROLLOUTS, rollout_key
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.queue import Queue


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
                                    explore_adapter_version=sel.adapter_version, gate=sel.gate,
                                    gate_failed=sel.gate_failed,
                                    **sde_rollout_fields(out, j, sampler)).SerializeToString())
                for j, (i, seed, x0, reward) in enumerate(zip(kept, out.seeds, out.x0, out.rewards))]

    return handle


def regenerator_worker(queue: Queue, plane: RegeneratorDataPlane, **kwargs) -> StreamWorker:
    return StreamWorker(queue, STREAM_REGENERATE, GROUP_REGENERATORS, STREAM_ROLLOUTS, regenerate_handler(plane),
                        **kwargs)
