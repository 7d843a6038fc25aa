"""The GPU kit: the wheels the lent GPU image lacks for `make gpu-check`, prepared on a CPU machine.

The image (envs/gpu-image-packages.txt: Python 3.12, torch 2.11.0, triton 3.6, transformers 5.17, peft, grpcio,
protobuf) cannot fetch anything, and one run carries at most 64 MiB, the repository included. Three commands:

- `python -m solrl.gpu_kit download --dest runs/gpu-kit` (`make gpu-kit`), here, with network: `pip download`s the
  pinned cp312 manylinux x86_64 wheels of KIT (no dependencies: each wheel's requirements are checked against the
  image's list and the kit instead), checks that the kit plus the repository's tracked files fit in 64 MiB, and
  writes MANIFEST (manifest.json: each wheel's file, bytes, sha256 and requirements);
- `python3 -m solrl.gpu_kit install --kit runs/gpu-kit --target DIR`, there: checks each wheel's sha256 against the
  manifest and installs it with `pip install --no-index --no-deps --find-links` into DIR (a wheel marked
  `only_if_broken` only where its import fails on the image: peft, whose `peft.functional` the LoRA code needs);
- `python3 -m solrl.gpu_kit check --kit runs/gpu-kit -- GPU_CHECK_ARGS`, there: install, then
  `python -m solrl.gpu_check GPU_CHECK_ARGS` with DIR and the repository first on PYTHONPATH; its first seconds
  are gpu_check's preflight (versions, the GPU, whether torch.compile and Triton work).

`gpu_check_imports()` is the third-party import closure of solrl/gpu_check.py (every `solrl` module it can reach,
function-level imports included); tests/gpu_check/test_gpu_kit.py checks it against the image's list and the kit.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import hmac
import importlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "envs" / "gpu-image-packages.txt"
MANIFEST = "manifest.json"
LIMIT_BYTES = 64 * 2**20   # what one run carries: the working tree and the carried paths together
PLATFORM = ("--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
            "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--no-deps")


@dataclasses.dataclass(frozen=True)
class Wheel:
    """One pinned distribution of the kit; `only_if_broken`: install it only where this import fails there."""

    name: str
    version: str
    why: str
    only_if_broken: str | None = None


# torchao 0.18.0 loads its compiled extensions only on torch >= 2.11.0 (its __init__'s version check), the image's
# torch; benchmarks/results/pretrain_trajectories_gpu.md ran on that image with these two versions as wheels.
KIT = (
    Wheel("diffusers", "0.42.1", "the denoisers' classes (the project's pin); not in the image"),
    Wheel("torchao", "0.18.0", "the emulations' formats and the fp8-torchao GEMM (the project's pin); not in the image"),
    Wheel("peft", "0.21.2", "the LoRA code needs peft.functional; the image's peft version is not documented",
          only_if_broken="peft.functional"),
)
# gpu_check's imports that the kit does not carry, and why
NOT_CARRIED = {
    "transformer-engine": "no binary wheel for the image's torch (it builds from source); the fp8 name runs as "
                          "fp8-torchao without it",
    "redis": "the services section only, which also needs a Redis server (none in the image): it skips, saying why",
    "wandb": "telemetry's optional online logging; gpu_check never turns it on",
}
# import name -> distribution, where they differ
DIST_OF = {"PIL": "pillow", "yaml": "pyyaml", "google": "protobuf", "grpc": "grpcio", "huggingface_hub":
           "huggingface-hub", "transformer_engine": "transformer-engine", "sklearn": "scikit-learn",
           "cv2": "opencv-python-headless", "prometheus_client": "prometheus-client"}


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def image_packages(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The image's distributions (normalized name -> version, None where not documented)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, *ver = line.split()
            out[norm(name)] = ver[0] if ver else None
    return out


def _module_file(module: str) -> Path | None:
    p = ROOT.joinpath(*module.split("."))
    return p / "__init__.py" if (p / "__init__.py").is_file() else p.with_suffix(".py") if p.with_suffix(
        ".py").is_file() else None


# modules that import solrl submodules by name (importlib): module -> (the dict literal naming them, its keys or
# values, the package they are in)
DYNAMIC = {"solrl.precision.registry": ("MODULES", "keys", "solrl.precision"),
           "solrl.precision": ("_WHERE", "values", "solrl.precision")}


def _dynamic(module: str, tree: ast.Module) -> list[str]:
    """The submodules `module` imports by name, read off its dict literal (DYNAMIC)."""
    if module not in DYNAMIC:
        return []
    name, part, package = DYNAMIC[module]
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(
            node, ast.Assign) else None
        if isinstance(target, ast.Name) and target.id == name and isinstance(node.value, ast.Dict):
            items = node.value.keys if part == "keys" else node.value.values
            return [f"{package}.{x.value}" for x in items if isinstance(x, ast.Constant)]
    raise ValueError(f"{module}: no dict literal {name}")


def gpu_check_imports(start: str = "solrl.gpu_check") -> dict[str, list[str]]:
    """Third-party distributions imported by `start` and every solrl module it reaches (module-level and
    function-level imports alike, and the modules DYNAMIC names; the services, which the core reaches only by
    entry point, are not followed):
    distribution -> the solrl modules importing it."""
    seen: set[str] = set()
    todo, found = [start], {}
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = _module_file(module)
        if path is None:
            continue
        tree = ast.parse(path.read_text())
        todo += _dynamic(module, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "solrl":
                    parts = name.split(".")
                    todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
                elif top not in sys.stdlib_module_names and top != "services":
                    found.setdefault(norm(DIST_OF.get(top, top)), set()).add(module)
    return {d: sorted(m) for d, m in sorted(found.items())}


def _requirements(wheel: Path) -> list[str]:
    """A wheel's Requires-Dist lines without extras' markers."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [x.split(":", 1)[1].strip() for x in lines if x.startswith("Requires-Dist:") and "extra ==" not in x]


def _req_name(req: str) -> str:
    import re

    return norm(re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0])


def unmet(reqs: list[str], have: dict[str, str | None]) -> list[str]:
    """The requirements whose distribution `have` lists at a documented version outside the requirement's range
    (a requirement with an environment marker is skipped)."""
    from packaging.requirements import Requirement

    out = []
    for text in reqs:
        req = Requirement(text)
        got = have.get(norm(req.name))
        if req.marker is None and got and req.specifier and not req.specifier.contains(got, prereleases=True):
            out.append(f"{text} (the image has {got})")
    return out


def repo_bytes() -> int:
    """Bytes of the repository's tracked files (what a run carries besides the kit)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return sum((ROOT / f).stat().st_size for f in out.decode().split("\0") if f and (ROOT / f).is_file())


def download(dest: Path, python: str = sys.executable) -> dict:
    """pip download KIT's wheels into `dest`, check their requirements and the size, write the manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    specs = [f"{w.name}=={w.version}" for w in KIT]
    subprocess.run([python, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(dest), *specs], check=True)
    image, kit = image_packages(), {norm(w.name) for w in KIT}
    wheels = []
    for w in KIT:
        (path,) = [p for p in dest.glob("*.whl") if norm(p.name.split("-")[0]) == norm(w.name)]
        reqs = _requirements(path)
        wheels.append({"name": w.name, "version": w.version, "file": path.name, "bytes": path.stat().st_size,
                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "why": w.why,
                       "only_if_broken": w.only_if_broken, "requires": reqs,
                       # diffusers names importlib_metadata but imports it only on Python < 3.8
                       "requires_missing": [r for r in reqs if _req_name(r) not in image and _req_name(r) not in kit
                                            and _req_name(r) != "importlib-metadata"],
                       "requires_unmet": unmet(reqs, image)})
    total, repo = sum(w["bytes"] for w in wheels), repo_bytes()
    manifest = {"wheels": wheels, "total_bytes": total, "repo_tracked_bytes": repo, "limit_bytes": LIMIT_BYTES,
                "fits": total + repo <= LIMIT_BYTES, "platform": list(PLATFORM),
                "not_carried": NOT_CARRIED}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _imports(module: str, python: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True, check=False).returncode == 0


def install(kit: Path, target: Path, python: str = sys.executable) -> list[str]:
    """Check each wheel against the manifest and install it into `target` (no index, no dependencies); a wheel
    marked only_if_broken only where its import fails with the interpreter's own packages. Returns what it did."""
    manifest = json.loads((kit / MANIFEST).read_text())
    did = []
    for w in manifest["wheels"]:
        path = kit / w["file"]
        if not hmac.compare_digest(hashlib.sha256(path.read_bytes()).hexdigest(), w["sha256"]):
            raise SystemExit(f"gpu-kit: {path} does not match its sha256 in the manifest")
        if w.get("only_if_broken") and _imports(w["only_if_broken"], python):
            did.append(f"{w['name']}: kept the installed one (import {w['only_if_broken']} works)")
            continue
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--find-links", str(kit), "--target", str(target),
                        str(path)], check=True)
        did.append(f"{w['name']} {w['version']}: installed into {target}")
    return did


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m solrl.gpu_kit", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=("download", "install", "check", "imports"))
    p.add_argument("--dest", "--kit", dest="kit", default=str(ROOT / "runs" / "gpu-kit"), help="the kit's folder")
    p.add_argument("--target", default="/tmp/solrl-gpu-kit", help="where install puts the wheels")
    a = p.parse_args(argv)
    kit = Path(a.kit)
    if a.command == "imports":
        print(json.dumps(gpu_check_imports(), indent=1))
    elif a.command == "download":
        m = download(kit)
        for w in m["wheels"]:
            print(f"{w['file']}  {w['bytes'] / 2**20:.2f} MiB  {w['sha256'][:12]}  missing requirements: "
                  f"{w['requires_missing'] or 'none'}; outside the image's versions: {w['requires_unmet'] or 'none'}")
        print(f"gpu-kit: {m['total_bytes'] / 2**20:.2f} MiB of wheels + {m['repo_tracked_bytes'] / 2**20:.2f} MiB of "
              f"tracked files; {'fits' if m['fits'] else 'DOES NOT FIT'} in {LIMIT_BYTES / 2**20:.0f} MiB; "
              f"{kit / MANIFEST}")
        return 0 if m["fits"] and not any(w["requires_missing"] or w["requires_unmet"] for w in m["wheels"]) else 1
    else:
        for line in install(kit, Path(a.target)):
            print(f"gpu-kit: {line}", flush=True)
        if a.command == "check":
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                [a.target, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "PYTHONUNBUFFERED": "1"}
            importlib.invalidate_caches()
            return subprocess.run([sys.executable, "-m", "solrl.gpu_check", *rest], cwd=ROOT, env=env,
                                  check=False).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
