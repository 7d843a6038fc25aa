"""`solrl bench <name>`: the paper's claims measured on the shapes world, and our own costs.

Each benchmark is a module `solrl.bench.<name>` (`serve`: services/bench.py, `doors`: services/doors.py, entry
points) with
`run(out: Path, small: bool, **kw) -> dict`
that writes `out/<name>.json` and `out/<name>.md` (machine described; see `common.write_results`).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

BENCHES: dict[str, str] = {
    "ranking": "low-precision few-step proxy vs BF16 full-step rewards: Kendall tau, Spearman, top-k",
    "rollout": "per-epoch rollout seconds (wall and CPU) and forwards: naive_scaling vs sol_rl per explorer vs diffusion_nft",
    "ablate": "pool size and explore steps at a fixed training budget",
    "curve": "held-out reward against wall-clock for the four modes; time to reach diffusion_nft's final",
    "serve": "services vs embedded epoch time; reward service throughput and latency via tritonclient",
    "doors": "the reward and explorer doors, gRPC and REST, under perf_analyzer: throughput, p50/p99, server split",
    "denoisers": "shapes denoiser families: pretraining step and 16-seed forward cost, NVFP4-quantized share",
    "cli": "seconds to answer `solrl --help` and each subcommand's --help, against importing torch",
    "pretrain_sweep": "shapes base pretraining variants x seeds, tracked with the headroom CFG shows (choose a base)",
    "relations": "whether a shapes model reads the relation word: order, pixel change and pairs right both ways when it flips",
    "profile": "where an epoch's time goes: phases, the loop's and the trainer's marked regions, the top operators",
    "selection": "paired study: no / random / oracle / proxy choice of k of n, link by link, with the seeds it needs",
    "sensitivity": "image error of the low-precision explorer per block and per layer kind (one part quantized at a time)",
}

# benchmarks that live with the services (services/bench.py), by their `solrl.services` entry point
PLUGIN_BENCHES = {"serve": "bench-serve", "doors": "bench-doors"}


def run_bench(name: str, out: Path, small: bool = False, **kw: Any) -> dict[str, Any]:
    if name not in BENCHES:
        raise ValueError(f"unknown bench {name!r}; available: {sorted(BENCHES)}")
    if name in PLUGIN_BENCHES:   # measured through the services, which the core does not import (solrl/plugins.py)
        from solrl import plugins

        run = plugins.load(PLUGIN_BENCHES[name])
    else:
        run = importlib.import_module(f"solrl.bench.{name}").run
    accepted = inspect.signature(run).parameters
    unknown = sorted(k for k in kw if k not in accepted)
    if unknown:
        raise ValueError(f"bench {name!r} does not take {', '.join(unknown)}")
    return run(Path(out), small=small, **kw)
