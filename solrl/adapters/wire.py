"""Adapter wire format: safetensors bytes (never pickle) with version, spec and sha256.

The payload is a diffusers pipeline LoRA file: tensors keyed ``transformer.<module>.lora_{A,B}.weight``
and diffusers' ``lora_adapter_metadata`` entry, so ``load_lora_adapter(..., prefix="transformer")``
reads it as is. solrl's own entries live under ``solrl.*``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import safetensors.torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from safetensors import SafetensorError
from torch import Tensor

from solrl.adapters.lora import PREFIX, LoraSpec, check_state

FORMAT_NAME = "solrl-lora/1"
_KEY_RE = re.compile(rf"^{re.escape(PREFIX)}\.(.+)\.lora_(A|B)\.weight$")
_RESERVED = ("format", LORA_ADAPTER_METADATA_KEY)


@dataclass(frozen=True)
class AdapterPayload:
    """A decoded adapter: tensors, version, spec, sha256 of the bytes and the raw metadata."""

    state: dict[str, Tensor]
    version: int
    spec: LoraSpec
    sha256: str
    metadata: dict[str, str] = field(default_factory=dict)


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of a payload."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    return hashlib.sha256(data).hexdigest()


def _diffusers_metadata(spec: LoraSpec) -> str:
    # diffusers stores the transformer's LoraConfig kwargs under "<component>.<field>" in one JSON entry.
    return json.dumps({f"{PREFIX}.{k}": v for k, v in spec.peft_kwargs().items()}, sort_keys=True)


def _check_structure(state: Mapping[str, Tensor], rank: int, what: str) -> dict[str, tuple[int, ...]]:
    """Key format, A/B pairing and rank; returns the implied layout."""
    modules: dict[str, set[str]] = {}
    for key, tensor in state.items():
        match = _KEY_RE.match(key) if isinstance(key, str) else None
        if match is None:
            raise ValueError(f"{what}: key {key!r} is not of the form '{PREFIX}.<module>.lora_A|lora_B.weight'")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{what}[{key!r}] must be a Tensor, got {type(tensor).__name__}")
        part, module = match.group(2), match.group(1)
        rank_dim = 0 if part == "A" else 1
        if tensor.ndim != 2 or tensor.shape[rank_dim] != rank:
            raise ValueError(
                f"{what}[{key!r}]: shape {tuple(tensor.shape)} does not have rank {rank} in dim {rank_dim}"
            )
        modules.setdefault(module, set()).add(part)
    if not modules:
        raise ValueError(f"{what}: no LoRA tensors")
    unpaired = sorted(m for m, parts in modules.items() if parts != {"A", "B"})
    if unpaired:
        raise ValueError(f"{what}: modules without both lora_A and lora_B: {unpaired[:3]}")
    return {key: tuple(t.shape) for key, t in state.items()}


def encode_adapter(
    state: Mapping[str, Tensor], version: int, spec: LoraSpec, extra: Mapping[str, str] | None = None
) -> bytes:
    """Serialize one adapter's state dict (diffusers key format) to canonical safetensors bytes."""
    if not isinstance(spec, LoraSpec):
        raise TypeError(f"spec must be a LoraSpec, got {type(spec).__name__}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"version must be a non-negative int, got {version!r}")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of str to Tensor, got {type(state).__name__}")
    check_state(state, _check_structure(state, spec.rank, "state"), "state")
    metadata = {
        "format": "pt",
        LORA_ADAPTER_METADATA_KEY: _diffusers_metadata(spec),
        "solrl.format": FORMAT_NAME,
        "solrl.version": str(version),
        "solrl.rank": str(spec.rank),
        "solrl.alpha": repr(float(spec.alpha)),
        "solrl.target_modules": json.dumps(list(spec.target_modules)),
        "solrl.init": spec.init,
    }
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"extra must map str to str, got {key!r}: {type(value).__name__}")
        if key in _RESERVED or key.startswith("solrl."):
            raise ValueError(f"extra key {key!r} is reserved")
        metadata[key] = value
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    return canonical_safetensors(safetensors.torch.save(tensors, metadata=metadata))


def canonical_safetensors(data: bytes) -> bytes:
    """The same safetensors bytes with a deterministic header (metadata sorted)."""
    # safetensors writes "__metadata__" in hash-map order (it differs between calls), so the same
    # adapter would hash differently; rewrite the header with sorted metadata. Header layout
    # (8-byte little-endian length, JSON, space padding to 8 bytes) per the safetensors spec.
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    raw = json.dumps({"__metadata__": dict(sorted(metadata.items())), **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def _read_metadata(data: bytes) -> dict[str, str]:
    # safetensors 0.8 reads metadata only from files (safe_open); parse the header by hand.
    if len(data) < 8:
        raise ValueError(f"data: {len(data)} bytes is too short for safetensors (8-byte header length)")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError(
            f"data: header length {n} exceeds the {len(data) - 8} bytes present (truncated or not safetensors)"
        )
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"data: header is not JSON, not a safetensors payload ({err})") from err
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("data: safetensors header has no string '__metadata__' table")
    return metadata


def _spec_from_metadata(metadata: Mapping[str, str]) -> tuple[int, LoraSpec]:
    if metadata.get("solrl.format") != FORMAT_NAME:
        found = metadata.get("solrl.format")
        raise ValueError(f"data: metadata 'solrl.format' is {found!r}, expected {FORMAT_NAME!r}")
    try:
        version = int(metadata["solrl.version"])
        spec = LoraSpec(
            rank=int(metadata["solrl.rank"]),
            alpha=float(metadata["solrl.alpha"]),
            target_modules=tuple(json.loads(metadata["solrl.target_modules"])),
            init=metadata["solrl.init"],
        )
    except KeyError as err:
        raise ValueError(f"data: metadata lacks {err.args[0]!r}") from err
    except (TypeError, ValueError) as err:
        raise ValueError(f"data: bad solrl metadata ({err})") from err
    if version < 0:
        raise ValueError(f"data: metadata version {version} is negative")
    if metadata.get(LORA_ADAPTER_METADATA_KEY) != _diffusers_metadata(spec):
        raise ValueError(f"data: metadata {LORA_ADAPTER_METADATA_KEY!r} disagrees with the solrl.* spec entries")
    return version, spec


def decode_adapter(
    data: bytes, expected_layout: Mapping[str, tuple[int, ...]] | None = None, max_bytes: int | None = None
) -> AdapterPayload:
    """Parse and validate adapter bytes; every problem raises ValueError naming it."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if max_bytes is not None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
        if len(data) > max_bytes:
            raise ValueError(f"data: {len(data)} bytes exceeds max_bytes={max_bytes}")
    metadata = _read_metadata(data)
    version, spec = _spec_from_metadata(metadata)
    try:
        state = safetensors.torch.load(data)
    except SafetensorError as err:
        raise ValueError(f"data: not a valid safetensors payload (truncated or corrupt): {err}") from err
    if expected_layout is not None:
        check_state(state, expected_layout, "data")
    check_state(state, _check_structure(state, spec.rank, "data"), "data")
    return AdapterPayload(state=state, version=version, spec=spec, sha256=sha256_hex(data), metadata=dict(metadata))
