"""`make test-compose`: docker-compose.cpu.yml on a real Docker engine, driven by the docker SDK.

The command a user with Docker runs to trust the files: build the four CPU images, then for each of two
runs bring the stack up as compose would (the file as `docker-compose config` resolves it: images,
commands, environment, named volumes, health checks, the service names as network aliases, start order
by `depends_on` health), run 2 epochs, and tear everything down. One run goes straight through; in the
other the trainer container is killed once epoch 1 is checkpointed and started again unchanged (what
compose's `restart: on-failure` does). Both must end with the same adapter bytes, as in
tests/deploy/test_deploy.py, which runs the same check with the services as local processes. Ports are not
published (the harness reads results from the containers), so it runs beside anything on the host.

Where no Docker engine answers, every test here skips, saying so.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import tarfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

from services.common.env import ENV_ADAPTER_TOKEN

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = "docker-compose.cpu.yml"
ROLES = ("reward", "explorer", "regenerator", "trainer")
TOKEN = "compose-engine-test-token"
DEPLOY_SET = ("epochs=2 rollout.prompts_per_epoch=2 rollout.pool=4 rollout.kept=2 rollout.explore_steps=2 "
              "rollout.steps=3 train.micro_batch=4 eval.prompts=2 eval.seeds_per_prompt=1 eval.every=0 eval.steps=2")

pytestmark = pytest.mark.compose


def _duration_ns(text: str | int | None) -> int:
    """compose durations ("10s", "1m30s", "500ms") as the engine API's nanoseconds."""
    if text is None:
        return 0
    if isinstance(text, int):
        return text * 1_000_000_000
    units = {"h": 3600e9, "m": 60e9, "s": 1e9, "ms": 1e6, "us": 1e3, "ns": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a compose duration: {text!r}")
    return int(sum(float(n) * units[u] for n, u in parts))


def compose_config(env: dict[str, str]) -> dict:
    """The compose file as compose itself resolves it (variables interpolated, anchors merged)."""
    for cmd in (["docker-compose"], ["docker", "compose"]):
        try:
            out = subprocess.run([*cmd, "-f", COMPOSE_FILE, "config"], cwd=ROOT, env={**os.environ, **env},
                                 capture_output=True, text=True, check=True)
        except (FileNotFoundError, subprocess.CalledProcessError):
            continue
        return yaml.safe_load(out.stdout)
    pytest.skip("neither docker-compose nor `docker compose` is installed")


def container_specs(config: dict, project: str) -> dict[str, dict]:
    """Per service, the docker SDK `containers.create` arguments compose would use (no published ports)
    plus what the harness needs: its network alias and the services it waits for."""
    specs = {}
    for name, svc in config["services"].items():
        volumes = {}
        for v in svc.get("volumes", []):
            source, target, *mode = str(v).split(":") if not isinstance(v, dict) else \
                (v["source"], v["target"], "ro" if v.get("read_only") else "rw")
            if source not in config.get("volumes", {}):
                raise ValueError(f"{name}: only named volumes are supported here, got {v!r}")
            volumes[f"{project}_{source}"] = {"bind": target, "mode": (mode or ["rw"])[0]}
        kwargs = {"image": svc["image"], "name": f"{project}-{name}", "command": svc.get("command"),
                  "environment": {k: str(v) for k, v in svc.get("environment", {}).items()},
                  "volumes": volumes, "labels": {"solrl.compose-test": project}, "detach": True}
        if "healthcheck" in svc:
            hc = svc["healthcheck"]
            kwargs["healthcheck"] = {"test": hc["test"], "interval": _duration_ns(hc.get("interval")),
                                     "timeout": _duration_ns(hc.get("timeout")), "retries": int(hc.get("retries", 3))}
        depends = svc.get("depends_on", {})
        specs[name] = {"create": kwargs, "alias": name,
                       "after": list(depends) if isinstance(depends, (dict, list)) else []}
    return specs


def start_order(specs: dict[str, dict]) -> list[str]:
    order: list[str] = []
    while len(order) < len(specs):
        ready = [n for n in specs if n not in order and all(d in order for d in specs[n]["after"])]
        if not ready:
            raise ValueError(f"depends_on has a cycle among {sorted(set(specs) - set(order))}")
        order += sorted(ready)
    return order


def test_container_specs_follow_the_compose_file():
    """The translation, checked without an engine: what the harness would create is what the file says."""
    config = compose_config({ENV_ADAPTER_TOKEN: TOKEN, "SOLRL_SET": DEPLOY_SET})
    specs = container_specs(config, "p")
    assert start_order(specs) == ["redis", "reward", "explorer", "regenerator", "trainer"]
    trainer = specs["trainer"]["create"]
    assert trainer["image"] == "solrl/trainer:cpu" and trainer["volumes"] == {"p_runs": {"bind": "/runs", "mode": "rw"}}
    assert trainer["environment"]["SOLRL_SET"] == DEPLOY_SET and trainer["environment"][ENV_ADAPTER_TOKEN] == TOKEN
    assert specs["redis"]["create"]["healthcheck"]["interval"] == 10_000_000_000
    assert specs["explorer"]["create"]["command"] == ["--threads", "1"]
    assert _duration_ns("1m30s") == 90_000_000_000 and _duration_ns("500ms") == 500_000_000
    with pytest.raises(ValueError):
        _duration_ns("ten seconds")


@pytest.fixture(scope="module")
def engine():
    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:  # DockerException, connection errors: no engine to drive
        pytest.skip(f"no Docker engine answers ({os.environ.get('DOCKER_HOST', 'the default socket')}): {exc}")
    # each role's image from the one services/Dockerfile, with the target and build arguments the compose
    # file gives it (ROLE, GRPC_PORT, HTTP_PORT), tagged as the file names it
    services = compose_config({ENV_ADAPTER_TOKEN: TOKEN})["services"]
    for role in ROLES:
        build = services[role]["build"]
        assert build["dockerfile"] == "services/Dockerfile" and build["args"]["ROLE"] == role
        client.images.build(path=str(ROOT), dockerfile="services/Dockerfile", target=build["target"],
                            buildargs={k: str(v) for k, v in build["args"].items()}, tag=services[role]["image"],
                            rm=True)
    client.images.pull("redis", tag="7.2-bookworm")
    yield client
    client.close()


class Stack:
    def __init__(self, client, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.project = f"solrl-test-{run_id}-{uuid.uuid4().hex[:6]}"
        config = compose_config({ENV_ADAPTER_TOKEN: TOKEN, "SOLRL_SET": DEPLOY_SET, "SOLRL_RUN_ID": run_id})
        self.specs = container_specs(config, self.project)
        self.network = client.networks.create(f"{self.project}_default")
        self.volumes = [client.volumes.create(f"{self.project}_{v}") for v in config.get("volumes", {})]
        self.containers: dict[str, object] = {}

    def up(self, name: str, wait_healthy: bool = True):
        spec = self.specs[name]
        c = self.client.containers.create(**spec["create"])
        self.network.connect(c, aliases=[spec["alias"]])
        c.start()
        self.containers[name] = c
        deadline = time.monotonic() + 300
        while wait_healthy:
            state = self.client.api.inspect_container(c.id)["State"]
            if state.get("Health", {}).get("Status") == "healthy":
                break
            assert state["Status"] == "running", c.logs().decode()[-3000:]
            assert time.monotonic() < deadline, f"{name} not healthy after 300 s"
            time.sleep(2)
        return c

    def file(self, name: str, path: str) -> bytes:
        stream, _ = self.containers[name].get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            return tar.extractfile(tar.getmembers()[0]).read()

    def down(self) -> None:
        for c in self.containers.values():
            c.remove(force=True)
        self.network.remove()
        for v in self.volumes:
            v.remove(force=True)


def run_stack(client, run_id: str, restart_trainer: bool) -> tuple[bytes, list[int], str]:
    stack = Stack(client, run_id)
    run_dir = f"/runs/{run_id}"
    try:
        for name in start_order(stack.specs):
            if name != "trainer":
                stack.up(name)
        trainer = stack.up("trainer", wait_healthy=False)
        if restart_trainer:
            deadline = time.monotonic() + 600
            while trainer.exec_run(["test", "-f", f"{run_dir}/checkpoints/latest"]).exit_code != 0:
                assert time.monotonic() < deadline, trainer.logs().decode()[-3000:]
                time.sleep(1)
            trainer.kill()
            trainer.start()   # the same container, command and environment: compose's restart
        status = trainer.wait(timeout=1200)
        logs = trainer.logs().decode()
        assert status["StatusCode"] == 0, logs[-3000:]
        adapter = stack.file("trainer", f"{run_dir}/adapter_ema.safetensors")
        metrics = stack.file("trainer", f"{run_dir}/metrics.jsonl").decode()
        epochs = [json.loads(line)["epoch"] for line in metrics.splitlines()]
        return adapter, epochs, logs
    finally:
        stack.down()


@pytest.mark.slow
def test_compose_stack_on_an_engine_finishes_and_survives_a_trainer_restart(engine):
    straight, _, _ = run_stack(engine, "straight", restart_trainer=False)
    restarted, epochs, logs = run_stack(engine, "restarted", restart_trainer=True)
    assert straight == restarted
    assert epochs == [0, 1, 2] and "resuming" in logs
    assert TOKEN not in logs
