"""Adapter hot reload for the inference services (explorer, regenerator): build aside, swap atomically.

HotSwapModel     the serving copy of one denoiser: a plain base model, a precision backend and the
                 adapter version it serves. A pushed LoRA is built into a NEW copy, and only then is
                 the reference swapped under a lock. Quantizing backends (the explorer's nvfp4 /
                 mxfp4 / fp8) merge it into the base weights (W + s*B@A, without peft) and
                 re-quantize; the reference backends (bf16 / fp32: the regenerator) keep it unmerged
                 as peft LoRA layers in fp32 beside the rounded base, so they compute exactly what
                 the trainer's peft model computes (merging into bf16 weights would round away the
                 small updates RL makes). A call takes the current copy
                 once, at its start (`acquire`), and finishes on it whatever is pushed meanwhile; the
                 old copy is freed when its last call ends. A rejected push changes nothing.
                 `use(precision)` switches the backend (the adaptive proxy: the trainer names the
                 proxy in each ExploreJob): the served adapter version is rebuilt through the new
                 backend, and every later push is built with it.
AdapterEndpoint  the front door shared by `PUT /v1/adapter` on the ops app and the LoadAdapter RPCs:
                 bearer token (env SOLRL_ADAPTER_TOKEN, hmac.compare_digest), size limit, sha256,
                 version order (a re-push of the served version with the same sha256 is
                 accepted as a no-op). REJECTIONS is the one table of refusal -> HTTP status / gRPC code.
"""

from __future__ import annotations

import copy
import hmac
import logging
import threading
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from peft.functional import cast_adapter_dtype, inject_adapter_in_model
from prometheus_client import Counter, Gauge
from starlette.concurrency import run_in_threadpool
from torch import Tensor, nn

from services.common.args import DEFAULT_MAX_ADAPTER_BYTES
from services.common.auth import bearer_token
from services.common.bodies import read_body
from services.common.env import ENV_ADAPTER_TOKEN
from services.common.errors import BodyTimeoutError, TooLargeError, UnavailableError
from services.common.metrics import ServiceMetrics
from solrl.adapters import LoraSpec, decode_adapter, sha256_hex
from solrl.adapters.lora import PREFIX, check_state
from solrl.adapters.merge import lora_layout, merge_lora, target_weights
from solrl.models.base import ModelSpec
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.base import with_model_skips

log = logging.getLogger(__name__)

VERSION_HEADER = "X-Adapter-Version"
SHA256_HEADER = "X-Adapter-Sha256"

# reason -> (HTTP status, gRPC status code)
REJECTIONS: dict[str, tuple[int, grpc.StatusCode]] = {
    "invalid": (400, grpc.StatusCode.INVALID_ARGUMENT),        # bad bytes, keys, shapes, sha256, headers
    "unauthenticated": (401, grpc.StatusCode.UNAUTHENTICATED),  # no or wrong bearer token
    "disabled": (403, grpc.StatusCode.PERMISSION_DENIED),       # no token configured on the server
    "stale": (409, grpc.StatusCode.FAILED_PRECONDITION),        # version <= the one served
    "too_large": (413, grpc.StatusCode.RESOURCE_EXHAUSTED),     # over the size limit
}


class AdapterRejected(Exception):
    """A refused adapter push; `reason` is a key of REJECTIONS."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REJECTIONS:
            raise ValueError(f"reason must be one of {sorted(REJECTIONS)}, got {reason!r}")
        super().__init__(message)
        self.reason = reason

    @property
    def http_status(self) -> int:
        return REJECTIONS[self.reason][0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return REJECTIONS[self.reason][1]


@dataclass(frozen=True)
class ServingCopy:
    """One immutable serving copy: never modified after it is published."""

    module: nn.Module
    version: int
    sha256: str  # of the adapter's safetensors bytes; "" for the base model (version 0)
    precision: PrecisionConfig | None = None  # the backend config the copy was built with
    label: str = ""                           # its name: "BACKEND" or "BACKEND/POLICY"


@dataclass(frozen=True)
class LoadResult:
    version: int
    sha256: str
    swap_ms: float          # build (merge + re-quantize, or LoRA layers) + swap
    previous_version: int


def serving_precision(precision: PrecisionConfig, spec: ModelSpec) -> PrecisionConfig:
    """`precision` plus the model's own skip list and minimum layer size (as `InferenceCopy` combines them)."""
    if not isinstance(precision, PrecisionConfig):
        raise TypeError(f"precision must be a PrecisionConfig, got {type(precision).__name__}")
    return with_model_skips(precision, spec.quant_skip, spec.quant_min_features)


class HotSwapModel:
    """A denoiser served at one adapter version at a time, hot-reloadable.

    Holds `base` (a plain, peft-free model, put in eval mode without grad; its weights are never
    modified) and the current serving copy (base with the adapter, put through the precision
    backend), so base + serving copy are resident, plus the new copy while a push builds it and any
    old copy a call still runs on (unmerged: those copies share the serving base's weights and add
    only their LoRA). Version 0 is the base model. `merges` says how an adapter is
    applied: merged and re-quantized (quantizing backends) or as unmerged LoRA layers (bf16 / fp32).
    """

    ADAPTER = "served"   # the peft adapter name of an unmerged LoRA

    def __init__(self, base: nn.Module, lora: LoraSpec | None, precision: PrecisionConfig) -> None:
        if not isinstance(base, nn.Module):
            raise TypeError(f"base must be an nn.Module, got {type(base).__name__}")
        if lora is not None and not isinstance(lora, LoraSpec):
            raise TypeError(f"lora must be a LoraSpec or None, got {type(lora).__name__}")
        # lora: a pinned layout every push must have, or None: each push brings its own (rank, alpha and
        # targets from the adapter's metadata), so a worker never serves its own flags' guess of the
        # trainer's LoRA
        self.lora, self.precision = lora, precision
        self._base = base.eval().requires_grad_(False)
        self._layouts: dict[LoraSpec, tuple[dict[str, tuple[int, ...]], dict[str, Tensor]]] = {}
        if lora is not None:
            self._layout_for(lora)  # a pinned spec that matches no layer fails at start-up
        self.fetcher: AdapterFetcher | None = None  # pulls the current adapter when a call needs a newer one
        self._cond = threading.Condition()   # guards _current; notified on every swap
        self._load_lock = threading.Lock()   # one build (push or precision switch) at a time
        self._adapter: tuple[Mapping[str, Tensor], LoraSpec] | None = None  # the served LoRA (None: the base)
        self._set_backend(precision, precision.backend)
        self._current = ServingCopy(self._module_for(None), 0, "", precision, self.label)

    def _set_backend(self, precision: PrecisionConfig, label: str) -> None:
        self.precision, self.label = precision, label
        self._backend = build_backend(precision)
        self.merges = self._backend.quantizes
        if not self.merges:
            # the base through the backend, once: version 0, and the tensors every LoRA version shares
            self._serving_base = self._backend.prepare(copy.deepcopy(self._base))

    def _module_for(self, adapter: tuple[Mapping[str, Tensor], LoraSpec] | None) -> nn.Module:
        """A serving copy of the base with `adapter` (None: the base alone) through the current backend."""
        if adapter is None:
            return self._build({}) if self.merges else self._serving_base
        state, spec = adapter
        if self.merges:
            return self._build(merge_lora(self._layout_for(spec)[1], state, spec))
        return self._build_unmerged(state, spec)

    def use(self, precision: PrecisionConfig, label: str | None = None) -> float:
        """Serve `precision` from now on (a no-op if served already): the current adapter version is rebuilt
        through its backend and swapped in; calls in flight finish on their copy. Returns the build's ms.
        A backend that cannot be built here raises and leaves the served copy as it was."""
        with self._load_lock:
            if precision == self.precision:
                return 0.0
            t0 = time.perf_counter()
            before = (self.precision, self.label, self._backend, self.merges, getattr(self, "_serving_base", None))
            try:
                self._set_backend(precision, label or precision.backend)
                module = self._module_for(self._adapter)
            except Exception:
                self.precision, self.label, self._backend, self.merges, self._serving_base = before
                raise
            with self._cond:
                cur = self._current
                self._current = ServingCopy(module, cur.version, cur.sha256, precision, self.label)
                self._cond.notify_all()
            ms = (time.perf_counter() - t0) * 1000.0
        log.info("now serving %s (adapter version %d rebuilt in %.1f ms)", self.label, cur.version, ms)
        return ms

    def _layout_for(self, spec: LoraSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, Tensor]]:
        """(adapter key -> shape, target name -> base weight) of `spec` on this base (cached per spec)."""
        if spec not in self._layouts:
            self._layouts[spec] = (lora_layout(self._base, spec), target_weights(self._base, spec))
        return self._layouts[spec]

    def _build_unmerged(self, state: Mapping[str, Tensor], spec: LoraSpec) -> nn.Module:
        """A new serving copy: the prepared base plus `state` as peft LoRA layers (fp32, the trainer's own
        layer type and order of operations: base(x) + s * B(A(x))). Only the module tree is copied: every
        version shares the prepared base's parameters and buffers (never modified), so a push allocates
        just the LoRA weights."""
        shared = {id(t): t for t in (*self._serving_base.parameters(), *self._serving_base.buffers())}
        module = copy.deepcopy(self._serving_base, shared)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(spec.lora_config(), module, adapter_name=self.ADAPTER)
        cast_adapter_dtype(module, self.ADAPTER)   # fp32 LoRA on a bf16 base, as the trainer's
        with torch.no_grad():
            for name in self._layout_for(spec)[1]:
                layer = module.get_submodule(name)
                for part in ("lora_A", "lora_B"):
                    weight = getattr(layer, part)[self.ADAPTER].weight
                    weight.copy_(state[f"{PREFIX}.{name}.{part}.weight"].to(weight.device, weight.dtype))
        return module.eval().requires_grad_(False)

    def _build(self, merged: Mapping[str, Tensor]) -> nn.Module:
        """A new serving copy: the base with `merged` as its LoRA targets' weights, through the backend."""
        module = copy.deepcopy(self._base)
        for name, weight in merged.items():
            linear = module.get_submodule(name)
            # replaced (not copied into) so the backend quantizes from the fp32 merge, whatever the
            # base dtype: the same numbers InferenceCopy.sync (prepare, then requantize) gives
            linear.weight = nn.Parameter(weight.to(linear.weight.device), requires_grad=False)
        self._backend.prepare(module)
        return module

    @property
    def backend(self) -> str:
        return self.precision.backend

    def current(self) -> ServingCopy:
        with self._cond:
            return self._current

    def acquire(self, min_version: int = 0, timeout: float = 0.0,
                precision: PrecisionConfig | None = None) -> ServingCopy:
        """The copy a call runs on: the current one, once its version is >= min_version (waits up to
        `timeout` seconds for a push; UnavailableError after that). With a `fetcher`, a call that needs a
        newer version than served first fetches the current adapter itself (a missed push). `precision`: the
        one the caller switched to (`use`); a concurrent call that switched to another one in between gives
        UnavailableError (retry)."""
        if self.fetcher is not None and self.current().version < min_version:
            self.fetcher.fetch()
        with self._cond:
            if not self._cond.wait_for(lambda: self._current.version >= min_version, timeout):
                raise UnavailableError(f"serving adapter version {self._current.version}, the request needs "
                                       f">= {min_version}; push that version or retry later")
            if precision is not None and self._current.precision != precision:
                raise UnavailableError(f"a concurrent request switched this explorer to {self._current.label}; "
                                       f"retry")
            return self._current

    def weight_bytes(self) -> dict[str, int]:
        """Resident weight bytes of the current copy (the backend's accounting)."""
        return self._backend.weight_bytes(self.current().module)

    def load(self, data: bytes, *, version: int, sha256: str, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES) -> LoadResult:
        """Validate, merge, re-quantize and swap in an adapter; AdapterRejected says why not."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > max_bytes:
            raise AdapterRejected("too_large", f"adapter is {len(data)} bytes, over the limit of {max_bytes}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise AdapterRejected("invalid", f"version must be an integer >= 1, got {version!r}")
        if not isinstance(sha256, str) or not sha256:
            raise AdapterRejected("invalid", "sha256 is required (hex sha256 of the safetensors bytes)")
        actual = sha256_hex(data)
        if not hmac.compare_digest(sha256.strip().lower().encode(), actual.encode()):
            raise AdapterRejected("invalid", f"sha256 mismatch: given {sha256.strip()!r}, the bytes hash to {actual}")
        with self._load_lock:
            previous = self.current()
            if version == previous.version and hmac.compare_digest(previous.sha256.encode(), actual.encode()):
                # the very adapter being served, pushed again (a trainer resumed from its checkpoint
                # re-pushes the version it pushed before it died): nothing to do
                log.info("adapter version %d (sha256 %s) is already served", version, actual[:12])
                return LoadResult(version, actual, 0.0, previous.version)
            if version <= previous.version:
                raise AdapterRejected("stale", f"version {version} is not newer than the served version "
                                               f"{previous.version}")
            try:
                payload = decode_adapter(data, None, max_bytes)
            except ValueError as exc:
                raise AdapterRejected("invalid", f"adapter: {exc}") from None
            if payload.version != version:
                raise AdapterRejected("invalid", f"version {version} disagrees with the adapter's own "
                                                 f"metadata version {payload.version}")
            spec = payload.spec
            pinned = self.lora
            if pinned is not None and (spec.rank, spec.alpha, spec.target_modules) != \
                    (pinned.rank, pinned.alpha, pinned.target_modules):
                raise AdapterRejected("invalid", f"adapter LoRA rank/alpha/targets {spec.rank}/{spec.alpha}/"
                                                 f"{list(spec.target_modules)} differ from the LoRA this server was "
                                                 f"started with, {pinned.rank}/{pinned.alpha}/"
                                                 f"{list(pinned.target_modules)}")
            try:
                layout = self._layout_for(spec)[0]
                check_state(payload.state, layout, "adapter")
            except (TypeError, ValueError) as exc:
                raise AdapterRejected("invalid", f"adapter does not fit this model: {exc}") from None
            t0 = time.perf_counter()
            module = self._module_for((payload.state, spec))
            with self._cond:
                self._current = ServingCopy(module, version, actual, self.precision, self.label)
                self._cond.notify_all()
            self._adapter = (payload.state, spec)
            swap_ms = (time.perf_counter() - t0) * 1000.0
        log.info("adapter version %d (sha256 %s) swapped in after %.1f ms", version, actual[:12], swap_ms)
        return LoadResult(version, actual, swap_ms, previous.version)


class AdapterFetcher:
    """Pulls the run's current adapter from the trainer's GET /v1/adapter/current and loads it through
    `HotSwapModel.load` (the same checks as a push). Used at start-up, so a rollout service that starts
    or restarts mid-run serves the current adapter before it takes jobs, and when a call needs a newer
    version than was pushed here. Failures are logged, never raised: pushes still work without it."""

    def __init__(self, trainer_url: str, token: str | None, model: HotSwapModel, timeout_s: float = 30.0) -> None:
        parsed = urllib.parse.urlsplit(trainer_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"--trainer-url must be http(s)://host:port, got {trainer_url!r}")
        self.url = trainer_url.rstrip("/") + "/v1/adapter/current"
        self.token, self.model, self.timeout_s = token, model, float(timeout_s)
        self._lock = threading.Lock()

    def fetch(self) -> int | None:
        """Load the trainer's current adapter if it is newer; the version served afterwards, or None when
        the trainer could not be asked or has pushed nothing yet."""
        with self._lock:   # concurrent calls needing a newer version share one fetch
            request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token or ''}"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    if response.status == 204:
                        return None
                    data = response.read(DEFAULT_MAX_ADAPTER_BYTES + 1)
                    version = int(response.headers.get(VERSION_HEADER, "0"))
                    sha256 = response.headers.get(SHA256_HEADER, "")
            except (OSError, ValueError) as exc:   # URLError and HTTPError are OSErrors
                log.warning("could not fetch the current adapter from %s: %s", self.url, exc)
                return None
            if version <= self.model.current().version:
                return self.model.current().version
            try:
                result = self.model.load(data, version=version, sha256=sha256)
            except AdapterRejected as exc:
                log.warning("adapter version %d fetched from %s refused (%s): %s", version, self.url, exc.reason, exc)
                return None
            log.info("fetched adapter version %d from %s", result.version, self.url)
            return result.version


class AdapterEndpoint:
    """Hot reload over HTTP (`mount`) and gRPC (`grpc_load`), with one auth and error policy.

    token=None (or "") disables loading: every push is refused with 403 / PERMISSION_DENIED.
    """

    def __init__(self, model: HotSwapModel, *, token: str | None, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES,
                 metrics: ServiceMetrics | None = None) -> None:
        if not isinstance(model, HotSwapModel):
            raise TypeError(f"model must be a HotSwapModel, got {type(model).__name__}")
        if token is not None and not isinstance(token, str):
            raise TypeError("token must be a str or None")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.model, self.max_bytes = model, max_bytes
        self._token = token.encode() if token else None
        self._loads: Counter | None = None
        if metrics is not None:
            Gauge("solrl_adapter_version", "Adapter version being served", ["service"],
                  registry=metrics.registry).labels(metrics.service).set_function(lambda: model.current().version)
            self._loads = Counter("solrl_adapter_loads", "Adapter pushes, by outcome", ["service", "outcome"],
                                  registry=metrics.registry)
            self._service = metrics.service

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def status(self) -> dict[str, Any]:
        cur = self.model.current()
        return {"version": cur.version, "sha256": cur.sha256}

    def authorize(self, token: str | None) -> None:
        if self._token is None:
            raise AdapterRejected("disabled", f"adapter loading is disabled: the server has no token "
                                              f"(set {ENV_ADAPTER_TOKEN} where it starts)")
        if token is None:
            raise AdapterRejected("unauthenticated", "missing bearer token (Authorization: Bearer <token>)")
        if not hmac.compare_digest(token.encode(), self._token):
            raise AdapterRejected("unauthenticated", "invalid bearer token")

    def _count(self, outcome: str) -> None:
        if self._loads is not None:
            self._loads.labels(self._service, outcome).inc()

    def load(self, authorization: str | None, data: bytes, version: int, sha256: str) -> LoadResult:
        """Authorize (the raw Authorization value) then HotSwapModel.load; outcomes are counted."""
        try:
            self.authorize(bearer_token(authorization))
            result = self.model.load(data, version=version, sha256=sha256, max_bytes=self.max_bytes)
        except AdapterRejected as exc:
            self._count(exc.reason)
            log.info("adapter push refused (%s): %s", exc.reason, exc)
            raise
        self._count("ok")
        return result

    def grpc_load(self, context: grpc.ServicerContext, data: bytes, version: int, sha256: str) -> LoadResult:
        """For a LoadAdapter RPC: token from the 'authorization' metadata; refusals abort with their code."""
        metadata: Sequence[tuple[str, Any]] = context.invocation_metadata() or ()
        authorization = next((v for k, v in metadata if k.lower() == "authorization"), None)
        try:
            return self.load(authorization if isinstance(authorization, str) else None, data, version, sha256)
        except AdapterRejected as exc:
            context.abort(exc.grpc_code, str(exc))  # raises
            raise

    def mount(self, app: FastAPI) -> None:
        """PUT /v1/adapter (safetensors body) and GET /v1/adapter on `app`."""

        @app.exception_handler(AdapterRejected)
        async def rejected(request: Request, exc: AdapterRejected) -> JSONResponse:
            headers = {"WWW-Authenticate": "Bearer"} if exc.http_status == 401 else None
            return JSONResponse({"error": exc.reason, "detail": str(exc), **self.status()},
                                status_code=exc.http_status, headers=headers)

        @app.get("/v1/adapter")
        def adapter_status() -> dict[str, Any]:
            return self.status()

        @app.put("/v1/adapter", openapi_extra=_PUT_ADAPTER_OPENAPI,
                 responses={REJECTIONS[r][0]: {"description": r} for r in REJECTIONS})
        async def put_adapter(request: Request) -> dict[str, Any]:
            authorization = request.headers.get("authorization")
            try:
                self.authorize(bearer_token(authorization))  # before reading a byte of the body
                data = await self._read_body(request)
                version = _header_int(request.headers.get(VERSION_HEADER), VERSION_HEADER)
                sha256 = request.headers.get(SHA256_HEADER)
                if not sha256:
                    raise AdapterRejected("invalid", f"{SHA256_HEADER} header is required")
            except AdapterRejected as exc:
                self._count(exc.reason)
                raise
            result = await run_in_threadpool(self.load, authorization, data, version, sha256)
            return {"version": result.version, "sha256": result.sha256, "swap_ms": round(result.swap_ms, 3),
                    "previous_version": result.previous_version}

    async def _read_body(self, request: Request) -> bytes:
        try:
            return await read_body(request, self.max_bytes, what="adapter body")
        except TooLargeError as exc:
            raise AdapterRejected("too_large", str(exc)) from None
        except BodyTimeoutError as exc:
            raise AdapterRejected("invalid", str(exc)) from None


# The PUT route reads its headers and raw body itself (to refuse before reading the body); this
# describes them in the ops app's OpenAPI document, which clients and the fuzz tests read.
_PUT_ADAPTER_OPENAPI: dict[str, Any] = {
    "parameters": [
        {"name": "Authorization", "in": "header", "required": True, "schema": {"type": "string"},
         "description": f"Bearer <token> ({ENV_ADAPTER_TOKEN})"},
        {"name": VERSION_HEADER, "in": "header", "required": True, "schema": {"type": "integer", "minimum": 1}},
        {"name": SHA256_HEADER, "in": "header", "required": True,
         "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
    ],
    "requestBody": {"required": True, "description": "the adapter as safetensors bytes (never pickle)",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
}


def _header_int(value: str | None, name: str) -> int:
    if value is None or not value.strip():
        raise AdapterRejected("invalid", f"{name} header is required")
    try:
        return int(value.strip())
    except ValueError:
        raise AdapterRejected("invalid", f"{name} header must be an integer, got {value!r}") from None
