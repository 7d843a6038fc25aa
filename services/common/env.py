"""Addresses and settings from the environment: the SOLRL_* names the service shells read (the core library
never does). Light on purpose (no grpc, torch): the command-line options (services.*.args) build from it."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_HOST = "SOLRL_BIND_HOST"
ENV_GRPC_PORT = "SOLRL_GRPC_PORT"
ENV_HTTP_PORT = "SOLRL_HTTP_PORT"
# One run's settings for every role: the preset and KEY=VALUE overrides the trainer trains with and the
# rollout services take their model, path, precisions, reward and sampling defaults from.
ENV_PRESET = "SOLRL_PRESET"
ENV_SET = "SOLRL_SET"
ENV_TRAINER_URL = "SOLRL_TRAINER_URL"   # the trainer's ops URL a rollout service fetches the current adapter from
ENV_REWARD_ADDR = "SOLRL_REWARD_ADDR"   # host:port of the reward service a rollout service scores with
ENV_ADAPTER_TOKEN = "SOLRL_ADAPTER_TOKEN"   # the bearer token of adapter pushes and fetches (never a flag)
# the optional bearer token of the data planes: explore, regenerate, reward (services.common.auth; never a flag)
ENV_DATA_TOKEN = "SOLRL_DATA_TOKEN"
ENV_REDIS_URL = "SOLRL_REDIS_URL"   # the work queue (redis://<role>@redis:6379/0: the user, never the password)
ENV_REDIS_PASSWORD = "SOLRL_REDIS_PASSWORD"   # the URL user's Redis password (never a flag, never in the URL we log)
ENV_QUEUE_KEY = "SOLRL_QUEUE_KEY"   # the run's HMAC key for queue messages, shared by the queue roles (never a flag)
ENV_QUEUE_NAMESPACE = "SOLRL_QUEUE_NAMESPACE"
# Each secret above (the adapter and data tokens, the Redis password, the queue key) may come from a file instead:
# env <NAME>_FILE names it (compose `secrets:`, a mounted Kubernetes Secret), so the value is in no container's
# inspected environment.
FILE_SUFFIX = "_FILE"


def secret(environ: Mapping[str, str], name: str) -> str | None:
    """The secret `name`: its value in the environment, else the contents of the file env `<name>_FILE` names (without
    the trailing newline); None when neither is set. ValueError, naming the variable, when that file cannot be read or
    is empty (a file named and empty is a mistake, never "no secret")."""
    value = environ.get(name)
    if value:
        return value
    path = environ.get(name + FILE_SUFFIX)
    if not path:
        return None
    try:
        text = Path(path).read_text().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"{name}{FILE_SUFFIX}: cannot read {path}: {exc.strerror}") from None
    if not text:
        raise ValueError(f"{name}{FILE_SUFFIX}: {path} is empty")
    return text


def _port(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{name} must be in [0, 65535], got {port}")
    return port


@dataclass(frozen=True)
class Addresses:
    """Where a service listens: one host, a gRPC port and an HTTP (ops) port; 0 = any free port."""

    host: str
    grpc_port: int
    http_port: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str], *, grpc_port: int, http_port: int,
                 host: str = "0.0.0.0") -> Addresses:
        """SOLRL_BIND_HOST, SOLRL_GRPC_PORT and SOLRL_HTTP_PORT over the given defaults."""
        return cls(host=environ.get(ENV_HOST, "").strip() or host,
                   grpc_port=_port(environ, ENV_GRPC_PORT, grpc_port),
                   http_port=_port(environ, ENV_HTTP_PORT, http_port))


def split_overrides(text: str) -> list[str]:
    """KEY=VALUE overrides from the value of env SOLRL_SET (separated by spaces or newlines; shell quoting
    allowed). Errors name SOLRL_SET."""
    try:
        items = shlex.split(text or "")
    except ValueError as exc:
        raise ValueError(f"{ENV_SET}: cannot split {text!r}: {exc}") from None
    bad = [i for i in items if "=" not in i]
    if bad:
        raise ValueError(f"{ENV_SET}: expected KEY=VALUE items, got {bad}")
    return items


def add_address_arguments(p: argparse.ArgumentParser, addr: Addresses) -> None:
    """--host, --grpc-port and --http-port with `addr` (`Addresses.from_env`) as defaults."""
    p.add_argument("--host", default=addr.host, help="bind address (env SOLRL_BIND_HOST)")
    p.add_argument("--grpc-port", type=int, default=addr.grpc_port, help="gRPC port, 0 = any (env SOLRL_GRPC_PORT)")
    p.add_argument("--http-port", type=int, default=addr.http_port, help="ops HTTP port, 0 = any (env SOLRL_HTTP_PORT)")


def add_run_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str], role: str) -> None:
    """--preset (env SOLRL_PRESET), --config and --set (after env SOLRL_SET): the one set of run settings
    the trainer trains and the rollout services serve."""
    what = "the run it trains" if role == "trainer" else "the run whose settings it serves, as the trainer's"
    p.add_argument("--preset", default=environ.get(ENV_PRESET) or None,
                   help=f"run preset: {what} (env {ENV_PRESET}; default shapes-sol-rl)")
    p.add_argument("--config", default=None, help="a run config JSON instead of a preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help=f"run config override, e.g. rollout.pool=48 (after those of env {ENV_SET})")
    p.set_defaults(env_set=environ.get(ENV_SET, ""))
