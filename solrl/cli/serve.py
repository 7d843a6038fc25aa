"""`solrl serve ROLE`: one service role, found by name (solrl/plugins.py); what the containers run."""

from __future__ import annotations

import argparse

from solrl.cli.common import Help, missing_services
from solrl.config import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="run one service role (what containers run)")
    roles = sv.add_subparsers(dest="role", required=True)
    roles.add_parser("reward", help="reward service: solrl.reward.v1 + KServe v2 / Triton gRPC", add_help=False)
    for role, text in (("explorer", "low-precision explorer: Explore + KServe v2 'explore' model, adapter hot reload"),
                       ("regenerator", "BF16 regenerator: Regenerate, adapter hot reload"),
                       ("trainer", "trainer: drives explorers/regenerators through Redis, pushes adapters")):
        roles.add_parser(role, help=text, add_help=False)
    for role in ("reward", "explorer", "regenerator", "trainer"):
        # the role's own options are parsed when the role runs (services.<role>.args, light; the server module,
        # with grpc, torch and its stubs, only after): importing them only to build this parser would slow every
        # `solrl` command
        roles.choices[role].set_defaults(fn=lambda a, role=role: _serve(role, a.service_args), takes_extra=True)


def _serve(role: str, argv: list[str]) -> int:
    """`solrl serve <role> [options]`: the container entry point. The role's options come from its light
    services.<role>.args (no grpc, torch: `--help` and option errors are fast); its server module (grpc,
    torch, the stubs) loads once they parse, and the services' logging is set up before it runs."""
    from solrl import plugins

    try:
        options = plugins.role_module(role, "args")
    except ImportError as err:
        return missing_services(err)
    parser = argparse.ArgumentParser(prog=f"solrl serve {role}", formatter_class=Help)
    options.add_arguments(parser)
    args = parser.parse_args(argv)
    try:  # the service shells need the generated stubs (`make protos`); the core CLI does not
        module = plugins.role_module(role, "server")
        configure_logging = plugins.load("logging")
    except ImportError as err:
        return missing_services(err)
    try:
        configure_logging()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return module.run(args) or 0
