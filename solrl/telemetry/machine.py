"""The machine a run or a benchmark ran on: what metrics.jsonl's run header and every result file record."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

# The instruction-set flags that decide which CPU kernels are fast (what a timing is read against): vector width,
# BF16 (AVX512-BF16, AMX) and INT8 dot products (VNNI, AMX).
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags from a /proc/cpuinfo text (default: this machine's; empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def describe_machine() -> dict[str, Any]:
    """CPU model and its kernel-deciding flags (ISA_FLAGS), cores, torch version and threads, Python version (torch
    is imported here: this module loads without it, as `solrl bench --help` does)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), cpu)
    flags = cpu_flags(cpuinfo)
    return {"cpu": cpu, "cpu_flags": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}


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
    isa = m.get("cpu_flags")
    flags = f" ({' '.join(isa) if isa else 'no AVX2'})" if isa is not None else ""
    return (f"{m['cpu']}{flags}, {m['cores']} cores ({m['threads']} torch threads), {m['memory_gib']} GiB, {gpu}; "
            f"Python {m['python']}, torch {m['torch']}; {m['date']}{busy}")
