"""`solrl bench doors`: the reward and explorer doors under Triton's own benchmark client, `perf_analyzer`.

`perf_analyzer` ships as a binary in the `tritonclient` 2.34.0 wheel (later wheels dropped it). It runs in its own
environment, .venv/perf (PERF_PINS, installed on first use; `make perf-env` does the same and installs Debian's
`libb64-0d`, which the binary links against), with the CUDA runtime library of `nvidia-cuda-runtime-cu12` on its
library path (no GPU is used). Each door is a service process of its own (`python -m services.reward.server`,
`python -m services.explorer.server`, the shapes world) on loopback; the inputs are real: ground-truth renders of
valid shapes prompts at the model's 32 x 32 (8 a request) for the reward, a valid prompt with N, STEPS and K for
the explorer's `explore` model (the server draws the seeds; the answer carries them). For every door, protocol
(gRPC, REST) and concurrency, perf_analyzer's CSV gives throughput, p50 / p99 latency and the server-side split
(queue, compute input / infer / output, from the door's Triton statistics); the summary sets REST beside gRPC.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results

# what .venv/perf holds (the version of the CUDA runtime wheel only matters for the library's name, libcudart.so.12)
PERF_PINS = ("tritonclient==2.34.0", "nvidia-cuda-runtime-cu12==12.9.79")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PERF_ENV = ROOT / ".venv" / "perf"
CONCURRENCY = (1, 2, 4, 8, 16)
REWARD_PROMPTS = ("a red circle", "two blue squares", "a green triangle", "a yellow triangle",
                  "a blue circle", "three red squares", "a green square", "two yellow circles")
EXPLORE_PROMPT = "a red circle"
EXPLORE = {"N": 4, "STEPS": 2, "K": 2}   # seeds drawn per prompt, explore steps, seeds kept
# perf_analyzer's CSV columns (microseconds, but the throughput), as the table's keys
COLUMNS = {"Inferences/Second": "throughput", "p50 latency": "p50_us", "p99 latency": "p99_us",
           "Avg latency": "avg_us", "Server Queue": "queue_us", "Server Compute Input": "input_us",
           "Server Compute Infer": "infer_us", "Server Compute Output": "output_us"}


# ------------------------------------------------------------------ the tool

def perf_env(env_dir: Path = DEFAULT_PERF_ENV) -> tuple[Path, dict[str, str]]:
    """perf_analyzer's binary (installed into `env_dir` with PERF_PINS when missing) and the environment it runs
    in (the CUDA runtime library on LD_LIBRARY_PATH). RuntimeError naming the fix when libb64 is missing."""
    env_dir = Path(env_dir)
    binary, python = env_dir / "bin" / "perf_analyzer", env_dir / "bin" / "python"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PERF_PINS], check=True)
    lib = subprocess.run([str(python), "-c", "import nvidia.cuda_runtime as m, os; "
                          "print(os.path.join(list(m.__path__)[0], 'lib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in (lib, os.environ.get("LD_LIBRARY_PATH")) if p)}
    missing = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env).stdout
    missing_libs = [line.split()[0] for line in missing.splitlines() if "not found" in line]
    if missing_libs:
        raise RuntimeError(f"perf_analyzer lacks {', '.join(missing_libs)}: `apt-get install libb64-0d` "
                           f"(`make perf-env` does it)")
    return binary, env


# ------------------------------------------------------------------ the inputs

def reward_inputs() -> dict[str, Any]:
    """perf_analyzer input data for the reward model `shapes`: 8 ground-truth renders and their prompts."""
    from solrl.shapes.world import parse, render

    images = np.stack([render(parse(p), np.random.default_rng(i))
                       for i, p in enumerate(REWARD_PROMPTS)]).astype(np.uint8)
    return {"data": [{"IMAGES": {"content": images.reshape(-1).tolist(), "shape": list(images.shape)},
                      "PROMPTS": {"content": list(REWARD_PROMPTS), "shape": [len(REWARD_PROMPTS)]}}]}


def explorer_inputs() -> dict[str, Any]:
    """perf_analyzer input data for the explorer model `explore`: a prompt, N, STEPS and K."""
    return {"data": [{"PROMPTS": {"content": [EXPLORE_PROMPT], "shape": [1]},
                      **{k: {"content": [v], "shape": [1]} for k, v in EXPLORE.items()}}]}


# ------------------------------------------------------------------ the doors

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Door:
    """A service process serving one door's model on free loopback ports."""

    def __init__(self, role: str, model: str, args: list[str], log: Path, timeout_s: float = 180.0) -> None:
        self.role, self.model = role, model
        self.grpc_port, self.http_port = _free_port(), _free_port()
        cmd = [sys.executable, "-m", f"services.{role}.server", "--host", "127.0.0.1",
               "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), *args]
        self._log = open(log, "w")   # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {role} service exited ({self.proc.returncode}); see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {role} service was not ready within {timeout_s:g} s; see {log}")
            time.sleep(0.3)

    def url(self, protocol: str) -> str:
        return f"127.0.0.1:{self.grpc_port if protocol == 'grpc' else self.http_port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def measure(binary: Path, env: dict[str, str], door: Door, protocol: str, concurrency: int, data: Path,
            interval_ms: int, workdir: Path) -> dict[str, Any]:
    """One perf_analyzer run: `concurrency` synchronous clients on `door` over `protocol`; its CSV row."""
    out = workdir / f"{door.role}-{protocol}-{concurrency}.csv"
    cmd = [str(binary), "-m", door.model, "-u", door.url(protocol), "-i", protocol, "--input-data", str(data),
           "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval", str(interval_ms),
           "--stability-percentage", "50", "--max-trials", "10", "-f", str(out), "--verbose-csv"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0 or not out.exists():   # e.g. no stable window on a busy machine: kept, said so
        said = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return {"door": door.role, "protocol": protocol, "concurrency": concurrency,
                "error": f"perf_analyzer exited {proc.returncode}: {said[-1] if said else ''}"}
    with open(out, newline="") as f:
        row = next(csv.DictReader(f))
    got = {key: float(row[col]) for col, key in COLUMNS.items()}
    got["server_us"] = sum(got[k] for k in ("queue_us", "input_us", "infer_us", "output_us"))
    return {"door": door.role, "protocol": protocol, "concurrency": concurrency, **got}


# ------------------------------------------------------------------ the report

def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per door and concurrency: REST throughput over gRPC's, and at each protocol the client's mean latency
    above the server's (the transport's cost)."""
    by = {(r["door"], r["protocol"], r["concurrency"]): r for r in rows}
    out = []
    for (door, protocol, c), r in by.items():
        g = by.get((door, "grpc", c))
        if protocol != "http" or g is None or "error" in r or "error" in g:
            continue
        out.append({"door": door, "concurrency": c, "rest_over_grpc": r["throughput"] / g["throughput"],
                    "rest_client_minus_server_ms": (r["avg_us"] - r["server_us"]) / 1000,
                    "grpc_client_minus_server_ms": (g["avg_us"] - g["server_us"]) / 1000})
    return out


def markdown(rows: list[dict[str, Any]], summ: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = [
        f"perf_analyzer ({PERF_PINS[0]}) against each door's own service process on loopback, synchronous "
        f"clients, {settings['interval_ms']} ms measurement windows; reward: model `shapes`, "
        f"{len(REWARD_PROMPTS)} renders of 32x32 and their prompts a request; explorer: model `explore`, one "
        f"prompt, N={EXPLORE['N']}, STEPS={EXPLORE['STEPS']}, K={EXPLORE['K']}. The machine is shared with other "
        "work: compare within this table (REST beside gRPC, measured one after the other), not across runs.",
        "",
        "| door | protocol | concurrency | requests/s | p50 ms | p99 ms | mean ms | server ms | queue ms | "
        "input ms | infer ms | output ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['door']} | {'REST' if r['protocol'] == 'http' else 'gRPC'} | {r['concurrency']} | "
                         f"{r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['door']} | {'REST' if r['protocol'] == 'http' else 'gRPC'} | {r['concurrency']} | "
                     f"{r['throughput']:.1f} | " + " | ".join(f"{r[k] / 1000:.2f}" for k in (
                         "p50_us", "p99_us", "avg_us", "server_us", "queue_us", "input_us", "infer_us", "output_us"))
                     + " |")
    lines += ["", "REST against gRPC (goal: throughput ratio >= 0.8 at every concurrency; at concurrency 1 the "
              "client's mean latency within 2 ms of the server's):", "",
              "| door | concurrency | REST / gRPC throughput | REST client - server ms | gRPC client - server ms |",
              "|---|---|---|---|---|"]
    for s in summ:
        lines.append(f"| {s['door']} | {s['concurrency']} | {s['rest_over_grpc']:.2f} | "
                     f"{s['rest_client_minus_server_ms']:.2f} | {s['grpc_client_minus_server_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def run(out: Path, small: bool = False, tag: str = "", doors: tuple[str, ...] = ("reward", "explorer"),
        concurrency: tuple[int, ...] | None = None, perf_env_dir: Path | None = None) -> dict[str, Any]:
    """Sweep concurrency over `doors`, gRPC and REST, with perf_analyzer; write out/doors[-tag].json and .md.
    small: concurrency 1 and 4, 1 s windows (what the test runs)."""
    unknown = sorted(set(doors) - {"reward", "explorer"})
    if unknown:
        raise ValueError(f"doors: unknown {unknown}; the doors are reward and explorer")
    concurrency = tuple(concurrency or ((1, 4) if small else CONCURRENCY))
    interval_ms = 1000 if small else 3000
    binary, env = perf_env(perf_env_dir or DEFAULT_PERF_ENV)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="solrl-doors-") as tmp:
        work = Path(tmp)
        for role in doors:
            data = work / f"{role}.json"
            data.write_text(json.dumps(reward_inputs() if role == "reward" else explorer_inputs()))
            if role == "reward":
                door = Door("reward", "shapes", ["--rewards", "shapes"], work / "reward.log")
            else:
                door = Door("explorer", "explore", ["--model", "shapes", "--reward", "shapes", "--steps", "2",
                                                    "--kept", "2"], work / "explorer.log")
            try:
                for c in concurrency:
                    for protocol in ("grpc", "http"):
                        rows.append(measure(binary, env, door, protocol, c, data, interval_ms, work))
            finally:
                door.stop()
    summ = summary(rows)
    settings = {"interval_ms": interval_ms, "concurrency": list(concurrency), "perf_analyzer": PERF_PINS[0],
                "reward_images": [len(REWARD_PROMPTS), 32, 32, 3], "explore": EXPLORE}
    name = f"doors-{tag}" if tag else "doors"
    return write_results(out, name, {"settings": settings, "rows": rows, "summary": summ},
                         markdown(rows, summ, settings))
