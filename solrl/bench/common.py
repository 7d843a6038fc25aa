"""What every benchmark shares: the machine description and the result files.

Each benchmark module `solrl.bench.<name>` exposes `run(out: Path, small: bool) -> dict`, which writes
`out/<name>.json` and `out/<name>.md` through `write_results` (and a PNG where a picture helps).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

# `--small` runs of the training benchmarks (what the tests run): few sampling steps, so a run's forwards (explore,
# regenerate, each trained sample's timesteps, evaluation) are a fraction of the preset's; the properties the tests
# assert (files, intervals, costs, marked regions) do not depend on the step counts. SMALL_SAMPLING leaves the explore
# steps to a bench that varies them (ablate).
SMALL_SAMPLING = ["rollout.steps=4", "eval.steps=4"]
SMALL_STEPS = ["rollout.explore_steps=2", *SMALL_SAMPLING]


def machine() -> dict[str, Any]:
    """CPU model, cores, memory and library versions of the machine a benchmark ran on."""
    import torch

    from solrl.loop import describe_machine

    m = describe_machine()
    mem_gib = None
    try:
        kb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
        mem_gib = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:  # taken when the results are written: a 15-min load above the torch threads means the run shared the CPU
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {**m, "memory_gib": mem_gib, "gpu": gpu, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "loadavg_1_5_15": load}


def machine_line(m: dict[str, Any]) -> str:
    gpu = m["gpu"] or "no GPU"
    load = m.get("loadavg_1_5_15")
    busy = f"; load average at the end {'/'.join(map(str, load))} (1/5/15 min)" if load else ""
    return (f"{m['cpu']}, {m['cores']} cores ({m['threads']} torch threads), {m['memory_gib']} GiB, {gpu}; "
            f"Python {m['python']}, torch {m['torch']}; {m['date']}{busy}")


def write_results(out: Path, name: str, result: dict[str, Any], markdown_body: str,
                  machine_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write out/<name>.json (result + machine) and out/<name>.md (title, machine line, body).
    `machine_info`: the machine the runs ran on, where they ran elsewhere than the one writing (machine()'s keys)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"bench": name, "machine": machine_info or machine(), **result}
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    md = f"# solrl bench {name}\n\nMachine: {machine_line(result['machine'])}\n\n{markdown_body.strip()}\n"
    (out / f"{name}.md").write_text(md)
    return result
