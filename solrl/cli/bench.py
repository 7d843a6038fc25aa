"""`solrl bench NAME`: the benchmarks (solrl/bench/)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from solrl.cli.common import pool_list, step_list
from solrl.config import ConfigError


def cmd_bench(a: argparse.Namespace) -> int:
    from solrl.bench import run_bench

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    kw = {k: v for k, v in (("prompts", a.prompts), ("seeds", a.seeds), ("epochs", a.epochs), ("steps", a.steps),
                            ("repeats", a.repeats), ("jobs", a.jobs), ("compare", a.compare), ("device", a.device),
                            ("pools", a.pools), ("extend", a.extend)) if v}
    if a.seed is not None:
        kw["seed"] = a.seed
    # comma-separated lists (--reward names several rewards for ranking, one elsewhere)
    for key, value in (("precisions", a.precisions), ("policies", a.policies), ("modes", a.modes),
                       ("models", a.models), ("arms", a.arms)):
        if value:
            kw[key] = tuple(x for x in value.split(",") if x)
    if a.reward:
        if a.name == "ranking":
            kw["rewards"] = tuple(x for x in a.reward.split(",") if x)
        else:
            kw["reward"] = a.reward
    if a.sets:
        kw["overrides"] = tuple(a.sets)
    if a.tag:
        kw["tag"] = a.tag
    if a.name == "cli":
        kw["commands"] = a.commands()   # every command's words, from the parser (app.command_words)
    if a.name in ("curve", "selection") and a.threads:
        kw["threads"] = a.threads  # per run: the runs set their own torch threads
    try:
        result = run_bench(a.name, Path(a.out), small=a.small, **kw)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(Path(a.out, f"{result.get('bench', a.name)}.md").read_text())
    return 0


def add_parser(sub: argparse._SubParsersAction, commands: Callable[[], tuple[tuple[str, ...], ...]]) -> None:
    from solrl.bench import BENCHES

    b = sub.add_parser("bench", help="benchmarks: writes OUT/<name>.json and OUT/<name>.md",
                       description="\n".join(f"{k}: {v}" for k, v in BENCHES.items()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("name", choices=sorted(BENCHES))
    b.add_argument("--out", required=True, help="directory for NAME.json, NAME.md and plots")
    b.add_argument("--small", action="store_true", help="tiny settings (seconds; what the tests run)")
    b.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default; curve: per run)")
    b.add_argument("--seed", type=int, default=None, help="seed of the sampled seeds / training runs (default 0)")
    b.add_argument("--prompts", type=int, default=None,
                   help="ranking / relations: held-out prompts; rollout / ablate: prompts per epoch")
    b.add_argument("--seeds", type=int, default=None, help="ranking / relations: seeds per prompt")
    b.add_argument("--epochs", type=int, default=None,
                   help="rollout / curve / ablate / serve / selection: epochs per mode, setting or arm")
    b.add_argument("--precisions", default=None,
                   help="ranking: comma-separated proxy precisions; NAME@2/6 limits one to those explore steps; "
                        "rollout: the two-stage explorers (default bf16-cpu where the CPU runs it, nvfp4-emu)")
    b.add_argument("--steps", type=step_list, default=None, help="ranking, rollout: comma-separated explore steps; "
                                                                 "pretrain_sweep: STOP_AT[,EVAL_EVERY]")
    b.add_argument("--policies", default=None,
                   help="ranking: comma-separated per-layer policies for the quantizing precisions (default reference; "
                        "see solrl models quantized)")
    b.add_argument("--reward", default=None, help="ranking: comma-separated rewards to score with (default shapes); "
                                                  "curve: train on this reward (default: shapes); shapes-world rewards "
                                                  "are evaluated with the exact shapes reward")
    b.add_argument("--repeats", type=int, default=None,
                   help="curve / selection: training runs (run seeds) per mode or arm (default 3); cli: runs per command "
                        "(default 5)")
    b.add_argument("--jobs", type=int, default=None,
                   help="curve / selection: training runs at once, in separate processes (default 1); with --threads, threads "
                        "per run, "
                        "else the cores shared out; finished runs under --out are reused")
    b.add_argument("--modes", default=None,
                   help="curve: comma-separated modes to train (default the paper's four; sol_rl_auto: sol_rl with "
                        "the adaptive proxy; flow_grpo / sol_flow_grpo: FlowGRPO one- / two-stage)")
    b.add_argument("--arms", default=None,
                   help="selection: comma-separated arms (default: none, random, oracle, proxy_bf16, proxy_nvfp4, "
                        "proxy_fp8, proxy_bf16cpu, proxy_bf16cpu4; the guards against reward hacking by name: "
                        "proxy_gate, proxy_constrained, proxy_prompt_std, proxy_kl); NAME:N runs that arm on the first "
                        "N run seeds only")
    b.add_argument("--pools", type=pool_list, default=None, help="selection: comma-separated pool sizes n (default 16); "
                                                                 "rollout: one table each (default 32)")
    b.add_argument("--extend", default=None, metavar="JSON",
                   help="selection: an earlier selection JSON measured with the same settings (e.g. a committed one); "
                        "its runs are taken as done and only the seeds, arms and pools it lacks are trained")
    b.add_argument("--compare", default=None,
                   help="curve: an earlier curve JSON measured with the same settings whose modes are set beside these")
    b.add_argument("--device", default=None, help="pretrain_sweep: train (and track) on this torch device, e.g. cuda; "
                                                  "curve: each run's model.device")
    b.add_argument("--models", default=None,
                   help="relations: comma-separated shapes model directories (default: the bundled base), e.g. "
                        "solrl shapes pretrain's step_NNNNN")
    b.add_argument("--set", dest="sets", action="append", default=None, metavar="KEY=VALUE",
                   help="curve / selection: a config override for every run (repeat), e.g. train.beta=0.5")
    b.add_argument("--tag", default=None, help="doors: a suffix for the result files (OUT/doors-TAG.json), e.g. before")
    b.set_defaults(fn=cmd_bench, commands=commands)

