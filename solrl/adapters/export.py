"""Export an adapter as a plain diffusers pipeline LoRA file, for `pipe.load_lora_weights(path)`.

solrl's wire format already uses diffusers' key layout (``transformer.<module>.lora_A.weight`` /
``.lora_B.weight``) and its ``lora_adapter_metadata`` entry (the LoraConfig, so diffusers applies
alpha / rank rather than assuming alpha = rank). The export validates the payload, drops the solrl.*
bookkeeping and can cast the tensors (bf16 / fp16 files are what the Hub usually carries).

A two-expert model (Wan2.2 T2V-A14B, `solrl.models.wan.WanExperts`) trains one adapter over both experts, keyed
``transformer.transformer.<module>`` (high-noise expert) and ``transformer.transformer_2.<module>`` (low-noise).
diffusers loads an expert's LoRA from a file keyed like a single transformer's: ``pipe.load_lora_weights(f)``
puts it into ``pipe.transformer``, ``pipe.load_lora_weights(f, load_into_transformer_2=True)`` into
``pipe.transformer_2`` (diffusers `WanLoraLoaderMixin.load_lora_weights`). `export_expert_loras` writes one such
file per expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from torch import Tensor

from solrl.adapters.lora import PREFIX, LoraSpec
from solrl.adapters.wire import _diffusers_metadata, decode_adapter, encode_adapter

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def expert_state(state: Mapping[str, Tensor], expert: str) -> dict[str, Tensor]:
    """The LoRA tensors of one expert of a two-expert adapter, keyed as a single transformer's:
    ``transformer.<expert>.<module>...`` -> ``transformer.<module>...``. ValueError if the adapter has none."""
    head = f"{PREFIX}.{expert}."
    out = {f"{PREFIX}.{k.removeprefix(head)}": v for k, v in state.items() if k.startswith(head)}
    if not out:
        raise ValueError(f"the adapter has no LoRA tensors of expert {expert!r} (no key starts with {head!r})")
    return out


def _state_and_spec(adapter: bytes | Mapping[str, Tensor], spec: LoraSpec | None) -> tuple[dict[str, Tensor], LoraSpec]:
    """Adapter bytes (spec from their metadata) or a state dict with its spec, validated as the wire does."""
    if isinstance(adapter, (bytes, bytearray, memoryview)):
        if spec is not None:
            raise ValueError("spec comes from the adapter bytes' metadata; pass spec only with a state dict")
        payload = decode_adapter(bytes(adapter))
        return payload.state, payload.spec
    if not isinstance(spec, LoraSpec):
        raise TypeError("a state dict needs its LoraSpec (spec=...) for the rank / alpha metadata")
    return decode_adapter(encode_adapter(adapter, 0, spec)).state, spec  # the same validation as the wire


def export_diffusers_lora(adapter: bytes | Mapping[str, Tensor], out: str | Path, spec: LoraSpec | None = None,
                          dtype: str = "fp32", expert: str | None = None) -> Path:
    """Write `adapter` (solrl adapter bytes, or a state dict plus its `spec`) to `out` as a diffusers LoRA.

    Returns the path written. The file loads with `pipe.load_lora_weights(out)` into the pipeline of the
    model the adapter was trained on (SANA, SD3, FLUX, PixArt pipelines prefix their denoiser "transformer").
    `expert` (a two-expert adapter, e.g. "transformer_2"): only that expert's LoRA, keyed as a single
    transformer's (`expert_state`).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    state, spec = _state_and_spec(adapter, spec)
    if expert is not None:
        state = expert_state(state, expert)
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"out must be a .safetensors file, got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in state.items()}
    safetensors.torch.save_file(tensors, str(out),
                                metadata={"format": "pt", LORA_ADAPTER_METADATA_KEY: _diffusers_metadata(spec)})
    return out


def export_expert_loras(adapter: bytes | Mapping[str, Tensor], out_dir: str | Path, spec: LoraSpec | None = None,
                        dtype: str = "fp32", experts: tuple[str, ...] = ("transformer", "transformer_2")
                        ) -> dict[str, Path]:
    """A two-expert adapter (Wan2.2 A14B) as one diffusers LoRA file per expert in `out_dir`:
    ``pytorch_lora_weights.safetensors`` for the first (high-noise) expert, ``pytorch_lora_weights_<expert>
    .safetensors`` for the others. Load them with
    ``pipe.load_lora_weights(out_dir, weight_name="pytorch_lora_weights.safetensors")`` and
    ``pipe.load_lora_weights(out_dir, weight_name="pytorch_lora_weights_transformer_2.safetensors",
    load_into_transformer_2=True)``. Every tensor of the adapter must belong to one of `experts`."""
    state, spec = _state_and_spec(adapter, spec)
    stray = sorted(k for k in state if not any(k.startswith(f"{PREFIX}.{e}.") for e in experts))
    if stray:
        raise ValueError(f"{len(stray)} adapter key(s) belong to none of the experts {experts}, e.g. {stray[:2]}")
    out_dir = Path(out_dir)
    return {e: export_diffusers_lora(state, out_dir / ("pytorch_lora_weights.safetensors" if i == 0 else
                                                       f"pytorch_lora_weights_{e}.safetensors"),
                                     spec, dtype, expert=e) for i, e in enumerate(experts)}


__all__ = ["expert_state", "export_diffusers_lora", "export_expert_loras"]
