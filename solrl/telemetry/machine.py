"""The machine a run or a benchmark ran on: what metrics.jsonl's run header and every result file record."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any


def describe_machine() -> dict[str, Any]:
    """CPU model, cores, torch version and threads, Python version (torch is imported here: this module loads
    without it, as `solrl bench --help` does)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version()}


def machine() -> dict[str, Any]:
    """CPU model, cores, memory and library versions of the machine a benchmark ran on."""
    import torch

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
