"""KServe v2 / Triton inference-protocol tensors <-> numpy, on tritonclient's own messages and helpers.

An input tensor's data comes either from `raw_input_contents` (one entry per input, in input order:
little-endian elements, or for BYTES a 4-byte little-endian length before each element) or from the
typed `contents` field that matches its datatype; Triton's clients send raw. Outputs are sent raw,
the form `tritonclient`'s `InferResult.as_numpy` reads.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import (
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    triton_to_np_dtype,
)

from services.common.errors import TooLargeError
from services.common.tensors import DEFAULT_MAX_TENSOR_BYTES

MODEL_VERSION = "1"   # every model a solrl service serves has this one version
PLATFORM = "solrl"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str           # KServe v2 datatype
    shape: tuple[int, ...]  # -1 = any size


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

# Which typed `contents` field carries each datatype (KServe v2 gRPC protocol, InferTensorContents);
# FP16 and BF16 have none and travel raw only.
TYPED_CONTENTS: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _from_raw(name: str, datatype: str, dtype: np.dtype, shape: tuple[int, ...], raw: bytes,
              max_bytes: int) -> np.ndarray:
    if len(raw) > max_bytes:
        raise TooLargeError(f"{name}: {len(raw)} bytes, over the limit of {max_bytes}")
    if datatype == "BYTES":
        try:
            values = deserialize_bytes_tensor(raw)
        except struct.error:
            raise ValueError(f"{name}: malformed BYTES data (each element needs a 4-byte length)") from None
        if values.size != math.prod(shape):
            raise ValueError(f"{name}: BYTES data holds {values.size} elements but shape {list(shape)} "
                             f"needs {math.prod(shape)}")
        return values.reshape(shape)
    need = math.prod(shape) * dtype.itemsize   # from the declared shape, before any allocation
    if need > max_bytes:
        raise TooLargeError(f"{name}: {datatype} {list(shape)} is {need} bytes, over the limit of {max_bytes}")
    if len(raw) != need:
        raise ValueError(f"{name}: raw data holds {len(raw)} bytes but {datatype} {list(shape)} needs {need}")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype, copy=False).reshape(shape)


def _from_typed(name: str, datatype: str, dtype: np.dtype, shape: tuple[int, ...],
                contents: service_pb2.InferTensorContents, max_bytes: int) -> np.ndarray:
    field = TYPED_CONTENTS.get(datatype)
    if field is None:
        raise ValueError(f"{name}: {datatype} data must be sent in raw_input_contents")
    n = math.prod(shape)
    if datatype != "BYTES" and n * dtype.itemsize > max_bytes:   # from the declared shape, before allocating
        raise TooLargeError(f"{name}: {datatype} {list(shape)} is over the limit of {max_bytes} bytes")
    values = getattr(contents, field)
    if len(values) != n:
        raise ValueError(f"{name}: {datatype} {list(shape)} needs {n} values in contents.{field}, got {len(values)}")
    if datatype == "BYTES":
        if sum(len(v) for v in values) > max_bytes:
            raise TooLargeError(f"{name}: over the limit of {max_bytes} bytes")
        return np.array(list(values), dtype=object).reshape(shape)
    if dtype.kind in "iu":  # int_contents / uint_contents are wider than INT8..UINT32: check the range
        wide = np.array(values, dtype=np.int64 if dtype.kind == "i" else np.uint64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise ValueError(f"{name}: values outside the range of {datatype} [{info.min}, {info.max}]")
        return wide.astype(dtype).reshape(shape)
    return np.array(values, dtype=dtype).reshape(shape)


def decode_inputs(request: service_pb2.ModelInferRequest,
                  max_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> dict[str, np.ndarray]:
    """The request's input tensors by name. Errors name the input (or the request field)."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ValueError(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    out: dict[str, np.ndarray] = {}
    for i, inp in enumerate(request.inputs):
        name = inp.name or f"inputs[{i}]"
        if not inp.name:
            raise ValueError(f"{name}.name is empty")
        if name in out:
            raise ValueError(f"{name}: input given twice")
        np_type = triton_to_np_dtype(inp.datatype)
        if np_type is None:
            raise TypeError(f"{name}: unknown datatype {inp.datatype!r}")
        shape = tuple(int(d) for d in inp.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"{name}: shape must have non-negative sizes, got {list(shape)}")
        dtype = np.dtype(np_type)
        if raw:
            if inp.HasField("contents"):
                raise ValueError(f"{name}: both contents and raw_input_contents given")
            out[name] = _from_raw(name, inp.datatype, dtype, shape, raw[i], max_bytes)
        else:
            out[name] = _from_typed(name, inp.datatype, dtype, shape, inp.contents, max_bytes)
    return out


def encode_output(name: str, array: np.ndarray) -> tuple[service_pb2.ModelInferResponse.InferOutputTensor, bytes]:
    """A numeric output tensor and its raw (little-endian) bytes for raw_output_contents."""
    datatype = np_to_triton_dtype(array.dtype)
    if datatype is None or datatype == "BYTES":
        raise TypeError(f"{name}: cannot send dtype {array.dtype} as a numeric output")
    meta = service_pb2.ModelInferResponse.InferOutputTensor(name=name, datatype=datatype, shape=list(array.shape))
    return meta, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()

