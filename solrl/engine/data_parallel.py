"""Data-parallel training under torchrun: `torchrun --nproc-per-node K -m solrl.cli train ...`.

Every rank builds the same Session. Rank 0 alone samples the epoch's rollouts, evaluates and writes (metrics,
checkpoints, evals); it broadcasts the training batch (x0, rewards, groups, prompts) and the state of the epoch's
torch generator, so every rank draws the same timestep plan and noise as a single process would. Each optimizer
step's samples are split among the ranks (contiguous, balanced), each rank runs its forwards and DDP sums the
LoRA gradients, so a step's gradient is the single-process one up to float summation order. Checkpoints hold no
rank-dependent state, so a run resumes with any number of ranks.

Why broadcast rather than every rank sampling the same rollouts: sampling is most of an epoch's compute
(explore + regenerate); K ranks recomputing it would spend K times the compute for the same wall-clock, and the
other ranks need no low-precision explorer copy. The batch is small beside the compute that made it.

Why DistributedDataParallel works with three adapters on one module: DDP wraps only the trainable forward
(the "default" adapter, the one `requires_grad` set: the reducer tracks exactly those tensors); the "old" and
reference forwards run under no_grad on the plain module, outside DDP. Forwards before a step's last run
under `no_sync` (gradients accumulate locally), so every rank all-reduces once per step whatever its number
of forwards. A comm hook SUMs instead of DDP's average, because each rank's loss is already weighted by its
rows over the step's total rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from solrl.config import ConfigError, RunConfig

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Upper bound on any collective: ranks > 0 wait in the batch broadcast while rank 0 samples and evaluates, so
# this must exceed an epoch's rollout + evaluation. A rank that dies is noticed much sooner: the peer's socket
# closes (gloo raises at once) and torchrun's agent stops the other ranks within seconds.
TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class Ranks:
    """This process's place in a torchrun launch (world 1: an ordinary single process)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    # Test hook (tests/engine/test_ddp.py): SOLRL_TEST_DIE_AT_EPOCH=E makes rank SOLRL_TEST_DIE_RANK (default 1)
    # os._exit(1) in epoch E (1-based), after receiving the batch and before training on it.
    die_at_epoch: int | None = None
    die_rank: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def from_env(env: dict[str, str] | os._Environ = os.environ) -> Ranks:
    """The torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) -> Ranks; SINGLE without them."""
    if not all(k in env for k in TORCHRUN_ENV):
        return SINGLE
    die = env.get("SOLRL_TEST_DIE_AT_EPOCH")
    return Ranks(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]),
                 int(die) if die else None, int(env.get("SOLRL_TEST_DIE_RANK", "1")))


@contextmanager
def launch(env: dict[str, str] | os._Environ = os.environ) -> Iterator[Ranks]:
    """The process group of a torchrun launch, destroyed on the way out: gloo for CPU tensors and, with CUDA
    (each rank on cuda:LOCAL_RANK), nccl for CUDA tensors, so DDP's buckets go where the model is (the shapes
    model stays on the CPU). Outside torchrun, or with one rank, nothing is started."""
    ranks = from_env(env)
    if not ranks.parallel:
        yield ranks
        return
    if torch.cuda.is_available():
        if ranks.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK={ranks.local_rank}, but this machine shows {torch.cuda.device_count()} CUDA "
                              f"device(s): one GPU per rank, so at most {torch.cuda.device_count()} ranks per node "
                              f"(--nproc-per-node / PET_NPROC_PER_NODE); CUDA_VISIBLE_DEVICES= runs the ranks on the "
                              f"CPU with gloo")
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", timeout=TIMEOUT)
    try:
        yield ranks
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- who trains what
def step_samples(prompts: int, kept: int, optimizer_steps: int) -> list[int]:
    """Samples in each optimizer step of an epoch: `prompts` prompt groups of `kept` samples, split into
    `optimizer_steps` runs of whole groups as NFTTrainer.plan splits them (np.array_split; 0: one step per
    group)."""
    steps = optimizer_steps or prompts
    return [len(chunk) * kept for chunk in np.array_split(np.arange(prompts), max(min(steps, prompts), 1))]


def max_ranks(cfg: RunConfig) -> int:
    """The most data-parallel trainer ranks a run can use: every rank trains at least one sample of every
    optimizer step, so the fewest samples any step holds (the rule `check_ranks` enforces, and the cap
    `solrl plan` places trainer ranks under)."""
    r, t = cfg.rollout, cfg.train
    return min(step_samples(r.prompts_per_epoch, r.kept, t.optimizer_steps_per_epoch))


def ranks_rule(cfg: RunConfig) -> str:
    """Where max_ranks comes from, naming the config fields (for errors and the plan's output)."""
    r, t = cfg.rollout, cfg.train
    steps = t.optimizer_steps_per_epoch or r.prompts_per_epoch
    return (f"rollout.prompts_per_epoch={r.prompts_per_epoch} prompts over train.optimizer_steps_per_epoch="
            f"{t.optimizer_steps_per_epoch} ({steps} steps) x rollout.kept={r.kept}")


def check_ranks(cfg: RunConfig, world: int) -> None:
    """Every rank needs at least one sample of every optimizer step: refuse a launch where one would have none."""
    if world <= 1:
        return
    algo = getattr(cfg.train, "algo", "nft")
    if algo != "nft":   # share_batch carries x0, rewards, groups and prompts: no SDE trajectories or log-probs
        raise ConfigError(f"train.algo={algo!r} is not data-parallel yet (WORLD_SIZE={world}): the batch rank 0 "
                          f"shares holds no SDE trajectories or log-probs; run it with one trainer rank")
    fewest = max_ranks(cfg)
    if fewest < world:
        raise ConfigError(
            f"WORLD_SIZE={world} trainer ranks, but an optimizer step can hold as few as {fewest} samples "
            f"({ranks_rule(cfg)}): each rank trains on at least one sample of every step; use at most {fewest} "
            f"ranks, fewer optimizer steps or more kept samples per prompt")


def rows_of_rank(n_samples: int, rows_per_sample: int, ranks: Ranks) -> tuple[int, int]:
    """[lo, hi) of a step's rows (sample-major, `rows_per_sample` timesteps each) that this rank trains: a
    contiguous, balanced share of whole samples."""
    sizes = [len(a) for a in np.array_split(np.arange(n_samples), ranks.world)]
    lo = sum(sizes[:ranks.rank])
    if sizes[ranks.rank] == 0:
        raise ValueError(f"rank {ranks.rank} of {ranks.world} has no sample of a {n_samples}-sample step")
    return lo * rows_per_sample, (lo + sizes[ranks.rank]) * rows_per_sample


def local_forwards(chunks: Iterable[tuple[torch.Tensor, ...]], lo: int, hi: int,
                   micro_batch: int) -> tuple[int, Iterator[tuple[torch.Tensor, ...]]]:
    """Rows [lo, hi) of a step, re-cut into balanced forwards of at most `micro_batch` rows.

    `chunks` are the single-process forwards (tuples of row-aligned tensors, in order); each is consumed whether
    or not it holds rows of this rank, so noise drawn per chunk from a shared generator advances it exactly as in
    the single-process run. Returns (number of forwards, iterator); iterate to the end."""
    n = hi - lo
    sizes = [len(c) for c in np.array_split(np.arange(n), -(-n // micro_batch))]

    def gen() -> Iterator[tuple[torch.Tensor, ...]]:
        pending: list[tuple[torch.Tensor, ...]] = []
        held, pos, want = 0, 0, iter(sizes)
        size = next(want, None)
        for chunk in chunks:
            m = len(chunk[0])
            a, b = max(lo, pos) - pos, min(hi, pos + m) - pos
            pos += m
            if a < b:
                pending.append(tuple(x[a:b] for x in chunk))
                held += b - a
            while size is not None and held >= size:
                joined = [parts[0] if len(parts) == 1 else torch.cat(parts) for parts in zip(*pending)]
                yield tuple(x[:size] for x in joined)
                held -= size
                pending = [tuple(x[size:] for x in joined)] if held else []
                size = next(want, None)
        if size is not None:
            raise ValueError(f"rows [{lo}, {hi}) run past the step's {pos} rows")

    return len(sizes), gen()


# ---------------------------------------------------------------- DDP over the LoRA
class _Velocity(nn.Module):
    """The model's velocity as one module, so DDP can wrap it: `T2IModel.velocity` inspects the transformer it
    is given (its config, base weights), which a DDP wrapper would hide."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.transformer = model.transformer
        self._velocity = model.velocity   # a bound method, not a module: DDP sees only the transformer

    def forward(self, xt: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        return self._velocity(self.transformer, xt, t, cond)


def _allreduce_sum(group, bucket):  # no annotations: DDP checks them, and this module's are strings
    """(ProcessGroup | None, GradBucket) -> Future[Tensor]. DDP's default hook averages; ranks here weight
    their losses by their share of the step, so SUM."""
    return (dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
            .then(lambda fut: fut.value()[0]))


def wrap(model: Any, adapter_params: Iterable[torch.Tensor]) -> nn.Module:
    """DDP over the trainable forward. The base weights come from the same files on every rank; the adapters
    (every tensor that trains or follows training) are broadcast from rank 0 instead of DDP's broadcast of the
    whole module (init_sync=False: for a big model that is gigabytes of frozen weights)."""
    with torch.no_grad():
        for p in adapter_params:
            p.copy_(_broadcast(p.detach()))
    ddp = nn.parallel.DistributedDataParallel(_Velocity(model), device_ids=None, forward_sync_buffers=False,
                                              init_sync=False)
    ddp.register_comm_hook(None, _allreduce_sum)
    return ddp


def grad_sync(ddp: nn.Module | None, last: bool):
    """Context for one forward of a step: DDP all-reduces in the backward of the step's last forward only."""
    return ddp.no_sync() if ddp is not None and not last else nullcontext()


def sum_stats(sums: dict[str, float], *counts: int) -> tuple[Any, ...]:
    """Sum the per-row statistics and counters of an update over the ranks (for the metrics rank 0 writes)."""
    keys = sorted(sums)
    buf = torch.tensor([sums[k] for k in keys] + [float(c) for c in counts], dtype=torch.float64)
    dist.all_reduce(buf)
    vals = buf.cpu().tolist()
    return (dict(zip(keys, vals[:len(keys)], strict=True)), *(int(v) for v in vals[len(keys):]))


# ---------------------------------------------------------------- the epoch's batch
def share_batch(ranks: Ranks, epoch: int, generator: torch.Generator, x0: torch.Tensor | None = None,
                rewards: np.ndarray | None = None, group: list[int] | None = None,
                prompts: list[str] | None = None) -> tuple[torch.Tensor, np.ndarray, list[int], list[str]]:
    """Rank 0 passes its training batch (x0 [N, ...], rewards [N], group [N], per-sample prompts); every rank
    returns it, and `generator` (the epoch's) takes rank 0's state, so the update draws the same plan and noise.
    Prompts travel as UTF-8 JSON, never pickle."""
    if ranks.is_main:
        text = torch.tensor(list(json.dumps(prompts).encode()), dtype=torch.uint8)
        head = torch.tensor([x0.dim(), _DTYPES.index(x0.dtype), len(text), x0.is_cuda, *x0.shape]
                            + [0] * (6 - x0.dim()), dtype=torch.long)
    else:
        head = torch.zeros(10, dtype=torch.long)
    head = _broadcast(head)
    nd, dtype, n_text, on_gpu = int(head[0]), _DTYPES[int(head[1])], int(head[2]), bool(head[3])
    shape = [int(s) for s in head[4:4 + nd]]
    if ranks.is_main:
        parts = [x0, torch.from_numpy(np.asarray(rewards, dtype=np.float32)),
                 torch.tensor(group, dtype=torch.long), text, generator.get_state()]
    else:
        parts = [torch.empty(shape, dtype=dtype), torch.empty(shape[0]), torch.empty(shape[0], dtype=torch.long),
                 torch.empty(n_text, dtype=torch.uint8), torch.empty_like(generator.get_state())]
    parts = [_broadcast(p.cpu()) for p in parts]   # through gloo: the batch is small beside its rollouts
    if not ranks.is_main:
        generator.set_state(parts[4])
        x0, rewards = (parts[0].cuda() if on_gpu else parts[0]), parts[1].numpy()
        group, prompts = parts[2].tolist(), json.loads(bytes(parts[3].tolist()).decode())
    if ranks.die_at_epoch == epoch + 1 and ranks.rank == ranks.die_rank:   # test hook (see Ranks)
        print(f"solrl test hook: rank {ranks.rank} dies in epoch {epoch + 1} at {time.time():.3f}",
              file=sys.stderr, flush=True)
        os._exit(1)
    return x0, rewards, group, prompts


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _broadcast(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank, on `t`'s device (gloo for CPU tensors, nccl for CUDA ones)."""
    buf = t.contiguous()
    dist.broadcast(buf, src=0)
    return buf


__all__ = ["Ranks", "SINGLE", "from_env", "launch", "step_samples", "max_ranks", "ranks_rule", "check_ranks",
           "rows_of_rank", "local_forwards", "wrap", "grad_sync", "sum_stats", "share_batch", "TIMEOUT"]
