"""How fast the command line answers: `solrl --help` and every subcommand's `--help` (each a fresh Python
process, median of `repeats`), against `python -c pass` (the interpreter alone) and `python -c "import torch"`
(what a CLI that imports the model stack pays before it can print anything). The list of subcommands comes from
the caller (`solrl bench cli` passes `solrl.cli.app.command_words()`)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from solrl.bench.common import write_results


def _median_s(argv: list[str], repeats: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = subprocess.run(argv, capture_output=True, text=True, env=env)
        times.append(time.perf_counter() - t0)
        if r.returncode not in (0,):
            raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {r.stderr[-500:]}")
    return statistics.median(times)


def run(out: Path, small: bool = False, repeats: int | None = None,
        commands: tuple[tuple[str, ...], ...] = ()) -> dict[str, Any]:
    """`commands`: the subcommands to time, as words (`solrl.cli.app.command_words()`, which `solrl bench cli` passes:
    the command line sits above the benchmarks, so they take its list rather than import it)."""
    if not commands:
        raise ValueError("bench 'cli' needs the subcommands to time (commands=solrl.cli.app.command_words())")
    n = repeats or (1 if small else 5)
    py = sys.executable
    rows = [{"command": "python -c pass", "seconds": _median_s([py, "-c", "pass"], n)},
            {"command": 'python -c "import torch"', "seconds": _median_s([py, "-c", "import torch"], n)}]
    cmds = [list(c) for c in (commands[:3] if small else commands)]
    for words in cmds:
        rows.append({"command": " ".join(["solrl", *words, "--help"]),
                     "seconds": _median_s([py, "-m", "solrl.cli", *words, "--help"], n)})
    torch_s = rows[1]["seconds"]
    helps = [r["seconds"] for r in rows[2:]]
    result = {"repeats": n, "rows": rows, "slowest_help_s": max(helps), "torch_import_s": torch_s}
    lines = ["| command | seconds (median) |", "|---|---|"] + [f"| `{r['command']}` | {r['seconds']:.3f} |" for r in rows]
    body = (f"Each command in a fresh process, median of {n}. The slowest `--help` takes {max(helps):.2f} s, "
            f"{max(helps) / torch_s:.2f}x the {torch_s:.2f} s of importing torch alone.\n\n" + "\n".join(lines))
    return write_results(out, "cli", result, body)
