"""How fast the command line answers: `solrl --help` and every subcommand's `--help` (each a fresh Python
process, median of `repeats`), against `python -c pass` (the interpreter alone) and `python -c "import torch"`
(what a CLI that imports the model stack pays before it can print anything)."""

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


def commands() -> list[list[str]]:
    """`--help` of the top level and of every subcommand (the service roles' own options included)."""
    from solrl.cli import _all_parsers, build_parser

    out = [[]]
    for sp in _all_parsers(build_parser()):
        words = sp.prog.split()[1:]  # "solrl bench" -> ["bench"]
        if words and words not in out:
            out.append(words)
    return out


def run(out: Path, small: bool = False, repeats: int | None = None) -> dict[str, Any]:
    n = repeats or (1 if small else 5)
    py = sys.executable
    rows = [{"command": "python -c pass", "seconds": _median_s([py, "-c", "pass"], n)},
            {"command": 'python -c "import torch"', "seconds": _median_s([py, "-c", "import torch"], n)}]
    cmds = commands()[:3] if small else commands()
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
