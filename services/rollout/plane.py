"""What the rollout services' data planes share: scorers (in process or remote), request checks, the
sampler defaults, and `RolloutPlane`, the hot-reloadable model copy with its lifecycle and info."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

import solrl
from services.common.args import DEFAULT_MAX_REWARD_REQUEST_BYTES
from services.common.auth import metadata
from services.common.env import ENV_REWARD_ADDR  # noqa: F401 (re-exported for callers of this module)
from services.common.errors import NotFoundError, UnavailableError
from services.common.grpc_server import MAX_GRPC_MESSAGE_SIZE
from services.common.tensors import numpy_to_tensor, torch_to_tensor
from services.rollout.hot_swap import HotSwapModel, serving_precision
from solrl.adapters import LoraSpec
from solrl.models import device_info, served_device
from solrl.models.base import T2IModel
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from solrl.precision import PrecisionConfig, runnable_backends
from solrl.rewards import Scorer, build_reward
from solrl.rollout.passes import PromptCache, SamplerSpec
from solrl.sampling.noise import SEED_LIMIT

ODE_SOLVERS = ("euler", "dpm2")  # what a request names; the SDE is asked for with SamplerSpec.sde_eta > 0


class RemoteScorer:
    """A reward service's `solrl.reward.v1.Reward/Score` as a scorer (images, prompts) -> scores; `token`: the
    data planes' bearer token the service requires (SOLRL_DATA_TOKEN), sent with every call."""

    def __init__(self, address: str, reward: str, timeout_s: float = 120.0,
                 max_request_bytes: int = DEFAULT_MAX_REWARD_REQUEST_BYTES, token: str | None = None) -> None:
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"address must be host:port, got {address!r}")
        if not isinstance(reward, str) or not reward:
            raise ValueError(f"reward must be a reward name, got {reward!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive int, got {max_request_bytes!r}")
        self.name, self.address, self.timeout_s = reward, address.strip(), float(timeout_s)
        self.max_request_bytes, self._metadata = max_request_bytes, metadata(token)
        self._channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE)])
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        """Scores of images [N, H, W, 3]: one Score call, or, over `max_request_bytes` (the reward service's
        default tensor limit: a video run scoring every frame of its clips, reward_frames=mean, sends N = clips x
        frames), consecutive slices of the batch each within it (a reward scores each image on its own)."""
        images = np.ascontiguousarray(images)
        prompts = list(prompts)
        per_image = images[:1].nbytes
        step = max(1, self.max_request_bytes // per_image) if per_image else len(images)
        if len(images) <= step:
            return self._score(images, prompts)
        if len(prompts) != len(images):
            raise ValueError(f"got {len(prompts)} prompts for {len(images)} images")
        return np.concatenate([self._score(images[i: i + step], prompts[i: i + step])
                               for i in range(0, len(images), step)])

    def _score(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        request = reward_pb2.ScoreRequest(reward=self.name, images=numpy_to_tensor(images), prompts=prompts)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                response = self._stub.Score(request, timeout=max(deadline - time.monotonic(), 0.001),
                                            metadata=self._metadata)
                break
            except grpc.RpcError as exc:
                wait = _retry_after(exc)   # the service's budget was full: a transient refusal, retried
                if wait is None or time.monotonic() + wait >= deadline:
                    self._raise(exc)
                time.sleep(wait)
        scores = np.asarray(response.scores, dtype=np.float32)
        if scores.shape != (len(prompts),):
            raise RuntimeError(f"reward service {self.address} returned {scores.size} scores for {len(prompts)} images")
        return scores

    def _raise(self, exc: grpc.RpcError) -> None:
        """A failed Score call as the core's exceptions."""
        code, details = exc.code(), exc.details()
        msg = f"reward service {self.address}: {code.name}: {details}"
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(msg) from None
        if code == grpc.StatusCode.NOT_FOUND:
            raise NotFoundError(msg) from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise UnavailableError(msg) from None
        raise RuntimeError(msg) from None

    def close(self) -> None:
        self._channel.close()


def _retry_after(exc: grpc.RpcError) -> float | None:
    """Seconds to wait before retrying a call refused by the service's budget for the requests in flight
    (RESOURCE_EXHAUSTED with a `retry-after` trailer, services.common.budget); None for any other error."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after":
            try:
                return max(float(value), 0.0)
            except ValueError:
                return None
    return None


def build_scorer(reward: str, address: str | None = None, token: str | None = None) -> Scorer:
    """The registry scorer `reward` in process, or the reward service at `address` scoring with it (sending
    `token`, the data planes' bearer token, if any)."""
    return RemoteScorer(address, reward, token=token) if address else build_reward(reward)


def resolve_sampler(default: SamplerSpec, solver: str = "", shift: float = 0.0, guidance: float = 0.0,
                    field: str = "sampler", sde_eta: float = 0.0) -> SamplerSpec:
    """A request's sampler: empty / zero values take `default`'s (as solrl.common.v1.SamplerSpec says).
    sde_eta > 0 (the regenerator of a flow_grpo run): the SDE at that noise level, which records every step;
    `solver` must still name an ODE solver (the explorer's)."""
    solver = solver or default.solver
    if solver not in ODE_SOLVERS:
        raise ValueError(f"{field}.solver must be one of {ODE_SOLVERS} (or empty for the default), got {solver!r}")
    shift = float(shift) or default.shift
    if not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"{field}.shift must be finite and > 0 (or 0 for the default), got {shift}")
    guidance = float(guidance) or default.guidance
    if not math.isfinite(guidance) or guidance < 1.0:
        raise ValueError(f"{field}.guidance must be finite and >= 1 (or 0 for the default), got {guidance}")
    sde_eta = float(sde_eta)
    if not math.isfinite(sde_eta) or sde_eta < 0:
        raise ValueError(f"{field}.sde_eta must be finite and >= 0 (0: no SDE), got {sde_eta}")
    if sde_eta > 0:
        return SamplerSpec("sde", shift, guidance, sde_eta)
    return SamplerSpec(solver, shift, guidance)


def sde_rollout_fields(outcome: Any, j: int, sampler: SamplerSpec) -> dict[str, Any]:
    """The common.v1.Rollout fields of the j-th seed of a regeneration `outcome` sampled with the SDE
    (trajectory, log_probs, sde_eta), {} for an ODE regeneration."""
    if outcome.trajectory is None:
        return {}
    return {"trajectory": torch_to_tensor(outcome.trajectory[j]), "log_probs": torch_to_tensor(outcome.log_probs[j]),
            "sde_eta": sampler.eta}


def check_int(value: Any, field: str, low: int, high: int) -> int:
    """`value` as an int in [low, high]; ValueError naming `field` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
        raise ValueError(f"{field} must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


def check_seeds(pool: Any, field: str, max_seeds: int) -> list[int]:
    if isinstance(pool, (str, bytes)) or not isinstance(pool, Sequence) or not pool:
        raise ValueError(f"{field} must be a non-empty list of seeds")
    if len(pool) > max_seeds:
        raise ValueError(f"{field} holds {len(pool)} seeds, over the limit of {max_seeds}")
    return [check_int(s, f"{field}[{i}]", 0, SEED_LIMIT - 1) for i, s in enumerate(pool)]


def check_prompts(cache: PromptCache, prompts: Any, field: str) -> list[str]:
    """Non-empty strings the model can encode (encoded into `cache` on the way)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"{field} must be a non-empty list of strings")
    names = [f"{field}[{i}]" if len(prompts) > 1 else field for i in range(len(prompts))]
    for name, p in zip(names, prompts):
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"{name} must be a non-empty string, got {p!r}")
    try:
        cache(list(prompts))
    except ValueError:  # find the prompt(s) the model cannot encode
        for name, p in zip(names, prompts):
            try:
                cache([p])
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        raise
    return list(prompts)


def default_sampler(model: T2IModel) -> SamplerSpec:
    return SamplerSpec(model.spec.default_solver, model.spec.default_shift, 1.0)


class RolloutPlane:
    """A hot-reloadable copy of `model.transformer` serving one rollout role.

    `model.transformer` is served in place (the plane takes it over; HotSwapModel); `precision`
    is combined with the model's quantization skip list; `lora` pins the layout pushed adapters must
    have (None: each adapter's own metadata). A request for a newer adapter version than served waits up to `version_wait_s`.
    """

    SERVICE = ""
    SWITCHES_PRECISION = False   # the explorer's adaptive proxy switches its backend (HotSwapModel.use)

    def __init__(self, model: T2IModel, precision: PrecisionConfig, lora: LoraSpec | None, scorer: Scorer, *,
                 model_name: str, steps: int, sampler: SamplerSpec | None, micro_batch: int, max_seeds: int,
                 max_steps: int, version_wait_s: float) -> None:
        if not isinstance(model, T2IModel):
            raise TypeError(f"model must be a T2IModel, got {type(model).__name__}")
        if not callable(scorer):
            raise TypeError(f"scorer must be callable, got {type(scorer).__name__}")
        self.max_seeds = check_int(max_seeds, "max_seeds", 1, 1 << 20)
        self.max_steps = check_int(max_steps, "max_steps", 1, 100_000)
        self.steps = check_int(steps, "steps", 1, self.max_steps)
        self.micro_batch = check_int(micro_batch, "micro_batch", 1, 1 << 16)
        if not version_wait_s >= 0:
            raise ValueError(f"version_wait_s must be >= 0, got {version_wait_s!r}")
        self.model, self.scorer = model, scorer
        self.model_name = model_name or model.spec.name
        self.sampler = resolve_sampler(default_sampler(model), *(
            (sampler.solver, sampler.shift, sampler.guidance) if sampler is not None else ()))
        self.version_wait_s = float(version_wait_s)
        # the one copy of the denoiser: model.transformer is served in place (see HotSwapModel)
        self.hot = HotSwapModel(model.transformer, lora, serving_precision(precision, model.spec),
                                targets=model.spec.lora_targets, switchable=self.SWITCHES_PRECISION)
        self.cache = PromptCache(model)
        self.available_precisions = runnable_backends()  # what this machine can build: fixed for the process
        self._closed = False
        # how the base was loaded (set by the service shell; reported by Info for the trainer's check)
        self.base_precision, self.model_path = "", ""

    def ready(self) -> bool:
        return not self._closed

    def defaults(self) -> dict[str, Any]:
        """Request defaults, reported by info()."""
        return {"steps": self.steps, "solver": self.sampler.solver, "shift": self.sampler.shift,
                "guidance": self.sampler.guidance}

    def info(self) -> dict[str, Any]:
        cur = self.hot.current()
        return {"service": self.SERVICE, "version": solrl.__version__, "model": self.model_name,
                "precision": self.hot.backend, "base_precision": self.base_precision, "model_path": self.model_path,
                "adapter_version": cur.version, "adapter_sha256": cur.sha256,
                "resident_weight_bytes": self.hot.weight_bytes()["total"],
                "available_precisions": self.available_precisions,
                "reward": getattr(self.scorer, "name", type(self.scorer).__name__),
                "defaults": self.defaults(), "ready": self.ready(), **self.clip(),
                **device_info(served_device(self.model))}

    def clip(self) -> dict[str, Any]:
        """A video model's clip and reward frames (Info's frames, height, width, reward_frames); {} for an image
        model (Info then says 0 and "")."""
        if self.model.spec.is_video:
            return {"frames": int(self.model.frames), "height": int(self.model.height),
                    "width": int(self.model.width), "reward_frames": str(self.model.reward_frames)}
        return {}

    def close(self) -> None:
        self._closed = True
        close = getattr(self.scorer, "close", None)
        if callable(close):
            close()
