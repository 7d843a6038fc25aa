"""The explorer's logic, free of any transport (the KServe `DataPlane` pattern).

A low-precision (e.g. NVFP4-emulated) copy of the denoiser samples a pool of seeds per prompt at few
steps, a scorer gives each image a proxy reward and `k` seeds are selected. Sampling, scoring and
selection are the core `solrl.rollout.explore`; this class adds input checks (errors name the request
field), the hot-reloadable serving copy (every result names the adapter version it was sampled with)
and the KServe v2 model `explore`. Also here, for both rollout services: the scorer choice (the
in-process registry or a remote reward service) and the sampler defaults.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

import solrl
from services.common.adapter_reload import HotSwapModel, serving_precision
from services.common.errors import NotFoundError, UnavailableError
from services.common.grpc_server import MAX_GRPC_MESSAGE_SIZE
from services.common.tensors import numpy_to_tensor
from services.reward.dataplane import MODEL_VERSION, PLATFORM, ModelMetadata, TensorSpec
from solrl.adapters import LoraSpec
from solrl.algo.selection import SELECTION_MODES
from solrl.models.base import T2IModel
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from solrl.precision import PrecisionConfig
from solrl.rewards import Scorer, build_reward
from solrl.rollout import PromptCache, SamplerSpec, explore
from solrl.sampling.noise import SEED_LIMIT

ENV_REWARD_ADDR = "SOLRL_REWARD_ADDR"
ODE_SOLVERS = ("euler", "dpm2")  # rollouts are deterministic ODE samples (the SDE needs a noise stream)

MODEL_NAME = "explore"
PROMPTS = TensorSpec("PROMPTS", "BYTES", (-1,))
N = TensorSpec("N", "INT32", (1,))
STEPS = TensorSpec("STEPS", "INT32", (1,))
K = TensorSpec("K", "INT32", (1,))
SEEDS = TensorSpec("SEEDS", "INT64", (-1, -1))
SCORES = TensorSpec("SCORES", "FP32", (-1, -1))
KEPT = TensorSpec("KEPT", "INT32", (-1, -1))
ADAPTER_VERSION = TensorSpec("ADAPTER_VERSION", "INT64", (1,))
INPUTS = (PROMPTS, N, STEPS, K)
OPTIONAL_INPUTS = frozenset({K.name})
OUTPUTS = (SEEDS, SCORES, KEPT, ADAPTER_VERSION)

# names of explore()'s arguments in error messages, by default and for the KServe model
FIELDS = {"prompts": "prompts", "seeds": "seeds", "n": "n", "steps": "steps", "kept": "kept",
          "selection": "selection", "min_version": "min_version"}
KSERVE_FIELDS = {**FIELDS, "prompts": PROMPTS.name, "n": N.name, "steps": STEPS.name, "kept": K.name}


# ---------------------------------------------------------------------- shared by the rollout services

class RemoteScorer:
    """A reward service's `solrl.reward.v1.Reward/Score` as a scorer (images, prompts) -> scores."""

    def __init__(self, address: str, reward: str, timeout_s: float = 120.0) -> None:
        if not isinstance(address, str) or not address.strip():
            raise ValueError(f"address must be host:port, got {address!r}")
        if not isinstance(reward, str) or not reward:
            raise ValueError(f"reward must be a reward name, got {reward!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.name, self.address, self.timeout_s = reward, address.strip(), float(timeout_s)
        self._channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE)])
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        request = reward_pb2.ScoreRequest(reward=self.name, images=numpy_to_tensor(np.ascontiguousarray(images)),
                                          prompts=list(prompts))
        try:
            response = self._stub.Score(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            msg = f"reward service {self.address}: {code.name}: {details}"
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(msg) from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFoundError(msg) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise UnavailableError(msg) from None
            raise RuntimeError(msg) from None
        scores = np.asarray(response.scores, dtype=np.float32)
        if scores.shape != (len(prompts),):
            raise RuntimeError(f"reward service {self.address} returned {scores.size} scores for {len(prompts)} images")
        return scores

    def close(self) -> None:
        self._channel.close()


def build_scorer(reward: str, address: str | None = None) -> Scorer:
    """The registry scorer `reward` in process, or the reward service at `address` scoring with it."""
    return RemoteScorer(address, reward) if address else build_reward(reward)


def resolve_sampler(default: SamplerSpec, solver: str = "", shift: float = 0.0, guidance: float = 0.0,
                    field: str = "sampler") -> SamplerSpec:
    """A request's sampler: empty / zero values take `default`'s (as solrl.common.v1.SamplerSpec says)."""
    solver = solver or default.solver
    if solver not in ODE_SOLVERS:
        raise ValueError(f"{field}.solver must be one of {ODE_SOLVERS} (or empty for the default), got {solver!r}")
    shift = float(shift) or default.shift
    if not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"{field}.shift must be finite and > 0 (or 0 for the default), got {shift}")
    guidance = float(guidance) or default.guidance
    if not math.isfinite(guidance) or guidance < 1.0:
        raise ValueError(f"{field}.guidance must be finite and >= 1 (or 0 for the default), got {guidance}")
    return SamplerSpec(solver, shift, guidance)


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


# ---------------------------------------------------------------------- the explorer

@dataclass(frozen=True)
class ExploreOutcome:
    seeds: list[list[int]]   # [P][n]
    scores: np.ndarray       # float32 [P, n] proxy rewards
    kept: list[list[int]]    # [P][k] indices into seeds[p]
    version: int             # adapter version sampled with
    sha256: str
    forwards: int


def selection_generator(seeds: list[list[int]]) -> torch.Generator:
    """A generator for the random selection modes, seeded by the seed pools: a job selects the same
    seeds on any replica."""
    state = np.random.SeedSequence([s for pool in seeds for s in pool]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> 1))


class ExplorerDataPlane:
    """Explore over a hot-reloadable low-precision copy of `model.transformer`.

    `model.transformer` becomes the plain base the adapters merge into (kept as given); `precision`
    is combined with the model's quantization skip list; `lora` is the layout pushed adapters must
    have. Defaults for requests that leave them out: `steps`, `kept`, `selection`, `sampler`.
    A request for a newer adapter version than served waits up to `version_wait_s`.
    """

    def __init__(self, model: T2IModel, precision: PrecisionConfig, lora: LoraSpec, scorer: Scorer, *,
                 model_name: str = "", steps: int = 6, kept: int = 24, selection: str = "best_worst",
                 sampler: SamplerSpec | None = None, micro_batch: int = 64, max_seeds: int = 4096,
                 max_steps: int = 1000, version_wait_s: float = 30.0) -> None:
        if not isinstance(model, T2IModel):
            raise TypeError(f"model must be a T2IModel, got {type(model).__name__}")
        if not callable(scorer):
            raise TypeError(f"scorer must be callable, got {type(scorer).__name__}")
        self.max_seeds = check_int(max_seeds, "max_seeds", 1, 1 << 20)
        self.max_steps = check_int(max_steps, "max_steps", 1, 100_000)
        self.steps = check_int(steps, "steps", 1, self.max_steps)
        self.kept = check_int(kept, "kept", 1, self.max_seeds)
        if selection not in SELECTION_MODES:
            raise ValueError(f"selection must be one of {SELECTION_MODES}, got {selection!r}")
        self.micro_batch = check_int(micro_batch, "micro_batch", 1, 1 << 16)
        if not version_wait_s >= 0:
            raise ValueError(f"version_wait_s must be >= 0, got {version_wait_s!r}")
        self.model, self.scorer, self.selection = model, scorer, selection
        self.model_name = model_name or model.spec.name
        self.sampler = resolve_sampler(default_sampler(model), *(
            (sampler.solver, sampler.shift, sampler.guidance) if sampler is not None else ()))
        self.version_wait_s = float(version_wait_s)
        self.hot = HotSwapModel(model.transformer, lora, serving_precision(precision, model.spec))
        self.cache = PromptCache(model)
        self._closed = False

    # ------------------------------------------------------------------ lifecycle and metadata

    def ready(self) -> bool:
        return not self._closed

    def info(self) -> dict[str, Any]:
        cur = self.hot.current()
        return {"service": "explorer", "version": solrl.__version__, "model": self.model_name,
                "precision": self.hot.backend, "adapter_version": cur.version, "adapter_sha256": cur.sha256,
                "resident_weight_bytes": self.hot.weight_bytes()["total"],
                "reward": getattr(self.scorer, "name", type(self.scorer).__name__),
                "defaults": {"steps": self.steps, "kept": self.kept, "selection": self.selection,
                             "solver": self.sampler.solver, "shift": self.sampler.shift,
                             "guidance": self.sampler.guidance},
                "ready": self.ready()}

    def close(self) -> None:
        self._closed = True
        close = getattr(self.scorer, "close", None)
        if callable(close):
            close()

    # ------------------------------------------------------------------ exploring

    def explore(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]] | None = None, *,
                n: int | None = None, steps: int | None = None, kept: int | None = None,
                selection: str | None = None, sampler: SamplerSpec | None = None, min_version: int = 0,
                fields: Mapping[str, str] = FIELDS) -> ExploreOutcome:
        """Sample each prompt's seed pool (given, or `n` fresh random seeds), score, keep `kept` per prompt.

        Errors name the request field (`fields` maps argument names to the caller's field names).
        """
        f = {**FIELDS, **fields}
        prompts = check_prompts(self.cache, prompts, f["prompts"])
        if seeds is None:
            if n is None:
                raise ValueError(f"{f['n']}: give a seed count or {f['seeds']}")
            pool_size = check_int(n, f["n"], 1, self.max_seeds)
        else:
            if n is not None:
                raise ValueError(f"{f['n']}: give either {f['seeds']} or a seed count, not both")
            if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence) or len(seeds) != len(prompts):
                raise ValueError(f"{f['seeds']} must hold one seed pool per prompt ({len(prompts)})")
            pools = [check_seeds(pool, f["seeds"] if len(seeds) == 1 else f"{f['seeds']}[{i}]", self.max_seeds)
                     for i, pool in enumerate(seeds)]
            if len({len(p) for p in pools}) > 1:
                raise ValueError(f"{f['seeds']}: every prompt's pool must have the same size")
            pool_size = len(pools[0])
        if len(prompts) * pool_size > self.max_seeds:
            raise ValueError(f"{f['n'] if seeds is None else f['seeds']}: {len(prompts)} prompts x {pool_size} seeds "
                             f"is over the limit of {self.max_seeds} samples per call")
        if seeds is None:  # fresh entropy: the seeds travel back in the result
            pools = np.random.default_rng().integers(0, SEED_LIMIT, size=(len(prompts), pool_size),
                                                     dtype=np.int64).tolist()
        steps = self.steps if steps is None else check_int(steps, f["steps"], 1, self.max_steps)
        selection = self.selection if selection is None else selection
        if selection not in SELECTION_MODES:
            raise ValueError(f"{f['selection']} must be one of {SELECTION_MODES}, got {selection!r}")
        if kept is None:  # the default, capped at the pool (and even for best_worst)
            k = min(self.kept, pool_size)
            k -= k % 2 if selection == "best_worst" and k > 1 else 0
        else:
            k = check_int(kept, f["kept"], 1, pool_size)
        if selection == "best_worst" and k % 2:
            raise ValueError(f"{f['kept']} must be even for best_worst selection, got {k}")
        min_version = check_int(min_version, f["min_version"], 0, 2**63 - 1)
        sampler = self.sampler if sampler is None else sampler
        serving = self.hot.acquire(min_version, self.version_wait_s)  # this call's copy, whatever is pushed later
        result = explore(self.model, serving.module, prompts, pools, steps, sampler, self.scorer, k, selection,
                         selection_generator(pools), self.micro_batch, self.cache)
        return ExploreOutcome(result.seeds, np.asarray(result.scores, dtype=np.float32), result.kept,
                              serving.version, serving.sha256, result.forwards)

    # ------------------------------------------------------------------ the KServe v2 model "explore"

    @property
    def models(self) -> list[str]:
        return [MODEL_NAME]

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == MODEL_NAME and version in ("", MODEL_VERSION) and self.ready()

    def resolve(self, name: str, version: str = "", *, field: str = "model_name") -> str:
        if name != MODEL_NAME:
            raise NotFoundError(f"{field}: unknown model {name!r}; serving {self.models}")
        if version not in ("", MODEL_VERSION):
            raise NotFoundError(f"model_version: model {name!r} has no version {version!r}; "
                                f"versions: [{MODEL_VERSION!r}]")
        return name

    def metadata(self, name: str, version: str = "") -> ModelMetadata:
        return ModelMetadata(self.resolve(name, version), (MODEL_VERSION,), PLATFORM, INPUTS, OUTPUTS)

    def infer(self, name: str, inputs: Mapping[str, np.ndarray], version: str = "",
              outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """PROMPTS [P], N [1], STEPS [1], optional K [1] -> SEEDS [P, n], SCORES [P, n], KEPT [P, k],
        ADAPTER_VERSION [1]."""
        self.resolve(name, version)
        specs = {s.name: s for s in INPUTS}
        for key in inputs:
            if key not in specs:
                raise ValueError(f"{key}: unknown input; model {name!r} takes {sorted(specs)}")
        for spec in INPUTS:
            if spec.name not in inputs and spec.name not in OPTIONAL_INPUTS:
                raise ValueError(f"{spec.name}: missing input")
        for key in outputs:
            if key not in {s.name for s in OUTPUTS}:
                raise ValueError(f"outputs: unknown output {key!r}; model {name!r} has {[s.name for s in OUTPUTS]}")
        raw_prompts = inputs[PROMPTS.name]
        if raw_prompts.dtype != object or raw_prompts.ndim != 1:
            raise ValueError(f"{PROMPTS.name}: expected BYTES [-1], got {raw_prompts.dtype} {list(raw_prompts.shape)}")
        prompts = []
        for i, p in enumerate(raw_prompts):
            try:
                prompts.append(p.decode("utf-8") if isinstance(p, bytes) else str(p))
            except UnicodeDecodeError:
                raise ValueError(f"{PROMPTS.name}[{i}]: not valid UTF-8") from None
        scalars = {spec.name: _scalar(inputs[spec.name], spec) for spec in (N, STEPS, K) if spec.name in inputs}
        out = self.explore(prompts, n=scalars[N.name], steps=scalars[STEPS.name], kept=scalars.get(K.name),
                           fields=KSERVE_FIELDS)
        result = {SEEDS.name: np.asarray(out.seeds, dtype=np.int64),
                  SCORES.name: out.scores.astype(np.float32),
                  KEPT.name: np.asarray(out.kept, dtype=np.int32),
                  ADAPTER_VERSION.name: np.asarray([out.version], dtype=np.int64)}
        return {k: v for k, v in result.items() if not outputs or k in outputs}


def _scalar(array: np.ndarray, spec: TensorSpec) -> int:
    if array.dtype != np.int32 or array.shape != (1,):
        raise ValueError(f"{spec.name}: expected {spec.datatype} {list(spec.shape)}, "
                         f"got {array.dtype} {list(array.shape)}")
    return int(array[0])
