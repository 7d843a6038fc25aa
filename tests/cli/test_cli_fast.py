"""The command line: fast to start, every option explained, defaults shown, service options parsed by the role."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from solrl.cli.app import build_parser, main
from solrl.cli.common import all_parsers


def test_help_does_not_import_torch_or_the_services() -> None:
    code = ("import sys, solrl.cli.app; solrl.cli.app.build_parser().format_help(); "
            "print(sorted(m for m in ('torch', 'torchao', 'diffusers', 'grpc', 'services') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout.strip()
    assert out == "[]"


HEAVY = ("torch", "torchao", "diffusers", "grpc", "tritonclient", "fastapi")
ROLE_PORTS = {"reward": 8001, "explorer": 8011, "regenerator": 8021, "trainer": 8031}


@pytest.mark.parametrize("role", sorted(ROLE_PORTS))
def test_serve_role_help_does_not_import_torch_grpc_or_the_server(role: str) -> None:
    """`solrl serve ROLE --help` builds the role's parser from services.<role>.args alone: no torch, grpc,
    tritonclient, fastapi, and not the role's server module (the role runs only after its options parse)."""
    code = ("import sys, solrl.cli.app\n"
            "try:\n"
            f"    solrl.cli.app.main(['serve', {role!r}, '--help'])\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
            "print('SERVICES', sorted(m for m in sys.modules if m.startswith('services.') and "
            "not m.endswith('.args') and m not in ('services.common', 'services.common.env', "
            f"'services.{role}')))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOLRL_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": os.getcwd(), "COLUMNS": "120"})
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert f"usage: solrl serve {role}" in out and "--grpc-port" in out, out
    assert f"(default: {ROLE_PORTS[role]})" in out, out
    assert "HEAVY []" in out and "SERVICES []" in out, out


def test_the_static_choice_lists_match_the_registries() -> None:
    """The torch-free name lists the service options offer as choices are the registries' own."""
    from solrl.algo.selection import SELECTION_MODES
    from solrl.config import MODEL_NAMES, SELECTIONS
    from solrl.models import available_models
    from solrl.precision import BACKEND_NAMES, available_backends

    assert list(BACKEND_NAMES) == available_backends()
    assert list(MODEL_NAMES) == available_models()
    assert SELECTIONS == SELECTION_MODES


def test_the_services_use_the_light_modules_options_and_names() -> None:
    """The options and names moved to the light modules are still importable from where they were."""
    from services.common.args import (
        DEFAULT_MAX_ADAPTER_BYTES,
        DEFAULT_NAMESPACE,
        add_consumer_arguments,
        add_model_arguments,
    )
    from services.common.env import ENV_ADAPTER_TOKEN, ENV_QUEUE_NAMESPACE, ENV_REDIS_URL, ENV_REWARD_ADDR
    from services.explorer import args as explorer_args
    from services.explorer import server as explorer_server
    from services.rollout import adapter_endpoint, consumers, plane, shell
    from services.trainer import args as trainer_args
    from services.trainer import server as trainer_server

    assert (adapter_endpoint.DEFAULT_MAX_ADAPTER_BYTES, adapter_endpoint.ENV_ADAPTER_TOKEN) == (
        DEFAULT_MAX_ADAPTER_BYTES, ENV_ADAPTER_TOKEN)
    assert (consumers.DEFAULT_NAMESPACE, consumers.ENV_REDIS_URL, consumers.ENV_QUEUE_NAMESPACE) == (
        DEFAULT_NAMESPACE, ENV_REDIS_URL, ENV_QUEUE_NAMESPACE)
    assert plane.ENV_REWARD_ADDR == ENV_REWARD_ADDR
    assert shell.add_model_arguments is add_model_arguments
    assert consumers.add_consumer_arguments is add_consumer_arguments
    assert explorer_server.add_arguments is explorer_args.add_arguments
    assert trainer_server.add_arguments is trainer_args.add_arguments


def test_the_cli_bench_times_every_help_against_importing_torch(tmp_path) -> None:
    """The speed itself is a benchmark figure (`solrl bench cli`, docs/results.md), not a timed test: here, that the
    bench runs every subcommand's help and reports it beside the torch import."""
    from solrl.bench import run_bench
    from solrl.cli.app import command_words

    commands = command_words()
    assert commands[0] == () and {("bench",), ("serve", "explorer"), ("dashboard",)} <= set(commands)
    r = run_bench("cli", tmp_path, small=True, commands=commands)
    names = [row["command"] for row in r["rows"]]
    assert names[:3] == ["python -c pass", 'python -c "import torch"', "solrl --help"]
    assert all(row["seconds"] > 0 for row in r["rows"]) and r["slowest_help_s"] == max(
        row["seconds"] for row in r["rows"][2:])
    assert "import torch" in (tmp_path / "cli.md").read_text()


def test_every_option_has_help_and_defaults_are_shown(capsys) -> None:
    for sp in all_parsers(build_parser()):
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
