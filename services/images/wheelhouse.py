"""The wheels an image installs, fetched on this host through its own pip configuration (index, mirror,
find-links, proxy; `make wheelhouse`): services/Dockerfile installs them with `pip install --no-index`, so a
build needs no network, as on an air-gapped cluster (docs/deploy.md).

    python services/images/wheelhouse.py cpu build/wheelhouse/cpu   # torch 2.13.0's CPU wheel
    python services/images/wheelhouse.py gpu build/wheelhouse/gpu   # PyPI's CUDA torch, Transformer Engine
    python services/images/wheelhouse.py gpu build/wheelhouse/gpu --engine none   # CUDA torch without TE: the
                                                                    # reward, regenerator and trainer images

DEST gets every wheel of pyproject.toml's dependencies (plus setuptools, the project's build backend) and a
requirements.txt pinning each (name==version, from the wheel files). Existing wheels are reused (pip's own
cache too), so a second run only checks. Light on purpose: the standard library and the pip it runs."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
# a GPU wheelhouse must not take the CPU build of the same version (2.13.0+cpu sorts above 2.13.0, and a host's
# find-links may hold it): PyPI's torch 2.13.0 for Linux x86_64 is the CUDA 13.0 build (it requires
# cuda-toolkit==13.0.3 and nvidia-cudnn-cu13, whose wheels bring the CUDA libraries)
TORCH_GPU = "torch==2.13.0,!=2.13.0+cpu"
TE = "transformer-engine[pytorch]==2.20.2"   # pyproject.toml's `gpu` extra
# Transformer Engine's PyTorch binding is an sdist on PyPI (its core library, transformer_engine_cu<N>, a binary wheel
# whose N the binding's build takes from the CUDA it compiles against: cu13 with PyPI's torch 2.13.0): built here into
# a wheel against the CUDA torch and nvcc of the pip that runs (`--pip`: on a CUDA host, hence a GPU wheelhouse with TE
# is made there), for Hopper (sm_90: H100 / H200, FP8) and Blackwell (sm_100: B200, NVFP4) only, MAX_JOBS bounding
# the parallel compiles (left alone it compiles for every architecture it knows and can exhaust a builder's memory),
# NVTE_PYTORCH_FORCE_BUILD so that its setup compiles rather than fetch a prebuilt binding from GitHub (an air-gapped
# builder cannot, and those match NGC's torch builds, not PyPI's)
TE_BINDING = "transformer-engine-torch==2.20.2"
TE_BUILD_ENV = {"NVTE_FRAMEWORK": "pytorch", "NVTE_CUDA_ARCHS": "90;100", "TORCH_CUDA_ARCH_LIST": "9.0;10.0",
                "MAX_JOBS": "8", "NVTE_PYTORCH_FORCE_BUILD": "TRUE"}
BUILD = ["setuptools>=68", "wheel"]          # `pip install --no-build-isolation -e .` in the image
# What the image's python needs beyond the host's: pip resolves markers against the python it runs, and Debian
# bookworm's python3 is 3.11.2 (redis wants async-timeout below 3.11.3)
MARKERS = ["async-timeout>=4.0.3"]


def requirements(flavor: str, engine: str = "te") -> list[str]:
    """What the wheelhouse holds: the project's dependencies (torch pinned), the build backend, and for the GPU flavor
    with engine "te" Transformer Engine (pinned as the `gpu` extra; its binding built apart, TE_BINDING)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.startswith("torch==")]
    extra = project["optional-dependencies"]["gpu"] if flavor == "gpu" and engine == "te" else []
    assert extra in ([], [TE]), f"pyproject.toml's gpu extra {extra} is not {TE}"
    return [TORCH_GPU if flavor == "gpu" else TORCH, *deps, *extra, *BUILD, *MARKERS]


def pins(dest: Path) -> list[str]:
    """name==version of every wheel in dest (wheel file names: name-version-...; the local +cpu kept)."""
    out = []
    for wheel in sorted(dest.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        out.append(f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("flavor", choices=("cpu", "gpu"))
    p.add_argument("dest", type=Path)
    p.add_argument("--pip", default=f"{sys.executable} -m pip", help="the pip to run (host configuration applies)")
    p.add_argument("--engine", choices=("te", "none"), default="te",
                   help="gpu: with Transformer Engine (the explorer's image; its binding compiles, so nvcc and the "
                        "CUDA torch must be where pip runs) or without (the reward, regenerator and trainer images)")
    a = p.parse_args(argv)
    a.dest.mkdir(parents=True, exist_ok=True)
    cmd = [*a.pip.split(), "wheel", "--quiet", "--wheel-dir", str(a.dest), "--find-links", str(a.dest)]
    if a.flavor == "gpu":
        if a.engine == "te":   # the binding first (it needs torch and nvcc where pip runs), then the rest with it
            subprocess.run([*cmd, "--no-deps", "--no-build-isolation", TE_BINDING], check=True,
                           env={**os.environ, **TE_BUILD_ENV})
        cmd += ["--only-binary", "torch"]
    subprocess.run([*cmd, *requirements(a.flavor, a.engine)], check=True)
    torch = [w.name for w in a.dest.glob("torch-*.whl")]
    if a.flavor == "gpu" and any("+cpu" in w for w in torch):
        raise SystemExit(f"wheelhouse.py: a CPU torch wheel in the GPU wheelhouse {a.dest}: {torch}")
    (a.dest / "requirements.txt").write_text("\n".join(pins(a.dest)) + "\n")
    print(f"wheelhouse.py: {len(pins(a.dest))} wheels in {a.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
