"""The KServe v2 REST door (with Triton's HTTP extensions) on a service's ops app.

Every route transcodes its HTTP request into the protobuf request of the service's GRPCInferenceService
servicer, calls the very method the gRPC door calls, and transcodes the answer back: both doors share one
data plane, one set of input checks and one statistics record. Routes (KServe v2 / Triton HTTP protocol):

  GET  /v2/health/live, /v2/health/ready            {"live": true} / {"ready": true} 200; false 400 (the spec's 4xx)
  GET  /v2                                          server metadata (name, version, extensions)
  GET  /v2/models/{m}[/versions/{v}]                model metadata
  GET  /v2/models/{m}[/versions/{v}]/ready          {"name", "ready"}: 200 when ready, 400 when not (or unknown)
  GET  /v2/models/{m}[/versions/{v}]/config         Triton model configuration (JSON)
  POST /v2/models/{m}[/versions/{v}]/infer          inference: JSON tensors, or the binary tensor extension
  GET  /v2/models[/{m}[/versions/{v}]]/stats        Triton statistics
  POST /v2/repository/index                         Triton repository index

Binary tensor data (what tritonclient.http sends and asks for by default): the body is a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw tensors of the inputs whose
`parameters.binary_data_size` is set, in input order (BYTES as 4-byte little-endian lengths before each
element); outputs asked for with `parameters.binary_data` (or the request's `binary_data_output`) come back
the same way. A gzip or deflate `Content-Encoding` is accepted. Bodies are bounded before they are read: a
declared Content-Length over the door's limit is refused unread, the body is read as a stream and decompressed
with the limit on its output (services.common.bodies), its JSON part is at most MAX_JSON_BYTES (over a limit:
413). Errors are `{"error": message}` with the status of the gRPC code the same input gives (400 invalid or
malformed, JSON nested too deeply included, 404 unknown model, 413 too large, 503 unavailable or, with
Retry-After, the service's budget for the requests in flight full: services.common.budget). With a token
(SOLRL_DATA_TOKEN, services.common.auth) every route but /v2/health/* needs `Authorization: Bearer <token>` (401).
Written by hand over FastAPI (the service's ops app): KServe's `ModelServer` would bring its own servers and
a Kubernetes client, PyTriton a Triton binary and an older numpy.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from starlette.concurrency import run_in_threadpool
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor, triton_to_np_dtype

from services.common.auth import TokenMiddleware
from services.common.bodies import parse_json, read_body
from services.common.budget import retry_headers
from services.common.errors import BodyTimeoutError, OverloadedError, TooLargeError, message_for, status_for

HEADER_LENGTH = "Inference-Header-Content-Length"
INDEX_BODY_BYTES = 64 << 10   # a repository index request is {"ready": true}
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "UNIMPLEMENTED": 501,
               "FAILED_PRECONDITION": 400, "RESOURCE_EXHAUSTED": 413, "DEADLINE_EXCEEDED": 408}


def _error(exc: BaseException) -> JSONResponse:
    # a body cut off at its deadline leaves unread bytes on the connection: close it rather than read them as the
    # next request (uvicorn closes the connection after a response that says so)
    if isinstance(exc, OverloadedError):   # a transient refusal, its body left unread
        return JSONResponse({"error": message_for(exc)}, status_code=503, headers=retry_headers())
    headers = {"Connection": "close"} if isinstance(exc, BodyTimeoutError) else None
    return JSONResponse({"error": message_for(exc)}, status_code=HTTP_STATUS.get(status_for(exc).name, 500),
                        headers=headers)


def _dict(message: Any, *, defaults: bool = False) -> dict[str, Any]:
    """`message` as the REST protocol's JSON: proto field names, and 64-bit integers as numbers (the proto3
    JSON mapping would quote them: shapes, dims and counters are numbers in KServe v2 / Triton JSON)."""
    return _numbers(message, json_format.MessageToDict(message, preserving_proto_field_name=True,
                                                       always_print_fields_with_no_presence=defaults))


_WIDE = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)


def _numbers(message: Any, d: dict[str, Any]) -> dict[str, Any]:
    for f in message.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        value, repeated = d[f.name], f.label == FieldDescriptor.LABEL_REPEATED
        if f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                if f.message_type.fields_by_name["value"].cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                    field = getattr(message, f.name)
                    d[f.name] = {k: _numbers(field[k], v) for k, v in value.items()}
            elif repeated:
                d[f.name] = [_numbers(m, v) for m, v in zip(getattr(message, f.name), value)]
            else:
                d[f.name] = _numbers(getattr(message, f.name), value)
        elif f.cpp_type in _WIDE:
            d[f.name] = [int(v) for v in value] if repeated else int(value)
    return d


# ---------------------------------------------------------------------- infer: HTTP -> protobuf

def _json_tensor(name: str, datatype: str, shape: tuple[int, ...], data: Any) -> bytes:
    """A JSON `data` array (nested or flat, row-major) as the raw little-endian bytes of the gRPC door."""
    if datatype == "BYTES":
        flat = np.array(data, dtype=object).reshape(-1)
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in flat]
        if any(not isinstance(v, bytes) for v in values):
            raise ValueError(f"{name}: BYTES data must be strings")
        array = np.array(values, dtype=object)
    else:
        np_type = triton_to_np_dtype(datatype)
        if np_type is None:
            raise TypeError(f"{name}: unknown datatype {datatype!r}")
        try:
            array = np.array(data, dtype=np_type).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: data is not {datatype}: {exc}") from None
    if array.size != math.prod(shape):
        raise ValueError(f"{name}: data holds {array.size} elements but shape {list(shape)} needs {math.prod(shape)}")
    if datatype == "BYTES":
        return serialize_byte_tensor(array).item() if array.size else b""  # a 0-d object array of the bytes
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def infer_request(model: str, version: str, header: dict[str, Any], binary: bytes
                  ) -> tuple[service_pb2.ModelInferRequest, set[str] | None]:
    """The ModelInferRequest of a REST infer body (JSON header + binary tail), and the outputs to return as
    binary (None: all of them)."""
    if not isinstance(header, dict):
        raise ValueError("request body: a JSON object is required")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ValueError("inputs: a non-empty list is required")
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=str(header.get("id", "")))
    offset = 0
    for i, inp in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(inp, dict) or not isinstance(inp.get("name"), str) or not inp["name"]:
            raise ValueError(f"{where}.name: required")
        name = inp["name"]
        shape, datatype = inp.get("shape"), inp.get("datatype")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise ValueError(f"{name}: shape must be a list of integers")
        if not isinstance(datatype, str):
            raise ValueError(f"{name}: datatype is required")
        params = inp.get("parameters") or {}
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(binary):
                raise ValueError(f"{name}: binary_data_size {size!r} does not fit the {len(binary) - offset} "
                                 f"binary bytes left in the body")
            raw = binary[offset:offset + size]
            offset += size
        elif "data" in inp:
            if any(d < 0 for d in shape):
                raise ValueError(f"{name}: shape must have non-negative sizes, got {shape}")
            raw = _json_tensor(name, datatype, tuple(shape), inp["data"])
        else:
            raise ValueError(f"{name}: give data, or parameters.binary_data_size with binary data")
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    if offset != len(binary):
        raise ValueError(f"request body: {len(binary) - offset} binary bytes that no input claims")
    outputs = header.get("outputs")
    all_binary = bool((header.get("parameters") or {}).get("binary_data_output", False))
    binary_out: set[str] = set()
    if outputs is not None:
        if not isinstance(outputs, list):
            raise ValueError("outputs: must be a list")
        for i, out in enumerate(outputs):
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise ValueError(f"outputs[{i}].name: required")
            request.outputs.add(name=out["name"])
            if (out.get("parameters") or {}).get("binary_data", all_binary):
                binary_out.add(out["name"])
    return request, (None if outputs is None and all_binary else binary_out)


# ---------------------------------------------------------------------- infer: protobuf -> HTTP

def infer_response(response: service_pb2.ModelInferResponse, binary_out: set[str] | None) -> Response:
    """The REST answer: JSON `data` for each output, or the binary extension for those in `binary_out`."""
    outputs, blobs = [], []
    for meta, raw in zip(response.outputs, response.raw_output_contents):
        entry: dict[str, Any] = {"name": meta.name, "datatype": meta.datatype, "shape": list(meta.shape)}
        if binary_out is None or meta.name in binary_out:
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif meta.datatype == "BYTES":
            entry["data"] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                             for v in deserialize_bytes_tensor(raw)]
        else:
            dtype = np.dtype(triton_to_np_dtype(meta.datatype)).newbyteorder("<")
            entry["data"] = np.frombuffer(raw, dtype=dtype).tolist()
        outputs.append(entry)
    body = {"model_name": response.model_name, "model_version": response.model_version, "outputs": outputs}
    if response.id:
        body["id"] = response.id
    head = json.dumps(body).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(head))})


# The JSON part of a body (the whole body without the binary extension): JSON amplifies (a number of 2 bytes
# becomes a Python object of 28 plus an 8-byte list slot), so it gets its own bound: 16 MiB holds the JSON
# form of a few 1024 x 1024 images, enough for curl; batches travel as binary tensors (tritonclient's default).
MAX_JSON_BYTES = 16 << 20


async def _body(request: Request, max_bytes: int) -> tuple[dict[str, Any], bytes]:
    """The JSON header and binary tail of an infer body, bounded before reading (services.common.bodies)."""
    length = request.headers.get(HEADER_LENGTH)
    if length is not None:
        if not length.isdigit():
            raise ValueError(f"{HEADER_LENGTH}: {length!r} is not a length")
        if int(length) > MAX_JSON_BYTES:
            raise TooLargeError(f"{HEADER_LENGTH}: {length} bytes of JSON, over the limit of {MAX_JSON_BYTES}")
    data = await read_body(request, max_bytes, decode=True)
    split = len(data) if length is None else int(length)   # the JSON part ends there
    if split > len(data):
        raise ValueError(f"{HEADER_LENGTH}: {length} is not a length within the {len(data)}-byte body")
    if split > MAX_JSON_BYTES:   # a body without the binary extension: all of it is JSON
        raise TooLargeError(f"request body: {split} bytes of JSON, over the limit of {MAX_JSON_BYTES} "
                            f"(send tensors with the binary extension, {HEADER_LENGTH})")
    return parse_json(data[:split]), data[split:]


# ---------------------------------------------------------------------- routes

def mount_kserve_http(app: FastAPI, servicer: Any, *, max_body_bytes: int, token: str | None = None) -> None:
    """Add the KServe v2 REST routes (module doc) to `app`, over `servicer`'s GRPCInferenceService methods.
    max_body_bytes bounds an infer body, decompressed; token: the bearer token every /v2 route but
    /v2/health/* needs (services.common.auth; None: open)."""
    if token:
        app.add_middleware(TokenMiddleware, token=token)

    def call(method: str, request: Any) -> Any:
        return getattr(servicer, method)(request, None)

    def answer(fn) -> Response:
        try:
            return fn()
        except Exception as exc:  # the gRPC door's mapping, as HTTP statuses
            return _error(exc)

    def state(key: str, value: bool, **extra: str) -> JSONResponse:
        return JSONResponse({**extra, key: value}, status_code=200 if value else 400)

    @app.get("/v2/health/live")
    def live() -> Response:
        return answer(lambda: state("live", call("ServerLive", service_pb2.ServerLiveRequest()).live))

    @app.get("/v2/health/ready")
    def ready() -> Response:
        return answer(lambda: state("ready", call("ServerReady", service_pb2.ServerReadyRequest()).ready))

    @app.get("/v2")
    def server_metadata() -> Response:
        return answer(lambda: JSONResponse(_dict(call("ServerMetadata", service_pb2.ServerMetadataRequest()))))

    @app.get("/v2/models/stats")
    def all_stats() -> Response:
        return answer(lambda: JSONResponse(_stats(call("ModelStatistics", service_pb2.ModelStatisticsRequest()))))

    @app.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        try:
            raw = await read_body(request, INDEX_BODY_BYTES, decode=True)
            body = parse_json(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise ValueError("request body: a JSON object such as {\"ready\": true} is expected")
        except ValueError as exc:
            return _error(exc)
        ready_only = bool(body.get("ready", False))
        return answer(lambda: JSONResponse([_dict(m) for m in call(
            "RepositoryIndex", service_pb2.RepositoryIndexRequest(ready=ready_only)).models]))

    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        @app.get(prefix)
        def model_metadata(model: str, version: str = "") -> Response:
            return answer(lambda: JSONResponse(_dict(call(
                "ModelMetadata", service_pb2.ModelMetadataRequest(name=model, version=version)))))

        @app.get(prefix + "/ready")
        def model_ready(model: str, version: str = "") -> Response:
            return answer(lambda: state("ready", call(
                "ModelReady", service_pb2.ModelReadyRequest(name=model, version=version)).ready, name=model))

        @app.get(prefix + "/config")
        def model_config(model: str, version: str = "") -> Response:
            return answer(lambda: JSONResponse(_dict(call(
                "ModelConfig", service_pb2.ModelConfigRequest(name=model, version=version)).config)))

        @app.get(prefix + "/stats")
        def model_stats(model: str, version: str = "") -> Response:
            return answer(lambda: JSONResponse(_stats(call(
                "ModelStatistics", service_pb2.ModelStatisticsRequest(name=model, version=version)))))

        @app.post(prefix + "/infer")
        async def infer(model: str, request: Request, version: str = "") -> Response:
            try:
                header, binary = await _body(request, max_body_bytes)
                proto, binary_out = infer_request(model, version, header, binary)
            except Exception as exc:
                return _error(exc)
            try:  # the model call runs in a worker thread: the event loop keeps serving health checks meanwhile
                response = await run_in_threadpool(call, "ModelInfer", proto)
            except Exception as exc:
                return _error(exc)
            return infer_response(response, binary_out)


def _stats(message: service_pb2.ModelStatisticsResponse) -> dict[str, Any]:
    """Triton's statistics JSON (zero counters included, as Triton prints them)."""
    return _dict(message, defaults=True)
