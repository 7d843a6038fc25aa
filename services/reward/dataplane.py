"""The reward service's logic, free of any transport (the KServe `DataPlane` pattern).

Both front doors (solrl.reward.v1.Reward and the KServe v2 / Triton GRPCInferenceService) convert
their messages and call this class; tests can drive it in-process. One model per reward name, one
version ("1"). Every model takes IMAGES (UINT8 [-1, -1, -1, 3]) and PROMPTS (BYTES [-1]) and
returns SCORES (FP32 [-1]); concurrent requests to a model share scorer calls (DynamicBatcher).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tritonclient.utils import np_to_triton_dtype

import solrl
from services.common.batching import DynamicBatcher
from services.common.errors import NotFoundError

# the KServe model descriptors are the front door's (services.kserve.tensors); re-exported for the planes
from services.kserve.tensors import MODEL_VERSION, PLATFORM, ModelMetadata, TensorSpec  # noqa: E402,F401
from solrl.models import device_info
from solrl.rewards import PromptError, Scorer, build_reward, check_images, ready_rewards
from solrl.rewards.frames import frame_incapable, score_frames
from solrl.rewards.weights import default_device

IMAGES = TensorSpec("IMAGES", "UINT8", (-1, -1, -1, 3))
PROMPTS = TensorSpec("PROMPTS", "BYTES", (-1,))
SCORES = TensorSpec("SCORES", "FP32", (-1,))


def _datatype(array: np.ndarray) -> str:
    return np_to_triton_dtype(array.dtype) or str(array.dtype)


class RewardDataPlane:
    """Scorers by name behind dynamic batchers.

    observe(model, n_requests, n_images, seconds) is called after every scorer call.
    """

    device = ""   # where the scorers' models load ("": CUDA where present); set by build

    def __init__(self, scorers: Mapping[str, Scorer], *, max_batch: int = 64, max_delay_ms: float = 5.0,
                 observe: Callable[[str, int, int, float], None] | None = None) -> None:
        if not isinstance(scorers, Mapping) or not scorers:
            raise ValueError("scorers must map at least one reward name to a scorer")
        for name, scorer in scorers.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"scorers: reward names must be non-empty strings, got {name!r}")
            if not callable(scorer):
                raise TypeError(f"scorers[{name!r}] must be callable, got {type(scorer).__name__}")
        if not max_delay_ms >= 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms!r}")
        self.max_batch, self.max_delay_ms = max_batch, float(max_delay_ms)
        self._batchers = {
            name: DynamicBatcher(scorer, max_batch=max_batch, max_delay_s=max_delay_ms / 1000.0,
                                 name=f"reward-{name}",
                                 observe=None if observe is None else _bind(observe, name))
            for name, scorer in scorers.items()
        }

    @classmethod
    def build(cls, names: Sequence[str] | None = None, device: str = "", **kwargs: Any) -> RewardDataPlane:
        """Scorers from the core registry (solrl.rewards.build_reward) for exactly `names`: a reward that
        cannot be built fails the whole build with ValueError naming each such reward and why, so a
        service never starts healthy without a reward it was asked for. names=None serves every reward
        that can be built here (its packages installed and weights found locally). `device`: where the scorers' models
        load ("": CUDA where present, else the CPU)."""
        names = ready_rewards() if names is None else list(names)
        if not names:
            raise ValueError("names must list at least one reward")
        scorers, failed = {}, []
        for name in names:
            try:
                scorers[name] = build_reward(name, device or None)
            except Exception as exc:  # any failure to build names its reward (ImportError, OSError, ...)
                failed.append(f"{name} ({type(exc).__name__}: {exc})")
        if failed:
            for scorer in scorers.values():
                close = getattr(scorer, "close", None)
                if callable(close):
                    close()
            raise ValueError(f"cannot serve reward(s) {', '.join(failed)}; docs/rewards.md says what each needs")
        plane = cls(scorers, **kwargs)
        plane.device = str(torch.device(device)) if device else ""
        return plane

    # ------------------------------------------------------------------ lifecycle and metadata

    @property
    def models(self) -> list[str]:
        return list(self._batchers)

    def ready(self) -> bool:
        return all(b.alive for b in self._batchers.values())

    def model_ready(self, name: str, version: str = "") -> bool:
        """False for a model this server does not serve (as Triton's ModelReady)."""
        return name in self._batchers and version in ("", MODEL_VERSION) and self._batchers[name].alive

    def resolve(self, name: str, version: str = "", *, field: str = "model_name") -> str:
        """The model's name; ValueError when none is given (no implicit default: a request names what
        scores it), NotFoundError (naming the request `field`) for an unknown model or version."""
        if not name:
            raise ValueError(f"{field}: required (one of {self.models})")
        if name not in self._batchers:
            raise NotFoundError(f"{field}: unknown model {name!r}; serving {self.models}")
        if version not in ("", MODEL_VERSION):
            raise NotFoundError(f"model_version: model {name!r} has no version {version!r}; "
                                f"versions: [{MODEL_VERSION!r}]")
        return name

    def metadata(self, name: str, version: str = "") -> ModelMetadata:
        return ModelMetadata(self.resolve(name, version), (MODEL_VERSION,), PLATFORM, (IMAGES, PROMPTS), (SCORES,))

    def info(self) -> dict[str, Any]:
        return {"service": "reward", "version": solrl.__version__, "models": self.models,
                "max_batch": self.max_batch,
                "max_delay_ms": self.max_delay_ms, "ready": self.ready(), **device_info(self.device or default_device())}

    def close(self) -> None:
        for b in self._batchers.values():
            b.close()

    # ------------------------------------------------------------------ scoring

    def score(self, name: str, images: np.ndarray, prompts: Sequence[str], *,
              fields: tuple[str, str, str] = ("reward", "images", "prompts")) -> np.ndarray:
        """float32 scores [B] of uint8 images [B, H, W, 3] against B prompts, or of video clips [B, F, H, W, 3]:
        every frame scored with its clip's prompt, each clip's score the mean over its F frames (what a video run's
        reward_frames=mean scores; frame 0 alone, reward_frames=first, is [B, 1, H, W, 3]: its score exactly).
        A reward that cannot score video frames (the shapes world's) refuses clips.

        Errors name the request fields `fields` = (model name, images, prompts).
        """
        name_field, images_field, prompts_field = fields
        name = self.resolve(name, field=name_field)
        if isinstance(prompts, (str, bytes)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"{prompts_field} must be a list of strings")
        prompts = list(prompts)
        clips = isinstance(images, np.ndarray) and images.ndim == 5
        try:
            if clips:
                _check_clips(name, images, len(prompts))
            else:
                check_images(images, len(prompts))
        except (TypeError, ValueError) as exc:
            raise type(exc)(_named(images_field, exc)) from None
        if not prompts:
            return np.zeros(0, dtype=np.float32)
        try:
            scores = score_frames(self._batchers[name], images, prompts) if clips else self._batchers[name](images,
                                                                                                          prompts)
        except PromptError as exc:
            raise PromptError(_named(prompts_field, exc)) from None
        return np.asarray(scores, dtype=np.float32)

    def infer(self, name: str, inputs: Mapping[str, np.ndarray], version: str = "",
              outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """KServe v2 inference: {"IMAGES", "PROMPTS"} -> {"SCORES"} (input and output names as in metadata)."""
        name = self.resolve(name, version)
        for key in inputs:
            if key not in (IMAGES.name, PROMPTS.name):
                raise ValueError(f"{key}: unknown input; model {name!r} takes {IMAGES.name} and {PROMPTS.name}")
        for spec in (IMAGES, PROMPTS):
            if spec.name not in inputs:
                raise ValueError(f"{spec.name}: missing input")
        for key in outputs:
            if key != SCORES.name:
                raise ValueError(f"outputs: unknown output {key!r}; model {name!r} has {SCORES.name}")
        images, raw_prompts = inputs[IMAGES.name], inputs[PROMPTS.name]
        if images.dtype != np.uint8:
            raise TypeError(f"IMAGES: expected datatype UINT8, got {_datatype(images)}")
        if images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(f"IMAGES: expected shape [-1, -1, -1, 3], got {list(images.shape)}")
        if raw_prompts.dtype != object:
            raise TypeError(f"PROMPTS: expected datatype BYTES, got {_datatype(raw_prompts)}")
        if raw_prompts.ndim != 1:
            raise ValueError(f"PROMPTS: expected shape [-1], got {list(raw_prompts.shape)}")
        if len(raw_prompts) != len(images):
            raise ValueError(f"PROMPTS: {len(raw_prompts)} prompts for {len(images)} images in IMAGES; "
                             "the batch sizes must match")
        prompts = []
        for i, p in enumerate(raw_prompts):
            try:
                prompts.append(p.decode("utf-8") if isinstance(p, bytes) else str(p))
            except UnicodeDecodeError:
                raise ValueError(f"PROMPTS[{i}]: not valid UTF-8") from None
        return {SCORES.name: self.score(name, images, prompts, fields=("model_name", IMAGES.name, PROMPTS.name))}


def _check_clips(name: str, clips: np.ndarray, n_prompts: int) -> None:
    """uint8 clips [B, F, H, W, 3] (F >= 1), one prompt each, for a reward that can score video frames."""
    if clips.dtype != np.uint8:
        raise TypeError(f"clips must have dtype uint8, got {clips.dtype}")
    if clips.shape[1] < 1 or clips.shape[-1] != 3 or clips.shape[2] < 4 or clips.shape[3] < 4:
        raise ValueError(f"clips must have shape [B, F, H, W, 3] (F >= 1, H, W >= 4), got {list(clips.shape)}")
    if clips.shape[0] != n_prompts:
        raise ValueError(f"got {clips.shape[0]} clips but {n_prompts} prompts")
    try:
        bad = frame_incapable(name)
    except (KeyError, ValueError):   # a scorer served under a name of its own (not the registry's)
        bad = []
    if bad:
        raise ValueError(f"reward {name!r}: {bad} cannot score video frames (the shapes world's rewards parse renders "
                         f"of that world); send images [B, H, W, 3]")


def _named(field: str, exc: Exception) -> str:
    """The error message, starting with the request field it is about."""
    msg = str(exc)
    return msg if msg.startswith(field) else f"{field}: {msg}"


def _bind(observe: Callable[[str, int, int, float], None], name: str) -> Callable[[int, int, float], None]:
    return lambda requests, items, seconds: observe(name, requests, items, seconds)
