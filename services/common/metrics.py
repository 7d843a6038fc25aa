"""Prometheus metrics of one service, in its own registry (several servers may share a process in tests)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServiceMetrics:
    """gRPC request counts and latencies by method and status code; dynamic-batcher calls by model."""

    def __init__(self, service: str) -> None:
        if not isinstance(service, str) or not service:
            raise ValueError(f"service must be a non-empty string, got {service!r}")
        self.service = service
        self.registry = CollectorRegistry()
        # the standard process_* / python_* series (CPU, memory, open files, GC, interpreter), as a default
        # prometheus_client registry would have them
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self.requests = Counter("solrl_grpc_requests", "gRPC requests handled, by method and status code",
                                ["service", "method", "code"], registry=self.registry)
        self.latency = Histogram("solrl_grpc_request_seconds", "gRPC request handling time",
                                 ["service", "method"], registry=self.registry)
        self.batch_calls = Counter("solrl_batch_calls", "Calls of a batched model function",
                                   ["service", "model"], registry=self.registry)
        self.batch_requests = Counter("solrl_batch_requests", "Requests served by batched calls",
                                      ["service", "model"], registry=self.registry)
        self.batch_items = Histogram("solrl_batch_items", "Items (e.g. images) per batched call",
                                     ["service", "model"], buckets=_BATCH_BUCKETS, registry=self.registry)
        self.batch_seconds = Histogram("solrl_batch_seconds", "Time of one batched call",
                                       ["service", "model"], registry=self.registry)
        self.queue_rejected = Counter("solrl_queue_rejected_messages", "Work-queue messages dropped unread because "
                                      "their HMAC did not verify (reason: unsigned, bad_signature)",
                                      ["service", "stream", "reason"], registry=self.registry)

    def observe_rejected(self, stream: str, reason: str) -> None:
        """A queue message dropped because it is not signed with the run's key (solrl.queue.SignedQueue)."""
        self.queue_rejected.labels(self.service, stream, reason).inc()

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(self.service, method, code).inc()
        self.latency.labels(self.service, method).observe(seconds)

    def observe_batch(self, model: str, requests: int, items: int, seconds: float) -> None:
        self.batch_calls.labels(self.service, model).inc()
        self.batch_requests.labels(self.service, model).inc(requests)
        self.batch_items.labels(self.service, model).observe(items)
        self.batch_seconds.labels(self.service, model).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)


# stage durations of an epoch: seconds on a CPU bed to tens of minutes for a real model on one node
_STAGE_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
# metrics.jsonl keys -> (gauge, label value)
_REWARDS = {"explore.kept_proxy_mean": "explore_kept", "explore.reward_mean": "explore",
            "rollout.reward_mean": "rollout", "eval.mean_reward": "heldout"}
_STAGES = {"time_sync_s": "sync", "time_explore_s": "explore", "time_regenerate_s": "regenerate",
           "time_rollout_s": "rollout", "time_train_s": "train", "time_epoch_s": "epoch", "time_eval_s": "eval"}


class TrainingMetrics:
    """What a running training reports on the trainer's /metrics (issue 16's live view): progress, rewards,
    loss, KL, proxy agreement, adapter version, stage durations, adapter pushes, and the work queue's depth at
    scrape time. `observe_epoch` takes an epoch's metrics.jsonl record, so the series are the run's own numbers."""

    def __init__(self, metrics: ServiceMetrics, run_id: str, epochs: int) -> None:
        r, labels = metrics.registry, ["run"]
        self.run = run_id
        self.epochs = Gauge("solrl_train_epochs", "Epochs the run is configured for", labels, registry=r)
        self.epoch = Gauge("solrl_train_epoch", "Epochs done", labels, registry=r)
        self.adapter_version = Gauge("solrl_train_adapter_version", "Adapter version the trainer holds", labels,
                                     registry=r)
        self.optimizer_step = Gauge("solrl_train_optimizer_step", "Optimizer steps taken", labels, registry=r)
        self.reward = Gauge("solrl_train_reward", "Mean reward of the last epoch: explore (the proxy's, whole pool), "
                            "explore_kept (the proxy's, kept seeds), rollout (BF16 regenerated), heldout (EMA "
                            "adapter on the evaluation prompts)", ["run", "kind"], registry=r)
        self.loss = Gauge("solrl_train_loss", "DiffusionNFT loss of the last epoch", labels, registry=r)
        self.kl = Gauge("solrl_train_kl", "KL term (velocity distance to the reference) of the last epoch", labels,
                        registry=r)
        self.grad_norm = Gauge("solrl_train_grad_norm", "Mean gradient norm of the last epoch", labels, registry=r)
        self.proxy_tau = Gauge("solrl_train_proxy_kendall_tau", "Kendall tau of the explorer's and the BF16 rewards "
                               "on the kept seeds, last epoch", labels, registry=r)
        self.proxy_gap = Gauge("solrl_train_proxy_gap", "Mean proxy minus BF16 reward on the kept seeds", labels,
                               registry=r)
        self.stage = Histogram("solrl_train_stage_seconds", "Time of one stage of an epoch", ["run", "stage"],
                               buckets=_STAGE_BUCKETS, registry=r)
        self.pushes = Counter("solrl_train_adapter_pushes", "Adapter pushes to the rollout services, by outcome "
                              "(ok, failed: the run stops; dropped: a service missed it and fetches it later)",
                              ["run", "outcome"], registry=r)
        self.queue_depth = Gauge("solrl_queue_depth", "Messages in a work-queue stream (read at scrape time)",
                                 ["stream"], registry=r)
        # reward-hacking monitors (solrl/engine/monitors.py): the held-out images' flat, near-duplicate and diversity
        # measures, the trained rollouts' flat share, each reference reward and its drift, the alarms raised
        self.monitor = Gauge("solrl_monitor", "Reward-hacking monitor, last value: eval_flat_share, "
                             "eval_duplicate_share, eval_diversity (held-out images), rollout_flat_share, "
                             "rollout_best_flat_share (trained rollouts)", ["run", "monitor"], registry=r)
        self.reference = Gauge("solrl_monitor_reference_reward", "Held-out mean of a reward the run does not train on "
                               "(monitor.reference_rewards), and its drift from before training",
                               ["run", "reward", "kind"], registry=r)
        self.alarms = Counter("solrl_monitor_alarms", "Monitor thresholds crossed (monitor.* in the run config)",
                              labels, registry=r)
        self.alarms.labels(run_id)
        self.epochs.labels(run_id).set(epochs)
        for outcome in ("ok", "failed", "dropped"):
            self.pushes.labels(run_id, outcome)  # present (at 0) before the first push

    def watch_queue(self, streams: Sequence[str], length: Callable[[str], int]) -> None:
        """Read each stream's length when /metrics is scraped (NaN while the queue cannot be reached)."""
        def reader(stream: str) -> Callable[[], float]:
            def read() -> float:
                try:
                    return float(length(stream))
                except Exception:  # a scrape must not fail because Redis is briefly away
                    return math.nan
            return read

        for stream in streams:
            self.queue_depth.labels(stream).set_function(reader(stream))

    def observe_epoch(self, rec: Mapping[str, Any]) -> None:
        run = self.run
        if "epoch" in rec:
            self.epoch.labels(run).set(rec["epoch"])
        if "adapter_version" in rec:
            # the record's version is the one the epoch sampled with (with rollout.staleness=1 one behind the trainer's,
            # train.adapter_version); training made the next one
            held = rec.get("train.adapter_version", rec["adapter_version"])
            self.adapter_version.labels(run).set(held + (1 if rec.get("epoch", 0) > 0 else 0))
        for key, gauge in (("train.global_step", self.optimizer_step), ("train.loss", self.loss),
                           ("train.kl", self.kl), ("train.grad_norm", self.grad_norm),
                           ("proxy_kendall_tau", self.proxy_tau), ("proxy_gap", self.proxy_gap)):
            if isinstance(rec.get(key), (int, float)):
                gauge.labels(run).set(rec[key])
        for key, kind in _REWARDS.items():
            if isinstance(rec.get(key), (int, float)):
                self.reward.labels(run, kind).set(rec[key])
        for key, stage in _STAGES.items():
            if isinstance(rec.get(key), (int, float)):
                self.stage.labels(run, stage).observe(rec[key])
        for key in ("eval.flat_share", "eval.duplicate_share", "eval.diversity", "rollout.flat_share",
                    "rollout.best_flat_share"):
            if isinstance(rec.get(key), (int, float)):
                self.monitor.labels(run, key.replace(".", "_")).set(rec[key])
        for key, value in rec.items():
            for prefix, kind in (("eval.ref.", "heldout"), ("eval.ref_drift.", "drift")):
                if key.startswith(prefix) and isinstance(value, (int, float)):
                    self.reference.labels(run, key[len(prefix):], kind).set(value)
        if rec.get("monitor.alarms"):
            self.alarms.labels(run).inc(rec["monitor.alarms"])

    def observe_push(self, outcome: str) -> None:
        self.pushes.labels(self.run, outcome).inc()
