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
import gzip
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
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

    def __init__(self, role: str, model: str, args: list[str], log: Path, timeout_s: float = 180.0,
                 root: Path = ROOT) -> None:
        self.role, self.model = role, model
        self.grpc_port, self.http_port = _free_port(), _free_port()
        cmd = [sys.executable, "-m", f"services.{role}.server", "--host", "127.0.0.1",
               "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port), *args]
        self._log = open(log, "w")   # noqa: SIM115 (closed in stop)
        # run from `root`: its own `services` and `solrl` come first on the path (another checkout: an A/B)
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self._log, stderr=subprocess.STDOUT)
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


# ------------------------------------------------------------------ hostile load: a burst and a soak

def gzip_zeros(n: int) -> bytes:
    """`n` zero bytes (a multiple of 1 MiB) as a gzip stream, built from one compressed MiB repeated (a full
    flush after each makes every MiB compress to the same bytes): 1 GiB is about 1 MB of gzip."""
    mib = bytes(1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(n >> 20):
        crc = zlib.crc32(mib, crc)
    return (gzip.compress(b"")[:10] + block * (n >> 20) + c.flush() + crc.to_bytes(4, "little")
            + (n & 0xFFFFFFFF).to_bytes(4, "little"))


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for pid {pid}")


def _valid_json(rid: str = "") -> dict[str, Any]:
    inputs = reward_inputs()["data"][0]
    return {**({"id": rid} if rid else {}), "inputs": [
        {"name": "IMAGES", "shape": inputs["IMAGES"]["shape"], "datatype": "UINT8",
         "data": inputs["IMAGES"]["content"]},
        {"name": "PROMPTS", "shape": inputs["PROMPTS"]["shape"], "datatype": "BYTES",
         "data": inputs["PROMPTS"]["content"]}]}


def burst(n: int = 64, gzip_bytes: int = 3 << 19, workdir: Path | None = None,
          args: tuple[str, ...] = ()) -> dict[str, Any]:
    """`n` gzip bodies of about `gzip_bytes` each (zeros, each inflating far past the request limit) sent at once
    to a reward service process (its defaults, or `args`); its peak resident memory (VmHWM) before and after,
    the answers' statuses, and how long a valid request takes right after."""
    import httpx

    bomb = gzip_zeros((gzip_bytes // 1030) << 20)   # a MiB of zeros deflates to ~1 KB
    with tempfile.TemporaryDirectory(prefix="solrl-burst-") as tmp:
        door = Door("reward", "shapes", ["--rewards", "shapes", *args], Path(workdir or tmp) / "reward.log")
        try:
            url = f"http://127.0.0.1:{door.http_port}/v2/models/shapes/infer"
            with httpx.Client(timeout=60) as c:   # warm: valid requests on both doors
                for _ in range(3):
                    assert c.post(url, json=_valid_json()).status_code == 200
            baseline = _status_kb(door.proc.pid, "VmHWM")
            statuses: list[int] = []
            barrier = threading.Barrier(n)

            def send() -> None:
                with httpx.Client(timeout=300) as c:
                    barrier.wait()
                    r = c.post(url, content=bomb, headers={"Content-Encoding": "gzip",
                                                           "Content-Type": "application/json"})
                    statuses.append(r.status_code)

            threads = [threading.Thread(target=send) for _ in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            burst_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            with httpx.Client(timeout=60) as c:
                valid = c.post(url, json=_valid_json())
            after_s = time.perf_counter() - t1
            peak = _status_kb(door.proc.pid, "VmHWM")
        finally:
            door.stop()
    counts = {str(s): statuses.count(s) for s in sorted(set(statuses))}
    return {"requests": n, "gzip_bytes": len(bomb), "baseline_mb": baseline / 1024, "peak_mb": peak / 1024,
            "growth_mb": (peak - baseline) / 1024, "statuses": counts, "burst_s": burst_s,
            "valid_after_status": valid.status_code, "valid_after_s": after_s}


def soak(seconds: float = 45.0, concurrency: int = 16, warmup_s: float = 10.0, workdir: Path | None = None,
         sample_s: float = 0.5) -> dict[str, Any]:
    """`concurrency` clients for `seconds` against a reward service process, each cycling through valid requests
    (tritonclient.http and tritonclient.grpc, each with its own id, checked in the answer) and invalid ones (bad
    JSON, an unknown model, a wrong datatype on gRPC, a truncated gzip body), with its resident memory sampled
    every `sample_s`. The result: the memory curve, its growth after `warmup_s` (the mean of the last 5 s over the
    mean of the 5 s after the warm-up), and the answers by kind: every request must get exactly one answer, the
    valid ones with their own id, the invalid ones a 4xx / INVALID_ARGUMENT / NOT_FOUND, none a 5xx."""
    import httpx
    import tritonclient.grpc as tgrpc
    import tritonclient.http as thttp
    from tritonclient.utils import InferenceServerException

    data = reward_inputs()["data"][0]
    images = np.asarray(data["IMAGES"]["content"], np.uint8).reshape(data["IMAGES"]["shape"])
    prompts = np.array([p.encode() for p in data["PROMPTS"]["content"]], dtype=object)
    truncated = gzip.compress(json.dumps(_valid_json()).encode())[:-20]
    kinds = ("rest", "grpc", "bad_json", "unknown_model", "grpc_bad_type", "truncated_gzip")
    tally = {k: {"sent": 0, "expected": 0, "unexpected": 0} for k in kinds}
    problems: list[str] = []
    ids: list[str] = []
    lock, stop = threading.Lock(), threading.Event()
    with tempfile.TemporaryDirectory(prefix="solrl-soak-") as tmp:
        door = Door("reward", "shapes", ["--rewards", "shapes"], Path(workdir or tmp) / "reward.log")
        curve: list[tuple[float, float]] = []
        t_start = time.perf_counter()

        def sample() -> None:
            while not stop.is_set():
                curve.append((time.perf_counter() - t_start, _status_kb(door.proc.pid, "VmRSS") / 1024))
                stop.wait(sample_s)

        def client(w: int) -> None:
            rest = thttp.InferenceServerClient(door.url("http"), network_timeout=120, connection_timeout=120)
            grpc_c = tgrpc.InferenceServerClient(door.url("grpc"))
            http = httpx.Client(base_url=f"http://{door.url('http')}", timeout=120)
            i = 0
            try:
                while not stop.is_set():
                    kind, rid = kinds[(w + i) % len(kinds)], f"{w}-{i}"
                    i += 1
                    ok, why = _one(kind, rid, rest, grpc_c, http, images, prompts, truncated,
                                   thttp, tgrpc, InferenceServerException)
                    with lock:
                        tally[kind]["sent"] += 1
                        tally[kind]["expected" if ok else "unexpected"] += 1
                        if kind in ("rest", "grpc"):
                            ids.append(rid)
                        if not ok and len(problems) < 20:
                            problems.append(f"{kind} {rid}: {why}")
            finally:
                rest.close()
                grpc_c.close()
                http.close()

        sampler = threading.Thread(target=sample, daemon=True)
        workers = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
        try:
            sampler.start()
            for t in workers:
                t.start()
            stop.wait(seconds)
            stop.set()
            for t in workers:
                t.join(180)
            sampler.join(5)
            alive = door.proc.poll() is None
        finally:
            stop.set()
            door.stop()
    after = [m for t, m in curve if warmup_s <= t < warmup_s + 5]
    last = [m for t, m in curve if t >= curve[-1][0] - 5]
    growth = (sum(last) / len(last)) / (sum(after) / len(after)) - 1 if after and last else float("nan")
    return {"seconds": seconds, "concurrency": concurrency, "warmup_s": warmup_s, "tally": tally,
            "answers": sum(k["sent"] for k in tally.values()), "unexpected": sum(k["unexpected"] for k in tally.values()),
            "duplicate_ids": len(ids) - len(set(ids)), "problems": problems, "alive": alive,
            "rss_growth_after_warmup": growth, "rss_curve_mb": [(round(t, 1), round(m, 1)) for t, m in curve]}


def _one(kind, rid, rest, grpc_c, http, images, prompts, truncated, thttp, tgrpc, error) -> tuple[bool, str]:
    """One soak request of `kind`; whether its answer is the one expected, and if not, what came."""
    try:
        if kind in ("rest", "grpc"):
            mod, client = (thttp, rest) if kind == "rest" else (tgrpc, grpc_c)
            a = mod.InferInput("IMAGES", list(images.shape), "UINT8")
            a.set_data_from_numpy(images)
            b = mod.InferInput("PROMPTS", [len(prompts)], "BYTES")
            b.set_data_from_numpy(prompts)
            res = client.infer("shapes", [a, b], request_id=rid)
            got = res.get_response()["id"] if kind == "rest" else res.get_response().id
            scores = res.as_numpy("SCORES")
            return (got == rid and scores is not None and scores.shape == (len(prompts),)), f"id {got!r}"
        if kind == "grpc_bad_type":
            a = tgrpc.InferInput("IMAGES", list(images.shape), "FP32")
            a.set_data_from_numpy(images.astype(np.float32))
            b = tgrpc.InferInput("PROMPTS", [len(prompts)], "BYTES")
            b.set_data_from_numpy(prompts)
            try:
                grpc_c.infer("shapes", [a, b], request_id=rid)
            except error as exc:
                return "INVALID_ARGUMENT" in str(exc.status()) and "IMAGES" in exc.message(), str(exc)
            return False, "answered"
        if kind == "bad_json":
            r = http.post("/v2/models/shapes/infer", content=b'{"inputs": [', headers={"Content-Type": "application/json"})
            return r.status_code == 400 and "not JSON" in r.json()["error"], f"{r.status_code} {r.text[:200]}"
        if kind == "unknown_model":
            r = http.post("/v2/models/no_such_reward/infer", json=_valid_json(rid))
            return r.status_code == 404, f"{r.status_code} {r.text[:200]}"
        r = http.post("/v2/models/shapes/infer", content=truncated,
                      headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        return r.status_code == 400 and "decompress" in r.json()["error"], f"{r.status_code} {r.text[:200]}"
    except Exception as exc:  # noqa: BLE001 - any failure of the exchange is an unexpected answer, counted
        return False, f"{type(exc).__name__}: {exc}"


def _soak_markdown(r: dict[str, Any]) -> str:
    curve = r["rss_curve_mb"]
    step = max(1, len(curve) // 20)
    lines = [f"A reward service process (`--rewards shapes`, its defaults) under {r['concurrency']} clients for "
             f"{r['seconds']:g} s, each cycling through valid requests (tritonclient.http, tritonclient.grpc; each "
             "answer checked for its own request id and 8 scores) and invalid ones (bad JSON, an unknown model, a "
             "wrong datatype on gRPC, a truncated gzip body). The machine is shared with other work.", "",
             f"- answers: {r['answers']}, unexpected: {r['unexpected']} (a 5xx, a wrong status or id, a lost "
             f"answer), duplicated ids: {r['duplicate_ids']}, service alive at the end: {r['alive']}",
             f"- resident memory after the {r['warmup_s']:g} s warm-up: {100 * r['rss_growth_after_warmup']:+.1f}% "
             "(mean of the last 5 s over the 5 s after the warm-up)", "",
             "| kind | sent | as expected | unexpected |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['sent']} | {v['expected']} | {v['unexpected']} |" for k, v in r["tally"].items()]
    lines += ["", "Resident memory (MB) over time (s):", "", "| s | MB |", "|---|---|"]
    lines += [f"| {t:g} | {m:.1f} |" for t, m in curve[::step]]
    return "\n".join(lines) + "\n"


def _burst_markdown(r: dict[str, Any]) -> str:
    return (f"{r['requests']} gzip bodies of {r['gzip_bytes'] / 1e6:.2f} MB each (zeros, each inflating far past "
            f"the request limit) sent at once to a reward service process (`--rewards shapes`, its defaults: "
            f"256 MiB a request, a budget of 257 MiB for the requests in flight).\n\n"
            f"- peak resident memory (VmHWM): {r['baseline_mb']:.0f} MB warm, {r['peak_mb']:.0f} MB after the "
            f"burst (+{r['growth_mb']:.0f} MB)\n- answers: {r['statuses']} in {r['burst_s']:.1f} s\n"
            f"- a valid request right after: {r['valid_after_status']} in {1000 * r['valid_after_s']:.0f} ms\n")


def ab(before_root: Path, out: Path, rounds: int = 2, concurrency: tuple[int, ...] = (1, 16),
       interval_ms: int = 3000) -> dict[str, Any]:
    """The reward door served by another checkout (`before_root`, e.g. a worktree of the commit before a change)
    and by this one, alternated `rounds` times, each at `concurrency` over gRPC and REST: a before / after pair
    measured under the same load of a shared machine. Writes out/doors-ab.md and .json."""
    binary, env = perf_env()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="solrl-doors-ab-") as tmp:
        work = Path(tmp)
        data = work / "reward.json"
        data.write_text(json.dumps(reward_inputs()))
        for r in range(rounds):
            for side, root in (("before", Path(before_root)), ("after", ROOT)):
                door = Door("reward", "shapes", ["--rewards", "shapes"], work / f"{side}.log", root=root)
                try:
                    for c in concurrency:
                        for protocol in ("grpc", "http"):
                            row = measure(binary, env, door, protocol, c, data, interval_ms, work)
                            rows.append({**row, "side": side, "round": r})
                finally:
                    door.stop()
    lines = [f"The reward door (`shapes`, 8 renders of 32x32 a request) served by the code before (`{before_root}`) "
             f"and after, alternated {rounds} times, perf_analyzer {interval_ms} ms windows; the machine is shared "
             "with other work.", "",
             "| round | code | protocol | concurrency | requests/s | p50 ms | p99 ms | mean ms | server ms | queue ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        if "error" in x:
            lines.append(f"| {x['round']} | {x['side']} | {x['protocol']} | {x['concurrency']} | {x['error']} |"
                         + " |" * 5)
            continue
        lines.append(f"| {x['round']} | {x['side']} | {'REST' if x['protocol'] == 'http' else 'gRPC'} | "
                     f"{x['concurrency']} | {x['throughput']:.1f} | " + " | ".join(
                         f"{x[k] / 1000:.2f}" for k in ("p50_us", "p99_us", "avg_us", "server_us", "queue_us")) + " |")
    return write_results(out, "doors-ab", {"before_root": str(before_root), "rows": rows}, "\n".join(lines))


def batcher_ab(before_root: Path, out: Path, rounds: int = 2, seconds: float = 3.0,
               concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict[str, Any]:
    """The dynamic batcher alone, `before_root`'s against this checkout's, alternated: a batch function whose time
    grows with its items and takes no CPU (a sleep of 2 ms + 0.5 ms an item), so the machine's other work does not
    decide; synchronous clients of 8 items a request, max_batch 64, 5 ms delay. Writes out/doors-batcher-ab.md."""
    import importlib.util
    import statistics

    def load(path: Path, name: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    mods = {"before": load(Path(before_root) / "services/common/batching.py", "solrl_batching_before"),
            "after": load(ROOT / "services/common/batching.py", "solrl_batching_after")}

    def one(mod: Any, c: int) -> dict[str, float]:
        calls: list[int] = []

        def fn(items: np.ndarray, meta: list) -> np.ndarray:
            calls.append(len(items))
            time.sleep(0.002 + 0.0005 * len(items))
            return items.sum(axis=(1, 2, 3))

        b = mod.DynamicBatcher(fn, max_batch=64, max_delay_s=0.005)
        stop, done, waits = threading.Event(), [0] * c, []

        def client(i: int) -> None:
            x = np.zeros((8, 4, 4, 3), np.float32)
            while not stop.is_set():
                with mod.queue_timer() as w:
                    b(x, ["p"] * 8)
                waits.append(sum(w))
                done[i] += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        b.close()
        return {"throughput": sum(done) / seconds, "queue_ms": statistics.mean(waits) * 1000,
                "requests_per_call": sum(calls) / 8 / len(calls)}

    rows = [{"concurrency": c, "round": r, "side": side, **one(mods[side], c)}
            for c in concurrency for r in range(rounds) for side in ("before", "after")]
    lines = [f"The dynamic batcher alone (services/common/batching.py), the code before (`{before_root}`) and after, "
             "alternated: a batch function of 2 ms + 0.5 ms an item that takes no CPU (the machine's other work "
             f"does not decide), synchronous clients of 8 items a request, max_batch 64, 5 ms delay, {seconds:g} s "
             "each.", "", "| concurrency | round | code | requests/s | queue ms | requests a call |", "|---|---|---|---|---|---|"]
    lines += [f"| {x['concurrency']} | {x['round']} | {x['side']} | {x['throughput']:.1f} | {x['queue_ms']:.2f} | "
              f"{x['requests_per_call']:.1f} |" for x in rows]
    return write_results(out, "doors-batcher-ab", {"before_root": str(before_root), "rows": rows}, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """`python -m services.doors soak|burst|ab --out DIR`: the long soak, the burst and a before / after pair."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m services.doors")
    p.add_argument("what", choices=("soak", "burst", "ab", "batcher-ab"))
    p.add_argument("--before-root", default=None, help="ab: the checkout serving the 'before' side")
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=600.0, help="soak: how long")
    p.add_argument("--concurrency", type=int, default=16, help="soak: clients at once")
    a = p.parse_args(argv)
    if a.what == "batcher-ab":
        batcher_ab(Path(a.before_root), Path(a.out))
        print(Path(a.out, "doors-batcher-ab.md").read_text())
        return 0
    if a.what == "ab":
        r = ab(Path(a.before_root), Path(a.out))
        print(Path(a.out, "doors-ab.md").read_text())
        return 0
    if a.what == "soak":
        r = soak(a.seconds, a.concurrency, warmup_s=30.0)
        write_results(Path(a.out), "doors-soak", r, _soak_markdown(r))
    else:
        r = burst()
        write_results(Path(a.out), "doors-burst", r, _burst_markdown(r))
    print(json.dumps({k: v for k, v in r.items() if k != "rss_curve_mb"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
