"""The registry without torchao (the GPU image as it is): BF16, FP32 and the Transformer Engine names stay
registered, the torchao modules' backends are recorded as unavailable with their ImportError, and building one
says why. Run in a subprocess, torchao made unimportable before solrl loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
sys.modules["torchao"] = None   # import torchao raises ImportError
from solrl.precision import PrecisionConfig, available_backends, build_backend, unavailable_backends
out = {"available": available_backends(), "unavailable": unavailable_backends(),
       "bf16": type(build_backend(PrecisionConfig("bf16"))).__name__,
       "fp8": type(build_backend(PrecisionConfig("fp8"))).__name__}
try:
    build_backend(PrecisionConfig("fp8-e4m3-emu"))
except ImportError as err:
    out["emu_error"] = str(err)
print(json.dumps(out))
"""


def test_registry_without_torchao_keeps_bf16_and_records_why():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["available"] == ["bf16", "bf16-cpu", "fp32", "fp8", "nvfp4"]
    assert set(out["unavailable"]) == {"fp8-e4m3-emu", "fp8-e5m2-emu", "fp8-torchao", "mxfp4-emu", "nvfp4-emu",
                                       "nvfp4-te-emu"}
    assert all("torchao" in why for why in out["unavailable"].values())
    # fp8 without Transformer Engine and without torchao: the TE backend, whose machine check then says why
    assert out["bf16"] == "Bf16Backend" and out["fp8"] == "FP8TEBackend"
    assert "fp8-e4m3-emu" in out["emu_error"] and "torchao" in out["emu_error"]


def test_with_torchao_every_built_in_backend_registers():
    from solrl.precision import available_backends, unavailable_backends
    from solrl.precision.config import BACKEND_NAMES
    from solrl.precision.registry import MODULES

    assert unavailable_backends() == {}
    assert sorted(n for names in MODULES.values() for n in names) == sorted(BACKEND_NAMES) == available_backends()
    print(json.dumps(available_backends()))
