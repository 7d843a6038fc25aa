"""Inference copies that serve rollouts: the low-precision explorer (and, in services, the regenerator).

An `InferenceCopy` is a plain base denoiser (no peft layers) put through a precision backend. `sync`
merges an adapter into it (W + s*B@A, computed by the trainer side) and re-quantizes, then records
the adapter version it serves. The swap is validated before anything changes (the backend's
`requantize` is atomic).
"""

from __future__ import annotations

from torch import nn

from solrl.adapters import LoraAdapters, make_inference_copy
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.base import with_model_skips


class InferenceCopy:
    def __init__(self, adapters: LoraAdapters, precision: PrecisionConfig, skip: tuple[str, ...] = (),
                 min_features: int = 0) -> None:
        base = adapters.model
        self.module: nn.Module = make_inference_copy(adapters, type(base), base.config)
        self.backend = build_backend(with_model_skips(precision, skip, min_features))
        self.backend.prepare(self.module)
        self.version = 0

    def sync(self, merged: dict, version: int) -> None:
        self.backend.requantize(self.module, merged)
        self.version = version

    def weight_bytes(self) -> dict[str, int]:
        return self.backend.weight_bytes(self.module)
