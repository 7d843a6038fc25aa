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


def pytest_collection_modifyitems(config, items):
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

