"""`--set a.b=v` overrides, each parsed against the field's declared type."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

from solrl.config.schema import ConfigError, RunConfig, _convert
from solrl.precision.config import PrecisionConfig


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply `a.b.c=value` strings. Unknown keys and badly typed values raise ConfigError."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. rollout.pool=48)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        obj: Any = cfg
        for i, p in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or p not in {f.name for f in dataclasses.fields(obj)}:
                known = sorted(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else []
                raise ConfigError(f"unknown config key {key!r} (at {'.'.join(parts[:i + 1])!r}; known here: {known})")
            if i < len(parts) - 1:
                obj = getattr(obj, p)
        tp = typing.get_type_hints(type(obj))[parts[-1]]
        if dataclasses.is_dataclass(tp):
            raise ConfigError(f"{key!r} is a section; set one of its fields, e.g. {key}.<field>=...")
        value: Any = raw
        if raw.lower() in ("none", "null") and type(None) in typing.get_args(tp):
            value = None
        elif raw.startswith("["):
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: bad list {raw!r} ({e})") from e
        setattr(obj, parts[-1], _convert(tp, value, key))
        if isinstance(obj, PrecisionConfig) and parts[-1] == "backend":
            # a backend named explicitly is the one to run: a fallback given with the earlier one is dropped
            obj.fallback = obj.note = ""
    return cfg
