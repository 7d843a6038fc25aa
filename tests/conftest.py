import os

import pytest
import torch

# Two cores are shared by the test processes and the services they start: a pytest-xdist worker
# (make test runs several) takes one torch thread, so the workers do not oversubscribe the cores; a lone
# pytest takes two.
torch.set_num_threads(int(os.environ.get("SOLRL_TEST_THREADS", "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2")))


def pytest_configure(config):
    # Generated protobuf stubs are imported at collection time by the service tests.
    from solrl.protos_build import build_protos

    build_protos()


# The files that take longest (pytest --durations, benchmarks/results/test_durations.md), longest first: collected
# first, so that under pytest-xdist (make test: whole files per worker, handed out in collection order) they start
# at once instead of one of them running on alone at the end.
HEAVY_FILES = ("test_learning.py", "test_bench_curve.py", "test_deploy.py", "test_bench.py", "test_faults.py",
               "test_gpu_deploy.py", "test_proxy.py", "test_pretrain.py", "test_gpu_check.py", "test_trainer_service_ddp.py",
               "test_hpsv3.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: every file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def reward_service():
    """A running reward service (shapes and jpeg_compressibility, 1 ms batching) on free ports, per test module."""
    from services.common.metrics import ServiceMetrics
    from services.reward.dataplane import RewardDataPlane
    from services.reward.server import start

    metrics = ServiceMetrics("reward")
    plane = RewardDataPlane.build(["shapes", "jpeg_compressibility"], max_delay_ms=1.0, observe=metrics.observe_batch)
    svc = start(plane, metrics, host="127.0.0.1")
    yield svc
    svc.stop(grace=0.5)

