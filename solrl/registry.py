"""What the core's registries share: an entry given as "module:attr", imported only when it is used.

The models, rewards, prompt sets and presets registries take such names beside callables: a heavy dependency then
loads only when its entry is built, and a package above the core (the shapes bed, solrl/shapes/) registers into the
core without the core importing it (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import Any


def load_entry(ref: Any) -> Any:
    """`ref` itself, or, for a "module:attr" string, that attribute of that module (imported now)."""
    if not isinstance(ref, str):
        return ref
    mod, _, attr = ref.partition(":")
    return getattr(importlib.import_module(mod), attr)
