"""The GPU kit (solrl/gpu_kit.py): what gpu_check imports is in the lent image's list (envs/gpu-image-packages.txt)
or in the kit, the kit carries nothing the image has (but a wheel installed only where the image's import fails),
and a downloaded kit (`make gpu-kit`) fits a run's 64 MiB and installs from its manifest."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from solrl import gpu_kit

KIT_DIR = gpu_kit.ROOT / "runs" / "gpu-kit"


def test_the_image_list_holds_the_documented_versions():
    image = gpu_kit.image_packages()
    assert image["torch"] == "2.11.0" and image["triton"] == "3.6.0" and image["transformers"] == "5.17.0"
    assert {"peft", "grpcio", "protobuf", "numpy", "safetensors", "huggingface-hub", "pillow"} <= set(image)
    assert not {"diffusers", "torchao", "transformer-engine", "redis"} & set(image)


def test_gpu_check_imports_are_in_the_image_or_the_kit():
    image, kit = gpu_kit.image_packages(), {gpu_kit.norm(w.name) for w in gpu_kit.KIT}
    imports = gpu_kit.gpu_check_imports()
    assert {"torch", "diffusers", "torchao", "peft"} <= set(imports)
    missing = {d: mods for d, mods in imports.items() if d not in image and d not in kit
               and d not in gpu_kit.NOT_CARRIED}
    assert missing == {}, f"gpu_check imports these and neither the image nor the kit has them: {missing}"
    # the kit carries nothing the image has, except a wheel installed only where the image's own import fails
    assert {gpu_kit.norm(w.name) for w in gpu_kit.KIT if not w.only_if_broken} & set(image) == set()
    assert set(gpu_kit.NOT_CARRIED) <= set(imports) | {"redis"}


@pytest.mark.skipif(not (KIT_DIR / gpu_kit.MANIFEST).is_file(), reason="no kit downloaded here (make gpu-kit)")
def test_the_downloaded_kit_fits_and_installs_from_its_manifest(tmp_path):
    m = json.loads((KIT_DIR / gpu_kit.MANIFEST).read_text())
    assert [(w["name"], w["version"]) for w in m["wheels"]] == [(w.name, w.version) for w in gpu_kit.KIT]
    assert m["fits"] and m["total_bytes"] + m["repo_tracked_bytes"] <= gpu_kit.LIMIT_BYTES
    assert all(not w["requires_missing"] and not w.get("requires_unmet") for w in m["wheels"])
    did = gpu_kit.install(KIT_DIR, tmp_path / "site", python=sys.executable)
    assert (tmp_path / "site" / "diffusers").is_dir() and (tmp_path / "site" / "torchao").is_dir()
    assert any(line.startswith("peft") for line in did)
    # a wheel that does not match its manifest is refused
    bad = tmp_path / "kit"
    shutil.copytree(KIT_DIR, bad)
    m["wheels"][0]["sha256"] = "0" * 64
    (bad / gpu_kit.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(SystemExit, match="sha256"):
        gpu_kit.install(bad, tmp_path / "site2", python=sys.executable)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_passes_the_budget_and_runs_the_kit_with_the_images_python():
    import subprocess

    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", *args], cwd=gpu_kit.ROOT, capture_output=True, text=True,
                              check=True).stdout

    assert "-m solrl.gpu_check --out runs/gpu-check --budget-s 123" in dry("gpu-check", "BUDGET=123")
    assert "--budget-s 400" in dry("gpu-check")   # the default
    assert ("python3 -m solrl.gpu_kit check --kit runs/gpu-kit -- --out runs/gpu-check --budget-s 400"
            in dry("gpu-check-kit"))


def test_a_requirement_outside_the_images_documented_version_is_reported():
    image = {"huggingface-hub": "1.33.0", "safetensors": "0.8.0", "numpy": None}
    assert gpu_kit.unmet(["huggingface-hub<3.0,>=1.32.0", "safetensors>=0.8.0", "numpy>=1.17", "Pillow"], image) == []
    assert gpu_kit.unmet(["safetensors>=0.9"], image) == ["safetensors>=0.9 (the image has 0.8.0)"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_the_rehearsal_pins_the_images_versions():
    import re
    import subprocess

    text = subprocess.run(["make", "-n", "gpu-rehearsal"], cwd=gpu_kit.ROOT, capture_output=True, text=True,
                          check=True).stdout
    image = gpu_kit.image_packages()
    pins = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][0-9a-z.+]*)", text))
    assert {"torch", "transformers"} <= set(pins)
    assert all(image[gpu_kit.norm(name)] == version for name, version in pins.items()), pins
    assert "solrl.gpu_kit check --kit runs/gpu-kit" in text and "--dry-run" in text
