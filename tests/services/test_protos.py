"""The proto contracts and their build step (solrl.protos_build)."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from solrl.protos_build import OUT_DIR, PROTO_ROOT, STAMP, build_protos, main, proto_files

SERVICES = {"explorer": {"Explorer": {"Explore", "Info", "LoadAdapter"}},
            "regenerator": {"Regenerator": {"Regenerate", "Info", "LoadAdapter"}},
            "reward": {"Reward": {"Score", "ListRewards"}},
            "trainer": {"Trainer": {"Status"}}}
# Shared messages and the fields the roles agreed on (ARCHITECTURE.md, Messages).
COMMON_FIELDS = {
    "Tensor": {"dtype", "shape", "data"},
    "AdapterVersion": {"version", "sha256"},
    "SamplerSpec": {"solver", "steps", "shift", "guidance"},
    "ExploreJob": {"job_id", "run_id", "prompt", "seeds", "steps", "kept", "selection", "min_adapter_version",
                   "sampler", "precision", "precision_policy"},
    "SeedSelection": {"job_id", "prompt", "seeds", "proxy_scores", "kept_indices", "adapter_version", "proxy"},
    "Rollout": {"job_id", "prompt", "seed", "x0", "reward", "proxy_reward", "adapter_version", "proxy"},
    "InfoResponse": {"model", "precision", "adapter_version", "resident_weight_bytes", "reward", "base_precision",
                     "model_path", "available_precisions"},
    "LoadAdapterRequest": {"safetensors", "version", "sha256"},
    "LoadAdapterResponse": {"adapter_version", "swap_ms"},
}


@pytest.fixture(scope="session", autouse=True)
def _generated() -> None:
    build_protos()  # a fresh clone has no solrl/pb yet


def _import_all(root: Path, package: str) -> dict:
    """Import every generated module of `package` (under root) in a fresh interpreter; report packages,
    services and methods. A subprocess keeps these modules out of this process's descriptor pool."""
    code = f"""
import importlib, json, pathlib, sys
sys.path.insert(0, {str(root)!r})
out = {{}}
for f in sorted(pathlib.Path({str(root)!r}, {package!r}).rglob("*_pb2*.py")):
    mod = ".".join(f.relative_to({str(root)!r}).with_suffix("").parts)
    m = importlib.import_module(mod)
    d = (m if mod.endswith("_pb2") else importlib.import_module(mod[:-5])).DESCRIPTOR
    services = {{s.name: sorted(s.methods_by_name) for s in d.services_by_name.values()}}
    out[mod] = {{"package": d.package, "services": services}}
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_generation_from_scratch_into_a_temp_dir(tmp_path: Path) -> None:
    out = tmp_path / "gen" / "pbgen"
    assert build_protos(PROTO_ROOT, out, package="pbgen") is True
    for rel in proto_files(PROTO_ROOT):
        stem = out / rel.parent / rel.stem
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert Path(f"{stem}{suffix}").is_file(), f"{stem}{suffix}"
        for d in [out, *(out / p for p in rel.parents if str(p) != ".")]:
            assert (d / "__init__.py").is_file(), d
    # idempotent: nothing is rewritten when the protos did not change
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    assert build_protos(PROTO_ROOT, out, package="pbgen") is False
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # the imports point into the output package, never at the top-level `solrl`
    for f in out.rglob("*.py*"):
        for line in f.read_text().splitlines():
            assert not re.match(r"^from solrl[. ]", line), f"{f}: {line}"
    found = _import_all(tmp_path / "gen", "pbgen")
    assert found["pbgen.solrl.reward.v1.reward_pb2"]["services"] == {"Reward": ["ListRewards", "Score"]}
    assert {v["package"] for v in found.values()} == {f"solrl.{s}.v1" for s in [*SERVICES, "common"]}


def test_regenerates_when_a_proto_changes(tmp_path: Path) -> None:
    root = tmp_path / "protos"
    shutil.copytree(PROTO_ROOT, root)
    out = tmp_path / "gen" / "pbedit"
    assert build_protos(root, out, package="pbedit") is True
    proto = root / "solrl" / "trainer" / "v1" / "trainer.proto"
    proto.write_text(proto.read_text().replace("int64 rollouts_consumed = 7;",
                                               "int64 rollouts_consumed = 7;\n  int64 added_for_test = 8;"))
    assert build_protos(root, out, package="pbedit") is True
    assert "added_for_test" in (out / "solrl" / "trainer" / "v1" / "trainer_pb2.pyi").read_text()
    extra = root / "solrl" / "extra" / "v1" / "extra.proto"
    extra.parent.mkdir(parents=True)
    extra.write_text('syntax = "proto3";\npackage solrl.extra.v1;\nmessage Ping { int32 n = 1; }\n')
    assert build_protos(root, out, package="pbedit") is True
    found = _import_all(tmp_path / "gen", "pbedit")
    assert found["pbedit.solrl.extra.v1.extra_pb2"]["package"] == "solrl.extra.v1"
    assert build_protos(root, out, package="pbedit") is False
    assert build_protos(root, out, package="pbedit", force=True) is True


def test_every_service_proto_has_a_versioned_package() -> None:
    files = proto_files(PROTO_ROOT)
    assert {f.parts[1] for f in files} == {*SERVICES, "common"}
    for rel in files:
        assert re.fullmatch(r"solrl/[a-z_]+/v\d+/[a-z_]+\.proto", rel.as_posix()), rel
        text = (PROTO_ROOT / rel).read_text()
        declared = re.findall(r"^package\s+([\w.]+)\s*;", text, flags=re.MULTILINE)
        assert declared == [".".join(rel.parts[:3])], (rel, declared)
        assert re.search(r'^syntax\s*=\s*"proto3"\s*;', text, flags=re.MULTILINE), rel


def test_generated_modules_import_and_declare_the_contracts() -> None:
    for svc, services in SERVICES.items():
        pb2 = importlib.import_module(f"solrl.pb.solrl.{svc}.v1.{svc}_pb2")
        grpc_mod = importlib.import_module(f"solrl.pb.solrl.{svc}.v1.{svc}_pb2_grpc")
        assert pb2.DESCRIPTOR.package == f"solrl.{svc}.v1"
        for name, methods in services.items():
            assert set(pb2.DESCRIPTOR.services_by_name[name].methods_by_name) == methods
            assert hasattr(grpc_mod, f"{name}Stub") and hasattr(grpc_mod, f"add_{name}Servicer_to_server")
    common = importlib.import_module("solrl.pb.solrl.common.v1.common_pb2")
    assert common.DESCRIPTOR.package == "solrl.common.v1"
    for msg, fields in COMMON_FIELDS.items():
        assert fields <= set(common.DESCRIPTOR.message_types_by_name[msg].fields_by_name), msg
    assert (OUT_DIR / STAMP).is_file()
    # both rollout roles answer Info and LoadAdapter with the one set of messages in common.v1
    for role, service in (("explorer", "Explorer"), ("regenerator", "Regenerator")):
        pb2 = importlib.import_module(f"solrl.pb.solrl.{role}.v1.{role}_pb2")
        methods = pb2.DESCRIPTOR.services_by_name[service].methods_by_name
        for rpc in ("Info", "LoadAdapter"):
            assert methods[rpc].input_type.full_name == f"solrl.common.v1.{rpc}Request"
            assert methods[rpc].output_type.full_name == f"solrl.common.v1.{rpc}Response"
        assert "InfoRequest" not in pb2.DESCRIPTOR.message_types_by_name  # no second copy


def test_messages_round_trip_on_the_wire() -> None:
    from solrl.pb.solrl.common.v1 import common_pb2
    from solrl.pb.solrl.regenerator.v1 import regenerator_pb2

    rollout = common_pb2.Rollout(job_id="j1", prompt="a red circle", seed=2**63 - 1, reward=0.5, proxy_reward=0.25,
                                 x0=common_pb2.Tensor(dtype="float32", shape=[4, 8, 8], data=bytes(4 * 256)),
                                 adapter_version=common_pb2.AdapterVersion(version=3, sha256="ab" * 32))
    resp = regenerator_pb2.RegenerateResponse(rollouts=[rollout])
    back = regenerator_pb2.RegenerateResponse.FromString(resp.SerializeToString())
    assert back == resp and back.rollouts[0].seed == 2**63 - 1 and list(back.rollouts[0].x0.shape) == [4, 8, 8]


def test_bad_input_gives_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"proto_root .* holds no \.proto files"):
        build_protos(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ValueError, match=r"proto_root .* is not a directory"):
        build_protos(tmp_path / "missing", tmp_path / "out")
    with pytest.raises(ValueError, match="package must be a dotted"):
        build_protos(PROTO_ROOT, tmp_path / "out", package="1bad")
    broken = tmp_path / "broken" / "solrl" / "x" / "v1"
    broken.mkdir(parents=True)
    (broken / "x.proto").write_text('syntax = "proto3";\npackage solrl.x.v1;\nmessage M { int32 n = 1 }\n')
    with pytest.raises(RuntimeError, match=r"(?s)protoc failed.*x\.proto:3:.*Expected"):
        build_protos(tmp_path / "broken", tmp_path / "out", package="out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no build leftovers


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--out", str(tmp_path / "clipb"), "--package", "clipb"]
    assert main(args) == 0 and "generated" in capsys.readouterr().out
    assert main(args) == 0 and "up to date" in capsys.readouterr().out
