"""The command line: fast to start, every option explained, defaults shown, service options parsed by the role."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from solrl.cli import _all_parsers, build_parser, main


def test_help_does_not_import_torch_or_the_services() -> None:
    code = ("import sys, solrl.cli; solrl.cli.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'torchao', 'diffusers', 'grpc', 'services') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.strip()
    assert out == "[]"


def test_help_is_fast() -> None:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "solrl.cli", "--help"], capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0 and "calibrate" in r.stdout
    assert elapsed < 5.0, f"solrl --help took {elapsed:.1f} s"  # 0.3 s on the 2-core machine; 9.5 s before


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
