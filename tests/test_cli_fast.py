"""The command line: fast to start, every option explained, defaults shown, service options parsed by the role."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from solrl.cli import _all_parsers, build_parser, main


def test_help_does_not_import_torch_or_the_services() -> None:
    code = ("import sys, solrl.cli; solrl.cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'torchao', 'diffusers', 'grpc', 'services') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.strip()
    assert out == "[]"


def test_the_cli_bench_times_every_help_against_importing_torch(tmp_path) -> None:
    """The speed itself is a benchmark figure (`solrl bench cli`, README), not a timed test: here, that the
    bench runs every subcommand's help and reports it beside the torch import."""
    from solrl.bench import run_bench
    from solrl.bench.cli import commands

    assert ["bench"] in commands() and ["serve", "explorer"] in commands() and ["dashboard"] in commands()
    r = run_bench("cli", tmp_path, small=True)
    names = [row["command"] for row in r["rows"]]
    assert names[:3] == ["python -c pass", 'python -c "import torch"', "solrl --help"]
    assert all(row["seconds"] > 0 for row in r["rows"]) and r["slowest_help_s"] == max(
        row["seconds"] for row in r["rows"][2:])
    assert "import torch" in (tmp_path / "cli.md").read_text()


def test_every_option_has_help_and_defaults_are_shown(capsys) -> None:
    for sp in _all_parsers(build_parser()):
        for action in sp._actions:
            if action.option_strings and "-h" not in action.option_strings:
                assert action.help, f"{sp.prog} {action.option_strings[0]} has no help"
    with pytest.raises(SystemExit):
        main(["shapes", "pretrain", "--help"])
    assert "images per optimizer step (default: 64)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["serve", "reward", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "solrl serve reward" in out and "--grpc-port" in out and "(default: 8001)" in out


def test_unknown_options_still_fail(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "explorer", "--bogus"])
    assert "solrl serve explorer: error: unrecognized arguments: --bogus" in capsys.readouterr().err
