"""Model registry: a name -> a loader returning a `T2IModel`. Nothing is downloaded at run time."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from solrl.models.base import Cond, ModelSpec, T2IModel


def _load_shapes(path: str | None, device: str | None = None) -> T2IModel:
    from solrl.models.shapes import ShapesModel

    return ShapesModel.load(path, device=device)


def _diffusers_loader(name: str) -> Callable[[str | None], T2IModel]:
    """Lazy: diffusers pipelines are imported only when such a model is loaded."""

    def load(path: str | None, device: str | None = None) -> T2IModel:
        from solrl.models.diffusers_t2i import MODEL_CLASSES

        return MODEL_CLASSES[name].load(path, device=device)

    return load


def _wan_loader(name: str) -> Callable[..., T2IModel]:
    """A Wan2.2 video model; options: frames, height, width (the clip) and reward_frames (solrl/models/wan.py)."""

    def load(path: str | None, **options) -> T2IModel:
        from solrl.models.wan import WAN_CLASSES

        return WAN_CLASSES[name].load(path, **options)

    load.takes_options = True  # type: ignore[attr-defined]
    return load


_REGISTRY: dict[str, Callable[[str | None], T2IModel]] = {
    "shapes": _load_shapes,
    # real models (diffusers layout, local path or HF cache only): solrl/models/diffusers_t2i.py
    "sana1.5-1.6b": _diffusers_loader("sana1.5-1.6b"),
    "sd3.5-large": _diffusers_loader("sd3.5-large"),
    "flux1-dev": _diffusers_loader("flux1-dev"),
    # video (diffusers WanPipeline): solrl/models/wan.py
    "wan2.2-ti2v-5b": _wan_loader("wan2.2-ti2v-5b"),
    "wan2.2-t2v-a14b": _wan_loader("wan2.2-t2v-a14b"),
}


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def load_model(name: str, path: str | Path | None = None, device: str | None = None, **options) -> T2IModel:
    """Model `name` from `path` (None: its default location) on `device` (None or "": the model's default, the CPU
    for shapes and CUDA where present for the real models; `model.device` in a run's config). `options` go to
    loaders that take them (a video model's clip: frames, height, width, reward_frames;
    `RunConfig.model_options()`); the image models take none."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {available_models()}")
    loader = _REGISTRY[name]
    if options and not getattr(loader, "takes_options", False):
        raise ValueError(f"model {name!r} takes no load options, got {sorted(options)}")
    if device:
        options["device"] = device
    return loader(str(path) if path is not None else None, **options)


def register_model(name: str, loader: Callable[[str | None], T2IModel]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = loader


__all__ = ["Cond", "ModelSpec", "T2IModel", "available_models", "load_model", "register_model"]
