"""The explorer's logic, free of any transport (the KServe `DataPlane` pattern).

A low-precision (e.g. NVFP4-emulated) copy of the denoiser samples a pool of seeds per prompt at few
steps, a scorer gives each image a proxy reward and `k` seeds are selected. Sampling, scoring and
selection are the core `solrl.rollout.passes.explore`; this class adds input checks (errors name the request
field), the hot-reloadable serving copy (every result names the adapter version it was sampled with)
and the KServe v2 model `explore`. Also here, for both rollout services: the scorer choice (the
in-process registry or a remote reward service) and the sampler defaults.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.errors import NotFoundError
from services.kserve.tensors import MODEL_VERSION, PLATFORM, ModelMetadata, TensorSpec
from services.rollout.plane import (  # noqa: F401 (re-exported for callers of this module)
    ENV_REWARD_ADDR,
    ODE_SOLVERS,
    RemoteScorer,
    RolloutPlane,
    build_scorer,
    check_int,
    check_prompts,
    check_seeds,
    default_sampler,
    resolve_sampler,
)
from solrl.adapters import LoraSpec
from solrl.algo.guards import gate_check
from solrl.algo.selection import SELECTION_MODES
from solrl.models.base import T2IModel
from solrl.precision import PrecisionConfig
from solrl.rewards import Scorer
from solrl.rollout.passes import SamplerSpec, explore
from solrl.sampling.noise import SEED_LIMIT

MODEL_NAME = "explore"
PROMPTS = TensorSpec("PROMPTS", "BYTES", (-1,))
N = TensorSpec("N", "INT32", (1,))
STEPS = TensorSpec("STEPS", "INT32", (1,))
K = TensorSpec("K", "INT32", (1,))
SEEDS = TensorSpec("SEEDS", "INT64", (-1, -1))
SCORES = TensorSpec("SCORES", "FP32", (-1, -1))
KEPT = TensorSpec("KEPT", "INT32", (-1, -1))
GATE = TensorSpec("GATE", "BYTES", (1,))   # the validity gate's name (guard.gate), "" or absent: none
ADAPTER_VERSION = TensorSpec("ADAPTER_VERSION", "INT64", (1,))
INPUTS = (PROMPTS, N, STEPS, K, GATE)
OPTIONAL_INPUTS = frozenset({K.name, GATE.name})
OUTPUTS = (SEEDS, SCORES, KEPT, ADAPTER_VERSION)

# names of explore()'s arguments in error messages, by default and for the KServe model
FIELDS = {"prompts": "prompts", "seeds": "seeds", "n": "n", "steps": "steps", "kept": "kept",
          "selection": "selection", "min_version": "min_version", "precision": "precision",
          "policy": "precision_policy", "gate": "gate"}
KSERVE_FIELDS = {**FIELDS, "prompts": PROMPTS.name, "n": N.name, "steps": STEPS.name, "kept": K.name,
                 "gate": GATE.name}
# ... and for an ExploreJob (the Explore RPC and the queue's explore stream)
JOB_FIELDS = {"prompts": "job.prompt", "seeds": "job.seeds", "n": "n", "steps": "job.steps", "kept": "job.kept",
              "selection": "job.selection", "min_version": "job.min_adapter_version", "precision": "job.precision",
              "policy": "job.precision_policy", "gate": "job.gate"}


# ---------------------------------------------------------------------- the explorer

@dataclass(frozen=True)
class ExploreOutcome:
    seeds: list[list[int]]   # [P][n]
    scores: np.ndarray       # float32 [P, n] proxy rewards
    kept: list[list[int]]    # [P][k] indices into seeds[p]
    version: int             # adapter version sampled with
    sha256: str
    forwards: int
    proxy: str = ""          # the precision sampled with: "BACKEND" or "BACKEND/POLICY"
    gate: str = ""           # the validity gate the ranking applied ("" none)
    gate_failed: int = 0     # candidates that failed it


def selection_generator(seeds: list[list[int]]) -> torch.Generator:
    """A generator for the random selection modes, seeded by the seed pools: a job selects the same
    seeds on any replica."""
    state = np.random.SeedSequence([s for pool in seeds for s in pool]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> 1))


class ExplorerDataPlane(RolloutPlane):
    SWITCHES_PRECISION = True
    SERVICE = "explorer"

    """Explore over a hot-reloadable low-precision copy of `model.transformer`.

    `model.transformer` is served in place (the plane takes it over; HotSwapModel); `precision`
    is combined with the model's quantization skip list; `lora` pins the layout pushed adapters must
    have (None: each adapter's own metadata). Defaults for requests that leave them out: `steps`, `kept`, `selection`, `sampler`.
    A request for a newer adapter version than served waits up to `version_wait_s`.
    """

    def __init__(self, model: T2IModel, precision: PrecisionConfig, lora: LoraSpec | None, scorer: Scorer, *,
                 model_name: str = "", steps: int = 6, kept: int = 24, selection: str = "best_worst",
                 sampler: SamplerSpec | None = None, micro_batch: int = 64, max_seeds: int = 4096,
                 max_steps: int = 1000, version_wait_s: float = 30.0) -> None:
        super().__init__(model, precision, lora, scorer, model_name=model_name, steps=steps, sampler=sampler,
                         micro_batch=micro_batch, max_seeds=max_seeds, max_steps=max_steps,
                         version_wait_s=version_wait_s)
        self.kept = check_int(kept, "kept", 1, self.max_seeds)
        if selection not in SELECTION_MODES:
            raise ValueError(f"selection must be one of {SELECTION_MODES}, got {selection!r}")
        self.selection = selection
        # one model call at a time on a backend whose kernels keep process-global state (Transformer Engine's
        # autocast recipe and scaling state): concurrent RPCs and queue jobs take turns on the device
        self.device_lock = threading.Lock()

    def serialised(self) -> bool:
        """Whether the backend served now keeps process-global state (its calls then hold `device_lock`)."""
        return self.hot.global_state

    def defaults(self) -> dict[str, Any]:
        return {**super().defaults(), "kept": self.kept, "selection": self.selection}

    def info(self) -> dict[str, Any]:
        return {**super().info(), "proxy": self.hot.current().label}

    def proxy_precision(self, backend: str, policy: str = "", fields: Mapping[str, str] = FIELDS
                        ) -> tuple[PrecisionConfig, str]:
        """The serving precision of a requested proxy (backend + per-layer policy, the model's own skips
        included) and its label; errors name the request field."""
        from solrl.precision.policy import policy_config
        from solrl.rollout.candidates import ProxyPartError, check_proxy_parts, proxy_label

        f = {**FIELDS, **fields}
        try:
            policy = check_proxy_parts(backend, policy)
        except ProxyPartError as exc:
            raise ValueError(f"{f['precision'] if exc.part == 'format' else f['policy']}: {exc}") from None
        return policy_config(backend, policy, self.model.spec), proxy_label(backend, policy)

    # ------------------------------------------------------------------ exploring

    def explore(self, prompts: Sequence[str], seeds: Sequence[Sequence[int]] | None = None, *,
                n: int | None = None, steps: int | None = None, kept: int | None = None,
                selection: str | None = None, sampler: SamplerSpec | None = None, min_version: int = 0,
                precision: str = "", policy: str = "", gate: str = "",
                fields: Mapping[str, str] = FIELDS) -> ExploreOutcome:
        """Sample each prompt's seed pool (given, or `n` fresh random seeds), score, keep `kept` per prompt.

        `precision` (and its per-layer `policy`): the proxy to sample with (the adaptive proxy); the explorer
        switches to it and keeps serving it. Empty: whatever it serves now (its own until asked otherwise).
        `gate`: the validity gate (guard.gate, solrl.algo.guards): its failing candidates are ranked out of the kept best.
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
        valid = gate_check(gate, f["gate"])
        sampler = self.sampler if sampler is None else sampler
        wanted, label = self.proxy_precision(precision, policy, f) if precision else (None, None)
        if wanted is not None:
            try:
                self.hot.use(wanted, label)
            except (ImportError, RuntimeError) as exc:  # a backend this machine cannot run (e.g. TE without CUDA)
                raise ValueError(f"{f['precision']}: {precision!r} cannot run on this explorer: {exc}") from None
        # this call's version, held to its end (a push waits for it); the device taken in turn where the
        # backend's state is process-global
        with (self.hot.serving(min_version, self.version_wait_s, wanted) as serving,
              self.device_lock if self.serialised() else contextlib.nullcontext()):
            result = explore(self.model, serving.module, prompts, pools, steps, sampler, self.scorer, k, selection,
                             selection_generator(pools), self.micro_batch, self.cache, valid=valid)
        return ExploreOutcome(result.seeds, np.asarray(result.scores, dtype=np.float32), result.kept,
                              serving.version, serving.sha256, result.forwards, serving.label, gate, result.failed)

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
        """PROMPTS [P], N [1], STEPS [1], optional K [1] and GATE [1] -> SEEDS [P, n], SCORES [P, n], KEPT [P, k],
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
        prompts = [_text(p, f"{PROMPTS.name}[{i}]") for i, p in enumerate(raw_prompts)]
        gate = ""
        if GATE.name in inputs:
            raw_gate = inputs[GATE.name]
            if raw_gate.dtype != object or raw_gate.shape != (1,):
                raise ValueError(f"{GATE.name}: expected BYTES [1], got {raw_gate.dtype} {list(raw_gate.shape)}")
            gate = _text(raw_gate[0], GATE.name)
        scalars = {spec.name: _scalar(inputs[spec.name], spec) for spec in (N, STEPS, K) if spec.name in inputs}
        out = self.explore(prompts, n=scalars[N.name], steps=scalars[STEPS.name], kept=scalars.get(K.name),
                           gate=gate, fields=KSERVE_FIELDS)
        result = {SEEDS.name: np.asarray(out.seeds, dtype=np.int64),
                  SCORES.name: out.scores.astype(np.float32),
                  KEPT.name: np.asarray(out.kept, dtype=np.int32),
                  ADAPTER_VERSION.name: np.asarray([out.version], dtype=np.int64)}
        return {k: v for k, v in result.items() if not outputs or k in outputs}


def _text(value: Any, field: str) -> str:
    try:
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)
    except UnicodeDecodeError:
        raise ValueError(f"{field}: not valid UTF-8") from None


def _scalar(array: np.ndarray, spec: TensorSpec) -> int:
    if array.dtype != np.int32 or array.shape != (1,):
        raise ValueError(f"{spec.name}: expected {spec.datatype} {list(spec.shape)}, "
                         f"got {array.dtype} {list(array.shape)}")
    return int(array[0])
