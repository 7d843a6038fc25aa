"""The trainer's driver for the distributed loop: the embedded epoch with rollouts over the work queue.

Per epoch: push the "old" adapter to the rollout services (a callable the service injects), publish
one ExploreJob per prompt to `explore`, collect exactly P * k Rollouts from `rollouts` (deduplicated
by their idempotency key), then train with the same `NFTTrainer.update` as the embedded loop.
Prompts, seed pools and the training generator come from the same `epoch_rng(seed, epoch, 0)`, so
with the same config the distributed run follows the embedded one. Transport-free: it takes a Queue.
With rollout.staleness=1 the epochs are pipelined: epoch e+1's jobs are published (for the adapter before epoch
e's update) before epoch e is trained, so the rollout services sample them meanwhile (`RemoteSession.epoch`).

Supported mode: sol_rl (explore -> select -> regenerate), with train.algo nft or flow_grpo (the regenerators
then sample with the SDE, SamplerSpec.sde_eta, and each Rollout carries its trajectory and log-probs). The stream
and group names here are the pipeline's contract; the services' stream consumers (services.explorer.consumer,
services.regenerator.consumer) import them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from solrl.adapters import encode_adapter
from solrl.adapters.wire import sha256_hex
from solrl.config import RunConfig
from solrl.engine import data_parallel as ddp
from solrl.engine.run import resume_session, run_epochs
from solrl.engine.session import Session, epoch_rng, proxy_agreement, selection_contrast, trained_spread
from solrl.engine.update import Batch
from solrl.queue import Queue
from solrl.rollout.strategies import STRATEGIES

# the modes the services' explorer -> regenerator pipeline runs (rollout strategies with runs_on_services)
SERVICE_MODES = tuple(name for name, s in STRATEGIES.items() if s.runs_on_services)
STREAM_EXPLORE, STREAM_REGENERATE, STREAM_ROLLOUTS = "explore", "regenerate", "rollouts"
GROUP_EXPLORERS, GROUP_REGENERATORS, GROUP_TRAINER = "explorers", "regenerators", "trainer"
PIPELINE = ((STREAM_EXPLORE, GROUP_EXPLORERS), (STREAM_REGENERATE, GROUP_REGENERATORS),
            (STREAM_ROLLOUTS, GROUP_TRAINER))

# push_adapter(safetensors bytes, version, sha256): load the adapter on every rollout service
PushAdapter = Callable[[bytes, int, str], None]


def ensure_pipeline(queue: Queue) -> None:
    """Create every pipeline stream's consumer group (idempotent; before anything is published)."""
    for stream, group in PIPELINE:
        queue.ensure_group(stream, group)


def rollout_key(job_id: str, position: int) -> str:
    """The idempotency key of the `position`-th kept seed's Rollout of job `job_id`.

    Keyed by position rather than by seed: a pool may draw the same seed twice.
    """
    return f"{job_id}:{position}"


def job_id_for(run_id: str, epoch: int, prompt_index: int) -> str:
    return f"{run_id}-e{epoch:06d}-p{prompt_index:05d}"


@dataclass
class EpochJobs:
    """One epoch's published ExploreJobs: what the driver collects and trains on."""

    epoch: int
    prompts: list[str]
    jobs: dict[str, int]          # job id -> prompt index
    published: dict[str, str]     # job id -> explore stream message id
    version: int                  # the adapter version the jobs are sampled with
    cand: Any = None              # the adaptive proxy's candidate the jobs name (None: the explorers' own)


def check_versions(rolls: list[Any], version: int, epoch: int, require_explorer: bool = False) -> None:
    """Every rollout was regenerated (and, where recorded, explored) with adapter `version`, the one its epoch's
    jobs asked for; RuntimeError naming the versions found otherwise. require_explorer: the explorer's version
    must be recorded (Rollout.explore_adapter_version; rollout.staleness=1)."""
    found = set()
    for ro in rolls:
        found.add(("regenerator", ro.adapter_version.version))
        if ro.HasField("explore_adapter_version"):
            found.add(("explorer", ro.explore_adapter_version.version))
        elif require_explorer:
            raise RuntimeError(f"rollout {ro.job_id} (seed {ro.seed}) does not record the explorer's adapter version "
                               f"(Rollout.explore_adapter_version): rollout.staleness=1 needs regenerators that "
                               f"forward it (update them)")
    wrong = sorted(f for f in found if f[1] != version)
    if wrong:
        raise RuntimeError(f"epoch {epoch + 1}: rollouts sampled with adapter versions "
                           f"{', '.join(f'{v} ({who})' for who, v in wrong)}, its jobs asked for exactly {version} "
                           f"(a rollout service that was pushed or fetched another version meanwhile)")


@dataclass
class DriverStatus:
    """Where the run stands (what the trainer service's Status RPC reports)."""

    run_id: str
    state: str = "starting"   # starting | running | evaluating | finished | failed
    epoch: int = 0            # epochs done
    optimizer_step: int = 0
    adapter_version: int = 0
    adapter_sha256: str = ""
    mean_reward: float = 0.0
    rollouts_consumed: int = 0
    error: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)


class RemoteSession:
    """A `Session` whose rollouts come from explorer / regenerator workers over `queue`."""

    def __init__(self, sess: Session, queue: Queue, push_adapter: PushAdapter, *, run_id: str,
                 rollout_timeout_s: float = 600.0, block_ms: int = 500, pickup_timeout_s: float | None = 120.0) -> None:
        if not sess.strategy.runs_on_services:
            raise ValueError(f"rollout.mode must be one the services run ({', '.join(SERVICE_MODES)}) for the "
                             f"distributed loop, got {sess.cfg.rollout.mode!r}")
        if not isinstance(queue, Queue):
            raise TypeError(f"queue must be a solrl.queue.Queue, got {type(queue).__name__}")
        if not callable(push_adapter):
            raise TypeError(f"push_adapter must be callable, got {type(push_adapter).__name__}")
        if not isinstance(run_id, str) or not run_id or ":" in run_id:
            raise ValueError(f"run_id must be a non-empty str without ':', got {run_id!r}")
        if not rollout_timeout_s > 0:
            raise ValueError(f"rollout_timeout_s must be > 0, got {rollout_timeout_s!r}")
        self.sess, self.queue, self.push_adapter = sess, queue, push_adapter
        self.run_id, self.rollout_timeout_s, self.block_ms = run_id, float(rollout_timeout_s), int(block_ms)
        self.pickup_timeout_s = pickup_timeout_s
        self.status = DriverStatus(run_id)
        self.pending: EpochJobs | None = None  # rollout.staleness=1: the next epoch's jobs, sampled meanwhile
        ensure_pipeline(queue)

    # ---------------------------------------------------------------- one epoch
    def sync(self, rollout: bool = False) -> float:
        """Push the "old" adapter at the current version to every rollout service (version 0 = base).
        rollout=True (rollout.staleness=1, an attempt's first epoch): the adapter that epoch's rollouts are
        sampled with instead, one version behind the trainer's (Session.rollout_version)."""
        t0 = time.perf_counter()
        sess = self.sess
        version = sess.rollout_version() if rollout else sess.version
        with sess.sampling_adapter() if rollout else contextlib.nullcontext():
            if version == 0:
                base, old = sess.adapters.merged_weights(None), sess.adapters.merged_weights("old")
                if any(not torch.equal(base[k], old[k]) for k in base):
                    raise ValueError("adapter version 0 must be the base model (LoRA B initialised to zero); "
                                     f"lora.init={sess.cfg.lora.init!r} gives a non-zero initial adapter")
                return time.perf_counter() - t0
            data = encode_adapter(sess.adapters.state_dict("old"), version, sess.adapters.spec)
        sha = sha256_hex(data)
        try:
            self.push_adapter(data, version, sha)
        except RuntimeError as exc:
            if not rollout:
                raise
            raise RuntimeError(f"{exc} -- rollout.staleness=1: the resumed epoch {self.status.epoch + 1}'s rollouts "
                               f"must be sampled with adapter version {version}, one behind the checkpoint's "
                               f"{sess.version}, and a rollout service already serves a newer one (pushed before the "
                               f"trainer stopped): restart the rollout services too") from None
        self.status.adapter_sha256 = sha
        return time.perf_counter() - t0

    def publish(self, epoch: int, version: int) -> EpochJobs:
        """Publish epoch `epoch`'s ExploreJobs (one per prompt), to be sampled with adapter `version`."""
        from solrl.pb.solrl.common.v1 import common_pb2

        sess, cfg, r = self.sess, self.sess.cfg, self.sess.cfg.rollout
        rng, _ = epoch_rng(cfg.seed, epoch, 0)  # the embedded loop's draws, in the same order
        prompts = sess.prompt_sampler(rng, r.prompts_per_epoch)
        seeds = rng.integers(0, 2**31 - 1, size=(len(prompts), r.pool)).tolist()
        sampler = common_pb2.SamplerSpec(solver=sess.sampler.solver, steps=r.steps, shift=sess.sampler.shift,
                                         guidance=sess.sampler.guidance,
                                         sde_eta=r.sde_eta if cfg.train.algo == "flow_grpo" else 0.0)
        jobs = {job_id_for(self.run_id, epoch, p): p for p in range(len(prompts))}
        published: dict[str, str] = {}
        cand = None  # the adaptive proxy: the explorers are told which precision and policy to sample with
        if sess.proxy is not None:
            from solrl.rollout.candidates import parse_candidate

            cand = parse_candidate(sess.proxy.current)
        for job_id, p in jobs.items():
            job = common_pb2.ExploreJob(job_id=job_id, run_id=self.run_id, prompt=prompts[p], seeds=seeds[p],
                                        steps=sess.explore_steps(), kept=r.kept, selection=r.selection,
                                        min_adapter_version=version, sampler=sampler,
                                        precision=cand.backend if cand else "",
                                        precision_policy=cand.policy if cand else "", gate=cfg.guard.gate)
            published[job_id] = self.queue.publish(STREAM_EXPLORE, job.SerializeToString(), key=job_id,
                                                   timeout_s=self.rollout_timeout_s)
        return EpochJobs(epoch, prompts, jobs, published, version, cand)

    def epoch(self, epoch: int) -> dict[str, Any]:
        """One epoch. rollout.staleness=0: push the adapter, publish this epoch's jobs, collect, train.
        rollout.staleness=1: collect this epoch's rollouts (published during the previous epoch, or now on an
        attempt's first epoch), push the current adapter, publish the next epoch's jobs, then train: the rollout
        services sample epoch e+1 with the adapter before epoch e's update while the trainer trains epoch e. The
        next adapter is pushed only once every rollout of the jobs in flight is in, so each is sampled with one
        version (checked: explorer and regenerator record it in every Rollout)."""
        sess, cfg, r = self.sess, self.sess.cfg, self.sess.cfg.rollout
        _, tgen = epoch_rng(cfg.seed, epoch, 0)
        pend = self.pending if self.pending is not None and self.pending.epoch == epoch else None
        self.pending = None
        rec: dict[str, Any] = {"epoch": epoch + 1, "adapter_version": pend.version if pend else sess.rollout_version(),
                               "mode": r.mode}
        if r.staleness:
            rec["train.adapter_version"] = sess.version
        rec["time_sync_s"] = self.sync(rollout=bool(r.staleness)) if pend is None else 0.0

        t0 = time.perf_counter()
        if pend is None:
            pend = self.publish(epoch, sess.rollout_version())
        prompts, cand = pend.prompts, pend.cand
        if cand is not None:
            rec["explore.proxy"] = sess.proxy.current
        got = self.collect(pend.jobs, r.kept, pend.published)
        rec["time_rollout_s"] = time.perf_counter() - t0

        order = sorted(got)  # (prompt index, kept position): the embedded loop's order
        rolls = [got[key] for key in order]
        check_versions(rolls, pend.version, epoch, require_explorer=bool(r.staleness))
        if r.staleness and epoch + 1 < cfg.epochs:
            # every rollout of the jobs in flight is in: the services move to the current adapter and sample the next
            # epoch with it while this one trains
            t1 = time.perf_counter()
            self.sync()
            self.pending = self.publish(epoch + 1, sess.version)
            rec["time_sync_s"] += time.perf_counter() - t1
        wrong = sorted({ro.proxy for ro in rolls if ro.proxy != cand.label}) if cand else []
        if wrong:
            raise RuntimeError(f"epoch {epoch + 1}: the explorers sampled with {wrong}, the adaptive proxy asked "
                               f"for {cand.label!r} (an explorer that ignores ExploreJob.precision: update it)")
        x0 = torch.stack([_tensor(ro.x0) for ro in rolls])
        rewards = np.asarray([ro.reward for ro in rolls], dtype=np.float32)
        proxy = np.asarray([ro.proxy_reward for ro in rolls], dtype=np.float32).reshape(len(prompts), r.kept)
        group = [p for p, _ in order]
        traj, log_probs = sde_records(rolls, r.steps, r.sde_eta) if cfg.train.algo == "flow_grpo" else (None, None)
        rec.update({"rollout.reward_mean": float(rewards.mean()), "rollout.reward_std": float(rewards.std()),
                    "explore.kept_proxy_mean": float(proxy.mean()),
                    **proxy_agreement(proxy, rewards.reshape(len(prompts), r.kept)),
                    **selection_contrast(rewards.reshape(len(prompts), r.kept), r.selection),
                    **trained_spread(rewards.reshape(len(prompts), r.kept))})

        per_sample = [prompts[p] for p in group]
        rewards = self.screen(rolls, order, x0, rewards, per_sample, rec)

        t0 = time.perf_counter()
        if sess.trainer.ranks.parallel:  # data-parallel: the other ranks train on this batch too (Session.follow)
            ddp.share_batch(sess.trainer.ranks, epoch, tgen, x0, rewards, group, per_sample)
        batch = Batch(x0, sess.cache(per_sample), rewards, group, traj, log_probs)
        sess.keep_rollout_adapter()
        rec.update(sess.trainer.update(batch, tgen))
        sess.version += 1
        rec["time_train_s"] = time.perf_counter() - t0
        rec["time_epoch_s"] = rec["time_sync_s"] + rec["time_rollout_s"] + rec["time_train_s"]
        st = self.status
        st.epoch, st.optimizer_step, st.adapter_version = epoch + 1, sess.trainer.global_step, sess.version
        st.mean_reward, st.rollouts_consumed = rec["rollout.reward_mean"], st.rollouts_consumed + len(rolls)
        return rec

    def screen(self, rolls: list[Any], order: list[tuple[int, int]], x0: torch.Tensor, rewards: np.ndarray,
               prompts: list[str], rec: dict[str, Any]) -> np.ndarray:
        """The trained rewards after the guards, as the embedded loop's (`Session.screen_trained`). The explorers
        ranked with the validity gate each job named (checked: every rollout says which); the trained latents are
        decoded here for the monitors and the guards that read images (`Session.reads_trained_images`)."""
        sess, r = self.sess, self.sess.cfg.rollout
        gate = sess.cfg.guard.gate
        wrong = sorted({ro.gate for ro in rolls} - {gate})
        if wrong:
            raise RuntimeError(f"rollouts ranked with validity gate {wrong}, the run's guard.gate is {gate!r} (an "
                               f"explorer that ignores ExploreJob.gate: update it)")
        if not sess.reads_trained_images():
            return rewards
        n_prompts = len(rewards) // r.kept
        if gate:  # the explored candidates that failed the gate: each job's count, in every one of its rollouts
            failed = {p: ro.gate_failed for (p, _), ro in zip(order, rolls)}
            rec["guard.failed_share"] = sum(failed.values()) / max(1, n_prompts * r.pool)
        images = sess.model.decode(x0)
        by_prompt = rewards.reshape(n_prompts, r.kept)
        return sess.screen_trained(images, prompts, by_prompt, rec).reshape(-1).astype(np.float32)

    def collect(self, jobs: dict[str, int], kept: int, published: dict[str, str] | None = None
                ) -> dict[tuple[int, int], Any]:
        return collect_rollouts(self.queue, jobs, kept, self.rollout_timeout_s, consumer=f"driver-{self.run_id}",
                                block_ms=self.block_ms, published=published, pickup_timeout_s=self.pickup_timeout_s)


def collect_rollouts(queue: Queue, jobs: dict[str, int], kept: int, timeout_s: float, *, consumer: str = "driver",
                     block_ms: int = 500, published: dict[str, str] | None = None,
                     pickup_timeout_s: float | None = None) -> dict[tuple[int, int], Any]:
    """Exactly `kept` Rollouts per job of `jobs` (job id -> prompt index), keyed (prompt index, kept position).

    Reads `rollouts` in group "trainer"; a duplicate (a redelivered job published twice) or a rollout of
    another job is acked and dropped. TimeoutError if they do not all arrive within `timeout_s`, or,
    given `published` (job id -> explore message id), if no explorer has taken any of them within
    `pickup_timeout_s` (no worker consumes the queue: fail early, naming the jobs, not at `timeout_s`).
    """
    from solrl.pb.solrl.common.v1 import common_pb2

    want = len(jobs) * kept
    got: dict[tuple[int, int], Any] = {}
    start = time.monotonic()
    deadline = start + timeout_s
    watch = bool(published) and pickup_timeout_s is not None and pickup_timeout_s < timeout_s
    while len(got) < want:
        if watch and time.monotonic() - start >= pickup_timeout_s:
            waiting = queue.undelivered(STREAM_EXPLORE, GROUP_EXPLORERS, list(published.values()))
            if len(waiting) == len(published):
                names = sorted(published)
                raise TimeoutError(f"no explorer took any of this epoch's {len(names)} jobs within "
                                   f"{pickup_timeout_s:g}s ({names[0]} ... {names[-1]}): is an explorer consuming "
                                   f"stream {STREAM_EXPLORE!r} of this queue namespace?")
            watch = False  # taken: from here on only the overall timeout applies
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(j for j, p in jobs.items() if sum(k[0] == p for k in got) < kept)
            raise TimeoutError(f"collected {len(got)} of {want} rollouts within {timeout_s}s; jobs still short: "
                               f"{missing[:5]}{' ...' if len(missing) > 5 else ''} (are explorer and regenerator "
                               f"workers consuming the queue?)")
        deliveries = queue.consume(STREAM_ROLLOUTS, GROUP_TRAINER, consumer, count=64,
                                   block_ms=max(1, min(block_ms, int(left * 1000))))
        for d in deliveries:
            job_id, _, pos = (d.key or "").rpartition(":")
            if job_id in jobs and pos.isdigit() and int(pos) < kept:
                got.setdefault((jobs[job_id], int(pos)), common_pb2.Rollout.FromString(d.payload))
        if deliveries:
            queue.ack(STREAM_ROLLOUTS, GROUP_TRAINER, [d.id for d in deliveries])
    return got


def _tensor(msg: Any, field: str = "x0") -> torch.Tensor:
    """A float32 common.v1.Tensor as a torch tensor (the rollouts' x0, trajectory, log_probs)."""
    if msg.dtype != "float32":
        raise ValueError(f"rollout {field}.dtype must be float32, got {msg.dtype!r}")
    array = np.frombuffer(msg.data, dtype="<f4")
    if array.size != int(np.prod(msg.shape)):
        raise ValueError(f"rollout {field}: {array.size} elements for shape {list(msg.shape)}")
    return torch.from_numpy(array.reshape(tuple(msg.shape)).copy())


def sde_records(rolls: list[Any], steps: int, eta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """flow_grpo: the Rollouts' SDE trajectories [N, steps+1, ...] and log-probs [N, steps], checked to be what
    the run asked for (a regenerator that ignores SamplerSpec.sde_eta sends none: a clear error, not a crash)."""
    for ro in rolls:
        if not ro.HasField("trajectory") or not ro.HasField("log_probs"):
            raise RuntimeError(f"rollout {ro.job_id} (seed {ro.seed}) has no SDE trajectory / log_probs: train.algo="
                               f"flow_grpo needs regenerators that sample with SamplerSpec.sde_eta (update them)")
        if ro.sde_eta != eta:
            raise RuntimeError(f"rollout {ro.job_id} was sampled with sde_eta {ro.sde_eta}, the run asked for {eta}")
    traj = torch.stack([_tensor(ro.trajectory, "trajectory") for ro in rolls])
    log_probs = torch.stack([_tensor(ro.log_probs, "log_probs") for ro in rolls])
    if traj.shape[1] != steps + 1 or log_probs.shape[1:] != (steps,):
        raise RuntimeError(f"rollouts of {log_probs.shape[1]} steps (trajectory {tuple(traj.shape[1:])}), the run "
                           f"samples {steps} (rollout.steps)")
    return traj, log_probs


def run_distributed(cfg: RunConfig, run_dir: Path, queue: Queue, push_adapter: PushAdapter, *, run_id: str = "run",
                    rollout_timeout_s: float = 600.0, log: Callable[[str], None] = print,
                    on_session: Callable[[RemoteSession], None] = lambda s: None,
                    resume: bool = False, pickup_timeout_s: float | None = 120.0,
                    on_record: Callable[[dict[str, Any]], None] = lambda rec: None,
                    ranks: ddp.Ranks = ddp.SINGLE) -> dict[str, Any]:
    """Train `cfg` for cfg.epochs with rollouts from the queue; writes config.json, metrics.jsonl,
    eval/ and checkpoints/ to `run_dir` as the embedded `solrl.engine.loop.train` does.
    `ranks`: rank 0 of a torchrun launch (the trainer service under torchrun): each epoch's batch goes to the other
    ranks, which follow as in the embedded loop (solrl.engine.loop.train with ranks > 0), and every rank trains its share.
    `on_session` receives the RemoteSession once built (the trainer service reads its status); `on_record` each
    metrics.jsonl record as it is written (the trainer service's Prometheus gauges).

    resume: continue from run_dir's latest checkpoint, as `solrl train --resume` does; the epochs
    after it follow the uninterrupted run (same draws, same rollouts, same update). Every attempt's
    jobs get fresh ids (`<run_id>-a<tag>-e...`, `-r<tag>` when resumed): jobs and rollouts a dead
    attempt left in the queue are then ignored (a job id the workers already processed would be
    skipped, and rollouts the dead trainer acked are gone), and the epoch it was in is recomputed
    whole; metrics.jsonl keeps only the epochs the checkpoint covers (none on a fresh start). The
    adapter it re-pushes is the one the rollout services already hold (accepted as a no-op), as long
    as checkpoint_every is 1; otherwise restart the rollout services too."""
    if not ranks.is_main:
        raise ValueError(f"run_distributed runs on rank 0; rank {ranks.rank} follows (solrl.engine.loop.train)")
    ddp.check_ranks(cfg, ranks.world)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    start, attempt_id = 0, f"{run_id}-a{uuid.uuid4().hex[:8]}"
    sess = Session.build(cfg, local_explorer=False)
    if resume:
        start = resume_session(sess, run_dir, "resume", log)
        attempt_id = f"{run_id}-r{uuid.uuid4().hex[:8]}"
        log(f"resuming {run_dir} after epoch {start} (adapter version {sess.version}); jobs {attempt_id}-*")
    sess.trainer.data_parallel(ranks)
    remote = RemoteSession(sess, queue, push_adapter, run_id=attempt_id, rollout_timeout_s=rollout_timeout_s,
                           pickup_timeout_s=pickup_timeout_s)
    remote.status.run_id = run_id
    remote.status.epoch, remote.status.optimizer_step, remote.status.adapter_version = \
        start, sess.trainer.global_step, sess.version
    on_session(remote)
    st = remote.status
    base_eval: dict[str, Any] | None = None

    def set_state(state: str, epoch: int) -> None:
        st.state = state

    def written(rec: dict[str, Any]) -> None:
        on_record(rec)
        if rec["epoch"]:
            st.history.append(rec)

    def done(rec: dict[str, Any]) -> None:
        log(f"epoch {rec['epoch']}/{cfg.epochs}: reward {rec['rollout.reward_mean']:.4f}, "
            f"loss {rec.get('train.loss', float('nan')):.4f}, {rec['time_epoch_s']:.1f} s")

    try:
        base_eval = run_epochs(sess, run_dir, start, remote.epoch, resume=resume, log=log, fresh_truncate=-1,
                               on_state=set_state, on_record=written, after_epoch=done)
    except BaseException as exc:
        st.state, st.error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    st.state = "finished"
    return {"run_id": run_id, "epochs": cfg.epochs, "adapter_version": sess.version, "resumed_after": start,
            "eval_before": base_eval["mean_reward"] if base_eval else None, "eval_after": st.history[-1].get("eval.mean_reward")
            if st.history else None}


__all__ = [
    "GROUP_EXPLORERS",
    "GROUP_REGENERATORS",
    "GROUP_TRAINER",
    "STREAM_EXPLORE",
    "STREAM_REGENERATE",
    "STREAM_ROLLOUTS",
    "DriverStatus",
    "EpochJobs",
    "PushAdapter",
    "RemoteSession",
    "check_versions",
    "collect_rollouts",
    "ensure_pipeline",
    "job_id_for",
    "rollout_key",
    "run_distributed",
]
