"""LoRA adapters: peft injection, switching, merging into inference copies, safetensors wire format."""

from solrl.adapters.export import export_diffusers_lora, export_expert_loras
from solrl.adapters.lora import LoraAdapters, LoraSpec, apply_merged, make_inference_copy
from solrl.adapters.merge import lora_layout, merge_lora
from solrl.adapters.wire import AdapterPayload, decode_adapter, encode_adapter, sha256_hex

__all__ = [
    "AdapterPayload",
    "LoraAdapters",
    "LoraSpec",
    "apply_merged",
    "decode_adapter",
    "encode_adapter",
    "export_diffusers_lora",
    "export_expert_loras",
    "lora_layout",
    "make_inference_copy",
    "merge_lora",
    "sha256_hex",
]
