"""Model registry: a name -> a loader returning a `T2IModel`. Nothing is downloaded at run time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from solrl.models.base import Cond, ModelSpec, T2IModel


def _load_shapes(path: str | None) -> T2IModel:
    from solrl.models.shapes import ShapesModel

    return ShapesModel.load(path)


def _diffusers_loader(name: str) -> Callable[[str | None], T2IModel]:
    """Lazy: diffusers pipelines are imported only when such a model is loaded."""

    def load(path: str | None) -> T2IModel:
        from solrl.models.diffusers_t2i import MODEL_CLASSES

        return MODEL_CLASSES[name].load(path)

    return load


_REGISTRY: dict[str, Callable[[str | None], T2IModel]] = {
    "shapes": _load_shapes,
    # real models (diffusers layout, local path or HF cache only): solrl/models/diffusers_t2i.py
    "sana1.5-1.6b": _diffusers_loader("sana1.5-1.6b"),
    "sd3.5-large": _diffusers_loader("sd3.5-large"),
    "flux1-dev": _diffusers_loader("flux1-dev"),
}


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
