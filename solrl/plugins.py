"""What the core starts but does not hold, found by name: the service roles (`solrl serve ROLE`), the dashboard's
HTTP server, the services' benchmark (`solrl bench serve`) and the served hot-swapped model (`solrl.gpu_check`).

The core never imports the top-level `services` package (the forbidden contract in pyproject.toml,
docs/architecture.md): the services plug into it. pyproject.toml declares them as entry points of the group
`solrl.services`, "module:attr" strings imported only when used, as solrl/rewards builds its "module:Class"
factories. An entry point without an attribute names a role's package: its `args` module (light: the role's
options) and its `server` module (`run(args)`).
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import Any

GROUP = "solrl.services"


class MissingPlugin(ImportError):
    """No entry point of that name: the services are not installed beside the core."""


def _entry(name: str) -> EntryPoint:
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        raise MissingPlugin(f"no {GROUP!r} entry point {name!r} (install the repository: pip install -e .)")
    return found[0]


def names() -> list[str]:
    """The registered names, sorted."""
    return sorted({ep.name for ep in entry_points(group=GROUP)})


def load(name: str) -> Any:
    """The object an entry point names ("module:attr"), imported now."""
    return _entry(name).load()


def role_module(role: str, part: str) -> Any:
    """Module `part` (`args` or `server`) of the package a role's entry point names."""
    return importlib.import_module(f"{_entry(role).module}.{part}")
