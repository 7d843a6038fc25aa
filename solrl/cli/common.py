"""What the commands share: argument types, the help formatter, the message when the services are missing."""

from __future__ import annotations

import argparse
import sys


def step_list(text: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps must be comma-separated integers, got {text!r}") from None
    if not steps or any(s <= 0 for s in steps):
        raise argparse.ArgumentTypeError(f"--steps must be positive integers, got {text!r}")
    return steps


def pool_list(text: str) -> tuple[int, ...]:
    try:
        return step_list(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"--pools must be comma-separated positive integers, got {text!r}") from None


def int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def missing_services(err: ImportError) -> int:
    print(f"solrl: error: the services are not available ({err}); run `make protos` in the repository",
          file=sys.stderr)
    return 2


class Help(argparse.HelpFormatter):
    """Help that shows each option's default, unless its text already speaks of it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sp in dict.fromkeys(action.choices.values()):
                yield from all_parsers(sp)
