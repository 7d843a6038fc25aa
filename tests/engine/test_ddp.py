"""The data-parallel trainer (solrl/engine/data_parallel.py) under torchrun with CPU gloo ranks: K = 2 trains the adapter K = 1
trains, a rank that dies fails the run within seconds and the run resumes (with another K), and a launch with
more ranks than samples per optimizer step is refused before training."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from solrl.config import ConfigError
from solrl.engine import data_parallel as ddp
from solrl.telemetry import read_metrics
from tests.engine.test_loop import TINY, random_model_dir, tiny_cfg  # noqa: F401  (a module-scoped fixture)

BIN = Path(sys.executable).parent
# diffusion_nft: no low-precision exploration, so a 2-epoch run takes seconds; one thread per rank.
# 2 prompts x 4 kept, one optimizer step per prompt group: 4 samples x 3 timesteps per step, 2 samples per rank.
PRESET = "shapes-diffusion-nft"


def _train_args(out: Path, model_dir: Path, extra: list[str] = ()) -> list[str]:
    args = ["-m", "solrl.cli", "train", "--preset", PRESET, "--out", str(out), "--epochs", "2", "--no-progress"]
    for o in [*TINY, f"model.path={model_dir}", "threads=1", *extra]:
        args += ["--set", o]
    return args


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=Path(__file__).resolve().parents[2])


def _torchrun(k: int, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={k}", *args], env)


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


# Tolerance for the adapters of two runs that differ only in float summation order (each rank's partial sum of
# its rows, then the all-reduce, against one process summing all rows): measured max |difference| over the
# default, old and EMA adapters after 2 epochs (4 AdamW steps): 5.1e-7 (values up to 1.09, so a few float32
# ulps). An AdamW step moves an element by up to lr = 1e-3, so a missing, doubled or misplaced row would
# differ by ~1e-4 and more; 1e-5 sits 20x above the noise and 10-100x below such errors. Adam hides a uniform
# scale of the gradient (e.g. averaging instead of summing), so the logged gradient norm is compared too.
ATOL = 1e-5
GRAD_NORM_RTOL = 1e-5   # measured 4.5e-8


@pytest.fixture(scope="module")
def k1_run(random_model_dir, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("k1") / "run"
    res = _run([sys.executable, *_train_args(out, random_model_dir)])
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_two_ranks_train_the_single_process_adapter(k1_run, random_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "k2"
    res = _torchrun(2, _train_args(out, random_model_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 data-parallel ranks" in res.stdout
    for f in ("checkpoints/epoch_0001/adapters.safetensors", "checkpoints/epoch_0002/adapters.safetensors",
              "adapter_ema.safetensors"):
        assert _max_diff(k1_run / f, out / f) < ATOL, f
    m1, m2 = read_metrics(k1_run / "metrics.jsonl"), read_metrics(out / "metrics.jsonl")
    assert [r["epoch"] for r in m2] == [0, 1, 2]   # rank 0 alone writes: each epoch once
    for r1, r2 in zip(m1[1:], m2[1:], strict=True):
        assert r2["rollout.reward_mean"] == r1["rollout.reward_mean"]   # the same rollouts (rank 0's)
        assert r2["train.timestep_evals"] == r1["train.timestep_evals"]  # every row trained once, on some rank
        assert r2["train.grad_norm"] == pytest.approx(r1["train.grad_norm"], rel=GRAD_NORM_RTOL)
        assert r2["train.loss"] == pytest.approx(r1["train.loss"], rel=1e-6)


def test_a_dead_rank_fails_the_run_which_resumes_with_one_rank(k1_run, random_model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "killed"
    res = _torchrun(2, _train_args(out, random_model_dir), env={"SOLRL_TEST_DIE_AT_EPOCH": "2"})
    ended = time.time()
    assert res.returncode != 0
    died = re.search(r"rank 1 dies in epoch 2 at ([0-9.]+)", res.stderr)
    assert died, res.stderr[-3000:]
    # torchrun's agent notices the dead worker and stops rank 0 (blocked in the gradient all-reduce); measured
    # about 0.1 s from the death to rank 0's SIGTERM, under 1 s to torchrun's exit
    assert ended - float(died.group(1)) < 30
    assert (out / "checkpoints/latest").read_text().strip() == "epoch_0001"
    assert not (out / "checkpoints/epoch_0002").exists()
    res = _run([sys.executable, "-m", "solrl.cli", "train", "--resume", str(out), "--no-progress"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming" in res.stdout
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    # epoch 1 trained by 2 ranks, epoch 2 by 1: the single-process run's adapter, to the same tolerance
    assert _max_diff(k1_run / "adapter_ema.safetensors", out / "adapter_ema.safetensors") < ATOL


def test_more_ranks_than_samples_per_step_is_refused_before_training(random_model_dir, tmp_path):  # noqa: F811
    # 1 kept sample per prompt, one step per prompt: 1 sample per step for 2 ranks
    out = tmp_path / "too_many"
    res = _torchrun(2, _train_args(out, random_model_dir, ["rollout.kept=1"]))
    assert res.returncode != 0
    assert "solrl: error: WORLD_SIZE=2 trainer ranks, but an optimizer step can hold as few as 1 samples" in res.stderr
    for name in ("train.optimizer_steps_per_epoch", "rollout.kept", "rollout.prompts_per_epoch"):
        assert name in res.stderr
    assert not out.exists()
    # the same check in-process: 8 prompts in 3 steps take 2 or 3 prompts each, x 4 kept -> 8 samples at least
    cfg = tiny_cfg(random_model_dir, PRESET, extra=["rollout.prompts_per_epoch=8", "train.optimizer_steps_per_epoch=3"])
    ddp.check_ranks(cfg, 8)
    with pytest.raises(ConfigError, match="WORLD_SIZE=9 .* as few as 8 samples .* use at most 8 ranks"):
        ddp.check_ranks(cfg, 9)


def test_ranks_split_a_step_and_draw_the_single_process_noise():
    """Each rank's forwards hold its contiguous share of whole samples, cut into balanced forwards of at most
    micro_batch rows; every single-process chunk is consumed (its noise drawn) whatever the rank."""
    n_samples, k, mb = 7, 3, 4
    rows = torch.arange(n_samples * k)
    chunks = [(rows[c], rows[c] * 10) for c in torch.tensor_split(rows, 6)]   # single-process forwards
    for world in (1, 2, 3, 7):
        got = []
        for rank in range(world):
            lo, hi = ddp.rows_of_rank(n_samples, k, ddp.Ranks(rank, world))
            assert lo % k == 0 and hi % k == 0   # whole samples
            consumed = []
            n, fwds = ddp.local_forwards((consumed.append(i) or c for i, c in enumerate(chunks)), lo, hi, mb)
            out = list(fwds)
            assert len(out) == n and max(len(s) for s, _ in out) <= mb
            assert max(len(s) for s, _ in out) - min(len(s) for s, _ in out) <= 1
            assert all(torch.equal(s * 10, t) for s, t in out)   # row-aligned tensors stay aligned
            assert consumed == list(range(len(chunks)))
            got += torch.cat([s for s, _ in out]).tolist()
        assert got == rows.tolist()
    with pytest.raises(ValueError, match="rank 7 of 8 has no sample"):
        ddp.rows_of_rank(n_samples, k, ddp.Ranks(7, 8))


def test_torchrun_env_is_detected():
    assert ddp.from_env({}) == ddp.SINGLE and not ddp.SINGLE.parallel
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    r = ddp.from_env(env)
    assert (r.rank, r.world, r.local_rank, r.is_main, r.parallel, r.die_at_epoch) == (1, 2, 1, False, True, None)
    assert ddp.from_env({**env, "SOLRL_TEST_DIE_AT_EPOCH": "3"}).die_at_epoch == 3


def test_algorithms_whose_batch_share_batch_does_not_carry_are_refused():
    """share_batch carries x0, rewards, groups and prompts; an algorithm that trains on SDE trajectories and
    log-probs (train.algo=flow_grpo) would leave ranks > 0 without them: refused with the field named."""
    from solrl.config import get_preset

    cfg = get_preset(PRESET)
    ddp.check_ranks(cfg, 2)
    cfg.train.algo = "flow_grpo"
    ddp.check_ranks(cfg, 1)   # one rank: nothing to share
    with pytest.raises(ConfigError, match="train.algo='flow_grpo' is not data-parallel yet"):
        ddp.check_ranks(cfg, 2)


def test_more_ranks_on_a_node_than_gpus_is_a_clear_error(monkeypatch):
    """On a CUDA machine each rank takes cuda:LOCAL_RANK; a rank without a GPU of its own stops before any process
    group with the option to change. (The branch's logic only: CUDA's device count is set here, as this machine
    has no GPU; the GPU path itself is not run here.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1, but this machine shows 1 CUDA device.*PET_NPROC_PER_NODE"):
        with ddp.launch(env):
            pass
