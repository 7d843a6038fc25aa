"""What every benchmark shares: the machine description and the result files.

Each benchmark module `solrl.bench.<name>` exposes `run(out: Path, small: bool) -> dict`, which writes
`out/<name>.json` and `out/<name>.md` through `write_results` (and a PNG where a picture helps).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from solrl.telemetry.machine import machine, machine_line  # noqa: F401 (the benchmarks' machine line)

# `--small` runs of the training benchmarks (what the tests run): few sampling steps, so a run's forwards (explore,
# regenerate, each trained sample's timesteps, evaluation) are a fraction of the preset's; the properties the tests
# assert (files, intervals, costs, marked regions) do not depend on the step counts. SMALL_SAMPLING leaves the explore
# steps to a bench that varies them (ablate).
SMALL_SAMPLING = ["rollout.steps=4", "eval.steps=4"]
SMALL_STEPS = ["rollout.explore_steps=2", *SMALL_SAMPLING]
# a --small training run (curve, selection): two prompts an epoch, four held-out prompts, a rank-4 LoRA
SMALL_RUN = ["rollout.prompts_per_epoch=2", "eval.prompts=4", "eval.seeds_per_prompt=1", "lora.rank=4", "lora.alpha=8",
             "train.micro_batch=8", *SMALL_STEPS]


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
