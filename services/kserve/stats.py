"""Triton's per-model inference statistics, kept by the KServe front door."""

from __future__ import annotations

import threading
import time


class InferStats:
    """Per-model statistics as Triton's statistics extension defines them, kept by the KServe front door (gRPC
    and REST share one). Durations in ns: `success` / `fail` whole requests from arrival to answer, `queue`
    the wait in the service's own batcher (0 where there is none), `compute_input` decoding the input tensors,
    `compute_infer` the model call less its queue wait, `compute_output` encoding the outputs. The models
    declare max_batch_size 0 (their tensors carry the batch axis), so each request is one inference and one
    execution, as in Triton for such models. Written by hand: Triton's own bookkeeping lives in its C++ server."""

    KINDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[tuple[str, str], dict[str, int]] = {}

    def record(self, name: str, version: str, *, ok: bool, total_ns: int, queue_ns: int = 0, input_ns: int = 0,
               infer_ns: int = 0, output_ns: int = 0) -> None:
        with self._lock:
            m = self._models.setdefault((name, version), {"last_inference": 0, "count": 0,
                                                           **{f"{k}_{x}": 0 for k in self.KINDS
                                                              for x in ("count", "ns")}})
            kind = "success" if ok else "fail"
            m[f"{kind}_count"] += 1
            m[f"{kind}_ns"] += int(total_ns)
            if not ok:
                return
            m["count"] += 1
            m["last_inference"] = int(time.time() * 1000)
            for k, ns in (("queue", queue_ns), ("compute_input", input_ns), ("compute_infer", infer_ns),
                          ("compute_output", output_ns)):
                m[f"{k}_count"] += 1
                m[f"{k}_ns"] += int(ns)

    def model_stats(self, name: str, version: str) -> dict:
        """One model's statistics in Triton's JSON form (zeros before its first request)."""
        with self._lock:
            m = dict(self._models.get((name, version), {}))

        def dur(k: str) -> dict[str, int]:
            return {"count": m.get(f"{k}_count", 0), "ns": m.get(f"{k}_ns", 0)}

        n = m.get("count", 0)
        return {"name": name, "version": version, "last_inference": m.get("last_inference", 0),
                "inference_count": n, "execution_count": n,
                "inference_stats": {k: dur(k) for k in self.KINDS} | {"cache_hit": {"count": 0, "ns": 0},
                                                                       "cache_miss": {"count": 0, "ns": 0}},
                "batch_stats": [{"batch_size": 1, **{k: dur(k) for k in self.KINDS[3:]}}] if n else []}
