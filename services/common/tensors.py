"""`solrl.common.v1.Tensor` <-> numpy / torch, with the checks a server needs on untrusted input.

Wire format: dtype by name, shape, raw bytes in row-major order, little-endian. numpy has no
bfloat16, so bfloat16 tensors convert to and from torch only (the bits travel as little-endian int16).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from services.common.errors import TooLargeError
from solrl.pb.solrl.common.v1 import common_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_TORCH_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_MAX_TENSOR_BYTES = 1 << 30


def _wire_dtype(name: str) -> np.dtype:
    """numpy dtype of the wire bytes (bfloat16 as its int16 bit pattern)."""
    return np.dtype("<i2") if name == "bfloat16" else np.dtype(name).newbyteorder("<")


def check_tensor(msg: common_pb2.Tensor, field: str = "tensor",
                 max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> tuple[str, tuple[int, ...]]:
    """Validate a Tensor message; returns (dtype name, shape). Errors name `field`."""
    if not isinstance(msg, common_pb2.Tensor):
        raise TypeError(f"{field} must be a solrl.common.v1.Tensor, got {type(msg).__name__}")
    if msg.dtype not in DTYPES:
        raise TypeError(f"{field}.dtype must be one of {sorted(DTYPES)}, got {msg.dtype!r}")
    shape = tuple(int(d) for d in msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{field}.shape must have non-negative sizes, got {list(shape)}")
    need = math.prod(shape) * _wire_dtype(msg.dtype).itemsize   # from the declared shape, before any allocation
    if need > max_bytes:
        raise TooLargeError(f"{field}: {msg.dtype} {list(shape)} is {need} bytes, over the limit of {max_bytes}")
    if len(msg.data) != need:
        raise ValueError(f"{field}.data holds {len(msg.data)} bytes but {msg.dtype} {list(shape)} needs {need}")
    return msg.dtype, shape


def numpy_to_tensor(array: np.ndarray) -> common_pb2.Tensor:
    """numpy array -> Tensor message (copies into little-endian, row-major bytes)."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array must be a numpy array, got {type(array).__name__}")
    name = array.dtype.name
    if name not in DTYPES or name == "bfloat16":
        raise TypeError(f"array dtype must be one of {sorted(set(DTYPES) - {'bfloat16'})}, got {array.dtype}")
    data = np.ascontiguousarray(array, dtype=_wire_dtype(name)).tobytes()
    return common_pb2.Tensor(dtype=name, shape=list(array.shape), data=data)


def tensor_to_numpy(msg: common_pb2.Tensor, field: str = "tensor",
                    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> np.ndarray:
    """Tensor message -> numpy array in native byte order (read-only; copy it to write)."""
    name, shape = check_tensor(msg, field, max_bytes)
    if name == "bfloat16":
        raise TypeError(f"{field}.dtype is bfloat16, which numpy cannot hold; use tensor_to_torch")
    return np.frombuffer(msg.data, dtype=_wire_dtype(name)).astype(np.dtype(name), copy=False).reshape(shape)


def torch_to_tensor(tensor: torch.Tensor) -> common_pb2.Tensor:
    """torch tensor (any device) -> Tensor message."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _TORCH_NAMES:
        raise TypeError(f"tensor dtype must be one of {sorted(DTYPES)}, got {tensor.dtype}")
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy()
        return common_pb2.Tensor(dtype="bfloat16", shape=list(t.shape), data=bits.astype("<i2").tobytes())
    return numpy_to_tensor(t.numpy())


def tensor_to_torch(msg: common_pb2.Tensor, field: str = "tensor",
                    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> torch.Tensor:
    """Tensor message -> CPU torch tensor (owns its memory)."""
    name, shape = check_tensor(msg, field, max_bytes)
    host = np.frombuffer(msg.data, dtype=_wire_dtype(name)).astype(_wire_dtype(name).newbyteorder("="))
    out = torch.from_numpy(host.reshape(shape))
    return out.view(torch.bfloat16) if name == "bfloat16" else out
