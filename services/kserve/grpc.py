"""The KServe v2 / Triton gRPC front door (`inference.GRPCInferenceService` on tritonclient's generated
stubs) over a service's data plane: the reward service's rewards and the explorer's `explore` model.

A data plane gives `models`, `ready()`, `model_ready(name, version)`, `resolve(name, version, field=)`,
`metadata(name, version) -> ModelMetadata` and `infer(name, inputs, version, outputs) -> {name: array}`.
Errors map to status codes in one place (services.common.grpc_server.ErrorInterceptor)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

import solrl
from services.common.batching import queue_timer
from services.common.errors import NotFoundError
from services.common.tensors import DEFAULT_MAX_TENSOR_BYTES
from services.kserve.stats import InferStats
from services.kserve.tensors import MODEL_VERSION, TensorSpec, decode_inputs, encode_output


def _tensor_metadata(spec: TensorSpec) -> service_pb2.ModelMetadataResponse.TensorMetadata:
    return service_pb2.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype,
                                                            shape=list(spec.shape))


def _config_type(datatype: str) -> int:
    # Triton's model config calls the BYTES datatype TYPE_STRING; the others are TYPE_<datatype>.
    return model_config_pb2.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """The KServe v2 / Triton inference protocol over the data plane, with Triton's statistics and the
    repository index (the REST door, services.kserve.http, calls these same methods). RPCs not
    overridden here (streaming inference, repository load / unload, shared memory, tracing, logging) answer
    UNIMPLEMENTED: the models are fixed at start-up and run in this process."""

    EXTENSIONS = ("binary_tensor_data", "statistics", "model_configuration", "model_repository(index)")

    def __init__(self, plane: Any, max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES, *, server_name: str,
                 optional_inputs: frozenset[str] = frozenset(),
                 parameters: Callable[[], dict[str, str]] | None = None) -> None:
        self.plane, self.max_tensor_bytes, self.server_name = plane, max_tensor_bytes, server_name
        self.optional_inputs, self.parameters = optional_inputs, parameters or dict
        self.stats = InferStats()

    def ServerLive(self, request: service_pb2.ServerLiveRequest,
                   context: grpc.ServicerContext) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    def ServerReady(self, request: service_pb2.ServerReadyRequest,
                    context: grpc.ServicerContext) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.plane.ready())

    def ModelReady(self, request: service_pb2.ModelReadyRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=self.plane.model_ready(request.name, request.version))

    def ServerMetadata(self, request: service_pb2.ServerMetadataRequest,
                       context: grpc.ServicerContext) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=self.server_name, version=solrl.__version__,
                                                  extensions=list(self.EXTENSIONS))

    def ModelStatistics(self, request: service_pb2.ModelStatisticsRequest,
                        context: grpc.ServicerContext) -> service_pb2.ModelStatisticsResponse:
        names = [self.plane.resolve(request.name, request.version, field="name")] if request.name else self.plane.models
        return json_format.ParseDict({"model_stats": [self.stats.model_stats(n, request.version or MODEL_VERSION)
                                                      for n in names]}, service_pb2.ModelStatisticsResponse())

    def RepositoryIndex(self, request: service_pb2.RepositoryIndexRequest,
                        context: grpc.ServicerContext) -> service_pb2.RepositoryIndexResponse:
        if request.repository_name:
            raise NotFoundError(f"repository_name: this server has one unnamed repository, not "
                                f"{request.repository_name!r}")
        out = service_pb2.RepositoryIndexResponse()
        for name in self.plane.models:
            ready = self.plane.model_ready(name)
            if ready or not request.ready:
                out.models.add(name=name, version=MODEL_VERSION, state="READY" if ready else "UNAVAILABLE",
                               reason="" if ready else "the model's worker is not running")
        return out

    def ModelMetadata(self, request: service_pb2.ModelMetadataRequest,
                      context: grpc.ServicerContext) -> service_pb2.ModelMetadataResponse:
        md = self.plane.metadata(request.name, request.version)
        return service_pb2.ModelMetadataResponse(name=md.name, versions=list(md.versions), platform=md.platform,
                                                 inputs=[_tensor_metadata(s) for s in md.inputs],
                                                 outputs=[_tensor_metadata(s) for s in md.outputs])

    def ModelConfig(self, request: service_pb2.ModelConfigRequest,
                    context: grpc.ServicerContext) -> service_pb2.ModelConfigResponse:
        md = self.plane.metadata(request.name, request.version)
        # max_batch_size 0: the shapes above already include the batch axis; batching, where a service does
        # it, is its own (its settings travel as parameters)
        config = model_config_pb2.ModelConfig(
            name=md.name, platform=md.platform, max_batch_size=0,
            input=[model_config_pb2.ModelInput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape),
                                               optional=s.name in self.optional_inputs) for s in md.inputs],
            output=[model_config_pb2.ModelOutput(name=s.name, data_type=_config_type(s.datatype), dims=list(s.shape))
                    for s in md.outputs],
            parameters={k: model_config_pb2.ModelParameter(string_value=v) for k, v in self.parameters().items()})
        return service_pb2.ModelConfigResponse(config=config)

    def ModelInfer(self, request: service_pb2.ModelInferRequest,
                   context: grpc.ServicerContext) -> service_pb2.ModelInferResponse:
        if not request.model_name:
            raise ValueError("model_name: required")
        name = self.plane.resolve(request.model_name, request.model_version)  # NOT_FOUND before decoding
        version = request.model_version or MODEL_VERSION
        t0 = time.perf_counter_ns()
        try:
            inputs = decode_inputs(request, self.max_tensor_bytes)
            t1 = time.perf_counter_ns()
            with queue_timer() as waits:
                outputs = self.plane.infer(name, inputs, request.model_version, [o.name for o in request.outputs])
            t2 = time.perf_counter_ns()
            response = service_pb2.ModelInferResponse(model_name=name, model_version=version, id=request.id)
            for out_name, array in outputs.items():
                meta, raw = encode_output(out_name, array)
                response.outputs.append(meta)
                response.raw_output_contents.append(raw)
        except BaseException:
            self.stats.record(name, version, ok=False, total_ns=time.perf_counter_ns() - t0)
            raise
        t3 = time.perf_counter_ns()
        queued = int(sum(waits) * 1e9)
        self.stats.record(name, version, ok=True, total_ns=t3 - t0, queue_ns=queued, input_ns=t1 - t0,
                          infer_ns=max(0, t2 - t1 - queued), output_ns=t3 - t2)
        return response
