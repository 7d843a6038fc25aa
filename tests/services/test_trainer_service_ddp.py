"""The trainer service under torchrun (`torchrun --nproc-per-node K --no-python solrl serve trainer ...`), CPU gloo
ranks, a real Redis at 127.0.0.1:6379: K = 2 trains the adapter K = 1 trains on the same rollouts, and a rank that is
SIGKILLed ends the service with a non-zero status within seconds, leaving no process behind.

The rollouts come from the explorer and regenerator stream workers running in this process (the services' own
workers and data planes, as tests/services/test_distributed.py runs them); they take each new adapter from the trainer's
GET /v1/adapter/current (AdapterFetcher, what a rollout service that starts mid-run does), so the trainer service
needs no rollout service addresses and the workers start afresh for every run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from services.explorer.consumer import explorer_worker
from services.regenerator.consumer import regenerator_worker
from services.rollout.adapter_endpoint import AdapterFetcher
from solrl.queue import QueueConfig, build_queue
from solrl.telemetry import read_metrics
from tests.engine.test_ddp import ATOL, GRAD_NORM_RTOL, _max_diff
from tests.services.test_distributed import REDIS, TINY, model_dir, planes, tiny_cfg  # noqa: F401  (a module-scoped fixture)

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
TOKEN = "ddp-service-test-token"
EPOCHS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_or_skip():
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS).ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    return redis.Redis.from_url(REDIS)


def trainer_command(ranks: int, model_dir: Path, out: Path, namespace: str, grpc_port: int,  # noqa: F811
                    http_port: int) -> list[str]:
    """`solrl serve trainer` for the tiny run, under torchrun when ranks > 1 (the compose / k8s entry's shape)."""
    serve = ["serve", "trainer", "--preset", "shapes-sol-rl", "--out", str(out), "--redis-url", REDIS,
             "--namespace", namespace, "--host", "127.0.0.1", "--grpc-port", str(grpc_port), "--http-port",
             str(http_port), "--rollout-timeout-s", "120", "--pickup-timeout-s", "60"]
    for o in [*TINY, f"model.path={model_dir}", f"epochs={EPOCHS}", "threads=1"]:
        serve += ["--set", o]
    if ranks == 1:
        return [str(BIN / "solrl"), *serve]
    return [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", "--no-python", str(BIN / "solrl"),
            *serve]


class ServiceRun:
    """One trainer service process started with `cmd` and `env` (what it trains: `cfg`; its ops port:
    `http_port`; its queue namespace: `namespace`), with fresh in-process explorer / regenerator workers that
    take adapters from the trainer's /v1/adapter/current. tests/deploy/test_deploy.py starts the deployment files'
    trainer entry commands through it."""

    def __init__(self, cmd: list[str], cfg, http_port: int, namespace: str, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.redis = _redis_or_skip()
        self.namespace, self.cmd, self.log = namespace, cmd, log
        self.env = {**os.environ, "SOLRL_ADAPTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", **(env or {})}
        self.queue = build_queue(REDIS, QueueConfig(namespace=namespace, claim_idle_ms=300))
        self.explorer, self.regenerator = planes(cfg)
        for plane in (self.explorer, self.regenerator):
            plane.hot.fetcher = AdapterFetcher(f"http://127.0.0.1:{http_port}", self.env["SOLRL_ADAPTER_TOKEN"],
                                               plane.hot)
        self.workers = [explorer_worker(self.queue, self.explorer, block_ms=100),
                        regenerator_worker(self.queue, self.regenerator, block_ms=100)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        for w in self.workers:
            w.start()
        self.t0 = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.log.parent,
                                         env=self.env)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the trainer service still runs after {timeout} s: {self.text()[-3000:]}")
        self.wall_s = time.monotonic() - self.t0
        return rc

    def text(self) -> str:
        return self.log.read_text()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for w in self.workers:
            w.stop()
        self.queue.close()
        keys = list(self.redis.scan_iter(f"{self.namespace}:*"))
        if keys:
            self.redis.delete(*keys)


def tiny_service(ranks: int, model_dir: Path, out: Path) -> ServiceRun:  # noqa: F811
    namespace = f"solrl-test-ddpsvc-{uuid.uuid4().hex[:10]}"
    grpc_port, http_port = _free_port(), _free_port()
    run = ServiceRun(trainer_command(ranks, model_dir, out, namespace, grpc_port, http_port),
                     tiny_cfg(model_dir, EPOCHS), http_port, namespace, out.parent / f"{out.name}.log")
    run.out = out
    return run


def _run_to_end(ranks: int, model_dir: Path, out: Path) -> ServiceRun:  # noqa: F811
    run = tiny_service(ranks, model_dir, out)
    try:
        run.start()
        rc = run.wait(240)
        assert rc == 0, run.text()[-3000:]
    finally:
        run.close()
    return run


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory) -> ServiceRun:  # noqa: F811
    """The plain `solrl serve trainer` run: the reference."""
    return _run_to_end(1, model_dir, tmp_path_factory.mktemp("k1") / "k1")


def test_two_rank_service_trains_the_one_rank_adapter_on_the_same_rollouts(one_rank, model_dir, tmp_path):  # noqa: F811
    one = one_rank
    two = _run_to_end(2, model_dir, tmp_path / "k2")
    assert "2 data-parallel ranks" in two.text() and "data-parallel" not in one.text()
    for f in ("checkpoints/epoch_0001/adapters.safetensors", "checkpoints/epoch_0002/adapters.safetensors",
              "adapter_ema.safetensors"):
        assert _max_diff(one.out / f, two.out / f) < ATOL, f   # tests/engine/test_ddp.py says why 1e-5
    m1, m2 = read_metrics(one.out / "metrics.jsonl"), read_metrics(two.out / "metrics.jsonl")
    assert [r["epoch"] for r in m2] == [0, 1, 2]   # rank 0 alone writes: each epoch once
    # epoch 1: the base model's rollouts, bit for bit; epoch 2: sampled with adapters equal to ~1e-7
    assert m2[1]["rollout.reward_mean"] == m1[1]["rollout.reward_mean"]
    assert m2[2]["rollout.reward_mean"] == pytest.approx(m1[2]["rollout.reward_mean"], abs=1e-4)
    for r1, r2 in zip(m1[1:], m2[1:], strict=True):
        assert r2["train.timestep_evals"] == r1["train.timestep_evals"]   # every row trained once, on some rank
        assert r2["train.grad_norm"] == pytest.approx(r1["train.grad_norm"], rel=GRAD_NORM_RTOL)
    # the rollouts each run consumed: 2 prompts x 2 epochs through each worker
    assert [w.processed for w in one.workers] == [w.processed for w in two.workers] == [4, 4]
    print(f"\ntrainer service wall: 1 rank {one.wall_s:.1f} s, 2 ranks {two.wall_s:.1f} s; train per epoch: "
          f"1 rank {[round(r['time_train_s'], 2) for r in m1[1:]]}, 2 ranks {[round(r['time_train_s'], 2) for r in m2[1:]]}")


def _rank_process(launcher: psutil.Process, rank: int) -> psutil.Process:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in child.environ():
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no rank {rank} under torchrun {launcher.pid}")


def test_a_killed_rank_ends_the_service_non_zero_and_a_restart_resumes(one_rank, model_dir, tmp_path):  # noqa: F811
    """Rank 1 SIGKILLed after epoch 1: the launch exits non-zero within seconds, no process left; started again
    unchanged (a compose / Job restart: the same command on the same run directory), both ranks resume from the
    checkpoint and end with the one-rank run's adapter."""
    run = tiny_service(2, model_dir, tmp_path / "killed")
    try:
        run.start()
        launcher = psutil.Process(run.proc.pid)
        deadline = time.monotonic() + 180
        while not (run.out / "checkpoints" / "latest").exists():   # epoch 1 done: rank 1 waits for epoch 2's batch
            assert run.proc.poll() is None, run.text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 180 s"
            time.sleep(0.2)
        victim = _rank_process(launcher, 1)
        family = [launcher, *launcher.children(recursive=True)]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rc = run.wait(60)
        ended = time.monotonic() - killed
    finally:
        run.close()
    assert rc != 0, run.text()[-3000:]
    assert ended < 30, f"{ended:.1f} s from the kill to the service's exit"
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in family)   # no rank left behind
    assert (run.out / "checkpoints" / "latest").read_text().strip() == "epoch_0001"
    assert not (run.out / "checkpoints" / "epoch_0002").exists()
    print(f"\nrank 1 SIGKILLed: the service exited {rc} after {ended:.2f} s")
    again = tiny_service(2, model_dir, run.out)
    again.log = tmp_path / "restarted.log"
    try:
        again.start()
        assert again.wait(240) == 0, again.text()[-3000:]
    finally:
        again.close()
    assert "resuming" in again.text() and "2 data-parallel ranks" in again.text()
    assert [r["epoch"] for r in read_metrics(run.out / "metrics.jsonl")] == [0, 1, 2]
    assert [w.processed for w in again.workers] == [2, 2]   # epoch 2 only
    assert _max_diff(one_rank.out / "adapter_ema.safetensors", run.out / "adapter_ema.safetensors") < ATOL
