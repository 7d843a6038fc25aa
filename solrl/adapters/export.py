"""Export an adapter as a plain diffusers pipeline LoRA file, for `pipe.load_lora_weights(path)`.

solrl's wire format already uses diffusers' key layout (``transformer.<module>.lora_A.weight`` /
``.lora_B.weight``) and its ``lora_adapter_metadata`` entry (the LoraConfig, so diffusers applies
alpha / rank rather than assuming alpha = rank). The export validates the payload, drops the solrl.*
bookkeeping and can cast the tensors (bf16 / fp16 files are what the Hub usually carries).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from torch import Tensor

from solrl.adapters.lora import LoraSpec
from solrl.adapters.wire import _diffusers_metadata, decode_adapter, encode_adapter

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_diffusers_lora(adapter: bytes | Mapping[str, Tensor], out: str | Path, spec: LoraSpec | None = None,
                          dtype: str = "fp32") -> Path:
    """Write `adapter` (solrl adapter bytes, or a state dict plus its `spec`) to `out` as a diffusers LoRA.

    Returns the path written. The file loads with `pipe.load_lora_weights(out)` into the pipeline of the
    model the adapter was trained on (SANA, SD3, FLUX, PixArt pipelines prefix their denoiser "transformer").
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if isinstance(adapter, (bytes, bytearray, memoryview)):
        if spec is not None:
            raise ValueError("spec comes from the adapter bytes' metadata; pass spec only with a state dict")
        payload = decode_adapter(bytes(adapter))
        state, spec = payload.state, payload.spec
    else:
        if not isinstance(spec, LoraSpec):
            raise TypeError("a state dict needs its LoraSpec (spec=...) for the rank / alpha metadata")
        state = decode_adapter(encode_adapter(adapter, 0, spec)).state  # the same validation as the wire
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"out must be a .safetensors file, got {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(_DTYPES[dtype]).contiguous() for k, v in state.items()}
    safetensors.torch.save_file(tensors, str(out),
                                metadata={"format": "pt", LORA_ADAPTER_METADATA_KEY: _diffusers_metadata(spec)})
    return out


__all__ = ["export_diffusers_lora"]
