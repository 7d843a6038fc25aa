"""The hot-swapped model of the rollout services (explorer, regenerator): one served copy, pushes applied in place.

HotSwapModel     the one served copy of a denoiser: a plain base put through a precision backend in place,
                 and the adapter version it serves. A push is merged into the served weights in place
                 (quantizing backends: merged from the LoRA targets' kept originals and re-quantized;
                 bf16 / fp32: loaded as unmerged peft LoRA layers), once no call holds the served version:
                 a call holds it from start to end (`serving`), so it finishes on the version it began
                 with, and calls arriving during a push wait for it. No second copy is ever built. A
                 rejected push changes nothing. `use(precision)` switches the backend (the adaptive proxy:
                 the trainer names the proxy in each ExploreJob): the model is rebuilt from its originals
                 through the new backend, and every later push is applied with it.
AdapterRejected  a refused push (size limit, sha256, version order: a re-push of the served version with the
                 same sha256 is accepted as a no-op; layout); REJECTIONS is the one table of refusal -> HTTP
                 status / gRPC code.

Its front door (PUT /v1/adapter, the LoadAdapter RPCs, the fetch from the trainer) is
services/rollout/adapter_endpoint.py.
"""

from __future__ import annotations

import copy
import dataclasses
import hmac
import logging
import math
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch
from peft.functional import cast_adapter_dtype, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from services.common.args import DEFAULT_MAX_ADAPTER_BYTES
from services.common.errors import UnavailableError
from solrl.adapters import LoraSpec, decode_adapter, sha256_hex
from solrl.adapters.lora import PREFIX, check_state
from solrl.adapters.merge import lora_layout, lora_targets, merge_lora
from solrl.models.base import ModelSpec
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.base import allow_tf32, replace_module, with_model_skips

log = logging.getLogger(__name__)

# reason -> (HTTP status, gRPC status code)
REJECTIONS: dict[str, tuple[int, grpc.StatusCode]] = {
    "invalid": (400, grpc.StatusCode.INVALID_ARGUMENT),        # bad bytes, keys, shapes, sha256, headers
    "unauthenticated": (401, grpc.StatusCode.UNAUTHENTICATED),  # no or wrong bearer token
    "disabled": (403, grpc.StatusCode.PERMISSION_DENIED),       # no token configured on the server
    "stale": (409, grpc.StatusCode.FAILED_PRECONDITION),        # version <= the one served
    "too_large": (413, grpc.StatusCode.RESOURCE_EXHAUSTED),     # over the size limit
    "busy": (503, grpc.StatusCode.RESOURCE_EXHAUSTED),          # the budget for requests in flight is full now
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


class Fetcher(Protocol):
    """What `HotSwapModel.fetcher` is: something that loads the run's current adapter into the model
    (services.rollout.adapter_endpoint.AdapterFetcher); returns the version served afterwards, or None."""

    def fetch(self) -> int | None: ...


@dataclass(frozen=True)
class ServingCopy:
    """The served model and the version it holds (its weights change only while no call holds it)."""

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
    """A denoiser served at one adapter version at a time, hot-reloadable, with ONE copy of the model.

    `base` (a plain, peft-free model) is taken over: it goes through the precision backend in place and is
    served. Kept beside it: the LoRA targets' original weights (their own dtype and device), which every push
    merges from, and a weightless skeleton of the plain model on the meta device (the LoRA layout of a
    pushed adapter). A push changes the served weights in place: quantizing backends (the explorer's nvfp4 /
    mxfp4 / fp8) merge the adapter into the targets (W + s*B@A in fp32 from the originals, without peft) and
    re-quantize those layers; the reference backends (bf16 / fp32: the regenerator) carry it unmerged as peft
    LoRA layers in fp32 beside the rounded base, so they compute exactly what the trainer's peft model
    computes (merging into bf16 weights would round away the small updates RL makes). Nothing of an old
    version stays resident: the bytes after ten pushes are the bytes after one.

    Consistency comes from a version gate, not a second copy: a call holds the served version (`serving`)
    from its start to its end; a push (or precision switch) waits until no call holds it, changes the
    weights, and calls arriving meanwhile wait for it to finish (so a stream of calls never starves a push).
    Every response names the one version it ran on. Version 0 is the base model. A rejected push changes
    nothing.

    `switchable`: `use(precision)` may switch the backend (the explorer's adaptive proxy: the trainer names
    the proxy in each ExploreJob). Rebuilding through another backend needs the weights the first one
    quantized or rounded, so a switchable model also keeps the base's other original tensors in host (CPU)
    memory; the device still holds one copy. `targets`: LoRA target patterns whose originals are kept when
    no layout is pinned (the model spec's targets); a push naming layers outside them is refused.
    """

    ADAPTER = "served"   # the peft adapter name of an unmerged LoRA
    UNPINNED_CAP_RANK = 64   # the rank the adapter cap allows when no layout is pinned (the presets train 32)
    CHUNK_BYTES = 256 << 20   # merged fp32 weights re-quantized together (the transient a push adds)

    def __init__(self, base: nn.Module, lora: LoraSpec | None, precision: PrecisionConfig, *,
                 targets: Sequence[str] = (), switchable: bool = False) -> None:
        if not isinstance(base, nn.Module):
            raise TypeError(f"base must be an nn.Module, got {type(base).__name__}")
        if lora is not None and not isinstance(lora, LoraSpec):
            raise TypeError(f"lora must be a LoraSpec or None, got {type(lora).__name__}")
        # lora: a pinned layout every push must have, or None: each push brings its own (rank, alpha and
        # targets from the adapter's metadata), so a worker never serves its own flags' guess of the
        # trainer's LoRA
        self.lora, self.switchable = lora, bool(switchable)
        base = base.eval().requires_grad_(False)
        self._device = next(iter(base.parameters()), torch.empty(0)).device
        allow_tf32(self._device)   # the FP32 LoRA layers of the regenerator, on tensor cores (CUDA only)
        self._skeleton = meta_skeleton(base)   # the plain model's structure, no storage
        self._layouts: dict[LoraSpec, dict[str, tuple[int, ...]]] = {}
        self._targets: dict[LoraSpec, tuple[str, ...]] = {}   # the layer names of each layout, in model order
        self._set_backend(precision, precision.backend)
        patterns = tuple(lora.target_modules) if lora is not None else tuple(targets)
        # merges start from them; an unmerged LoRA (the regenerator) needs none
        keep = patterns and (self.merges or self.switchable)
        kept = lora_targets(self._skeleton, LoraSpec(1, 1.0, patterns)) if keep else {}
        # target name -> its original weight: the only weights kept beside the served ones
        self._originals: dict[str, Tensor] = {n: base.get_submodule(n).weight.detach() for n in kept}
        self._host: dict[str, Tensor] = {}
        if self.switchable:
            memo: dict[int, Tensor] = {}   # tied tensors stay tied
            self._host = {n: memo.setdefault(id(t), t.detach().to("cpu", copy=True))
                          for n, t in plain_tensors(base).items() if n.removesuffix(".weight") not in kept}
        self.fetcher: Fetcher | None = None  # pulls the current adapter when a call needs a newer one
        # the largest adapter accepted: the served LoRA layout's bytes (an AdapterEndpoint's flag overrides it)
        self.max_bytes = adapter_cap(self._skeleton, patterns, lora.rank if lora is not None else
                                     self.UNPINNED_CAP_RANK) if patterns else DERIVED_CAP_FALLBACK
        self._cond = threading.Condition()   # guards _current, _calls, _swapping; notified on every change
        self._calls = 0                      # calls running on the served version
        self._swapping = False               # a push / switch waits for calls to end, or changes the weights
        self._load_lock = threading.Lock()   # one push or precision switch at a time
        self._adapter: tuple[Mapping[str, Tensor], LoraSpec] | None = None  # the served LoRA (None: the base)
        self._merged: tuple[str, ...] = ()   # targets whose served weight holds a merged adapter
        self._injected: LoraSpec | None = None   # the layout of the peft LoRA layers in the model (unmerged)
        self._current = ServingCopy(self._prepare(base), 0, "", precision, self.label)

    def _set_backend(self, precision: PrecisionConfig, label: str) -> None:
        self.precision, self.label = precision, label
        self._backend = build_backend(precision)
        self.merges = self._backend.quantizes
        # its kernels keep process-global state (Transformer Engine): callers take turns on the device
        self.global_state = self._backend.global_state

    def _prepare(self, module: nn.Module) -> nn.Module:
        """`module` (plain) through the backend, in place. An original the backend left shared with a served
        tensor (a rounding that changed nothing) is copied, so a merge never writes into it."""
        self._backend.prepare(module)
        served = storages([*module.parameters(), *module.buffers()])
        for name, weight in self._originals.items():
            if storages([weight]).keys() & served.keys():
                self._originals[name] = weight.clone()
        self._merged, self._injected = (), None
        return module

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The write side of the version gate: new calls wait, the calls running end, then the body runs."""
        with self._cond:
            self._swapping = True
            self._cond.wait_for(lambda: self._calls == 0)
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()

    def use(self, precision: PrecisionConfig, label: str | None = None) -> float:
        """Serve `precision` from now on (a no-op if served already): once no call runs, the model is rebuilt
        from its originals through the new backend, with the current adapter. Returns the build's ms. A
        backend that cannot be built here raises and leaves the model served as it was."""
        with self._load_lock:
            if precision == self.precision:
                return 0.0
            if not self.switchable:
                raise RuntimeError(f"this server serves {self.label} only: it keeps no originals to rebuild from")
            t0 = time.perf_counter()
            before = (self.precision, self.label)
            with self._exclusive():
                self._current = dataclasses.replace(self._current, module=None)  # freed before the new build
                try:
                    self._set_backend(precision, label or precision.backend)
                    self._rebuild()
                except Exception:
                    self._set_backend(*before)
                    self._rebuild()
                    raise
            ms = (time.perf_counter() - t0) * 1000.0
        log.info("now serving %s (adapter version %d rebuilt in %.1f ms)", self.label, self._current.version, ms)
        return ms

    def _rebuild(self) -> None:
        """The plain model again (skeleton + originals), through the backend, with the served adapter."""
        module = copy.deepcopy(self._skeleton)
        copies: dict[int, Tensor] = {}
        for name, tensor in self._host.items():
            assign_tensor(module, name, copies.setdefault(id(tensor), tensor.to(self._device, copy=True)))
        for name, weight in self._originals.items():
            assign_tensor(module, f"{name}.weight", weight.clone())
        module = self._prepare(module.eval().requires_grad_(False))
        self._current = dataclasses.replace(self._current, module=module, precision=self.precision, label=self.label)
        if self._adapter is not None:
            self._apply(*self._adapter)

    def _layout_for(self, spec: LoraSpec) -> dict[str, tuple[int, ...]]:
        """Adapter key -> shape of `spec` on this model (cached per spec, with its targets: `_targets`)."""
        if spec not in self._layouts:
            layout = lora_layout(self._skeleton, spec)
            targets = tuple(lora_targets(self._skeleton, spec))
            missing = [n for n in targets if n not in self._originals]
            if missing and (self.merges or self.switchable):
                raise ValueError(f"it targets {missing[:3]} ({len(missing)} layers) outside the targets whose "
                                 f"original weights this server keeps")
            self._layouts[spec], self._targets[spec] = layout, targets
        return self._layouts[spec]

    def _targets_for(self, spec: LoraSpec) -> tuple[str, ...]:
        """The layer names `spec` targets on this model (cached with its layout)."""
        self._layout_for(spec)
        return self._targets[spec]

    def _apply(self, state: Mapping[str, Tensor] | None, spec: LoraSpec | None) -> None:
        """Make the served model carry `state` (None: the base alone), in place. Runs inside `_exclusive`."""
        module = self._current.module
        targets = self._targets_for(spec) if spec is not None else ()
        if self.merges:
            chunk: dict[str, Tensor] = {}
            chunk_bytes = 0   # of the chunk's weights in fp32
            wanted = set(targets)
            for name in (*targets, *(n for n in self._merged if n not in wanted)):
                weight = self._originals[name]
                if name in wanted:
                    keys = [f"{PREFIX}.{name}.lora_{p}.weight" for p in "AB"]
                    chunk[name] = merge_lora({name: weight}, {k: state[k] for k in keys}, spec)[name]
                else:   # merged by the previous adapter, not by this one: back to the original
                    chunk[name] = weight
                chunk_bytes += weight.numel() * 4
                if chunk_bytes >= self.CHUNK_BYTES:
                    self._backend.requantize(module, chunk)
                    chunk, chunk_bytes = {}, 0
            if chunk:
                self._backend.requantize(module, chunk)
            self._merged = targets
            return
        if self._injected is not None and self._injected != spec:
            remove_lora(module)
            self._injected = None
        if spec is None:
            return
        if self._injected is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(spec.lora_config(), module, adapter_name=self.ADAPTER)
            cast_adapter_dtype(module, self.ADAPTER)   # fp32 LoRA on a bf16 base, as the trainer's
            module.eval().requires_grad_(False)
            self._injected = spec
        with torch.no_grad():
            for name in targets:
                layer = module.get_submodule(name)
                for part in ("lora_A", "lora_B"):
                    weight = getattr(layer, part)[self.ADAPTER].weight
                    weight.copy_(state[f"{PREFIX}.{name}.{part}.weight"].to(weight.device, weight.dtype))

    @property
    def backend(self) -> str:
        return self.precision.backend

    def current(self) -> ServingCopy:
        with self._cond:
            return self._current

    @contextmanager
    def serving(self, min_version: int = 0, timeout: float = 0.0,
                precision: PrecisionConfig | None = None) -> Iterator[ServingCopy]:
        """The version a call runs on, held until the block ends (a push waits for it): the current one, once
        its version is >= min_version (waits up to `timeout` seconds for a push; UnavailableError after that).
        With a `fetcher`, a call that needs a newer version than served first fetches the current adapter
        itself (a missed push). `precision`: the one the caller switched to (`use`); a concurrent call that
        switched to another one in between gives UnavailableError (retry)."""
        if self.fetcher is not None and self.current().version < min_version:
            self.fetcher.fetch()
        with self._cond:
            if not self._cond.wait_for(lambda: self._current.version >= min_version, timeout):
                raise UnavailableError(f"serving adapter version {self._current.version}, the request needs "
                                       f">= {min_version}; push that version or retry later")
            self._cond.wait_for(lambda: not self._swapping)   # a push under way: it ends (versions only grow)
            if precision is not None and self._current.precision != precision:
                raise UnavailableError(f"a concurrent request switched this explorer to {self._current.label}; "
                                       f"retry")
            self._calls += 1
            held = self._current
        try:
            yield held
        finally:
            with self._cond:
                self._calls -= 1
                self._cond.notify_all()

    def weight_bytes(self) -> dict[str, int]:
        """Resident weight bytes of the served model (the backend's accounting)."""
        with self.serving() as cur:
            return self._backend.weight_bytes(cur.module)

    def resident_tensors(self) -> list[Tensor]:
        """Every tensor this object keeps: the served model's parameters and buffers, the originals, the host
        copies and the served adapter as pushed (the skeleton has no storage). A test sums their storages."""
        with self.serving() as cur:
            pushed = self._adapter[0].values() if self._adapter is not None else ()
            return [*cur.module.parameters(), *cur.module.buffers(), *self._originals.values(),
                    *self._host.values(), *pushed]

    def load(self, data: bytes, *, version: int, sha256: str, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES) -> LoadResult:
        """Validate, then merge and re-quantize (or load the LoRA layers) in place once no call runs;
        AdapterRejected says why not. max_bytes 0: this model's `max_bytes`."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        max_bytes = max_bytes or self.max_bytes
        if len(data) > max_bytes:
            raise AdapterRejected("too_large", f"adapter is {len(data)} bytes, over the limit of {max_bytes} "
                                               f"(the served LoRA layout's size unless --max-adapter-bytes sets it)")
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
                check_state(payload.state, self._layout_for(spec), "adapter")
            except (TypeError, ValueError) as exc:
                raise AdapterRejected("invalid", f"adapter does not fit this model: {exc}") from None
            t0 = time.perf_counter()
            with self._exclusive():
                try:
                    self._apply(payload.state, spec)
                except Exception:   # put the served version back as it was
                    self._apply(*(self._adapter or (None, None)))
                    raise
                with self._cond:
                    self._current = dataclasses.replace(self._current, version=version, sha256=actual)
                self._adapter = (payload.state, spec)
            swap_ms = (time.perf_counter() - t0) * 1000.0
        log.info("adapter version %d (sha256 %s) swapped in after %.1f ms", version, actual[:12], swap_ms)
        return LoadResult(version, actual, swap_ms, previous.version)


DERIVED_CAP_FALLBACK = 512 << 20   # the cap of a model given no LoRA targets to derive one from
CAP_HEADROOM = 64 << 10            # safetensors header and metadata room above the tensors' bytes


def adapter_cap(model: nn.Module, targets: Sequence[str], rank: int, dtype: torch.dtype = torch.float32) -> int:
    """The largest adapter a server of `model` accepts: the bytes of A [rank, in] and B [out, rank] for every
    module `targets` match (peft's matching), at `dtype`, plus CAP_HEADROOM and 256 header bytes a tensor.
    Works on a meta-device model (no storage is touched)."""
    layout = lora_layout(model, LoraSpec(rank, 1.0, tuple(targets)))
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return sum(math.prod(shape) for shape in layout.values()) * size + 256 * len(layout) + CAP_HEADROOM


def storages(tensors: Sequence[Tensor]) -> dict[int, int]:
    """Distinct storages of `tensors`, data pointer -> bytes; a tensor subclass (torchao's packed formats)
    counts its component tensors."""
    out: dict[int, int] = {}
    for t in tensors:
        if type(t) not in (Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            out.update(storages([c for c in (getattr(t, n) for n in names) if c is not None]))
        elif t.device.type != "meta":
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


def meta_skeleton(module: nn.Module) -> nn.Module:
    """A copy of `module`'s structure whose parameters and buffers are on the meta device (no storage)."""
    memo: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def plain_tensors(module: nn.Module) -> dict[str, Tensor]:
    """Dotted name -> every parameter and buffer of `module` (tied ones under each of their names)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def assign_tensor(module: nn.Module, name: str, tensor: Tensor) -> None:
    """Put `tensor` as the parameter or buffer `name` of `module` (the skeleton's meta one is replaced)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def remove_lora(module: nn.Module) -> None:
    """Take peft's LoRA layers out of `module` again (each back to the layer it wraps)."""
    for name, layer in list(module.named_modules()):
        if isinstance(layer, LoraLayer):
            replace_module(module, name, layer.get_base_layer())
    if hasattr(module, "peft_config"):
        del module.peft_config
