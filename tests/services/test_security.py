"""Security: constant-time tokens, safetensors only, size limits, a configurable bind address, no
secret in logs or images. Real servers and processes on loopback; source checks read the tree's AST."""

from __future__ import annotations

import ast
import copy
import ipaddress
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import torch

from services.common.grpc_server import DEFAULT_MAX_RECEIVE_BYTES, MAX_GRPC_MESSAGE_SIZE
from services.common.tensors import numpy_to_tensor
from services.reward.dataplane import RewardDataPlane
from services.reward.server import build_server
from services.rollout.adapter_endpoint import AdapterEndpoint
from services.rollout.hot_swap import AdapterRejected, HotSwapModel
from solrl.adapters import LoraAdapters, LoraSpec, encode_adapter, sha256_hex
from solrl.engine.checkpoint import load_checkpoint, save_checkpoint
from solrl.models import load_model
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.pb.solrl.explorer.v1 import explorer_pb2_grpc
from solrl.pb.solrl.reward.v1 import reward_pb2, reward_pb2_grpc
from solrl.precision import PrecisionConfig
from solrl.rewards.jpeg import JpegCompressibility
from solrl.shapes.model import ShapesModel

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("solrl", "services") for p in (ROOT / d).rglob("*.py") if "pb" not in p.parts)
TOKEN = "tok-7f3a9c2e51b84d06a1e9"   # what must never show up in a log, a response or a command line


class Detonator:
    """A pickle that, if anything unpickles it, creates a file: proof that pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# ---------------------------------------------------------------------- source checks


def calls(tree: ast.AST, name: str) -> list[ast.Call]:
    """Calls whose function is `name` or ends in `.name`."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == name) or (isinstance(f, ast.Name) and f.id == name):
                out.append(node)
    return out


def kw(call: ast.Call, name: str) -> object:
    for k in call.keywords:
        if k.arg == name:
            return ast.literal_eval(k.value) if isinstance(k.value, ast.Constant) else "<expr>"
    return None


def test_no_pickle_in_the_tree():
    """No pickle-family module is imported; torch.load always runs with weights_only=True; numpy
    never loads pickles; the model loaders insist on safetensors."""
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [f"{rel}: import {a.name}" for a in node.names if a.name.split(".")[0] in banned]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in banned:
                problems.append(f"{rel}: from {node.module} import ...")
        for call in calls(tree, "load"):
            f = call.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if owner == "torch" and kw(call, "weights_only") is not True:
                problems.append(f"{rel}:{call.lineno}: torch.load without weights_only=True")
            if owner in ("np", "numpy") and kw(call, "allow_pickle") not in (None, False):
                problems.append(f"{rel}:{call.lineno}: np.load with allow_pickle")
        if rel.parts[:2] == ("solrl", "models"):
            for call in calls(tree, "from_pretrained"):
                if kw(call, "use_safetensors") is not True:
                    problems.append(f"{rel}:{call.lineno}: model from_pretrained without use_safetensors=True")
    assert not problems, "\n".join(problems)


def test_tokens_are_compared_in_constant_time():
    """Every comparison that involves a token or digest goes through hmac.compare_digest, never ==."""
    problems, uses = [], 0
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        uses += len(calls(tree, "compare_digest"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                names = {n.id.lower() for n in ast.walk(node) if isinstance(n, ast.Name)} | \
                    {n.attr.lower() for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if any("token" in n or "secret" in n or "sha256" in n for n in names):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not problems, "\n".join(problems)
    assert uses >= 2  # the bearer token and the adapter's sha256


# ---------------------------------------------------------------------- safetensors only, at run time


def test_model_weights_as_pickle_are_refused_without_unpickling(tmp_path):
    """A model directory whose weights are pickles (.bin) is refused; the pickle never runs."""
    good = tmp_path / "good"
    ShapesModel.random(seed=0, layers=6, heads=4).save(good)
    bad, marker = tmp_path / "bad", tmp_path / "pickle-ran"
    for part, name in (("transformer", "diffusion_pytorch_model.bin"), ("text_encoder", "pytorch_model.bin")):
        (bad / part).mkdir(parents=True)
        (bad / part / "config.json").write_bytes((good / part / "config.json").read_bytes())
        torch.save({"weight": Detonator(marker)}, bad / part / name)
    with pytest.raises((OSError, ValueError, EnvironmentError)):
        load_model("shapes", bad)
    assert not marker.exists()
    assert load_model("shapes", good) is not None  # the same directory with safetensors loads


def test_a_checkpoint_that_is_a_pickle_is_refused_without_unpickling(tmp_path):
    import pickle  # only to build the hostile file

    model = ShapesModel.random(seed=0, layers=6, heads=4)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
    adapters = LoraAdapters(model.transformer, spec, seed=0)
    opt = torch.optim.AdamW(list(adapters.parameters("default")), lr=1e-3)
    ckpt = save_checkpoint(tmp_path / "run", 1, adapters, opt, 0, 1)
    marker = tmp_path / "pickle-ran"
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        original = (ckpt / name).read_bytes()
        (ckpt / name).write_bytes(pickle.dumps({"w": Detonator(marker)}))
        with pytest.raises(Exception, match="(?i)header|safetensor|deserial|invalid"):
            load_checkpoint(ckpt, adapters, opt)
        (ckpt / name).write_bytes(original)
    assert not marker.exists()
    load_checkpoint(ckpt, adapters, opt)  # restored files load


# ---------------------------------------------------------------------- size limits


def test_grpc_requests_over_the_size_limit_are_resource_exhausted():
    plane = RewardDataPlane({"jpeg_compressibility": JpegCompressibility()})
    server = build_server(plane, max_receive_bytes=64 << 10)
    server.start()
    try:
        with grpc.insecure_channel(server.address, options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE)]) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            small = np.zeros((2, 32, 32, 3), np.uint8)
            big = np.zeros((40, 32, 32, 3), np.uint8)  # 120 KiB
            with pytest.raises(grpc.RpcError) as info:
                stub.Score(reward_pb2.ScoreRequest(reward="jpeg_compressibility", images=numpy_to_tensor(big),
                                                   prompts=["x"] * 40), timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            ok = stub.Score(reward_pb2.ScoreRequest(reward="jpeg_compressibility", images=numpy_to_tensor(small),
                                                    prompts=["x"] * 2), timeout=30)
            assert len(ok.scores) == 2  # the server is unharmed
    finally:
        server.stop(0)
        plane.close()
    assert DEFAULT_MAX_RECEIVE_BYTES < MAX_GRPC_MESSAGE_SIZE  # services do not take 2 GiB requests by default
    with pytest.raises(ValueError, match="max_receive_bytes"):
        build_server(plane, max_receive_bytes=0)


def test_oversized_and_hostile_grpc_adapter_pushes_are_refused():
    model = ShapesModel.random(seed=0, layers=6, heads=4)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
    hot = HotSwapModel(copy.deepcopy(model.transformer), spec, PrecisionConfig("fp32"))
    endpoint = AdapterEndpoint(hot, token=TOKEN, max_bytes=4096)
    with pytest.raises(AdapterRejected) as info:
        endpoint.load(f"Bearer {TOKEN}", b"\0" * 4097, 1, sha256_hex(b"\0" * 4097))
    assert info.value.reason == "too_large" and info.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    import pickle  # only to build the hostile payload

    for data in (pickle.dumps({"w": 1}), b"", b"\xff" * 64):
        with pytest.raises(AdapterRejected) as info:
            endpoint.load(f"Bearer {TOKEN}", data, 1, sha256_hex(data))
        assert info.value.reason == "invalid"
    for auth in (None, "", "Bearer", f"Bearer {TOKEN}x", f"bearer {TOKEN[:-1]}", f"Basic {TOKEN}", "Bearer \u00e9"):
        with pytest.raises(AdapterRejected) as info:
            endpoint.load(auth, b"x", 1, sha256_hex(b"x"))
        assert info.value.reason == "unauthenticated", auth
    assert hot.current().version == 0


# ---------------------------------------------------------------------- bind address, secrets in logs


def listening(port: int) -> list[str]:
    """Local addresses listening on `port`, from /proc/net/tcp and tcp6."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, port_hex = local.rsplit(":", 1)
            if state == "0A" and int(port_hex, 16) == port:  # 0A = LISTEN
                raw = bytes.fromhex(addr)
                if len(raw) == 4:
                    out.append(".".join(str(b) for b in raw[::-1]))
                else:  # four little-endian 32-bit words; gRPC binds v4 addresses as v4-mapped v6
                    v6 = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                    out.append(str(v6.ipv4_mapped or v6))
    return out


def wait_banner(proc: subprocess.Popen, prefix: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if line.startswith(prefix):
                return line
    raise AssertionError(f"no {prefix!r} banner; exit code {proc.poll()}")


@pytest.mark.slow
def test_explorer_binds_where_told_and_never_shows_its_token(tmp_path):
    """An explorer process with SOLRL_BIND_HOST=127.0.0.1 and a token: it listens on loopback only;
    good, bad and oversized pushes over HTTP and gRPC; the token appears in no log line, response,
    metric or command line."""
    model_dir = tmp_path / "model"
    model = ShapesModel.random(seed=0, layers=6, heads=4)
    model.save(model_dir)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=model.spec.lora_targets)
    adapters = LoraAdapters(copy.deepcopy(model.transformer), spec, seed=1)
    with torch.no_grad():
        for p in adapters.parameters("default"):
            p.add_(0.1)
    good = encode_adapter(adapters.state_dict("default"), 1, spec)
    log_path = tmp_path / "explorer.log"
    env = {**os.environ, "SOLRL_BIND_HOST": "127.0.0.1", "SOLRL_ADAPTER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.explorer.server", "--model-path", str(model_dir), "--precision", "fp32",
         "--base-precision", "fp32", "--reward", "jpeg_compressibility", "--lora-rank", "2", "--lora-alpha", "4",
         "--threads", "1", "--grpc-port", "0", "--http-port", "0", "--max-adapter-bytes", str(len(good) + 1024)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True)
    seen: list[str] = []
    try:
        banner = wait_banner(proc, "solrl explorer:")
        seen.append(banner)
        grpc_addr = banner.split("grpc ")[1].split(",")[0]
        http_addr = banner.split("http ")[1].split(",")[0]
        for port in (int(grpc_addr.rsplit(":", 1)[1]), int(http_addr.rsplit(":", 1)[1])):
            assert listening(port) == ["127.0.0.1"], (port, listening(port))
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert TOKEN not in cmdline  # the token travels in the environment only

        http = httpx.Client(base_url=f"http://{http_addr}", timeout=60)

        def put(data: bytes, version: int, auth: str | None) -> httpx.Response:
            h = {"X-Adapter-Version": str(version), "X-Adapter-Sha256": sha256_hex(data)}
            if auth is not None:
                h["Authorization"] = auth
            r = http.put("/v1/adapter", content=data, headers=h)
            seen.append(r.text + str(r.headers))
            return r

        assert put(good, 1, f"Bearer {TOKEN}x").status_code == 401       # a near miss of the real token
        assert put(good, 1, f"Bearer {TOKEN[:8]}").status_code == 401    # its prefix
        assert put(good, 1, f"Basic {TOKEN}").status_code == 401
        assert put(b"\0" * (len(good) + 2048), 1, f"Bearer {TOKEN}").status_code == 413
        assert put(good[:-10], 1, f"Bearer {TOKEN}").status_code == 400
        assert put(good, 1, f"Bearer {TOKEN}").status_code == 200
        with grpc.insecure_channel(grpc_addr) as channel:
            stub = explorer_pb2_grpc.ExplorerStub(channel)
            for auth, want in ((f"Bearer {TOKEN}!", grpc.StatusCode.UNAUTHENTICATED),
                               (f"Bearer {TOKEN}", grpc.StatusCode.RESOURCE_EXHAUSTED)):
                data = good + b"\0" * 4096 if want == grpc.StatusCode.RESOURCE_EXHAUSTED else good
                with pytest.raises(grpc.RpcError) as info:
                    stub.LoadAdapter(common_pb2.LoadAdapterRequest(safetensors=data, version=2,
                                                                     sha256=sha256_hex(data)),
                                     metadata=[("authorization", auth)], timeout=60)
                assert info.value.code() == want
                seen.append(info.value.details() or "")
            info_rpc = stub.Info(common_pb2.InfoRequest(), timeout=30)
            assert info_rpc.adapter_version.version == 1  # the refused pushes changed nothing
            seen.append(str(info_rpc))
        for path in ("/v1/info", "/v1/adapter", "/metrics", "/healthz", "/readyz"):
            seen.append(http.get(path).text)
        http.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        seen.append(out)
    logs = log_path.read_text()
    assert "swapped in" in logs and "adapter push refused" in logs  # the pushes were logged ...
    for text in [logs, *seen]:
        assert TOKEN not in text and TOKEN[:8] not in text  # ... without the token or a piece of it
    print(f"explorer: {len(logs.splitlines())} log lines, {len(seen)} responses checked; token absent")


def test_images_carry_no_secret():
    """The Dockerfile (one for every role) copies only code and sets no secret; the token reaches containers
    at run time."""
    dockerfiles = sorted(ROOT.glob("services/**/Dockerfile"))
    assert dockerfiles == [ROOT / "services" / "Dockerfile"]
    # the code, the wheels built on the host (make wheelhouse: packages from PyPI) and HPSv3's pinned requirements:
    # no secret
    allowed = {"pyproject.toml", "README.md", "Makefile", "protos", "solrl", "services", "build/wheelhouse/${FLAVOR}",
               "envs/hpsv3/requirements.txt"}
    for path in dockerfiles:
        for line in path.read_text().splitlines():
            words = line.split()
            if not words:
                continue
            if words[0] in ("ENV", "ARG", "LABEL"):
                assert not re.search(r"(?i)token|secret|passw|api_?key", line), f"{path}: {line}"
            if words[0] in ("COPY", "ADD") and not any(w.startswith("--from") for w in words):
                sources = [w for w in words[1:-1] if not w.startswith("--")]
                assert set(sources) <= allowed, f"{path}: {line}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "runs" in ignored  # run directories (checkpoints, logs) never enter the build context
