"""`make test-compose`: docker-compose.cpu.yml on a real Docker engine, run as a user runs it.

The user's commands, through the docker-compose CLI (Debian's 1.29 or Compose v2's `docker compose`): `build`, then
`up -d` with the secrets' directory (SOLRL_SECRETS_DIR) and the run's settings in the environment. Two runs of 2 epochs:
- straight: every service turns healthy, the containers are inspected (`docker inspect`: a non-root user, a read-only
  root filesystem with writes only to volumes and tmpfs, no capability, no privilege gain, memory, CPU and PID
  limits, the secrets as read-only files and none in the environment; checked from inside too), the trainer
  finishes, `docker-compose logs` gives each role's JSON records;
- faulted: an explorer container is frozen holding an explore job, Redis is restarted from its append-only file
  (the stream's entries survive), the explorer's process is SIGKILLed (the engine restarts it: `restart:
  unless-stopped`; its job is redelivered), and the trainer's process is SIGKILLed once epoch 1 is checkpointed (the
  engine restarts it: `restart: on-failure`; it resumes).
Both end at the same adapter bytes (the faults cost no step and repeat none, as tests/deploy/test_deploy.py checks for
the same file run as local processes), and `down -v` leaves no container, network or volume of the project.

The images: `make images` (the bases bootstrapped from Debian's packages where no registry answers, the wheels from
build/wheelhouse); the fixture runs `docker-compose build` itself, cached. Where no Docker engine answers or the bases
are missing, every test here skips, saying so; with SOLRL_REQUIRE_ENGINE=1 (CI: .ci/run) it fails instead.
SOLRL_COMPOSE_REPORT=<path>: the inspected figures per service and the phases' seconds written there as JSON
(benchmarks/results/containers.md).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = "docker-compose.cpu.yml"
ROLES = ("reward", "explorer", "regenerator", "trainer")
SERVICES = ("redis", *ROLES)
REQUIRE = os.environ.get("SOLRL_REQUIRE_ENGINE") == "1"
SECRETS = {"SOLRL_ADAPTER_TOKEN": "compose-engine-adapter-token", "SOLRL_DATA_TOKEN": "compose-engine-data-token",
           "SOLRL_QUEUE_KEY": "compose-engine-queue-key-0123456789",
           **{f"SOLRL_REDIS_{r.upper()}_PASSWORD": f"compose-engine-{r}-password"
              for r in ("trainer", "explorer", "regenerator")}}
# the secrets as the file takes them: one file each in SOLRL_SECRETS_DIR (mounted at /run/secrets/<name>), readable by
# the roles' users in the containers
SECRET_FILES = {"SOLRL_ADAPTER_TOKEN": "adapter_token", "SOLRL_DATA_TOKEN": "data_token", "SOLRL_QUEUE_KEY": "queue_key",
                **{f"SOLRL_REDIS_{r.upper()}_PASSWORD": f"redis_{r}_password" for r in ("trainer", "explorer", "regenerator")}}
# the bases: the registry's, or (the default here, as `make images` builds them) bootstrapped from Debian's packages
BASES = {"SOLRL_BASE_IMAGE": os.environ.get("SOLRL_BASE_IMAGE", "solrl/base:bookworm"),
         "SOLRL_REDIS_IMAGE": os.environ.get("SOLRL_REDIS_IMAGE", "solrl/redis:bookworm")}
# a pool of 32 at 4 explore steps: an explore job long enough (about a second on a quick core) for the fault test to
# freeze the explorer while it holds one; with 4 seeds at 2 steps a quick machine acknowledged every job before the pause
DEPLOY_SET = ("epochs=2 rollout.prompts_per_epoch=2 rollout.pool=32 rollout.kept=2 rollout.explore_steps=4 "
              "rollout.steps=3 train.micro_batch=4 eval.prompts=2 eval.seeds_per_prompt=1 eval.every=0 eval.steps=2")
NAMESPACE = "solrl:default"
REPORT: dict = {"services": {}, "seconds": {}}

pytestmark = pytest.mark.compose


def unavailable(reason: str):
    if REQUIRE:
        pytest.fail(f"{reason} (SOLRL_REQUIRE_ENGINE=1)")
    pytest.skip(reason)


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 check=False).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.fixture(scope="module")
def secrets_dir():
    with tempfile.TemporaryDirectory(prefix="solrl-compose-engine-") as tmp:
        d = Path(tmp) / "secrets"
        d.mkdir(mode=0o711)
        for name, file in SECRET_FILES.items():
            (d / file).write_text(SECRETS[name] + "\n")
            (d / file).chmod(0o644)
        yield d


def docker(*args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, check=check, timeout=timeout, **kw)


def test_compose_file_is_what_the_engine_test_drives(secrets_dir):
    """Without an engine: the file's services, their start order by health, and the hardening the engine test inspects
    (so a file that lost them fails here too, wherever docker-compose is installed)."""
    exe = compose_command()
    if exe is None:
        unavailable("neither docker-compose nor `docker compose` is installed")
    out = subprocess.run([*exe, "-f", COMPOSE_FILE, "config"], cwd=ROOT,
                         env={**os.environ, **BASES, "SOLRL_SECRETS_DIR": str(secrets_dir)},
                         capture_output=True, text=True, check=True)
    config = yaml.safe_load(out.stdout)
    services = config["services"]
    # the secrets are files: none in any service's environment, each file the one SOLRL_SECRETS_DIR holds
    assert {n: Path(s["file"]) for n, s in config["secrets"].items()} == \
        {f: secrets_dir / f for f in SECRET_FILES.values()}
    assert not [(n, k) for n, svc in services.items() for k, v in svc["environment"].items()
                if str(v) in SECRETS.values()]
    assert set(services) == set(SERVICES)
    assert services["redis"]["image"] == BASES["SOLRL_REDIS_IMAGE"]
    for name in SERVICES:
        svc = services[name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"] and svc["mem_limit"] and svc["cpus"], name
        if name != "redis":
            assert svc["build"]["args"]["BASE"] == BASES["SOLRL_BASE_IMAGE"] and svc["build"]["target"] == "cpu"
            assert svc["environment"]["SOLRL_LOG_FORMAT"] == "json", name
    assert {d for d, c in services["trainer"]["depends_on"].items() if c["condition"] == "service_healthy"} == \
        {"redis", "explorer", "regenerator"}
    assert services["trainer"]["restart"] == "on-failure" and services["explorer"]["restart"] == "unless-stopped"


@pytest.fixture(scope="module")
def engine(secrets_dir):
    exe = compose_command()
    if exe is None or shutil.which("docker") is None:
        unavailable("the docker client or docker-compose is not installed (Debian: docker.io, docker-compose)")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          check=False, timeout=60)
    if info.returncode != 0:
        unavailable(f"no Docker engine answers ({os.environ.get('DOCKER_HOST', 'the default socket')}): "
                    f"{info.stderr.strip()[:300]}")
    missing = [image for image in BASES.values() if docker("image", "inspect", image, check=False).returncode != 0]
    if missing or not (ROOT / "build" / "wheelhouse" / "cpu" / "requirements.txt").exists():
        unavailable(f"base images {missing} or build/wheelhouse/cpu missing: run `make images`")
    t0 = time.monotonic()
    build = subprocess.run([*exe, "-f", COMPOSE_FILE, "build"], cwd=ROOT,
                           env={**os.environ, **BASES, "SOLRL_SECRETS_DIR": str(secrets_dir)},
                           capture_output=True, text=True, check=False, timeout=1800)
    assert build.returncode == 0, (build.stdout + build.stderr)[-3000:]
    REPORT["engine"] = info.stdout.strip()
    REPORT["seconds"]["build (cached)"] = round(time.monotonic() - t0, 1)
    yield exe, secrets_dir
    if os.environ.get("SOLRL_COMPOSE_REPORT"):
        Path(os.environ["SOLRL_COMPOSE_REPORT"]).write_text(json.dumps(REPORT, indent=2) + "\n")


class Stack:
    """One project of the compose file: the user's commands with the secrets and run settings in the environment."""

    def __init__(self, engine: tuple[list[str], Path], run_id: str) -> None:
        (self.exe, secrets_dir), self.run_id = engine, run_id
        self.project = f"solrltest{run_id}{uuid.uuid4().hex[:6]}"
        self.env = {**os.environ, **BASES, "SOLRL_SECRETS_DIR": str(secrets_dir), "COMPOSE_PROJECT_NAME": self.project,
                    "SOLRL_SET": DEPLOY_SET, "SOLRL_RUN_ID": run_id}
        self.run_dir = f"/runs/{run_id}"

    def compose(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run([*self.exe, "-f", COMPOSE_FILE, *args], cwd=ROOT, env=self.env, capture_output=True,
                              text=True, check=False, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(args)}: {(proc.stdout + proc.stderr)[-3000:]}"
        return proc.stdout

    def id(self, service: str) -> str:
        (cid,) = self.compose("ps", "-q", service).split()
        return cid

    def inspect(self, service: str) -> dict:
        return json.loads(docker("inspect", self.id(service), text=True).stdout)[0]

    def exec(self, service: str, *argv: str) -> subprocess.CompletedProcess:
        return docker("exec", self.id(service), *argv, check=False, text=True)

    def health(self, service: str) -> str:
        return self.inspect(service)["State"].get("Health", {}).get("Status", "none")

    def wait_healthy(self, service: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.health(service) != "healthy":
            assert time.monotonic() < deadline, f"{service} not healthy after {timeout} s: {self.logs(service)[-3000:]}"
            time.sleep(1)

    def sigkill(self, service: str) -> None:
        """SIGKILL the container's process from the host: a crash as the engine sees it (its restart policy applies;
        `docker kill` would count as a deliberate stop)."""
        os.kill(self.inspect(service)["State"]["Pid"], signal.SIGKILL)

    def wait_exit(self, service: str, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            state = self.inspect(service)["State"]
            if state["Status"] == "exited" and not state["Restarting"]:
                return state["ExitCode"]
            assert time.monotonic() < deadline, f"{service} still running after {timeout} s: {self.logs(service)[-3000:]}"
            time.sleep(1)

    def file(self, service: str, path: str) -> bytes:
        """A file of a container, running or exited (`docker cp`)."""
        tar = docker("cp", f"{self.id(service)}:{path}", "-").stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            return t.extractfile(t.getmembers()[0]).read()

    def logs(self, service: str | None = None) -> str:
        return self.compose("logs", "--no-color", *([service] if service else []))

    def redis(self):
        """The stack's Redis from this host (the container's address on the project network), as the explorer (the
        user that may read its stream's pending entries)."""
        import redis as redis_py

        ip = next(iter(self.inspect("redis")["NetworkSettings"]["Networks"].values()))["IPAddress"]
        return redis_py.Redis(host=ip, port=6379, username="explorer", password=SECRETS["SOLRL_REDIS_EXPLORER_PASSWORD"],
                              socket_timeout=5)

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: docker(*cmd, "--filter", label, "-q", text=True).stdout.split()
                for kind, cmd in (("containers", ("ps", "-a")), ("networks", ("network", "ls")),
                                  ("volumes", ("volume", "ls")))}

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans")


def inspect_hardening(stack: Stack, service: str) -> dict:
    """The service's container as the engine runs it, and the same seen from inside it."""
    c = stack.inspect(service)
    host = c["HostConfig"]
    writable = sorted({m["Destination"] for m in c["Mounts"] if m["RW"]} | set(host.get("Tmpfs") or {}))
    figures = {"user": c["Config"]["User"], "read_only_root": host["ReadonlyRootfs"], "cap_drop": host["CapDrop"],
               "cap_add": host["CapAdd"], "security_opt": host["SecurityOpt"], "memory_bytes": host["Memory"],
               "nano_cpus": host["NanoCpus"], "pids_limit": host["PidsLimit"], "privileged": host["Privileged"],
               "writable": writable,
               "secrets_in_env": sorted(k for k, v in (e.split("=", 1) for e in c["Config"]["Env"])
                                        if v in SECRETS.values())}
    where = f"{service}: {figures}"
    assert figures["user"] not in ("", "root", "0") and not figures["privileged"], where
    assert figures["read_only_root"] is True and figures["cap_drop"] == ["ALL"] and not figures["cap_add"], where
    assert "no-new-privileges:true" in figures["security_opt"], where
    assert figures["memory_bytes"] > 0 and figures["nano_cpus"] > 0 and figures["pids_limit"] > 0, where
    expected = {"redis": ["/data", "/tmp"], "trainer": ["/home/solrl", "/runs", "/tmp"]}.get(service,
                                                                                          ["/home/solrl", "/tmp"])
    assert writable == expected, where
    # the secrets: files mounted read-only at /run/secrets, none in the inspected environment, readable by the role
    assert figures["secrets_in_env"] == [] and not [e for e in c["Config"]["Env"] if e.split("=", 1)[1] in
                                                     SECRETS.values()], where
    secrets = sorted(m["Destination"] for m in c["Mounts"] if m["Destination"].startswith("/run/secrets/"))
    figures["secret_files"] = secrets
    assert secrets and all(not m["RW"] for m in c["Mounts"] if m["Destination"] in secrets), where
    assert stack.exec(service, "cat", secrets[0]).stdout.strip() in SECRETS.values(), where
    # from inside: not uid 0, no capability in any set, no privilege gain, the root filesystem refuses a write
    status = stack.exec(service, "cat", "/proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[0] != "0", where
    assert all(int(fields[k].strip(), 16) == 0 for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")), fields
    assert fields["NoNewPrivs"].strip() == "1", where
    assert stack.exec(service, "touch", "/usr/solrl-write-test").returncode != 0, where
    assert stack.exec(service, "touch", "/tmp/solrl-write-test").returncode == 0, where
    return figures


def check_json_logs(logs: str) -> None:
    """`docker-compose logs`: each role's log records are JSON objects (SOLRL_LOG_FORMAT=json); its other lines are
    its `solrl <role>:` progress lines (the reward, at INFO, logs no record on a run this short). No secret in any
    line."""
    records = {role: 0 for role in ROLES}
    for line in logs.splitlines():
        m = re.match(r"^(\S+?)(?:[_-]\d+)?\s+\| (.*)$", line)
        if not m:
            continue
        service, text = m.group(1), m.group(2)
        assert not [s for s in SECRETS.values() if s in text], line
        if service not in ROLES:
            continue
        if text.startswith("{"):
            record = json.loads(text)
            assert {"time", "level", "logger", "message"} <= set(record), line
            records[service] += 1
        else:
            assert text.startswith(f"solrl {service}: "), line
    assert all(records[role] > 0 for role in ("explorer", "regenerator", "trainer")), records


def run(engine: tuple[list[str], Path], run_id: str, faults: bool) -> tuple[bytes, Stack]:
    stack = Stack(engine, run_id)
    t0 = time.monotonic()
    try:
        # compose starts each service once those it depends on are healthy: the trainer starts its run at once
        stack.compose("up", "-d")
        if faults:
            faults_of(stack)
        else:
            for service in SERVICES[:-1]:
                assert stack.health(service) == "healthy", service
            REPORT["seconds"][f"{run_id}: up -d"] = round(time.monotonic() - t0, 1)
            # the trainer first: it exits when its 2 epochs are done, and the checks from inside need it running
            for service in sorted(SERVICES, key=lambda s: s != "trainer"):
                REPORT["services"][service] = inspect_hardening(stack, service)
        assert stack.wait_exit("trainer", 900) == 0, stack.logs("trainer")[-3000:]
        REPORT["seconds"][f"{run_id}: up to finished"] = round(time.monotonic() - t0, 1)
        adapter = stack.file("trainer", f"{stack.run_dir}/adapter_ema.safetensors")
        metrics = stack.file("trainer", f"{stack.run_dir}/metrics.jsonl").decode()
        assert [json.loads(line)["epoch"] for line in metrics.splitlines()] == [0, 1, 2]
        assert stack.file("trainer", f"{stack.run_dir}/checkpoints/latest").decode().strip() == "epoch_0002"
        logs = stack.logs()
        check_json_logs(logs)
        if faults:
            trainer = stack.inspect("trainer")
            explorer = stack.inspect("explorer")
            assert trainer["RestartCount"] == 1 and explorer["RestartCount"] == 1, (trainer["RestartCount"],
                                                                                  explorer["RestartCount"])
            assert re.search(r"resum", stack.logs("trainer"), re.IGNORECASE), stack.logs("trainer")[-3000:]
            # the job the killed explorer held was delivered again, to its successor
            assert re.search(r"done by \S+ \(delivery [2-9]\)", stack.logs("explorer")), stack.logs("explorer")[-3000:]
        return adapter, stack
    finally:
        t1 = time.monotonic()
        stack.down()
        REPORT["seconds"][f"{run_id}: down -v"] = round(time.monotonic() - t1, 1)
        assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}


def faults_of(stack: Stack) -> None:
    """The explorer frozen while it holds an explore job, Redis restarted from its AOF meanwhile, the explorer's
    process killed; then the trainer's, once epoch 1 is checkpointed."""
    redis = stack.redis()
    explore, deadline = f"{NAMESPACE}:explore", time.monotonic() + 300

    def held() -> set[bytes]:   # the entries delivered to a consumer and not acknowledged
        return {p["message_id"] for p in redis.xpending_range(explore, "explorers", "-", "+", 100)}

    while True:   # the explorer frozen while it holds a job it has taken and not acknowledged
        try:
            pending = redis.xpending(explore, "explorers")["pending"] > 0
        except Exception as exc:  # the stream or group not made yet (NOGROUP): the trainer has not published
            if "NOGROUP" not in str(exc) and "no such key" not in str(exc):
                raise
            pending = False
        if pending:
            docker("pause", stack.id("explorer"))
            before, entries = held(), redis.xlen(explore)
            if before:
                break
            # on a quick machine the job can be done between the look and the pause: let it go on, take the next
            docker("unpause", stack.id("explorer"))
        assert time.monotonic() < deadline, "no explore job held by a frozen explorer after 300 s"
        time.sleep(0.005)
    # Redis: a stop (SIGTERM: the AOF flushed) and a start on the same volume; its streams, their consumer groups and
    # pending entries come back from the AOF (the trainer may publish more meanwhile)
    stack.compose("restart", "redis")
    stack.wait_healthy("redis")
    redis = stack.redis()
    assert redis.xlen(explore) >= entries and before <= held()
    assert stack.exec("redis", "ls", "/data/appendonlydir").stdout.count(".aof") >= 1
    stack.sigkill("explorer")
    docker("unpause", stack.id("explorer"))
    stack.wait_healthy("explorer")
    deadline = time.monotonic() + 600
    while stack.exec("trainer", "cat", f"{stack.run_dir}/checkpoints/latest").stdout.strip() != "epoch_0001":
        assert time.monotonic() < deadline, stack.logs("trainer")[-3000:]
        assert stack.inspect("trainer")["State"]["Status"] == "running", stack.logs("trainer")[-3000:]
        time.sleep(0.5)
    stack.sigkill("trainer")


@pytest.mark.slow
def test_compose_stack_on_an_engine_survives_its_faults_and_ends_at_the_same_adapter(engine):
    straight, _ = run(engine, "straight", faults=False)
    faulted, _ = run(engine, "faulted", faults=True)
    assert straight == faulted
