"""`solrl`: the top-level parser, one subcommand a module (train, evaluate, calibrate, plan, dashboard, shapes, bench,
serve, up, reward, lists), and `main`. A command's heavy imports stay inside its function: `solrl --help` is fast."""

from __future__ import annotations

import argparse
import sys

from solrl.cli import bench, calibrate, dashboard, evaluate, lists, plan, reward, serve, shapes, train, up
from solrl.cli.common import Help, all_parsers
from solrl.config import ConfigError


def command_words() -> tuple[tuple[str, ...], ...]:
    """Every command as its words after `solrl`: () for the top level, then each subcommand (the service roles'
    included), in the parser's order (what `solrl bench cli` times)."""
    out: list[tuple[str, ...]] = [()]
    for sp in all_parsers(build_parser()):
        words = tuple(sp.prog.split()[1:])  # "solrl bench" -> ("bench",)
        if words and words not in out:
            out.append(words)
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = _build_parser()
    for sp in all_parsers(p):
        sp.formatter_class = Help
    return p


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="solrl", description="RL post-training of diffusion models with two-stage rollouts")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in (train, evaluate, calibrate, plan, dashboard, shapes):
        command.add_parser(sub)
    bench.add_parser(sub, command_words)   # `solrl bench cli` times every command
    for command in (serve, up, reward, lists):
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "takes_extra", False):
        args.service_args = extra  # `solrl serve ROLE ...`: the role's own parser reads them
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.fn(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"solrl: error: {err}", file=sys.stderr)
        return 2
