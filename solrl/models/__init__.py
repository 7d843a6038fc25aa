"""Model registry: a name -> a loader returning a `T2IModel`. Nothing is downloaded at run time."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from solrl.models.base import Cond, ModelSpec, T2IModel
from solrl.registry import load_entry


def _entry_loader(target: str) -> Callable[[str | None], T2IModel]:
    """A loader named "module:attr" (a class with `load(path, device=...)`), imported when the model is loaded: how
    a package above the core (the shapes bed, solrl/shapes/) registers its model without the core importing it."""

    def load(path: str | None, device: str | None = None) -> T2IModel:
        return load_entry(target).load(path, device=device)

    return load


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
    # the shapes bed (solrl/shapes/model.py), above the core: imported when loaded
    "shapes": _entry_loader("solrl.shapes.model:ShapesModel"),
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


# Tests only: a machine without a GPU runs a GPU deployment's roles (tests/deploy/test_gpu_deploy.py). Set to 1, a device
# of type cuda passes the run config's check, the model loads on the CPU instead, and each CUDA-only precision
# backend is built as its CPU emulation (the same format: solrl.precision.build_backend); every role still reports
# the device it was asked for (`served_device`) and says that it was stood in. Never set it on a real node.
ENV_CUDA_STANDIN = "SOLRL_TEST_CUDA_ON_CPU"
log = logging.getLogger(__name__)


def cuda_stood_in() -> bool:
    """Whether CUDA is stood in by the CPU: ENV_CUDA_STANDIN is set (tests only) and this machine has no CUDA
    device (where it has one, CUDA runs as it is)."""
    if os.environ.get(ENV_CUDA_STANDIN) != "1":
        return False
    import torch

    return not torch.cuda.is_available()


def served_device(model: T2IModel) -> str:
    """The device `model` serves on: as `load_model` was asked ("cuda", "cuda:1"; under ENV_CUDA_STANDIN the one it
    stands in for), else where its denoiser's weights are."""
    return getattr(model, "served_device", "") or str(next(model.transformer.parameters()).device)


def device_info(device: str) -> dict[str, str]:
    """What a role reports of its device (/v1/info, the Info RPC): `device`, and `device_stand_in` (the CPU) when
    a CUDA device is stood in (ENV_CUDA_STANDIN)."""
    stood_in = device.startswith("cuda") and cuda_stood_in()
    return {"device": device, **({"device_stand_in": "cpu"} if stood_in else {})}


def load_model(name: str, path: str | Path | None = None, device: str | None = None, **options) -> T2IModel:
    """Model `name` from `path` (None: its default location) on `device` (None or "": the model's default, the CPU
    for shapes and CUDA where present for the real models; `model.device` in a run's config). `options` go to
    loaders that take them (a video model's clip: frames, height, width, reward_frames;
    `RunConfig.model_options()`); the image models take none. The model's `served_device` names where it was
    placed (with ENV_CUDA_STANDIN, the CUDA device it would be on)."""
    import torch

    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; available: {available_models()}")
    loader = _REGISTRY[name]
    if options and not getattr(loader, "takes_options", False):
        raise ValueError(f"model {name!r} takes no load options, got {sorted(options)}")
    asked = str(torch.device(device)) if device else ""
    if asked.startswith("cuda") and cuda_stood_in():
        log.warning("%s=1: model %s asked for %s loads on the CPU (a test stand-in, never a real node)",
                    ENV_CUDA_STANDIN, name, asked)
        device = "cpu"
    if device:
        options["device"] = device
    model = loader(str(path) if path is not None else None, **options)
    model.served_device = asked
    return model


def register_model(name: str, loader: Callable[[str | None], T2IModel] | str) -> None:
    """`loader`: a callable (path, device=...) -> T2IModel, or "module:Class" imported when the model is loaded."""
    if name in _REGISTRY:
        raise ValueError(f"model {name!r} is already registered")
    _REGISTRY[name] = _entry_loader(loader) if isinstance(loader, str) else loader


__all__ = ["ENV_CUDA_STANDIN", "Cond", "ModelSpec", "T2IModel", "available_models", "cuda_stood_in", "device_info",
           "load_model", "register_model", "served_device"]
