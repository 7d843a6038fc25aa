"""`solrl up`: the process supervisor with real child processes, and the whole stack end to end."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from solrl.config import apply_overrides, get_preset
from solrl.deploy.up import ChildSpec, Supervisor, plan
from solrl.shapes.model import ShapesModel

ROOT = Path(__file__).resolve().parents[2]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


SLEEPER = "import time; print('up', flush=True); time.sleep(60)"
STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(60)")


def run_in_thread(sup: Supervisor) -> tuple[threading.Thread, dict]:
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("rc", sup.run()))
    t.start()
    return t, result


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_stop_request_terminates_every_child_and_prefixes_logs():
    out = io.StringIO()
    sup = Supervisor([[ChildSpec("a", py(SLEEPER))], [ChildSpec("bb", py(SLEEPER))]], out=out, grace_s=5)
    t, result = run_in_thread(sup)
    wait_for(lambda: out.getvalue().count("| up") == 2)
    sup.request_stop(signal.SIGINT)
    t.join(10)
    assert result["rc"] == 128 + signal.SIGINT
    assert all(p.returncode == -signal.SIGTERM for p in sup.procs.values())
    lines = out.getvalue().splitlines()
    assert " a | up" in lines and "bb | up" in lines


def test_a_dying_child_stops_the_rest_with_its_status():
    out = io.StringIO()
    dying = py("import time; time.sleep(0.5); raise SystemExit(3)")
    sup = Supervisor([[ChildSpec("ok", py(SLEEPER)), ChildSpec("bad", dying)]], out=out, grace_s=5)
    t0 = time.monotonic()
    assert sup.run() == 3
    assert time.monotonic() - t0 < 10
    assert sup.procs["ok"].returncode == -signal.SIGTERM
    assert "bad exited with status 3" in out.getvalue()


def test_done_role_exiting_zero_is_success_and_stubborn_children_are_killed():
    out = io.StringIO()
    sup = Supervisor([[ChildSpec("stubborn", py(STUBBORN))],
                      [ChildSpec("trainer", py("import time; time.sleep(1); print('done')"))]],
                     out=out, grace_s=1, done_role="trainer")
    t0 = time.monotonic()
    assert sup.run() == 0
    assert time.monotonic() - t0 < 10
    assert sup.procs["stubborn"].returncode == -signal.SIGKILL  # ignored SIGTERM, killed after grace_s
    assert "trainer finished" in out.getvalue()


def test_readiness_timeout_fails_and_stops_children():
    sup = Supervisor([[ChildSpec("deaf", py(SLEEPER), ready_url="http://127.0.0.1:9/readyz")]],
                     out=io.StringIO(), startup_timeout_s=1, grace_s=5)
    assert sup.run() == 1
    assert sup.procs["deaf"].returncode == -signal.SIGTERM


def test_plan_wires_ports_queue_and_config():
    cfg = apply_overrides(get_preset("shapes-sol-rl"), ["rollout.kept=4", "rollout.explore_precision.backend=fp32"])
    ports = iter(range(20000, 20008))
    stages = plan(cfg, redis_url="redis://h:1/0", namespace="ns", run_dir=Path("/tmp/r"), trainer_args=["--set", "x=1"],
                  token="tok", port=lambda: next(ports))
    roles = [[c.role for c in s] for s in stages]
    assert roles == [["reward"], ["explorer", "regenerator"], ["trainer"]]
    (reward,), (explorer, regen), (trainer,) = stages

    def opt(spec: ChildSpec, name: str) -> str:
        return spec.argv[spec.argv.index(name) + 1]

    assert opt(explorer, "--reward-addr") == f"127.0.0.1:{opt(reward, '--grpc-port')}"
    assert opt(explorer, "--queue-namespace") == opt(regen, "--queue-namespace") == opt(trainer, "--queue-namespace") == "ns"
    assert opt(trainer, "--explorer-addrs") == f"127.0.0.1:{opt(explorer, '--grpc-port')}"
    assert opt(trainer, "--regenerator-addrs") == f"127.0.0.1:{opt(regen, '--grpc-port')}"
    assert opt(explorer, "--precision") == "fp32" and opt(explorer, "--kept") == "4"
    assert opt(regen, "--precision") == "bf16" and opt(regen, "--steps") == str(cfg.rollout.steps)
    assert len({opt(c, p) for c in (reward, explorer, regen, trainer) for p in ("--grpc-port", "--http-port")}) == 8
    assert all(c.env["SOLRL_ADAPTER_TOKEN"] == "tok" for c in (explorer, regen, trainer))
    assert trainer.ready_url == f"http://127.0.0.1:{opt(trainer, '--http-port')}/readyz"


def test_plan_with_two_explorers_gives_each_its_ports_and_the_trainer_both_addresses():
    cfg = get_preset("shapes-sol-rl")
    ports = iter(range(21000, 21010))
    stages = plan(cfg, redis_url="redis://h:1/0", namespace="ns", run_dir=Path("/tmp/r"), trainer_args=[],
                  token="tok", port=lambda: next(ports), explorers=2)
    assert [[c.role for c in s] for s in stages] == [["reward"], ["explorer-1", "explorer-2", "regenerator"],
                                                     ["trainer"]]
    (reward,), (ex1, ex2, regen), (trainer,) = stages

    def opt(spec: ChildSpec, name: str) -> str:
        return spec.argv[spec.argv.index(name) + 1]

    everyone = (reward, ex1, ex2, regen, trainer)
    assert len({opt(c, p) for c in everyone for p in ("--grpc-port", "--http-port")}) == 10
    assert opt(trainer, "--explorer-addrs") == f"127.0.0.1:{opt(ex1, '--grpc-port')},127.0.0.1:{opt(ex2, '--grpc-port')}"
    for ex in (ex1, ex2):  # both run the explorer service on the same stream, queue and reward service
        assert ex.argv[ex.argv.index("-m") + 1] == "services.explorer.server"
        assert opt(ex, "--queue-namespace") == "ns" and ex.env["SOLRL_REDIS_URL"] == "redis://h:1/0"
        assert "redis://h:1/0" not in ex.argv and "tok" not in ex.argv   # secrets stay off command lines
        assert opt(ex, "--reward-addr") == f"127.0.0.1:{opt(reward, '--grpc-port')}"
        assert ex.ready_url == f"http://127.0.0.1:{opt(ex, '--http-port')}/readyz"
    with pytest.raises(ValueError, match="explorers must be >= 1"):
        plan(cfg, redis_url="redis://h:1/0", namespace="ns", run_dir=Path("/tmp/r"), trainer_args=[], token="tok",
             explorers=0)


@pytest.mark.slow
def test_solrl_up_runs_two_epochs_and_shuts_down_cleanly(tmp_path):
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0").ping()
    except redis.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    model_dir = tmp_path / "model"
    ShapesModel.random(seed=0, layers=6, heads=4).save(model_dir)
    ns = f"solrl-test-up-{uuid.uuid4().hex[:10]}"
    sets = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2",
            "rollout.explore_steps=2", "rollout.steps=2", "train.micro_batch=4", "eval.prompts=2",
            "eval.seeds_per_prompt=1", "eval.every=0", "eval.steps=2", "tensorboard=false", "lora.rank=4",
            "lora.alpha=8", "epochs=2", "rollout.precision.backend=fp32", "rollout.explore_precision.backend=fp32",
            f"model.path={model_dir}"]
    common = [sys.executable, "-m", "solrl.deploy.up", "--redis-url", "redis://127.0.0.1:6379/0", "--namespace", ns,
              "--threads", "1", "--grace-s", "10"]
    cmd = [*common, "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]]
    scraped: dict[str, str] = {}

    def scrape_while_running(line: str) -> None:
        """Once epoch 1 is logged, read the running trainer's /metrics and its dashboard API."""
        m = re.search(r"solrl trainer: grpc \S+, http (\S+):(\d+)", line)
        if m:
            scraped["url"] = f"http://{m.group(1)}:{m.group(2)}"
        if "solrl trainer: epoch 1/2" in line and "url" in scraped:
            import httpx

            scraped["metrics"] = httpx.get(scraped["url"] + "/metrics", timeout=10).text
            scraped["run"] = httpx.get(scraped["url"] + "/dashboard/api/run", timeout=10).text

    try:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in child.stdout:
            lines.append(line)
            scrape_while_running(line)
        child.wait(240)
        proc = subprocess.CompletedProcess(cmd, child.returncode, "".join(lines), "")
        # then one more epoch: --resume takes the saved config, --set raises the epoch count
        resumed = subprocess.run([*common, "--resume", str(tmp_path / "run"), "--set", "epochs=3"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=240, check=False)
    finally:
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
        keys = list(client.scan_iter(f"{ns}:*"))
        if keys:
            client.delete(*keys)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "trainer finished" in log
    for role in ("reward", "explorer", "regenerator", "trainer"):
        assert re.search(rf"^\s*up \| {role} ready$", log, re.MULTILINE), role
    assert re.search(r"^\s*trainer \| solrl trainer: epoch 2/2", log, re.MULTILINE)
    # the running trainer's /metrics, scraped after epoch 1: the run's series with the run's numbers
    from prometheus_client.parser import text_string_to_metric_families

    series = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
              for fam in text_string_to_metric_families(scraped["metrics"]) for smp in fam.samples}
    run_label = (("run", "run"),)
    first = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert series[("solrl_train_epoch", run_label)] == 1 and series[("solrl_train_epochs", run_label)] == 2
    assert series[("solrl_train_reward", (("kind", "rollout"), ("run", "run")))] == pytest.approx(
        first["rollout.reward_mean"])
    assert series[("solrl_train_loss", run_label)] == pytest.approx(first["train.loss"])
    assert series[("solrl_train_stage_seconds_count", (("run", "run"), ("stage", "rollout")))] == 1
    assert series[("solrl_train_adapter_pushes_total", (("outcome", "failed"), ("run", "run")))] == 0
    assert ("solrl_queue_depth", (("stream", "rollouts"),)) in series and ("process_cpu_seconds_total", ()) in series
    assert [r["epoch"] for r in json.loads(scraped["run"])["records"]][:2] == [0, 1]  # the dashboard's view
    # the run's end says where the run is and what the final evaluation gave
    assert re.search(r"^\s*trainer \| solrl trainer: finished 2 epochs \(adapter version 2\): held-out reward "
                     rf"[-0-9.]+ -> [-0-9.]+; run directory {re.escape(str(tmp_path / 'run'))} ", log, re.MULTILINE)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    metrics = metrics[:3]  # the first run's (the resumed run appended epoch 3)
    assert [m["epoch"] for m in metrics] == [0, 1, 2] and [m["adapter_version"] for m in metrics[1:]] == [0, 1]
    # epoch 2 was sampled with adapter version 1, pushed over gRPC LoadAdapter with the shared token
    for role in ("explorer", "regenerator"):
        assert re.search(rf"^\s*{role} \| .*adapter version 1 \(sha256", log, re.MULTILINE), role
    assert (tmp_path / "run" / "checkpoints").is_dir() and any((tmp_path / "run" / "checkpoints").iterdir())
    for pid in map(int, re.findall(r"started \w+ \(pid (\d+)\)", log)):  # every child is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-4000:]
    assert re.search(r"^\s*trainer \| solrl trainer: epoch 3/3", log, re.MULTILINE)
    assert not re.search(r"solrl trainer: epoch [12]/", log)  # continued, not restarted
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in metrics] == [0, 1, 2, 3] and metrics[-1]["adapter_version"] == 2
    for role in ("explorer", "regenerator"):  # the fresh services got the resumed adapter before epoch 3
        assert re.search(rf"^\s*{role} \| .*adapter version 2 \(sha256", log, re.MULTILINE), role
