"""Service processes log like services, and never print a secret.

Real processes started as containers start them (`solrl serve <role>`): timestamped INFO lines, JSON
lines with SOLRL_LOG_FORMAT=json, a bad SOLRL_LOG_LEVEL refused naming the variable, no weight-loading
progress bars; and with a password-protected Redis (a real `redis-server --requirepass`) and an adapter
token, neither the password nor the token appears in anything the processes print, errors included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from solrl.queue import QueueConfig, QueueUnavailable, RedisStreamQueue, build_queue, redact_url

ROOT = Path(__file__).resolve().parents[2]
SOLRL = shutil.which("solrl", path=str(Path(sys.executable).parent)) or "solrl"
PASSWORD, TOKEN = "redis-pw-9d1e", "adapter-token-77c4"
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) [\w.]+: ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redact_url():
    assert redact_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("rediss://user:s3cret@host:6380/1") == "rediss://user:***@host:6380/1"
    assert redact_url("redis://user@host:6379") == "redis://user@host:6379"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("unix:///run/redis.sock?db=0") == "unix:///run/redis.sock?db=0"
    assert redact_url("redis://:p@ss@host/0") == "redis://:***@host/0"   # '@' inside the password


def test_queue_errors_name_the_server_but_not_its_password():
    q = RedisStreamQueue(f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0",
                         QueueConfig(retry_give_up_s=0.3, retry_backoff_s=0.05, retry_backoff_cap_s=0.1))
    with pytest.raises(QueueUnavailable) as err:
        q.length("x")
    assert "redis://:***@127.0.0.1:" in str(err.value) and PASSWORD not in str(err.value)
    with pytest.raises(ValueError) as err:
        build_queue(f"http://:{PASSWORD}@host/0")
    assert PASSWORD not in str(err.value)


def serve(role: str, args: list[str], env: dict[str, str], seconds: float, until: str | None = None,
          log: Path | None = None) -> tuple[int, str]:
    """Run `solrl serve <role>` until `until` appears in its output (then SIGTERM) or it exits; its
    stdout and stderr together."""
    log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"solrl-serve-{role}-{os.getpid()}-{time.monotonic_ns()}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([SOLRL, "serve", role, *args], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "SOLRL_BIND_HOST": "127.0.0.1", **env})
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        if until and until in log.read_text():
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = log.read_text()
    log.unlink()
    return proc.returncode, text


def test_solrl_serve_logs_with_timestamps_levels_and_json():
    ports = ["--grpc-port", "0", "--http-port", "0", "--rewards", "jpeg_compressibility"]
    rc, text = serve("reward", ports, {}, 120, until="solrl reward: grpc")
    assert rc == 0, text
    logged = [line for line in text.splitlines() if STAMP.match(line)]
    assert any("INFO solrl.services.reward: shutting down" in line for line in logged), text

    rc, text = serve("reward", ports, {"SOLRL_LOG_FORMAT": "json"}, 120, until="solrl reward: grpc")
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert rc == 0 and any(r["level"] == "INFO" and r["message"] == "shutting down" for r in records), text
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert all(line.startswith("solrl reward:") or line.startswith("{") for line in text.splitlines() if line), text

    rc, text = serve("reward", ports, {"SOLRL_LOG_LEVEL": "chatty"}, 60)
    assert rc != 0 and "SOLRL_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in text, text


@pytest.mark.slow
def test_no_secret_in_what_the_services_print(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (Debian: redis-server)")
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", PASSWORD,
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        good = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        wrong = f"redis://:{PASSWORD}-wrong@127.0.0.1:{port}/0"
        base = {"SOLRL_ADAPTER_TOKEN": TOKEN, "SOLRL_QUEUE_NAMESPACE": "secrets-test"}
        # an explorer on the password-protected queue: it loads the model, serves, consumes; then stops
        rc, explorer = serve("explorer", ["--grpc-port", "0", "--http-port", "0", "--threads", "1"],
                             {**base, "SOLRL_REDIS_URL": good}, 180, until="solrl explorer: grpc")
        assert rc == 0, explorer
        assert "Loading weights" not in explorer and "it/s]" not in explorer   # no progress bars in service logs
        # a trainer with a wrong password: the run fails, and says so without the password or the token
        rc, trainer = serve("trainer", ["--out", str(tmp_path / "run"), "--set", "epochs=1", "--grpc-port", "0",
                                        "--http-port", "0"], {**base, "SOLRL_REDIS_URL": wrong}, 300)
        assert rc == 1 and "the run failed" in trainer, trainer
        # a clear error naming the server, its URL redacted (solrl.queue.QueueAuthError)
        assert f"QueueAuthError: Redis at redis://:***@127.0.0.1:{port}/0 refused user 'default'" in trainer, trainer
        for text in (explorer, trainer):
            assert PASSWORD not in text and TOKEN not in text
    finally:
        redis.terminate()
        redis.wait(timeout=10)
