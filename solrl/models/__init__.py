"""Model registry: a name -> a loader returning a `T2IModel`. Nothing is downloaded at run time."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from solrl.models.base import Cond, ModelSpec, T2IModel


def _load_shapes(path: str | None) -> T2IModel:
    from solrl.models.shapes import ShapesModel

    return ShapesModel.load(path)


_REGISTRY: dict[str, Callable[[str | None], T2IModel]] = {"shapes": _load_shapes}


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def load_model(name: str, path: str | Path | None = None) -> T2IModel:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {available_models()}")
    return _REGISTRY[name](str(path) if path is not None else None)


def register_model(name: str, loader: Callable[[str | None], T2IModel]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = loader


__all__ = ["Cond", "ModelSpec", "T2IModel", "available_models", "load_model", "register_model"]
