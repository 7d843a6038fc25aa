"""Reward scorers, found by name. A scorer maps (uint8 images [B,H,W,3], prompts) -> float32 scores [B].

Every reward is registered with a factory; the ones with heavy dependencies or downloaded weights
are imported only when built ("module:Class" factories). `build_reward` also accepts a weighted spec,
`pickscore:1.0+ocr:0.5` (see `solrl.rewards.multi`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from solrl.registry import load_entry
from solrl.rewards.inputs import PromptError, check_images
from solrl.rewards.jpeg import JpegCompressibility
from solrl.rewards.weights import MissingWeightsError


class Scorer(Protocol):
    """A reward. A scorer may also give evaluation metrics of its own: a method
    `score_with_metrics(images, prompts, seeds_per_prompt) -> (scores float64 [N], metrics, summary)`, which held-out
    evaluation (solrl.engine.evaluate) calls instead of the scorer when it has one (the shapes bed's exact reward does).
    `metrics` ({field: value}) go into the evaluation's result, `summary` (flat {field: value}) sums it up: the
    evaluation summary and a run's records (eval.<field>) copy those fields as they are."""

    name: str

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class RewardInfo:
    name: str
    factory: Callable[[], Scorer] | str   # a callable, or "module:attr" imported when the reward is built
    needs_weights: bool = False           # downloaded model weights (from a local path or the HF cache)
    requires: tuple[str, ...] = ()        # optional packages (import names) it needs
    weights: str = ""                     # where the weights come from (environment variables, defaults)
    frames: bool = True                   # scores any RGB image, so a video's frames (solrl/rewards/frames.py)

    def missing(self) -> list[str]:
        """What is absent for this reward to build here (packages, weights); [] = ready. Cheap: loads nothing."""
        out = [f"package {m}" for m in self.requires if importlib.util.find_spec(m) is None]
        if isinstance(self.factory, str) and not out:
            check = getattr(load_entry(self.factory), "missing", None)
            if check is not None:
                out += check()
        return out

    def build(self, device: str | None = None) -> Scorer:
        """The scorer; `device` goes to scorers that hold a model (those taking `device`), the rest ignore it."""
        factory = self.factory
        if isinstance(factory, str):
            lacking = [m for m in self.requires if importlib.util.find_spec(m) is None]
            if lacking:
                raise ImportError(f"reward {self.name!r} needs the packages {lacking}; install them (docs/rewards.md)")
            factory = load_entry(factory)
        if device and "device" in inspect.signature(factory).parameters:
            return factory(device=device)
        return factory()


_REGISTRY: dict[str, RewardInfo] = {}


def register_reward(name: str, factory: Callable[[], Scorer] | str, *, needs_weights: bool = False,
                    requires: tuple[str, ...] = (), weights: str = "", frames: bool = True) -> None:
    if not isinstance(name, str) or not name or any(c in name for c in ":+,{} "):
        raise ValueError(f"reward name must be a non-empty string without ':+,{{}} ', got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    _REGISTRY[name] = RewardInfo(name, factory, needs_weights, tuple(requires), weights, frames)


def available_rewards() -> list[str]:
    return sorted(_REGISTRY)


def reward_info(name: str) -> RewardInfo:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; available: {available_rewards()}")
    return _REGISTRY[name]


def ready_rewards() -> list[str]:
    """Registered rewards that can be built here now (packages installed, weights found locally)."""
    return [n for n in available_rewards() if not _REGISTRY[n].missing()]


def build_reward(name: str, device: str | None = None) -> Scorer:
    """A scorer by registry name, or a weighted sum from a spec like 'pickscore:1.0+ocr:0.5'; its models on `device`
    (None: CUDA where present)."""
    from solrl.rewards.multi import MultiReward, is_spec, parse_spec

    if is_spec(name):
        return MultiReward(parse_spec(name), lambda n: build_reward(n, device))
    return reward_info(name).build(device)


# the shapes bed's rewards (solrl/shapes/), imported when built: they parse renders of that world, so they cannot
# score a video model's frames
register_reward("shapes", "solrl.shapes.reward:ShapesReward", frames=False)
register_reward("shapes_dense", "solrl.shapes.dense:ShapesDenseReward", frames=False)
register_reward("jpeg_compressibility", JpegCompressibility)
register_reward("ocr", "solrl.rewards.ocr:OcrReward", requires=("rapidocr_onnxruntime", "rapidfuzz"),
                weights="none to download (rapidocr_onnxruntime ships its ONNX models)")
register_reward("clipscore", "solrl.rewards.clip:ClipScore", needs_weights=True,
                weights="SOLRL_CLIPSCORE_MODEL (default openai/clip-vit-large-patch14)")
register_reward("pickscore", "solrl.rewards.clip:PickScore", needs_weights=True,
                weights="SOLRL_PICKSCORE_MODEL (default yuvalkirstain/PickScore_v1), "
                        "SOLRL_PICKSCORE_PROCESSOR (default laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
register_reward("hpsv2", "solrl.rewards.hps:HPSv2", needs_weights=True,
                weights="SOLRL_HPSV2_CHECKPOINT (HPS_v2.1_compressed.pt; default repo xswu/HPSv2), "
                        "SOLRL_HPSV2_TOKENIZER (default laion/CLIP-ViT-H-14-laion2B-s32B-b79K)")
register_reward("imagereward", "solrl.rewards.imagereward:ImageReward", needs_weights=True,
                weights="SOLRL_IMAGEREWARD_CHECKPOINT (ImageReward.pt; default repo THUDM/ImageReward), "
                        "SOLRL_IMAGEREWARD_TOKENIZER (default google-bert/bert-base-uncased)")
register_reward("hpsv3", "solrl.rewards.hps:HPSv3", needs_weights=True,
                weights="SOLRL_HPSV3_CHECKPOINT (HPSv3.safetensors), SOLRL_HPSV3_CONFIG (default the package's "
                        "HPSv3_7B.yaml: base Qwen/Qwen2-VL-7B-Instruct); runs in its own environment "
                        "(envs/hpsv3/install.sh)")


__all__ = ["MissingWeightsError", "PromptError", "RewardInfo", "Scorer", "available_rewards", "build_reward", "check_images",
           "ready_rewards", "register_reward", "reward_info"]
