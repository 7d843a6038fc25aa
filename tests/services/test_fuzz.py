"""Fuzzing every RPC and HTTP route with generated input: a client's mistake is never a crash, never
INTERNAL / UNKNOWN over gRPC, never a 5xx over HTTP.

Real servers on loopback (the reward, explorer, regenerator and trainer gRPC servers, each rollout
service's ops app with its hot-reload route). hypothesis generates protobuf messages, tensors and
raw request bytes; schemathesis generates requests from each FastAPI app's OpenAPI document.
Examples are derandomized (the same ones every run) and bounded for CI.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import grpc
import httpx
import pytest
import schemathesis
import torch
from diffusers import PixArtTransformer2DModel
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from transformers import CLIPTextModel
from tritonclient.grpc import service_pb2

from services.common.grpc_server import GrpcService, build_grpc_server, service_name
from services.common.metrics import ServiceMetrics
from services.common.tensors import DTYPES
from services.explorer.dataplane import ExplorerDataPlane
from services.explorer.server import start as start_explorer
from services.regenerator.dataplane import RegeneratorDataPlane
from services.regenerator.server import start as start_regenerator
from services.reward.dataplane import RewardDataPlane
from services.reward.server import start as start_reward
from services.trainer.server import TrainerServicer
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2
from solrl.pb.solrl.regenerator.v1 import regenerator_pb2
from solrl.pb.solrl.reward.v1 import reward_pb2
from solrl.pb.solrl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from solrl.precision import PrecisionConfig
from solrl.rewards import build_reward
from solrl.shapes.model import ShapesModel, text_encoder_config, transformer_config

TOKEN = "fuzz-token"
# What a client's mistake may be answered with. INTERNAL and UNKNOWN are server faults; a hang
# (DEADLINE_EXCEEDED) is one too.
CLIENT_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tiny_shapes() -> ShapesModel:
    torch.manual_seed(0)
    config = {**transformer_config(), "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 16,
              "cross_attention_dim": 32}
    return ShapesModel(PixArtTransformer2DModel(**config), CLIPTextModel(text_encoder_config()))


class Servers:
    """Every service's gRPC server (and the rollout services' ops apps), in process on loopback."""

    def __init__(self) -> None:
        model = tiny_shapes()
        self.lora = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
        scorer = build_reward("jpeg_compressibility")
        limits = {"max_seeds": 16, "max_steps": 3, "version_wait_s": 0.0}  # bounded work per valid request
        self.reward = start_reward(RewardDataPlane.build(["jpeg_compressibility", "shapes"]), ServiceMetrics("reward"))
        self.explorer = start_explorer(
            ExplorerDataPlane(copy.deepcopy(model), PrecisionConfig("fp32"), self.lora, scorer, steps=2, kept=2,
                              **limits), ServiceMetrics("explorer"), adapter_token=TOKEN, max_adapter_bytes=1 << 20)
        self.regenerator = start_regenerator(
            RegeneratorDataPlane(copy.deepcopy(model), PrecisionConfig("fp32"), self.lora, scorer, steps=2, **limits),
            ServiceMetrics("regenerator"), adapter_token=TOKEN, max_adapter_bytes=1 << 20)
        self.trainer = build_grpc_server([GrpcService(service_name(trainer_pb2, "Trainer"),
                                                      trainer_pb2_grpc.add_TrainerServicer_to_server,
                                                      TrainerServicer("fuzz"))])
        self.trainer.start()
        adapters = LoraAdapters(copy.deepcopy(model.transformer), self.lora, seed=1)
        self.adapter = encode_adapter(adapters.state_dict("default"), 1, self.lora)
        self.addresses = {"reward": self.reward.grpc.address, "explorer": self.explorer.grpc.address,
                          "regenerator": self.regenerator.grpc.address, "trainer": self.trainer.address}
        self.channels = {k: grpc.insecure_channel(a) for k, a in self.addresses.items()}
        self.calls: dict[str, dict[str, int]] = {}

    def call(self, service: str, method: str, request: bytes, metadata=()) -> grpc.StatusCode:
        """One unary call with raw request bytes; returns its status code, asserting it is a client's."""
        rpc = self.channels[service].unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            rpc(request, timeout=60, metadata=metadata)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
        counts = self.calls.setdefault(f"{service}{method}", {})
        counts[code.name] = counts.get(code.name, 0) + 1
        assert code in CLIENT_CODES, f"{service} {method}: {code.name}: {details}"
        return code

    def healthy(self) -> None:
        for name, channel in self.channels.items():
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, name

    def close(self) -> None:
        for c in self.channels.values():
            c.close()
        for svc in (self.reward, self.explorer, self.regenerator):
            svc.stop(0)
        self.trainer.stop(0)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s = Servers()
    yield s
    s.healthy()  # still serving after everything thrown at it
    s.close()
    for method, counts in sorted(s.calls.items()):
        print(f"{method}: {counts}")


# ---------------------------------------------------------------------- strategies
# Hand-written: hypothesis has no maintained protobuf strategy package for protobuf 5/6, and these
# aim at the fields the servers check (near-valid values reach deeper code than random ones).

small_int = st.integers(-3, 40)
any_int32 = st.one_of(small_int, st.integers(-(2**31), 2**31 - 1))
any_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 3.0, -1.0]))
text = st.one_of(st.sampled_from(["", "a red circle", "two blue squares", "a blue dragon", " "]),
                 st.text(max_size=40))
DTYPE_NAMES = [*DTYPES, "", "float8", "complex64", "object", "U8"]


@st.composite
def tensors(draw, image_like: bool = False) -> common_pb2.Tensor:
    dtype = draw(st.sampled_from(["uint8"] * 4 + DTYPE_NAMES if image_like else DTYPE_NAMES))
    if image_like and draw(st.booleans()):
        shape = [draw(st.integers(0, 3)), draw(st.sampled_from([1, 8, 32])), draw(st.sampled_from([1, 8, 32])),
                 draw(st.sampled_from([1, 3, 4]))]
    else:
        shape = draw(st.lists(small_int, max_size=5))
    size = 1
    for d in shape:
        size *= max(d, 0)
    itemsize = torch.tensor([], dtype=DTYPES[dtype]).element_size() if dtype in DTYPES else 1
    if size * itemsize <= 1 << 16 and draw(st.booleans()):
        data = draw(st.binary(min_size=size * itemsize, max_size=size * itemsize))  # the right length
    else:
        data = draw(st.binary(max_size=256))
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def score_requests(draw) -> reward_pb2.ScoreRequest:
    """Half near-valid (uint8 [B, 32, 32, 3] and B prompts, sometimes one off), half anything."""
    reward = draw(st.sampled_from(["", "jpeg_compressibility", "shapes", "x"]))
    if draw(st.booleans()):
        return reward_pb2.ScoreRequest(reward=reward, images=draw(tensors(image_like=True)),
                                       prompts=draw(st.lists(text, max_size=4)))
    b = draw(st.integers(1, 3))
    data = draw(st.binary(min_size=b * 32 * 32 * 3, max_size=b * 32 * 32 * 3))
    prompts = draw(st.lists(text, min_size=max(b - 1, 0), max_size=b + 1))
    return reward_pb2.ScoreRequest(reward=reward, prompts=prompts,
                                   images=common_pb2.Tensor(dtype="uint8", shape=[b, 32, 32, 3], data=data))


samplers = st.builds(common_pb2.SamplerSpec, solver=st.sampled_from(["", "euler", "dpm2", "heun", "x"]),
                     steps=any_int32, shift=any_float, guidance=any_float)
seeds = st.lists(st.one_of(st.integers(0, 100), st.integers(0, 2**64 - 1)), max_size=20)
valid_prompts = st.sampled_from(["a red circle", "two blue squares", "a green triangle on the left"])
near_samplers = st.one_of(st.just(common_pb2.SamplerSpec()), samplers)
explore_jobs = st.one_of(
    st.builds(common_pb2.ExploreJob, job_id=text, run_id=text, prompt=text, seeds=seeds, steps=any_int32,
              kept=any_int32, selection=st.sampled_from(["", "best_worst", "top", "random", "x"]),
              min_adapter_version=st.sampled_from([0, 0, 0, 1, -5, 2**62]), sampler=samplers),
    st.builds(common_pb2.ExploreJob, job_id=text, prompt=valid_prompts,  # near-valid: reaches the model
              seeds=st.lists(st.integers(0, 1000), min_size=1, max_size=8), steps=st.sampled_from([0, 1, 2, 3, 4]),
              kept=st.sampled_from([0, 2, 2, 1, 3, 9]), selection=st.sampled_from(["", "best_worst", "best", "x"]),
              sampler=near_samplers))


@st.composite
def near_valid_selections(draw) -> common_pb2.SeedSelection:
    pool = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=6))
    kept = draw(st.lists(st.integers(-1, len(pool)), min_size=1, max_size=3))
    scores = draw(st.lists(st.floats(-1, 1, width=32), min_size=len(pool) - 1, max_size=len(pool)))
    return common_pb2.SeedSelection(job_id=draw(text), prompt=draw(valid_prompts), seeds=pool, proxy_scores=scores,
                                    kept_indices=kept, sampler=draw(near_samplers))


selections = st.one_of(
    st.builds(common_pb2.SeedSelection, job_id=text, prompt=text, seeds=seeds,
              proxy_scores=st.lists(st.floats(width=32), max_size=20), kept_indices=st.lists(any_int32, max_size=6),
              adapter_version=st.builds(common_pb2.AdapterVersion, version=st.sampled_from([0, 1, -1]), sha256=text),
              sampler=samplers),
    near_valid_selections())


@st.composite
def infer_requests(draw, models: list[str], inputs: list[str]) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from([*models, "", "nope"])),
                                        model_version=draw(st.sampled_from(["", "", "1", "2", "x"])),
                                        id=draw(text))
    datatypes = ["UINT8", "BYTES", "FP32", "INT64", "INT32", "BOOL", "FP16", "BF16", "UINT64", "WHAT", ""]
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 5))):
        t = req.inputs.add(name=draw(st.sampled_from([*inputs, "X", ""])), datatype=draw(st.sampled_from(datatypes)),
                           shape=draw(st.lists(small_int, max_size=4)))
        if raw:
            req.raw_input_contents.append(draw(st.binary(max_size=128)))
        elif draw(st.booleans()):
            t.contents.int_contents.extend(draw(st.lists(any_int32, max_size=8)))
            t.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=8), max_size=4)))
            t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=8)))
    if draw(st.booleans()):  # a stray raw entry with no input, or one too many
        req.raw_input_contents.append(draw(st.binary(max_size=32)))
    for name in draw(st.lists(st.sampled_from(["SCORES", "SEEDS", "KEPT", "nope"]), max_size=2)):
        req.outputs.add(name=name)
    return req


def auth_metadata(draw_auth: str | None) -> tuple[tuple[str, str], ...]:
    return () if draw_auth is None else (("authorization", draw_auth),)


auths = st.one_of(st.just(f"Bearer {TOKEN}"), st.none(),
                  st.sampled_from([f"Bearer {TOKEN}", "Bearer nope", TOKEN, "Basic x", "Bearer "]),
                  st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30))


# ---------------------------------------------------------------------- gRPC


def test_every_unary_rpc_takes_garbage_bytes_as_a_client_error(servers):
    """Raw bytes that may not even parse as the request message, against every unary method."""
    methods = [("reward", reward_pb2, "Reward"), ("reward", service_pb2, "GRPCInferenceService"),
               ("explorer", explorer_pb2, "Explorer"), ("explorer", service_pb2, "GRPCInferenceService"),
               ("regenerator", regenerator_pb2, "Regenerator"), ("trainer", trainer_pb2, "Trainer")]
    paths = [(svc, f"/{d.full_name}/{m.name}") for svc, mod, name in methods
             for d in [mod.DESCRIPTOR.services_by_name[name]] for m in d.methods
             if not (m.client_streaming or m.server_streaming)]

    @FUZZ
    @given(st.sampled_from(paths), st.one_of(st.binary(max_size=300), st.just(b"\x0a\xff\xff\xff\xff\x0f"),
                                             st.just(b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01")))
    def run(target, data):
        servers.call(*target, data)

    run()
    not_parsed = sum(c.get("INVALID_ARGUMENT", 0) for c in servers.calls.values())
    assert not_parsed > 0  # some of the bytes were refused, as a client error


def test_reward_score_and_model_infer(servers):
    @FUZZ
    @given(score_requests())
    def score(request):
        servers.call("reward", "/solrl.reward.v1.Reward/Score", request.SerializeToString())

    @FUZZ
    @given(infer_requests(["jpeg_compressibility", "shapes"], ["IMAGES", "PROMPTS"]))
    def infer(request):
        servers.call("reward", "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString())

    score()
    infer()
    assert servers.calls["reward/solrl.reward.v1.Reward/Score"].get("OK", 0) > 0  # some were valid


def test_explorer_explore_and_model_infer(servers):
    @FUZZ
    @given(st.builds(explorer_pb2.ExploreRequest, job=explore_jobs, n=st.sampled_from([0, 0, 1, 4, 17, -1])))
    def explore(request):
        servers.call("explorer", "/solrl.explorer.v1.Explorer/Explore", request.SerializeToString())

    @FUZZ
    @given(infer_requests(["explore"], ["PROMPTS", "N", "STEPS", "K", "GATE", "SEEDS"]))
    def infer(request):
        servers.call("explorer", "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString())

    explore()
    infer()
    assert servers.calls["explorer/solrl.explorer.v1.Explorer/Explore"].get("OK", 0) > 0  # some reached the model


def test_regenerator_regenerate(servers):
    @FUZZ
    @given(st.builds(regenerator_pb2.RegenerateRequest, selection=selections, return_images=st.booleans()))
    def regenerate(request):
        servers.call("regenerator", "/solrl.regenerator.v1.Regenerator/Regenerate", request.SerializeToString())

    regenerate()
    assert servers.calls["regenerator/solrl.regenerator.v1.Regenerator/Regenerate"].get("OK", 0) > 0


def test_load_adapter_and_trainer_status(servers):
    good = servers.adapter

    @FUZZ
    @given(st.sampled_from(["explorer", "regenerator"]),
           st.one_of(st.binary(max_size=200), st.just(good), st.just(good[:-7]),
                     st.binary(min_size=8, max_size=64).map(lambda b: good[:8] + b)),
           st.sampled_from([0, 1, 1, -1, 2**62]), st.one_of(text, st.just(sha256_hex(good))), auths)
    def load(service, data, version, sha, auth):
        req = common_pb2.LoadAdapterRequest(safetensors=data, version=version, sha256=sha)  # both roles (common.v1)
        method = f"/solrl.{service}.v1.{service.capitalize()}/LoadAdapter"
        servers.call(service, method, req.SerializeToString(), auth_metadata(auth))

    @FUZZ
    @given(st.binary(max_size=64))
    def status(data):
        servers.call("trainer", "/solrl.trainer.v1.Trainer/Status", data)

    load()
    status()


# ---------------------------------------------------------------------- HTTP (schemathesis)


@pytest.mark.parametrize("role", ["explorer", "regenerator"])
def test_ops_apps_answer_generated_requests_without_a_server_error(servers, role):
    """schemathesis, from the ops app's own OpenAPI document (health, metrics, info, hot reload), against
    the running uvicorn server; both positive and negative (schema-violating) requests."""
    svc = getattr(servers, role)
    app = svc.http._server.config.app
    raw = app.openapi()
    assert "/v1/adapter" in raw["paths"] and "/healthz" in raw["paths"]
    schema = schemathesis.openapi.from_dict(raw)
    base_url = f"http://127.0.0.1:{svc.http.port}"
    statuses: dict[int, int] = {}
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=40, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(), authorized=st.booleans())
        def run(case, authorized):
            # half the requests carry the real token, so that the body and the other headers are checked too
            headers = {"Authorization": f"Bearer {TOKEN}"} if authorized else None
            response = case.call(base_url=base_url, headers=headers, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        run()
    assert not [s for s in statuses if s >= 500], statuses
    assert statuses.get(200, 0) > 0 and any(400 <= s < 500 for s in statuses), statuses
    print(f"{role} ops app: responses by status {dict(sorted(statuses.items()))}")
    with httpx.Client(base_url=base_url) as http:
        assert http.get("/readyz").status_code == 200
