"""Adapter distribution that survives scaling, and the trainer's start-up check of its workers.

Real gRPC explorer services and the trainer's real ops app over HTTP: a push to a pod that is gone is
retried for a bounded time and dropped without failing; a refusal is not dropped; a pod that starts
late fetches the current adapter from the trainer itself; the trainer refuses rollout services that
serve another model, precision, reward or another run's adapter, naming what differs.
"""

from __future__ import annotations

import copy
import logging
import socket
import time

import httpx
import pytest
import torch

from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.explorer.dataplane import ExplorerDataPlane
from services.explorer.server import start
from services.rollout.adapter_endpoint import AdapterFetcher
from services.trainer.server import AdapterPusher, check_workers, mount_current_adapter
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.config import apply_overrides, get_preset
from solrl.precision import PrecisionConfig
from solrl.rewards import build_reward
from solrl.shapes.model import ShapesModel

TOKEN = "distribution-test-token"


def tiny_model() -> ShapesModel:
    return ShapesModel.random(seed=0, layers=1, heads=2)


def adapter(model: ShapesModel, version: int) -> bytes:
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
    adapters = LoraAdapters(copy.deepcopy(model.transformer), spec, seed=version)
    with torch.no_grad():
        for p in adapters.parameters("default"):
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(version)))
    return encode_adapter(adapters.state_dict("default"), version, spec)


def plane(model: ShapesModel, reward: str = "shapes") -> ExplorerDataPlane:
    p = ExplorerDataPlane(model, PrecisionConfig("nvfp4-emu"), None, build_reward(reward), steps=2, kept=2)
    p.model_name, p.base_precision = "shapes", "bf16"
    return p


def dead_address() -> str:
    with socket.socket() as s:   # a port nobody listens on: a pod that is gone
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def explorer():
    svc = start(plane(tiny_model()), ServiceMetrics("explorer"), adapter_token=TOKEN)
    yield svc
    svc.stop(0)


def test_a_vanished_pod_is_dropped_from_a_push_and_a_late_pod_fetches_the_adapter(explorer, caplog):
    model = tiny_model()
    gone = dead_address()
    pusher = AdapterPusher([explorer.grpc.address, gone], [], TOKEN, timeout_s=10, retry_s=1.5)
    data = adapter(model, 1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        pusher(data, 1, sha256_hex(data))   # does not raise: the live pod has it, the gone one is dropped
    assert 1.0 < time.monotonic() - t0 < 10    # retried for about retry_s, not the RPC timeout
    assert explorer.plane.hot.current().version == 1
    assert [(v, a) for v, a, _ in pusher.dropped] == [(1, gone)] and "UNAVAILABLE" in pusher.dropped[0][2]
    assert any(gone in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)

    # a refusal is a configuration error, never dropped: the run must stop and say why
    wrong = AdapterPusher([explorer.grpc.address], [], "not-the-token", retry_s=1.0)
    data2 = adapter(model, 2)
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        wrong(data2, 2, sha256_hex(data2))

    # the trainer's ops app serves the last pushed adapter to a pod that starts late
    app = create_ops_app(metrics=ServiceMetrics("trainer"), ready=lambda: True, info=dict)
    mount_current_adapter(app, pusher, TOKEN)
    http = HttpServer(app, "127.0.0.1", 0)
    http.start()
    try:
        url = f"http://127.0.0.1:{http.port}"
        assert httpx.get(f"{url}/v1/adapter/current").status_code == 401
        late = plane(tiny_model())
        assert AdapterFetcher(url, "wrong", late.hot).fetch() is None and late.hot.current().version == 0
        late.hot.fetcher = AdapterFetcher(url, TOKEN, late.hot)
        with late.hot.serving(min_version=1, timeout=5) as served:   # a job needing version 1: fetched, not waited for
            assert (served.version, served.sha256) == (1, sha256_hex(data))
        pusher.current = None
        assert httpx.get(f"{url}/v1/adapter/current", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 204
    finally:
        http.stop()
        pusher.close()
        wrong.close()


def test_the_trainer_refuses_workers_that_do_not_serve_its_run(explorer):
    # the run the explorer above serves: the preset with the emulated NVFP4 explorer named
    cfg = apply_overrides(get_preset("shapes-sol-rl"), ["rollout.explore_precision.backend=nvfp4-emu"]).validate()
    pusher = AdapterPusher([explorer.grpc.address], [], TOKEN)
    try:
        seen = check_workers(pusher, cfg, timeout_s=10)
        assert seen[0]["model"] == "shapes" and seen[0]["precision"] == "nvfp4-emu"
        other = apply_overrides(get_preset("shapes-sol-rl"), ["reward=jpeg_compressibility",
                                                              "rollout.explore_precision.backend=fp8-e5m2-emu",
                                      "rollout.precision.backend=fp32"]).validate()
        with pytest.raises(RuntimeError) as err:
            check_workers(pusher, other, timeout_s=10)
        text = str(err.value)
        assert f"explorer {explorer.grpc.address} serves reward 'shapes', the run has reward='jpeg_compressibility'" in text
        assert "serves precision 'nvfp4-emu', the run has rollout.explore_precision.backend='fp8-e5m2-emu'" in text
        assert "serves base precision 'bf16', the run has rollout.precision.backend='fp32'" in text
        # an emulated backend and its kernel compute the same format: compatible
        for same in ("nvfp4", "nvfp4-te-emu"):
            nvfp4 = apply_overrides(get_preset("shapes-sol-rl"), [f"rollout.explore_precision.backend={same}"]).validate()
            check_workers(pusher, nvfp4, 10)
        # the adaptive proxy: the explorer's own precision does not matter (each job names one), but it must be
        # able to build every candidate; Transformer Engine's NVFP4 needs a Blackwell GPU
        auto = ["rollout.explore_precision.backend=auto"]
        check_workers(pusher, apply_overrides(get_preset("shapes-sol-rl"), auto).validate(), 10)
        te = apply_overrides(get_preset("shapes-sol-rl"), auto + ['rollout.proxy.candidates=["nvfp4@4", "bf16@6"]'])
        if "nvfp4" not in explorer.plane.info()["available_precisions"]:
            with pytest.raises(RuntimeError, match=r"cannot serve the adaptive proxy's candidate precision\(s\) "
                                                   r"\['nvfp4'\]"):
                check_workers(pusher, te.validate(), 10)
        data = adapter(tiny_model(), 3)
        explorer.plane.hot.load(data, version=3, sha256=sha256_hex(data))
        with pytest.raises(RuntimeError, match="serves adapter version 3, newer than this run's 0"):
            check_workers(pusher, cfg, timeout_s=10)
        check_workers(pusher, cfg, timeout_s=10, version=3)   # a resumed run at that version: fine
        with pytest.raises(RuntimeError, match="did not answer Info within 1s"):
            check_workers(AdapterPusher([dead_address()], [], TOKEN), cfg, timeout_s=1)
    finally:
        pusher.close()
