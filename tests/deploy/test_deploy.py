"""Containers, compose and Kubernetes, validated offline (no Docker engine, no cluster here).

- `docker-compose config -q` on both compose files (Debian's docker-compose runs it without an engine);
- `kubectl kustomize` of every overlay through `kubernetes-validate --strict`;
- the KEDA ScaledObject (a CRD kubernetes-validate has no schema for) against the fields KEDA documents;
- ports and environment names in compose and k8s are exactly those `solrl serve` reads;
- services/Dockerfile, per role and flavor as its build arguments make it: non-root user, HEALTHCHECK on
  the ops port, entry `solrl serve <role>`, protos built; its checks refuse a missing or unknown role.
- the CPU compose file's services run as local processes, end to end (ComposeAsProcesses, below).
The tools are installed by `.ci/run`; elsewhere a missing tool skips with a reason, unless
SOLRL_REQUIRE_DEPLOY_TOOLS=1 (set by CI), where it fails.
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from services.common.args import DEFAULT_NAMESPACE
from services.common.env import (
    ENV_ADAPTER_TOKEN,
    ENV_DATA_TOKEN,
    ENV_GRPC_PORT,
    ENV_HOST,
    ENV_HTTP_PORT,
    ENV_QUEUE_KEY,
    ENV_QUEUE_NAMESPACE,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_URL,
    ENV_REWARD_ADDR,
    FILE_SUFFIX,
    secret,
)
from services.common.logs import ENV_LOG_FORMAT, ENV_LOG_LEVEL
from services.explorer import server as explorer_server
from services.regenerator import server as regenerator_server
from services.reward import server as reward_server
from services.reward.args import DEFAULT_REWARDS
from services.rollout.shell import run_rollout_role
from services.trainer import server as trainer_server
from solrl.engine.queue_loop import GROUP_EXPLORERS, STREAM_EXPLORE
from solrl.models import ENV_CUDA_STANDIN
from solrl.rewards import available_rewards, reward_info
from solrl.telemetry import read_metrics

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"explorer": explorer_server, "regenerator": regenerator_server, "reward": reward_server,
         "trainer": trainer_server}
PORTS = {role: (m.DEFAULT_GRPC_PORT, m.DEFAULT_HTTP_PORT) for role, m in ROLES.items()}


class RecordingEnv(dict):
    """An empty environment that remembers every name the code looks up in it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return default

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return False


def serve_reads(role: str) -> set[str]:
    """The SOLRL_* names `solrl serve <role>` reads, from the code itself: the names its argument
    parser looks up (the same `add_arguments` the CLI calls, fed a recording environment), plus the
    adapter token for roles whose run path reads it (the token is read at start, not parse time)."""
    module = ROLES[role]
    env = RecordingEnv()
    module.add_arguments(argparse.ArgumentParser(), env)
    names = {n for n in env.seen if n.startswith("SOLRL_")}
    run_src = run_source(role)
    for name in ("ENV_ADAPTER_TOKEN", "ENV_REDIS_PASSWORD", "ENV_QUEUE_KEY"):   # secrets: read at start, env only
        if name in run_src:
            names.add(globals()[name])
    return names


def run_source(role: str) -> str:
    """The source of what `solrl serve <role>` runs at start-up."""
    module = ROLES[role]
    run_src = inspect.getsource(module.run)
    if "run_rollout_role(" in run_src:
        run_src += inspect.getsource(run_rollout_role)
    if "return serve(" in run_src:   # the trainer: rank 0 (or the only process) serves; other ranks follow
        run_src += inspect.getsource(module.serve)
    return run_src


READS = {role: serve_reads(role) for role in ROLES}
# optional: the reward service's per-scorer weight overrides (unset = the default source in the HF cache)
OPTIONAL = {role: set() for role in ROLES}
OPTIONAL["reward"] = set(re.findall(r"SOLRL_[A-Z0-9_]+", " ".join(reward_info(n).weights for n in available_rewards())))
# optional for every role whose start-up reads it: the data planes' bearer token (unset: open doors, local use)
for _role in ROLES:
    if "read_data_token(" in run_source(_role):
        OPTIONAL[_role].add(ENV_DATA_TOKEN)
    # the services' logging, which `solrl serve` sets up for every role before it runs (solrl/cli/serve.py)
    OPTIONAL[_role] |= {ENV_LOG_LEVEL, ENV_LOG_FORMAT}
# every secret a role reads may come from a file instead (services.common.env.secret: <NAME>_FILE)
SECRET_NAMES = {ENV_ADAPTER_TOKEN, ENV_DATA_TOKEN, ENV_REDIS_PASSWORD, ENV_QUEUE_KEY}
for _role in ROLES:
    OPTIONAL[_role] |= {n + FILE_SUFFIX for n in (READS[_role] | OPTIONAL[_role]) & SECRET_NAMES}


def check_env(where: str, role: str, declared: set[str]) -> None:
    solrl = {n for n in declared if n.startswith("SOLRL_")}
    # a secret given as a file (<NAME>_FILE) is given
    solrl |= {n.removesuffix(FILE_SUFFIX) for n in solrl if n.removesuffix(FILE_SUFFIX) in SECRET_NAMES}
    missing, extra = READS[role] - solrl, solrl - READS[role] - OPTIONAL[role]
    assert not missing and not extra, f"{where}: missing {sorted(missing)}, not read by solrl serve {sorted(extra)}"


def test_serve_reads_are_derived_from_the_code():
    # guards the recorder: it must see what each role is known to need
    assert READS["reward"] == {ENV_HOST, ENV_GRPC_PORT, ENV_HTTP_PORT}
    for role in ("explorer", "regenerator"):
        assert READS[role] >= {ENV_REDIS_URL, ENV_QUEUE_NAMESPACE, ENV_REWARD_ADDR, ENV_ADAPTER_TOKEN,
                               ENV_REDIS_PASSWORD, ENV_QUEUE_KEY}
    assert READS["trainer"] >= {trainer_server.ENV_EXPLORER_ADDRS, trainer_server.ENV_REGENERATOR_ADDRS,
                                ENV_ADAPTER_TOKEN, ENV_REDIS_URL, ENV_REDIS_PASSWORD, ENV_QUEUE_KEY}
    assert "SOLRL_PICKSCORE_MODEL" in OPTIONAL["reward"]
    assert all(ENV_DATA_TOKEN in OPTIONAL[role] for role in ROLES)


REQUIRE = os.environ.get("SOLRL_REQUIRE_DEPLOY_TOOLS") == "1"


@pytest.fixture()
def cuda_stand_in(monkeypatch):
    """The GPU files' runs set model.device=cuda, which a run config accepts only where CUDA is: here the CPU stands
    in for it (solrl.models.ENV_CUDA_STANDIN, tests only), so their settings resolve as on a GPU node."""
    monkeypatch.setenv(ENV_CUDA_STANDIN, "1")


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        if REQUIRE:
            pytest.fail(f"{name} not found (SOLRL_REQUIRE_DEPLOY_TOOLS=1)")
        pytest.skip(f"{name} not installed (Debian: docker-compose, kubectl; PyPI: kubernetes-validate)")
    return path


def role_of(name: str) -> str:
    return re.sub(r"-\d+$", "", name)


# ------------------------------------------------------------------ compose

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.colocated.yml", "docker-compose.cpu.yml"]
QUEUE_ROLES = ("trainer", "explorer", "regenerator")
# what a user exports for compose: every secret, each required (names as the compose files and docs give them)
COMPOSE_SECRETS = {ENV_ADAPTER_TOKEN: "test-token", ENV_DATA_TOKEN: "test-data-token",
                   ENV_QUEUE_KEY: "test-queue-key-0123456789abcdef",
                   **{f"SOLRL_REDIS_{r.upper()}_PASSWORD": f"test-{r}-redis-password" for r in QUEUE_ROLES}}
REDIS_ACL_SCRIPT = ROOT / "k8s" / "base" / "redis-acl.sh"
# docker-compose.cpu.yml takes the same secrets as files (compose `secrets:`, one file each in SOLRL_SECRETS_DIR, at
# /run/secrets/<name> in the containers, named by the roles' SOLRL_*_FILE variables)
SECRET_FILES = {ENV_ADAPTER_TOKEN: "adapter_token", ENV_DATA_TOKEN: "data_token", ENV_QUEUE_KEY: "queue_key",
                **{f"SOLRL_REDIS_{r.upper()}_PASSWORD": f"redis_{r}_password" for r in QUEUE_ROLES}}
SECRETS_DIR = Path(tempfile.mkdtemp(prefix="solrl-compose-secrets-"))
atexit.register(shutil.rmtree, SECRETS_DIR, True)
for _name, _file in SECRET_FILES.items():
    (SECRETS_DIR / _file).write_text(COMPOSE_SECRETS[_name] + "\n")
# what a user gives every compose file: the secrets in the environment and as files
COMPOSE_ENV = {**COMPOSE_SECRETS, "SOLRL_SECRETS_DIR": str(SECRETS_DIR)}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_config_is_valid(name):
    exe = tool("docker-compose")
    env = {**os.environ, **COMPOSE_ENV}
    proc = subprocess.run([exe, "-f", name, "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    # without its secrets' directory the file refuses to start rather than run unauthenticated or unsigned
    required = set(re.findall(r"\$\{(\w+):\?", (ROOT / name).read_text()))
    assert required == {"SOLRL_SECRETS_DIR"}, required   # every secret is a file in it
    for var in required:
        proc = subprocess.run([exe, "-f", name, "config", "-q"], cwd=ROOT, capture_output=True, text=True,
                              check=False, env={k: v for k, v in env.items() if k != var})
        assert proc.returncode != 0 and f"set {var}" in proc.stderr, var


def compose_config(name: str) -> dict:
    exe = tool("docker-compose")
    env = {**os.environ, **COMPOSE_ENV}
    out = subprocess.run([exe, "-f", name, "config"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return yaml.safe_load(out.stdout)


def compose_services(name: str) -> dict:
    return compose_config(name)["services"]


def given(config: dict, service: str, name: str) -> str:
    """The secret `name` as the service gets it: its environment's value, or the file its <name>_FILE names (one of
    the service's compose `secrets:`, read from the host file compose mounts there)."""
    svc = config["services"][service]
    env = svc["environment"]
    if name in env:
        return str(env[name])
    path = env[name + FILE_SUFFIX]
    source = path.removeprefix("/run/secrets/")
    assert path.startswith("/run/secrets/") and {"source": source} in svc["secrets"], (service, name, path)
    return Path(config["secrets"][source]["file"]).read_text().rstrip("\n")


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_ports_and_env_match_what_solrl_serve_reads(name):
    config = compose_config(name)
    services = config["services"]
    roles = {role_of(s) for s in services} - {"redis"}
    assert roles == set(ROLES)
    for svc_name, svc in services.items():
        role = role_of(svc_name)
        if role == "redis":
            assert "--appendonly" in svc["command"] and "yes" in svc["command"]
            check_compose_redis(config, svc_name)
            continue
        env = svc["environment"]
        check_env(f"{name}: {svc_name}", role, set(env))
        # files: no secret in any container's environment
        assert not [k for k, v in env.items() if str(v) in COMPOSE_SECRETS.values()], svc_name
        # the doors closed in every role
        assert given(config, svc_name, ENV_DATA_TOKEN) == COMPOSE_SECRETS[ENV_DATA_TOKEN], svc_name
        grpc_port, http_port = PORTS[role]
        assert (int(env[ENV_GRPC_PORT]), int(env[ENV_HTTP_PORT])) == (grpc_port, http_port), svc_name
        if ENV_REDIS_URL in env:
            # the role's own ACL user in the URL, its password (and the queue key) from the user's environment
            assert env[ENV_REDIS_URL] == f"redis://{role}@redis:6379/0"
            assert given(config, svc_name, ENV_REDIS_PASSWORD) == COMPOSE_SECRETS[f"SOLRL_REDIS_{role.upper()}_PASSWORD"]
            assert given(config, svc_name, ENV_QUEUE_KEY) == COMPOSE_SECRETS[ENV_QUEUE_KEY]
            assert env[ENV_QUEUE_NAMESPACE] == DEFAULT_NAMESPACE
        if ENV_REWARD_ADDR in env:
            assert env[ENV_REWARD_ADDR] == f"reward:{PORTS['reward'][0]}"
        # built from the one Dockerfile, as this role, on the flavor its target names, serving these ports
        build = svc["build"]
        assert build["dockerfile"] == "services/Dockerfile"
        assert build["target"] == ("cpu" if name == "docker-compose.cpu.yml" else "gpu")
        assert build["args"].get("FLAVOR", "cpu") == build["target"], svc_name
        assert build["args"]["ROLE"] == role, svc_name
        image = dockerfile_image({k: str(v) for k, v in build["args"].items()}, build["target"])
        assert (image.env[ENV_GRPC_PORT], image.env[ENV_HTTP_PORT]) == (str(grpc_port), str(http_port)), svc_name
        assert svc["image"] == f"solrl/{role}:{build['target']}"
    trainer = services["trainer"]["environment"]
    for key, role in ((trainer_server.ENV_EXPLORER_ADDRS, "explorer"),
                      (trainer_server.ENV_REGENERATOR_ADDRS, "regenerator")):
        addrs = trainer_server.parse_addrs(trainer[key], key)
        expected = {f"{s}:{PORTS[role][0]}" for s in services if role_of(s) == role}
        assert set(addrs) == expected  # the trainer pushes adapters to every rollout service


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_compose_role_is_hardened(name):
    """What tests/deploy/test_compose_engine.py inspects on the engine for the CPU file, in every file's configuration:
    each service on a read-only root with tmpfs for /tmp, no capability, no privilege gain, PID, memory and CPU limits,
    reading only the secrets it needs, none of them from the environment; the GPU roles' limits those of the k8s GPU
    component (the trainer's per torchrun rank)."""
    from solrl.deploy.layouts import LIMITS

    config = compose_config(name)
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    for svc_name, svc in config["services"].items():
        assert svc["read_only"] is True and "/tmp" in svc["tmpfs"], svc_name
        assert svc["cap_drop"] == ["ALL"] and svc["security_opt"] == ["no-new-privileges:true"], svc_name
        assert svc["pids_limit"] > 0 and float(svc["cpus"]) > 0 and svc["mem_limit"], svc_name
        assert not svc.get("privileged") and not svc.get("cap_add") and svc.get("network_mode") != "host", svc_name
        assert {s["source"] for s in svc.get("secrets", [])} <= set(config["secrets"]), svc_name
        role = role_of(svc_name)
        if role != "redis":
            assert "/home/solrl" in svc["tmpfs"], svc_name   # HOME: the caches a role writes (triton, torch)
            wanted = {"data_token"} | ({"adapter_token", "queue_key", f"redis_{role}_password"} if role != "reward" else set())
            assert {s["source"] for s in svc["secrets"]} == wanted, svc_name
        if name != "docker-compose.cpu.yml" and role != "redis":
            mem, cpus = LIMITS[role]
            ranks = int(svc["environment"].get("PET_NPROC_PER_NODE", 1))
            scale = ranks if role == "trainer" else 1
            got = svc["mem_limit"]
            got = int(got) if isinstance(got, int) or str(got).isdigit() else int(got[:-1]) * units[got[-1].lower()]
            assert got == int(mem[:-1]) * 2**30 * scale and float(svc["cpus"]) == cpus * scale, svc_name


def check_compose_redis(config: dict, name: str) -> None:
    """Redis runs k8s/base/redis-acl.sh (mounted read-only) with every role's password from the environment or its
    file: no password on its command line, and the unauthenticated health check may still PING."""
    svc = config["services"][name]
    command, env = svc["command"], svc["environment"]
    assert command[:3] == ["sh", "/usr/local/bin/solrl-redis-acl.sh", "/tmp/users.acl"] and command[3] == "redis-server"
    assert f"{REDIS_ACL_SCRIPT}:/usr/local/bin/solrl-redis-acl.sh:ro" in svc["volumes"]
    assert svc["user"] == "redis"
    for role in QUEUE_ROLES:
        secret = f"SOLRL_REDIS_{role.upper()}_PASSWORD"
        assert given(config, name, secret) == COMPOSE_SECRETS[secret]
        assert not [a for a in command if COMPOSE_SECRETS[secret] in a]
    assert env[ENV_QUEUE_NAMESPACE] == DEFAULT_NAMESPACE
    assert svc["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


# ------------------------------------------------------------------ layouts from `solrl plan`

# The files `solrl plan --emit` generates; each names the command in its header.
GENERATED = ["docker-compose.yml", "docker-compose.colocated.yml", "k8s/overlays/b200/plan/kustomization.yaml",
             "k8s/overlays/hopper/plan/kustomization.yaml"]


def plan_command(path: str) -> list[str]:
    m = re.search(r"^# Generated by `(solrl plan [^`]+)`:$", (ROOT / path).read_text(), re.MULTILINE)
    assert m, f"{path}: no 'Generated by' header"
    return shlex.split(m.group(1))


@pytest.mark.parametrize("path", GENERATED)
def test_generated_layouts_are_what_solrl_plan_emits(path, capsys):
    from solrl.cli.app import main

    assert main(plan_command(path)[1:]) == 0
    assert capsys.readouterr().out == (ROOT / path).read_text(), f"{path} differs from its command's output"


def _plan(cfg, gpu: str, layout: str):
    from solrl.deploy.placement import make_plan

    return make_plan(cfg, "-", gpu, 8, layout=layout)


def _device_ids(svc: dict) -> list[str]:
    devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [g for d in devices for g in d["device_ids"]]


def _trainer_run_config(services: dict):
    """The run config the file's trainer service resolves from its own environment (SOLRL_PRESET, SOLRL_SET)."""
    parser = argparse.ArgumentParser()
    trainer_server.add_arguments(parser, {k: str(v) for k, v in services["trainer"]["environment"].items()})
    return trainer_server.run_config(parser.parse_args(["--out", "/tmp/unused"]))[0]


@pytest.mark.parametrize("name, layout", [("docker-compose.yml", "disaggregated"),
                                          ("docker-compose.colocated.yml", "colocated")])
def test_gpu_compose_header_predicts_the_run_its_trainer_starts(name, layout, cuda_stand_in):
    """The header's predicted epoch and stage times are the plan of the run the file's trainer resolves from its
    own environment: the preset as it trains now (no KL term, so no reference forward in the train stage), not
    only the output of the command the header names."""
    from solrl.deploy.layouts import _plan_lines

    cfg = _trainer_run_config(compose_services(name))
    assert cfg.train.kl_beta == 0   # the shapes preset: the train stage prices 4 passes, not 5
    predicted = _plan_lines(_plan(cfg, "b200", layout))[1]   # "predicted epoch ... (explore ..., train ...)."
    header = [line[2:] for line in (ROOT / name).read_text().splitlines()[:8] if line.startswith("# ")]
    assert predicted in header, (predicted, header)


@pytest.mark.parametrize("name, layout", [("docker-compose.yml", "disaggregated"),
                                          ("docker-compose.colocated.yml", "colocated")])
def test_gpu_compose_places_the_roles_as_the_plan_does(name, layout, cuda_stand_in):
    """The plan of the run the file starts (its default SOLRL_PRESET and SOLRL_SET, as the trainer resolves them)
    gives the file's GPUs: explorer and regenerator replicas, the trainer's torchrun ranks (one GPU each)."""
    services = compose_services(name)
    trainer = services["trainer"]
    best = _plan(_trainer_run_config(services), "b200", layout).best
    assert best.kind == layout
    gpus = {n: _device_ids(svc) for n, svc in services.items() if n != "redis"}
    explorers = [n for n in gpus if role_of(n) == "explorer"]
    regenerators = [n for n in gpus if role_of(n) == "regenerator"]
    assert (len(explorers), len(regenerators)) == (best.explorers, best.regenerators)
    assert all(len(gpus[n]) == 1 for n in explorers + regenerators) and len(gpus["reward"]) == 1
    # torchrun in the container, one rank per GPU it is given
    assert trainer["entrypoint"][:1] == ["torchrun"] and trainer["entrypoint"][-3:] == ["solrl", "serve", "trainer"]
    assert int(trainer["environment"]["PET_NPROC_PER_NODE"]) == len(gpus["trainer"]) == best.trainer_ranks
    every = [str(i) for i in range(8)]
    if layout == "disaggregated":   # each GPU to one service
        owned = [g for ids in gpus.values() for g in ids]
        assert sorted(owned, key=int) == every
    else:                           # each GPU: one explorer, one regenerator, one trainer rank
        for kind in (explorers, regenerators):
            assert sorted((gpus[n][0] for n in kind), key=int) == every
        assert gpus["trainer"] == every


# ------------------------------------------------------------------ kubernetes
# ------------------------------------------------------------------ kubernetes

OVERLAYS = ["cpu-demo", "b200", "hopper"]


def write_overlay_secrets(tree: Path, token: str = "test-token") -> None:
    """The GPU overlays' git-ignored secret files, as their headers tell a user to write them."""
    for overlay in ("b200", "hopper"):
        where = tree / "overlays" / overlay
        (where / "adapter-token.txt").write_text(token + "\n")
        (where / "data-token.txt").write_text("test-data-token\n")
        (where / "queue-key.txt").write_text("test-queue-key-0123456789abcdef\n")
        (where / "redis-passwords.env").write_text("".join(f"{r}=test-{r}-redis-password\n"
                                                           for r in (*QUEUE_ROLES, "keda")))


def k8s_copy(where: Path, token: str = "test-token") -> Path:
    """A copy of k8s/ in `where` with the GPU overlays' git-ignored secret files present, as a user has them."""
    tree = where / "k8s"
    shutil.copytree(ROOT / "k8s", tree)
    write_overlay_secrets(tree, token)
    return tree


@pytest.fixture()
def k8s_tree(tmp_path):
    return k8s_copy(tmp_path)


def kustomize(tree: Path, overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(tree / "overlays" / overlay)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_kubernetes(k8s_tree, overlay):
    kustomize(k8s_tree, overlay)
    out = subprocess.run(f"{tool('kubectl')} kustomize {k8s_tree / 'overlays' / overlay} | "
                         f"{tool('kubernetes-validate')} --strict --quiet -", shell=True, capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def container_env(c: dict, by_kind: dict) -> dict[str, str]:
    """The environment a container starts with: envFrom ConfigMaps, then env (values, ConfigMap keys,
    Secret keys as "<secret>", an indexed Job's completion index as the index-0 pod has it); every reference must
    resolve to an object of the rendered overlay."""
    out: dict[str, str] = {}
    for src in c.get("envFrom", []):
        out.update(by_kind[("ConfigMap", src["configMapRef"]["name"])]["data"])
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        if "configMapKeyRef" in ref:
            out[e["name"]] = by_kind[("ConfigMap", ref["configMapKeyRef"]["name"])]["data"][ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref:
            assert ref["secretKeyRef"]["key"] in by_kind[("Secret", ref["secretKeyRef"]["name"])]["data"]
            out[e["name"]] = "<secret>"
        elif "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == COMPLETION_INDEX, ref
            out[e["name"]] = "0"
        else:
            out[e["name"]] = e["value"]
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_ports_env_probes_and_security(k8s_tree, overlay):
    docs = kustomize(k8s_tree, overlay)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for role in ROLES:
        kind = "Job" if role == "trainer" else "Deployment"
        workload = by_kind[(kind, role)]
        (c,) = containers(workload)
        env = container_env(c, by_kind)
        check_env(f"{overlay}: {kind} {role}", role, set(env))
        grpc_port, http_port = PORTS[role]
        assert (int(env[ENV_GRPC_PORT]), int(env[ENV_HTTP_PORT])) == (grpc_port, http_port)
        if ENV_REDIS_URL in env:
            assert env[ENV_REDIS_URL] == f"redis://{role}@redis:6379/0" and env[ENV_QUEUE_NAMESPACE] == DEFAULT_NAMESPACE
            refs = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef") for e in c["env"]}
            # the role's own Redis password and the queue key: from the Secrets, never literals
            assert refs[ENV_REDIS_PASSWORD]["name"].startswith("solrl-redis-") and refs[ENV_REDIS_PASSWORD]["key"] == role
            assert refs[ENV_QUEUE_KEY]["name"].startswith("solrl-queue-key-") and refs[ENV_QUEUE_KEY]["key"] == "key"
        if ENV_REWARD_ADDR in env:
            assert env[ENV_REWARD_ADDR] == f"reward:{PORTS['reward'][0]}"
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": grpc_port, "http": http_port}
        assert c["readinessProbe"]["grpc"]["port"] == grpc_port
        if kind == "Deployment":
            assert c["livenessProbe"]["grpc"]["port"] == grpc_port
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["resources"]["requests"] and c["resources"]["limits"]
        if overlay in ("b200", "hopper"):   # one GPU per pod, the trainer's: one per torchrun rank
            gpus = int(env["PET_NPROC_PER_NODE"]) if role == "trainer" else 1
            assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus and c["image"].endswith(":gpu")
        if overlay == "hopper":  # every GPU pod on a Hopper node
            (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.family", "operator": "In", "values": ["hopper"]}]
        if ENV_ADAPTER_TOKEN in env:
            assert env[ENV_ADAPTER_TOKEN] == "<secret>"  # from the Secret, never a literal
        assert env[ENV_DATA_TOKEN] == "<secret>"   # every role's doors closed, with the token from the Secret
        svc = by_kind[("Service", role)]
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": grpc_port, "http": http_port}
    trainer_env = container_env(containers(by_kind[("Job", "trainer")])[0], by_kind)
    for key, role in ((trainer_server.ENV_EXPLORER_ADDRS, "explorer"),
                      (trainer_server.ENV_REGENERATOR_ADDRS, "regenerator")):
        (addr,) = trainer_server.parse_addrs(trainer_env[key], key)
        assert addr == f"{trainer_server.ALL_PREFIX}{role}-pods:{PORTS[role][0]}"
        assert by_kind[("Service", f"{role}-pods")]["spec"]["clusterIP"] == "None"  # headless: every pod
    # the trainer: torchrun in an indexed Job's pods, static rendezvous at the index-0 pod, which the Service selects
    job = by_kind[("Job", "trainer")]
    (c,) = containers(job)
    env = container_env(c, by_kind)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == int(env["PET_NNODES"])
    assert c["command"] == ["torchrun", "--no-python", "solrl", "serve", "trainer"]
    pods = by_kind[("Service", "trainer-pods")]["spec"]
    assert job["spec"]["template"]["spec"]["subdomain"] == "trainer-pods" and pods["clusterIP"] == "None"
    assert pods["publishNotReadyAddresses"] is True   # the rendezvous comes before readiness
    assert env["PET_MASTER_ADDR"] == "trainer-0.trainer-pods" and env["PET_NODE_RANK"] == "0"
    assert {p["port"] for p in pods["ports"]} == {int(env["PET_MASTER_PORT"])}
    assert by_kind[("Service", "trainer")]["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    redis = by_kind[("StatefulSet", "redis")]
    (c,) = containers(redis)
    assert "--appendonly" in c["args"] and redis["spec"]["volumeClaimTemplates"]
    # the ACL is written at start by the same script compose runs, from the solrl-redis Secret (no password in args)
    assert c["args"][:4] == ["sh", "/etc/solrl-redis/redis-acl.sh", "/run/redis/users.acl", "redis-server"]
    script = {v["name"]: v for v in redis["spec"]["template"]["spec"]["volumes"]}["acl-script"]["configMap"]["name"]
    assert by_kind[("ConfigMap", script)]["data"]["redis-acl.sh"] == REDIS_ACL_SCRIPT.read_text()
    refs = {e["name"]: e["valueFrom"].get("secretKeyRef") or e["valueFrom"]["configMapKeyRef"] for e in c["env"]}
    for role in (*QUEUE_ROLES, "keda"):
        ref = refs[f"SOLRL_REDIS_{role.upper()}_PASSWORD"]
        assert ref["name"].startswith("solrl-redis-") and ref["key"] == role
        assert ref["key"] in by_kind[("Secret", ref["name"])]["data"]
    assert {n for k, n in by_kind if k == "PodDisruptionBudget"} >= {"explorer", "regenerator", "reward"}


def overlay_run(by_kind: dict):
    """The run the overlay's trainer trains, resolved from its Job's args and env as its entry resolves them
    (SOLRL_PRESET or the base's run.json, then SOLRL_SET), and that env."""
    (c,) = containers(by_kind[("Job", "trainer")])
    env = container_env(c, by_kind)
    args = [str(ROOT / "k8s" / "base" / "run.json") if a == "/etc/solrl/run.json" else a for a in c.get("args", [])]
    parser = argparse.ArgumentParser()
    trainer_server.add_arguments(parser, env)
    return trainer_server.run_config(parser.parse_args(args))[0], env


# overlay: (the GPU kind it places on, the explorer's Transformer Engine format, the preset it trains)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_every_container_is_hardened_as_the_compose_roles_are(k8s_tree, overlay):
    """What tests/deploy/test_compose_engine.py inspects on the engine, in every workload of the overlay: a non-root
    user, the runtime's seccomp profile, a read-only root filesystem written only through volumes (emptyDir, PVC),
    no capability, no privilege gain, CPU and memory limits; secrets from Secrets, never literals."""
    docs = kustomize(k8s_tree, overlay)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet")]
    assert {d["metadata"]["name"] for d in workloads} >= {*ROLES, "redis"}
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        where = f"{overlay}: {w['kind']} {w['metadata']['name']}"
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0, where
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), where
        kinds = {v["name"]: next(k for k in v if k != "name") for v in pod.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged"), where
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), where
            for m in c.get("volumeMounts", []):
                if not m.get("readOnly"):
                    assert m["name"] in claims or kinds[m["name"]] in ("emptyDir", "persistentVolumeClaim"), (where, m)
            for e in c.get("env", []):
                if re.search(r"TOKEN|PASSWORD|KEY$", e["name"]) and not e["name"].endswith("_NAMESPACE"):
                    assert "secretKeyRef" in e.get("valueFrom", {}), (where, e["name"])


GPU_OVERLAYS = {"b200": ("b200", "nvfp4", ""), "hopper": ("h100", "fp8", "sd35l-sol-rl")}


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_explore_with_their_generation_s_format(k8s_tree, overlay, cuda_stand_in):
    """The run env every role reads sets the Transformer Engine format the GPU generation has and the device, and the
    run config it yields validates (the same resolution the services do). The hopper overlay trains SD3.5-Large:
    its weights and prompt files on the HF cache volume every pod mounts, its reward served by the reward pods."""
    _, backend, preset = GPU_OVERLAYS[overlay]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(k8s_tree, overlay)}
    cfg, env = overlay_run(by_kind)
    assert env["SOLRL_PRESET"] == preset
    assert cfg.rollout.explore_precision.backend == backend and cfg.model.device == "cuda"
    (reward,) = containers(by_kind[("Deployment", "reward")])
    served = reward["args"][reward["args"].index("--rewards") + 1].split(",") if "--rewards" in reward["args"] \
        else list(DEFAULT_REWARDS)
    assert cfg.reward in served and (cfg.eval.reward or cfg.reward) in served
    if preset:   # a real model: weights and prompts from the volume components/gpu mounts at /cache/hf
        assert cfg.model.name == "sd3.5-large" and cfg.model.path.startswith("/cache/hf/")
        assert cfg.prompts.train.startswith("/cache/hf/") and cfg.prompts.eval.startswith("/cache/hf/")
        for kind, role in (("Deployment", "explorer"), ("Deployment", "regenerator"), ("Job", "trainer")):
            (c,) = containers(by_kind[(kind, role)])
            assert "/cache/hf" in {m["mountPath"] for m in c["volumeMounts"]}, role
            claim = {v["name"]: v for v in by_kind[(kind, role)]["spec"]["template"]["spec"]["volumes"]}["hf-cache"]
            assert claim["persistentVolumeClaim"]["claimName"] == "solrl-hf-cache", role


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_place_the_roles_as_the_plan_does(k8s_tree, overlay, cuda_stand_in):
    """The plan of the overlay's own run (SOLRL_PRESET or run.json, and its SOLRL_SET, as the trainer resolves them)
    on 8 GPUs of its kind gives the overlay's replicas, the trainer's ranks and GPUs and its gradient checkpointing;
    each pod's memory holds its role's plan (a process stages its weights in host memory while loading; the
    trainer's pod holds one process per rank and the memory-backed /dev/shm)."""
    gpu = GPU_OVERLAYS[overlay][0]
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(k8s_tree, overlay)}
    (c,) = containers(by_kind[("Job", "trainer")])
    cfg, env = overlay_run(by_kind)
    best = _plan(cfg, gpu, "disaggregated").best
    assert by_kind[("Deployment", "explorer")]["spec"]["replicas"] == best.explorers
    assert by_kind[("Deployment", "regenerator")]["spec"]["replicas"] == best.regenerators
    assert int(env["PET_NPROC_PER_NODE"]) == c["resources"]["limits"]["nvidia.com/gpu"] == best.trainer_ranks > 1
    assert best.explorers + best.regenerators + best.trainer_ranks + 1 == 8   # + the reward's GPU
    assert not best.over_gb and (cfg.train.gradient_checkpointing == "true") == best.gradient_checkpointing
    shm = {v["name"]: v for v in by_kind[("Job", "trainer")]["spec"]["template"]["spec"]["volumes"]}["dshm"]
    for kind, role in (("Deployment", "explorer"), ("Deployment", "regenerator"), ("Deployment", "reward"),
                       ("Job", "trainer")):
        (rc,) = containers(by_kind[(kind, role)])
        need = best.memory_gb[role] * (best.trainer_ranks if role == "trainer" else 1) * 1e9
        if role == "trainer":
            need += _bytes(shm["emptyDir"]["sizeLimit"])
        assert _bytes(rc["resources"]["requests"]["memory"]) >= need, (role, rc["resources"], need / 1e9)


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


def test_run_config_in_the_configmap_loads():
    from solrl.config import RunConfig

    cfg = RunConfig.load(ROOT / "k8s" / "base" / "run.json").validate()
    assert cfg.rollout.mode == "sol_rl"


def test_keda_scaledobject_targets_the_explore_stream():
    """ScaledObject fields as KEDA documents them (keda.sh, scalers/redis-streams); kubernetes-validate
    has no schema for this CRD, so this checks the fields and that they name what the queue uses."""
    import jsonschema

    schema = {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
            "spec": {"type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
                     "properties": {
                         "scaleTargetRef": {"type": "object", "required": ["name"]},
                         "minReplicaCount": {"type": "integer", "minimum": 0},
                         "maxReplicaCount": {"type": "integer", "minimum": 1},
                         "cooldownPeriod": {"type": "integer"}, "pollingInterval": {"type": "integer"},
                         "triggers": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "required": ["type", "metadata"],
                             "properties": {"type": {"const": "redis-streams"}, "metadata": {
                                 "type": "object", "required": ["stream", "consumerGroup", "pendingEntriesCount"],
                                 "additionalProperties": {"type": "string"}}}}}}}}}
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "k8s" / "components" / "keda" / "scaledobject.yaml")
                                                     .read_text())}
    doc = docs["ScaledObject"]
    jsonschema.validate(doc, schema)
    (trigger,) = doc["spec"]["triggers"]
    meta = trigger["metadata"]
    assert meta["stream"] == f"{DEFAULT_NAMESPACE}:{STREAM_EXPLORE}" and meta["consumerGroup"] == GROUP_EXPLORERS
    assert doc["spec"]["scaleTargetRef"]["name"] == "explorer"
    # it reads Redis as the read-only keda ACL user, its password from the Secret (TriggerAuthentication, as KEDA
    # documents it)
    auth = docs["TriggerAuthentication"]
    assert meta["username"] == "keda" and trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "solrl-redis", "key": "keda"}]
    assert "user keda on" in REDIS_ACL_SCRIPT.read_text()


def test_keda_component_in_an_overlay_names_the_generated_secret(k8s_tree):
    (k8s_tree / "overlays" / "cpu-demo" / "kustomization.yaml").write_text(
        (k8s_tree / "overlays" / "cpu-demo" / "kustomization.yaml").read_text()
        .replace("components:\n", "components:\n  - ../../components/keda\n"))
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(k8s_tree, "cpu-demo")}
    (ref,) = by_kind[("TriggerAuthentication", "solrl-redis-keda")]["spec"]["secretTargetRef"]
    assert "keda" in by_kind[("Secret", ref["name"])]["data"]   # the hashed name kustomize gave it


@pytest.mark.parametrize("missing", ["adapter-token.txt", "data-token.txt", "queue-key.txt", "redis-passwords.env"])
def test_gpu_overlays_refuse_to_render_without_a_secret_file(k8s_tree, missing):
    (k8s_tree / "overlays" / "b200" / missing).unlink()
    out = subprocess.run([tool("kubectl"), "kustomize", str(k8s_tree / "overlays" / "b200")], capture_output=True,
                         text=True, check=False)
    assert out.returncode != 0 and missing in out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ Dockerfile

# One parametrised Dockerfile builds every role. No engine here, so the test builds its image
# *configuration* the way BuildKit would for the subset of the syntax the file uses (global and stage
# ARGs, FROM <stage> inheritance, ENV / EXPOSE / USER substitution, HEALTHCHECK, ENTRYPOINT), and runs
# for real the RUN steps that read the build arguments (the checks that make a bad build fail).
DOCKERFILE = ROOT / "services" / "Dockerfile"
FLAVORS = ("cpu", "gpu")


class BuildRefused(Exception):
    """A RUN step of the build failed: what `docker build` would stop on, with the step's stderr."""


class Image:
    def __init__(self) -> None:
        self.stages: list[str] = []       # the stages the target is made of, base first
        self.env: dict[str, str] = {}     # the image's ENV
        self.user: str | None = None
        self.expose: list[str] = []
        self.healthcheck: list[str] | None = None
        self.entrypoint: list[str] | None = None
        self.runs: list[str] = []         # every RUN, in build order (with those of the stages copied from)
        self.checks: list[str] = []       # the RUNs that read a build argument and only check it, run here
        self.copies: list[tuple[str, str, str | None]] = []   # COPY (source, destination, --from stage), expanded


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments): comments dropped, line continuations joined as Docker joins them."""
    out, pending = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (pending is None and not line.strip()):
            continue
        if line.endswith("\\"):
            pending = (pending or "") + line[:-1]
            continue
        word, _, rest = ((pending or "") + line).strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = None
    assert pending is None, "the Dockerfile ends in a line continuation"
    return out


def _expand(word: str, variables: dict[str, str]) -> str:
    out = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m.group(1) or m.group(2)) or "", word)
    assert "$" not in out, f"unmodelled substitution in {word!r}"
    return out


def dockerfile_image(args: dict[str, str], target: str | None = None) -> Image:
    """The image `docker build -f services/Dockerfile [--target T] --build-arg K=V ...` makes, as configuration;
    BuildRefused if one of its checks fails."""
    global_args: dict[str, str | None] = {}
    stages: list[dict] = []
    for instr, rest in dockerfile_instructions(DOCKERFILE.read_text()):
        if instr == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            stages.append({"base": m.group(1), "name": m.group(2), "body": []})
        elif not stages:
            assert instr == "ARG", f"only ARG may precede the first FROM, not {instr}"
            name, eq, default = rest.partition("=")
            global_args[name] = default if eq else None
        else:
            stages[-1]["body"].append((instr, rest))
    named = {s["name"]: s for s in stages if s["name"]}
    globals_ = {k: args.get(k, v) for k, v in global_args.items() if args.get(k, v) is not None}
    image = Image()

    def build(stage: dict, image: Image) -> None:
        base = _expand(stage["base"], globals_)
        if base in named:
            build(named[base], image)    # FROM <stage>: its filesystem and configuration
        else:
            image.stages.append(base)    # an external image: its configuration is not modelled
        image.stages.append(stage["name"] or "(last stage)")
        scope: dict[str, str] = {}       # the build arguments this stage declared
        for instr, rest in stage["body"]:
            variables = {**scope, **image.env}
            if instr == "ARG":
                name, eq, default = rest.partition("=")
                value = args.get(name, _expand(default, variables) if eq else globals_.get(name))
                scope[name] = value   # None: declared, not set
            elif instr == "ENV":
                for item in shlex.split(rest):
                    key, eq, value = item.partition("=")
                    assert eq, f"ENV {rest}: use KEY=VALUE"
                    image.env[key] = _expand(value, variables)
            elif instr == "RUN":
                image.runs.append(rest)
                # a RUN reading build arguments either only checks them (run here) or installs from the wheelhouse by
                # them (services/Dockerfile's deps: the wheels are not here), never more
                if any(re.search(rf"\$\{{?{name}\b", rest) for name in scope) and \
                        not re.search(r"\bpip install --quiet --no-index\b", rest):
                    assert not re.search(r"\b(pip|apt-get|useradd|chown|curl|wget)\b", rest), \
                        f"a RUN reading build arguments should only check them: {rest}"
                    image.checks.append(rest)
                    env = {"PATH": os.environ["PATH"], **image.env,
                           **{k: v for k, v in scope.items() if v is not None and k not in image.env}}
                    proc = subprocess.run(["sh", "-c", rest], env=env, capture_output=True, text=True, check=False)
                    if proc.returncode != 0:
                        raise BuildRefused(proc.stderr.strip())
            elif instr == "USER":
                image.user = _expand(rest, variables)
            elif instr == "EXPOSE":
                image.expose += _expand(rest, variables).split()
            elif instr == "HEALTHCHECK":
                image.healthcheck = json.loads(rest.split(" CMD ", 1)[1])
            elif instr == "ENTRYPOINT":
                image.entrypoint = json.loads(rest)
            elif instr == "COPY":
                words = rest.split()
                source = next((w.partition("=")[2] for w in words if w.startswith("--from=")), None)
                paths = [_expand(w, variables) for w in words if not w.startswith("--")]
                image.copies += [(src, paths[-1], source) for src in paths[:-1]]
                if source is not None:   # COPY --from=<stage>: that stage is built, its files alone taken
                    other = Image()
                    build(named[source], other)
                    image.runs += other.runs
                    image.checks += other.checks
                    image.copies += other.copies
                    image.stages.append(f"{source} (copied from)")
            else:
                assert instr == "WORKDIR", f"unmodelled instruction {instr} {rest}"

    build(named[target] if target else stages[-1], image)
    return image


TE_ROLES = {"explorer"}   # the roles whose GPU image carries Transformer Engine (services/Dockerfile's ENGINE)
TE_VERSION = "2.20.2"


def role_args(role: str, flavor: str = "cpu") -> dict[str, str]:
    grpc_port, http_port = PORTS[role]
    engine = "te" if flavor == "gpu" and role in TE_ROLES else "none"
    return {"FLAVOR": flavor, "ENGINE": engine, "ROLE": role, "GRPC_PORT": str(grpc_port), "HTTP_PORT": str(http_port)}


def entry_command(image: Image, args: list[str], env: dict[str, str] | None = None) -> list[str]:
    """The command the image's ENTRYPOINT runs with `args` after the image name (a stand-in `solrl`
    on PATH prints its argv)."""
    import tempfile

    with tempfile.TemporaryDirectory() as stub_dir:
        stub = Path(stub_dir) / "solrl"
        stub.write_text(f"#!/bin/sh\nexec '{sys.executable}' -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "
                        '"$@"\n')
        stub.chmod(0o755)
        proc = subprocess.run([*image.entrypoint, *args], capture_output=True, text=True, check=True, timeout=30,
                              env={**image.env, **(env or {}),
                                   "PATH": f"{stub_dir}:{image.env.get('PATH', '')}:{os.environ['PATH']}"})
    return ["solrl", *json.loads(proc.stdout)]


def run_healthcheck(image: Image, env: dict[str, str] | None = None) -> int:
    """The image's HEALTHCHECK command, verbatim, in the container's environment (the image's ENV, then
    what the container is given)."""
    assert image.healthcheck[0] == "python"
    proc = subprocess.run([sys.executable, *image.healthcheck[1:]], capture_output=True, text=True, timeout=30,
                          check=False, env={**os.environ, **image.env, **(env or {})})
    return proc.returncode


class _Healthz:
    """A stand-in ops server: 200 on /healthz."""

    def __init__(self, port: int) -> None:
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self.send_response(200 if self.path == "/healthz" else 404)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("role", sorted(ROLES))
def test_dockerfile_targets_user_healthcheck_and_entry(role):
    assert sorted(ROOT.glob("services/**/Dockerfile")) == [DOCKERFILE]  # one file for every role
    for flavor, target in [(f, f) for f in FLAVORS] + [(f, None) for f in FLAVORS]:
        image = dockerfile_image(role_args(role, flavor), target)
        where = f"{role}, FLAVOR={flavor}, --target {target}"
        # one base for both flavors; FLAVOR's wheelhouse, installed in the deps stage with no index (no network in
        # the build) and taken into the image as the environment alone
        assert image.stages[0] == "python:3.11-slim-bookworm" and "deps (copied from)" in image.stages, where
        assert ("build/wheelhouse/" + flavor, "/wheels", None) in image.copies, where
        assert ("/opt/venv", "/opt/venv", "deps") in image.copies and image.env["PATH"].startswith("/opt/venv/bin:")
        installs = [r for r in image.runs if re.search(r"\bpip install\b", r)]
        assert installs and all("--no-index" in r for r in installs), where
        assert image.checks, "the build checks its arguments"
        # Transformer Engine in exactly the roles that run it (ENGINE=te), pinned, from the wheelhouse, import-checked
        (deps,) = [r for r in image.runs if "-r /wheels/requirements.txt" in r]
        te = re.search(r'if \[ "\$ENGINE" = te \]; then(.*?); fi', deps)
        assert te and f'"transformer-engine[pytorch]=={TE_VERSION}"' in te.group(1), where
        assert "--find-links /wheels" in te.group(1), where
        assert te.group(1).strip().endswith('python -c "import transformer_engine.pytorch, peft"'), where
        assert role_args(role, flavor)["ENGINE"] == ("te" if flavor == "gpu" and role in TE_ROLES else "none")
        assert any("python -m solrl.protos_build" in r for r in image.runs)  # stubs generated in the build
        assert image.user and image.user not in ("root", "0"), where
        assert any(f"useradd --uid {image.user} " in r for r in image.runs), where
        assert any(f"mkdir -p /runs && chown {image.user}:{image.user} /runs" in r for r in image.runs), where
        grpc_port, http_port = PORTS[role]
        assert image.expose == [str(grpc_port), str(http_port)], where
        assert (image.env[ENV_GRPC_PORT], image.env[ENV_HTTP_PORT]) == (str(grpc_port), str(http_port)), where
        # the image's SOLRL_* defaults are names its `solrl serve` reads (and the role for the entry)
        assert {k for k in image.env if k.startswith("SOLRL_")} - {"SOLRL_ROLE"} <= READS[role], where
        assert image.env["HF_HUB_OFFLINE"] == "1", where
        # ENTRYPOINT: `solrl serve <role>`, the container's arguments appended unchanged
        assert entry_command(image, []) == ["solrl", "serve", role], where
        assert entry_command(image, ["--threads", "1", "a b"]) == ["solrl", "serve", role, "--threads", "1", "a b"]
    # HEALTHCHECK: GET /healthz on the image's ops port (HTTP_PORT), or on the one the container is given
    port, other = free_port(), free_port()
    image = dockerfile_image({**role_args(role), "HTTP_PORT": str(port)}, "cpu")
    assert run_healthcheck(image) != 0
    server = _Healthz(port)
    try:
        assert run_healthcheck(image) == 0
        assert run_healthcheck(image, {ENV_HTTP_PORT: str(other)}) != 0
    finally:
        server.close()


def test_transformer_engine_is_pinned_for_hopper_and_blackwell_and_only_in_the_gpu_wheelhouse():
    """services/images/wheelhouse.py: every Transformer Engine package at one pinned version (the `gpu` extra's, which
    the Dockerfile installs), the PyTorch binding compiled for sm_90 and sm_100 only; never in the CPU wheelhouse or
    the CPU / test install."""
    import importlib.util

    import tomllib

    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "services" / "images" / "wheelhouse.py")
    wheelhouse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheelhouse)
    env = wheelhouse.TE_BUILD_ENV
    assert env["NVTE_CUDA_ARCHS"] == "90;100" and env["TORCH_CUDA_ARCH_LIST"] == "9.0;10.0", env
    assert env["NVTE_FRAMEWORK"] == "pytorch" and int(env["MAX_JOBS"]) > 0
    pins = re.findall(r"transformer[-_]engine[\w\-\[\]]*==([\w.]+)", DOCKERFILE.read_text() +
                      (ROOT / "services" / "images" / "wheelhouse.py").read_text())
    assert len(pins) >= 3 and set(pins) == {TE_VERSION}, pins
    assert wheelhouse.TE_BINDING == f"transformer-engine-torch=={TE_VERSION}"
    assert wheelhouse.TE in wheelhouse.requirements("gpu") and not [r for r in wheelhouse.requirements("cpu")
                                                                    if "transformer" in r and "engine" in r]
    assert "torch==2.13.0" in wheelhouse.requirements("cpu")
    # the GPU wheelhouse: PyPI's CUDA build, never the CPU build of the version a host's find-links may hold
    assert "torch==2.13.0,!=2.13.0+cpu" in wheelhouse.requirements("gpu")
    assert not [r for r in wheelhouse.requirements("gpu", "none") if "transformer" in r and "engine" in r]
    assert env["NVTE_PYTORCH_FORCE_BUILD"] == "TRUE"   # compiled here, not fetched from GitHub
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"transformer-engine[pytorch]=={TE_VERSION}"]
    assert not [d for name, deps in extras.items() if name != "gpu" for d in deps if "transformer" in d and "engine" in d]


def test_dockerfile_refuses_a_missing_or_unknown_role_and_a_mismatched_flavor():
    good = role_args("explorer")
    dockerfile_image(good, "cpu")
    for args, target, says in [
        ({k: v for k, v in good.items() if k != "ROLE"}, "cpu", "ROLE"),
        ({**good, "ROLE": "rewards"}, "cpu", "ROLE"),
        ({**good, "ROLE": ""}, None, "ROLE"),
        ({k: v for k, v in good.items() if k != "GRPC_PORT"}, "cpu", "GRPC_PORT"),
        ({k: v for k, v in good.items() if k != "HTTP_PORT"}, "cpu", "HTTP_PORT"),
        ({**good, "HTTP_PORT": "80a"}, "cpu", "HTTP_PORT"),
        ({k: v for k, v in good.items() if k != "FLAVOR"}, "gpu", "FLAVOR=gpu"),   # --target gpu, CPU base
        (role_args("explorer", "gpu"), "cpu", "FLAVOR=cpu"),
        # Transformer Engine in the GPU explorer, and nowhere else
        ({**role_args("explorer", "gpu"), "ENGINE": "none"}, "gpu", "takes ENGINE=te"),
        ({**role_args("reward", "gpu"), "ENGINE": "te"}, "gpu", "takes ENGINE=none"),
        ({**role_args("trainer", "gpu"), "ENGINE": "te"}, "gpu", "takes ENGINE=none"),
        ({**role_args("regenerator", "gpu"), "ENGINE": "te"}, "gpu", "takes ENGINE=none"),
        ({**good, "ENGINE": "te"}, "cpu", "takes ENGINE=none"),
    ]:
        with pytest.raises(BuildRefused, match=re.escape(says)):
            dockerfile_image(args, target)
    # --target cpu with no FLAVOR is the CPU image (FLAVOR defaults to cpu)
    assert ("build/wheelhouse/cpu", "/wheels", None) in \
        dockerfile_image({k: v for k, v in good.items() if k != "FLAVOR"}, "cpu").copies


def test_trainer_expands_headless_service_addresses():
    addrs = trainer_server.parse_addrs("all+127.0.0.1:8011, explorer-0:8011", "x")
    assert trainer_server.expand_addrs(addrs) == ["127.0.0.1:8011", "explorer-0:8011"]
    with pytest.raises(RuntimeError, match="cannot resolve 'all\\+no-such-host.invalid:1'"):
        trainer_server.expand_addrs(["all+no-such-host.invalid:1"])
    with pytest.raises(ValueError, match="host:port"):
        trainer_server.parse_addrs("all+nohostport", "x")


# ------------------------------------------------------------------ the entry commands, run

def grpc_serving(port: int) -> bool:
    """grpc.health.v1 Check with the empty service name: what a k8s `grpc:` probe sends."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------ the CPU compose file, run as shipped

# A 2-epoch run small enough for CI, given to every role the way a user gives it: SOLRL_SET.
DEPLOY_SET = ("epochs=2 rollout.prompts_per_epoch=2 rollout.pool=4 rollout.kept=2 rollout.explore_steps=2 "
              "rollout.steps=3 train.micro_batch=4 eval.prompts=2 eval.seeds_per_prompt=1 eval.every=0 eval.steps=2")
TOKEN = "deploy-test-token-3f9c"
COMPOSE_ORDER = ("reward", "explorer", "regenerator", "trainer")


def start_container_process(argv: list[str], env: dict[str, str], log_path: Path, cwd: Path,
                            grpc_port: int | None) -> subprocess.Popen:
    """A container's command as a local process (`solrl` and torchrun on PATH, as in the image; one CPU thread here),
    its output in `log_path`; with `grpc_port`, once it answers SERVING there (what the probes ask)."""
    with open(log_path, "w") as log:
        path = f"{Path(tool('solrl')).parent}{os.pathsep}{os.environ['PATH']}"
        proc = subprocess.Popen(argv, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **env, "OMP_NUM_THREADS": "1", "PATH": path})
    deadline = time.monotonic() + 120
    while grpc_port is not None and not grpc_serving(grpc_port):
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"{argv} not SERVING after 120 s: {log_path.read_text()}"
        time.sleep(0.3)
    return proc


class ComposeAsProcesses:
    """A compose file (`file`, docker-compose.cpu.yml by default; its services `names`) as `docker-compose config`
    resolves it (its own interpolation of the user's environment), each service started as its container would
    be: the ENTRYPOINT of the image its `build` section makes of services/Dockerfile (`solrl serve <role>`, run
    verbatim with `solrl` on PATH),
    the service's `command`, the image's SOLRL_* ENV under the service's `environment` (the image's other
    ENV names container paths: HF_HOME=/cache/hf). The `redis` service too: its command (k8s/base/redis-acl.sh,
    which the file mounts, writing the ACL file and starting redis-server) and environment (the roles'
    passwords), with a port, directory and ACL file of this machine (a fresh namespace). What a container
    network gives is moved to this machine: every `service:port` to 127.0.0.1 and a free port, the `runs`
    volume to a directory."""

    def __init__(self, tmp: Path, user_env: dict[str, str], namespace: str, file: str = "docker-compose.cpu.yml",
                 names: tuple[str, ...] = COMPOSE_ORDER) -> None:
        exe = tool("docker-compose")
        out = subprocess.run([exe, "-f", file, "config"], cwd=ROOT, check=True, text=True,
                             capture_output=True, env={**os.environ, **user_env})
        self.compose = yaml.safe_load(out.stdout)
        self.services = self.compose["services"]
        self.images = {name: dockerfile_image({k: str(v) for k, v in self.services[name]["build"]["args"].items()},
                                              self.services[name]["build"]["target"]) for name in names}
        self.tmp, self.runs = tmp, tmp / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.moved = {"redis:6379": f"127.0.0.1:{free_port()}"}
        for name in names:
            env = self.services[name]["environment"]
            for key in (ENV_GRPC_PORT, ENV_HTTP_PORT):
                self.moved[f"{name}:{env[key]}"] = f"127.0.0.1:{free_port()}"
        self.namespace = namespace
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []

    def port(self, name: str, key: str) -> int:
        return int(self.moved[f"{name}:{self.services[name]['environment'][key]}"].rpartition(":")[2])

    def start_redis(self) -> subprocess.Popen:
        """The compose file's redis service as a local process (class doc), answering PING when this returns."""
        import redis as redis_py

        svc = self.services["redis"]
        command = svc["command"]
        mounts = dict(reversed(v.split(":")[:2]) for v in svc["volumes"] if v.count(":") == 2)
        script = mounts[command[1]]   # the host file the container runs
        port = int(self.moved["redis:6379"].rpartition(":")[2])
        (self.tmp / "redis").mkdir(exist_ok=True)
        args = list(command[3:])   # redis-server and its options; its data directory (the redis-data volume) here
        if "--dir" in args:
            assert args[args.index("--dir") + 1] == "/data" and "redis-data:/data:rw" in svc["volumes"], args
            args[args.index("--dir") + 1] = str(self.tmp / "redis")
        else:
            args += ["--dir", str(self.tmp / "redis")]
        argv = ["sh", script, str(self.tmp / "redis" / "users.acl"), *args, "--port", str(port), "--bind", "127.0.0.1"]
        env = {k: self.here(str(v)) for k, v in svc["environment"].items()}
        env[ENV_QUEUE_NAMESPACE] = self.namespace
        log_path = self.tmp / "redis.log"
        self.logs.append(log_path)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT,
                                    env={"PATH": os.environ["PATH"], **env})
        self.procs["redis"] = proc
        client, deadline = redis_py.Redis(port=port), time.monotonic() + 30
        while True:   # the compose healthcheck: an unauthenticated PING
            try:
                client.ping()
                return proc
            except redis_py.ConnectionError:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)

    def here(self, value: str) -> str:
        """A container path compose mounts a secret's file at (/run/secrets/<name>): that file on this machine."""
        if value.startswith("/run/secrets/"):
            return self.compose["secrets"][value.removeprefix("/run/secrets/")]["file"]
        return value

    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in self.images[name].env.items() if k.startswith("SOLRL_")}
        for key, value in self.services[name]["environment"].items():
            value = self.here(str(value))
            for there, here in self.moved.items():
                value = value.replace(there, here)
            env[key] = value
        env[ENV_HOST] = "127.0.0.1"
        env[ENV_GRPC_PORT], env[ENV_HTTP_PORT] = str(self.port(name, ENV_GRPC_PORT)), str(self.port(name, ENV_HTTP_PORT))
        if ENV_QUEUE_NAMESPACE in env:
            env[ENV_QUEUE_NAMESPACE] = self.namespace
        assert not [k for k, v in env.items() if "${" in v], env   # compose interpolated everything
        return env

    def argv(self, name: str) -> list[str]:
        volumes = [str(v) for v in self.services[name].get("volumes", [])]
        args = []
        for a in self.services[name].get("command", []):
            if a.startswith("/runs/"):
                # the named volume (created from the image's /runs, which its uid 10001 owns), not a bind mount
                assert [v for v in volumes if v.split(":")[:2] == ["runs", "/runs"]], volumes
                assert "runs" in self.compose["volumes"]
                a = str(self.runs / a.removeprefix("/runs/"))
            args.append(a)
        image = self.images[name]
        assert entry_command(image, args, self.env(name)) == ["solrl", "serve", role_of(name), *args]
        return [*image.entrypoint, *args]

    def start(self, name: str, wait: bool = True) -> subprocess.Popen:
        log_path = self.tmp / f"{name}-{len(self.logs)}.log"
        self.logs.append(log_path)
        proc = start_container_process(self.argv(name), self.env(name), log_path, self.tmp,
                                       self.port(name, ENV_GRPC_PORT) if wait else None)
        self.procs[name] = proc
        return proc

    def healthcheck(self, name: str, port: int) -> int:
        """The image's HEALTHCHECK command, verbatim, against `port`."""
        return run_healthcheck(self.images[name], {ENV_HTTP_PORT: str(port)})

    def wait(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {timeout} s: {self.logs[-1].read_text()[-3000:]}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _redis_server_or_skip() -> None:
    if shutil.which("redis-server") is None:
        if REQUIRE:
            pytest.fail("redis-server not found")
        pytest.skip("redis-server not installed (Debian: redis-server)")


def _redis_or_skip(url: str):
    import redis

    try:
        redis.Redis.from_url(url).ping()
    except redis.RedisError:
        if REQUIRE:
            pytest.fail(f"no Redis at {url}")
        pytest.skip(f"no Redis at {url}")
    return redis.Redis.from_url(url)


def _run_stack(tmp: Path, run_id: str, restart_trainer: bool) -> tuple[Path, ComposeAsProcesses]:
    """reward, explorer, regenerator, trainer in compose's dependency order; the trainer runs to its end
    (with restart_trainer: killed once its first epoch is checkpointed and started again, unchanged)."""
    stack = ComposeAsProcesses(tmp, {**COMPOSE_ENV, ENV_ADAPTER_TOKEN: TOKEN, "SOLRL_SET": DEPLOY_SET,
                                     "SOLRL_RUN_ID": run_id}, f"solrl-test-deploy-{run_id}-{os.getpid()}")
    run_dir = stack.runs / run_id
    try:
        stack.start_redis()
        for name in COMPOSE_ORDER[:3]:
            stack.start(name)
            # the image's HEALTHCHECK passes against the service and fails against a port nobody serves
            assert stack.healthcheck(name, stack.port(name, ENV_HTTP_PORT)) == 0
            assert stack.healthcheck(name, free_port()) != 0
        trainer = stack.start("trainer", wait=False)
        forge_rollouts(stack)
        if restart_trainer:
            deadline = time.monotonic() + 300
            while not (run_dir / "checkpoints" / "latest").exists():
                assert trainer.poll() is None, stack.logs[-1].read_text()
                assert time.monotonic() < deadline, "no checkpoint after 300 s"
                time.sleep(0.2)
            trainer.kill()                      # as a node loss or OOM kill: no clean shutdown
            trainer.wait(timeout=30)
            stack.start("trainer", wait=False)  # a Job / compose restart: the same arguments, no --resume
        assert stack.wait("trainer", 600) == 0, stack.logs[-1].read_text()[-3000:]
    finally:
        stack.stop()
    return run_dir, stack


def forge_rollouts(stack: ComposeAsProcesses) -> None:
    """What a neighbour who learnt the regenerator's Redis password could do: XADD Rollouts that are not signed with
    the run's queue key (one unsigned, one signed with another key). The trainer must drop both and finish as if they
    were never there; the explorer's user may not write the stream at all (NOPERM)."""
    import redis as redis_py

    from solrl.queue import message_tag

    port = int(stack.moved["redis:6379"].rpartition(":")[2])
    regen = redis_py.Redis(port=port, username="regenerator",
                           password=secret(stack.env("regenerator"), ENV_REDIS_PASSWORD))
    key = f"{stack.namespace}:rollouts"
    regen.xadd(key, {"p": b"forged, unsigned", "k": "forged-1:0"})
    tag = message_tag(b"not-the-run-key-0123456789", stack.namespace, "rollouts", "forged-2:0", b"forged")
    regen.xadd(key, {"p": tag + b"forged", "k": "forged-2:0"})
    explorer = redis_py.Redis(port=port, username="explorer",
                              password=secret(stack.env("explorer"), ENV_REDIS_PASSWORD))
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        explorer.xadd(key, {"p": b"x"})


@pytest.mark.slow
def test_cpu_compose_as_shipped_finishes_a_run_and_a_restarted_trainer_ends_where_it_would_have(tmp_path):
    """Every service of docker-compose.cpu.yml with its own command and environment; one 2-epoch run
    uninterrupted, one whose trainer is killed after epoch 1 and restarted with the same arguments.
    Both end with the same adapter bytes; the restarted run has each epoch's metrics once. Redis is the file's own
    (a password per role, ACL users); every message is signed with SOLRL_QUEUE_KEY, and two forged rollouts
    are dropped and logged, never trained on. No secret appears in any log."""
    _redis_server_or_skip()
    straight, _ = _run_stack(tmp_path / "a", "straight", restart_trainer=False)
    restarted, stack = _run_stack(tmp_path / "b", "restarted", restart_trainer=True)
    for run_dir in (straight, restarted):
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "epoch_0002"
    a, b = (d / "adapter_ema.safetensors" for d in (straight, restarted))
    assert a.read_bytes() == b.read_bytes()
    for name in ("adapters.safetensors",):
        assert (straight / "checkpoints" / "epoch_0002" / name).read_bytes() == \
            (restarted / "checkpoints" / "epoch_0002" / name).read_bytes()
    epochs = [json.loads(line)["epoch"] for line in (restarted / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [0, 1, 2]
    trainer_logs = [p.read_text() for p in stack.logs if p.name.startswith("trainer")]
    assert "resum" in trainer_logs[1].lower() and "after epoch 1" in trainer_logs[1]
    assert "dropped message" in trainer_logs[0] and "forged-1:0" in trainer_logs[0], trainer_logs[0][-3000:]
    for log in stack.logs:
        for value in (TOKEN, *COMPOSE_SECRETS.values()):
            assert value not in log.read_text(), log.name   # no secret is ever printed


def _role_settings(role: str, args: list[str], env: dict[str, str], files: dict[str, Path]):
    """What `solrl serve <role>` started with `args` and `env` trains or serves: the trainer's run config,
    or a rollout service's settled model / precisions / reward (as its Info RPC reports them)."""
    from types import SimpleNamespace

    import torch

    from services.rollout.shell import settle_role_args

    args = [str(files.get(a, a)) for a in args]
    parser = argparse.ArgumentParser()
    ROLES[role].add_arguments(parser, env)
    parsed = parser.parse_args(args)
    if role == "trainer":
        return trainer_server.run_config(parsed)[0]
    s = settle_role_args(parsed, role)
    return SimpleNamespace(model=s.model, model_path=s.model_path or "", base_precision=s.base_precision,
                           reward=s.reward, precision=s.precision, device=str(torch.device(s.device)) if s.device else "")


def _assert_one_run(where: str, roles: dict[str, tuple[list[str], dict[str, str]]], files: dict[str, Path]) -> None:
    cfg = _role_settings("trainer", *roles.pop("trainer"), files)
    for name, (args, env) in roles.items():
        info = _role_settings(role_of(name), args, env, files)
        problems = trainer_server.worker_mismatches(role_of(name), name, info, cfg)
        assert not problems, f"{where}: {problems}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_gives_every_role_one_run(name, cuda_stand_in):
    """The trainer's start-up check, applied to the file itself: the settings each rollout service
    resolves from its command and environment are those the trainer trains (with and without SOLRL_SET)."""
    for user_set in (None, "reward=jpeg_compressibility rollout.steps=4"):
        env = {**os.environ, **COMPOSE_ENV}
        if user_set is not None:
            env["SOLRL_SET"] = user_set
        out = subprocess.run([tool("docker-compose"), "-f", name, "config"], cwd=ROOT, env=env, capture_output=True,
                             text=True, check=True)
        services = yaml.safe_load(out.stdout)["services"]
        roles = {s: (list(svc.get("command", [])), {k: str(v) for k, v in svc["environment"].items()})
                 for s, svc in services.items() if role_of(s) in ("explorer", "regenerator", "trainer")}
        if user_set:   # after the GPU files' device
            device = "" if name == "docker-compose.cpu.yml" else "model.device=cuda "
            assert all(env.get("SOLRL_SET") == device + user_set for _, env in roles.values())
        _assert_one_run(f"{name} (SOLRL_SET={user_set!r})", roles, {})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_gives_every_role_one_run(k8s_tree, overlay, cuda_stand_in):
    docs = kustomize(k8s_tree, overlay)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    roles = {}
    for role in ("explorer", "regenerator", "trainer"):
        (c,) = containers(by_kind[("Job" if role == "trainer" else "Deployment", role)])
        roles[role] = (c.get("args", []), container_env(c, by_kind))
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        # the run: the base's run.json every role reads, or the preset of SOLRL_PRESET (the hopper overlay)
        assert ("/etc/solrl" in mounts) if "--config" in roles[role][0] else roles[role][1]["SOLRL_PRESET"], role
    _assert_one_run(overlay, roles, {"/etc/solrl/run.json": k8s_tree / "base" / "run.json"})


# ------------------------------------------------------------------ the trainer's torchrun entry, run

TRAINER_ENTRIES = ["docker-compose.yml", "docker-compose.colocated.yml", "k8s/overlays/b200", "k8s/overlays/cpu-demo"]


def trainer_entry(source: str, tmp: Path, run_set: str | None = DEPLOY_SET) -> tuple[list[str], dict[str, str]]:
    """The trainer container of `source` (a compose file, or an overlay's Job) as it starts: its argv (compose:
    entrypoint + command; k8s: command + args) and environment (compose: the image's SOLRL_* ENV under the
    service's; k8s: the container's env, its completion index as pod 0 has it), for the run_set run (the user's
    SOLRL_SET; None: the file's own)."""
    user = {**COMPOSE_ENV, ENV_ADAPTER_TOKEN: TOKEN, "SOLRL_RUN_ID": "entry",
            **({"SOLRL_SET": run_set} if run_set is not None else {})}
    if source.startswith("k8s/"):
        tree = k8s_copy(tmp, TOKEN)
        by_kind = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(tree, Path(source).name)}
        (c,) = containers(by_kind[("Job", "trainer")])
        env = container_env(c, by_kind)
        assert env[ENV_ADAPTER_TOKEN] == "<secret>"
        env.update({k: v for k, v in user.items() if k in env})   # the Secret's and the run-env ConfigMap's values
        return [*c["command"], *c["args"]], env
    out = subprocess.run([tool("docker-compose"), "-f", source, "config"], cwd=ROOT, check=True, text=True,
                         capture_output=True, env={**os.environ, **user})
    config = yaml.safe_load(out.stdout)
    svc = config["services"]["trainer"]
    image = dockerfile_image({k: str(v) for k, v in svc["build"]["args"].items()}, svc["build"]["target"])
    env = {k: v for k, v in image.env.items() if k.startswith("SOLRL_")}
    env.update({k: str(v) for k, v in svc["environment"].items()})
    for k, v in env.items():   # a secret's file where compose mounts it (/run/secrets/<name>): that file here
        if k.endswith(FILE_SUFFIX) and v.startswith("/run/secrets/"):
            env[k] = config["secrets"][v.removeprefix("/run/secrets/")]["file"]
    return [*svc["entrypoint"], *svc.get("command", [])], env


@pytest.mark.slow
@pytest.mark.parametrize("source", TRAINER_ENTRIES)
def test_trainer_entry_runs_under_torchrun(source, tmp_path, cuda_stand_in):
    """Each deployment's trainer entry command (torchrun over `solrl serve trainer`) as local processes: verbatim,
    with what a container network and volumes give moved to this machine (Redis and ports to 127.0.0.1, /runs and
    the run config to files here, torchrun's rendezvous address to 127.0.0.1) and at most 2 ranks (2 cores here).
    The rollouts come from this process's explorer and regenerator workers, which take each adapter from the
    trainer's /v1/adapter/current (the rollout service addresses are dropped). It serves gRPC health as the
    probes ask, trains the 2-epoch run with every rank and exits 0."""
    from tests.services.test_trainer_service_ddp import ServiceRun

    argv, env = trainer_entry(source, tmp_path)
    ranks = int(env["PET_NPROC_PER_NODE"])
    assert argv[0] == "torchrun" and argv[argv.index("--no-python") + 1:][:3] == ["solrl", "serve", "trainer"]
    grpc_port, http_port = free_port(), free_port()
    namespace = f"solrl-test-entry-{os.getpid()}-{free_port()}"
    assert env[ENV_REDIS_URL] == "redis://trainer@redis:6379/0"
    # this test is about the torchrun entry: the local Redis has no ACL users and the in-process workers do not sign
    # (tests/queue/test_queue_security.py and the CPU compose test run the secured queue); each secret is given, in
    # the environment (k8s: from its Secret) or as a file (compose)
    for name in (ENV_REDIS_PASSWORD, ENV_QUEUE_KEY):
        assert env.get(name) or Path(env[name + FILE_SUFFIX]).read_text().strip(), name
        env.pop(name, None)
        env.pop(name + FILE_SUFFIX, None)
    token = env.get(ENV_ADAPTER_TOKEN) or Path(env[ENV_ADAPTER_TOKEN + FILE_SUFFIX]).read_text().strip()
    env.update({ENV_REDIS_URL: "redis://127.0.0.1:6379/0",
                ENV_QUEUE_NAMESPACE: namespace, ENV_HOST: "127.0.0.1", ENV_GRPC_PORT: str(grpc_port),
                ENV_HTTP_PORT: str(http_port), trainer_server.ENV_EXPLORER_ADDRS: "",
                trainer_server.ENV_REGENERATOR_ADDRS: "", "PET_NPROC_PER_NODE": str(min(ranks, 2))})
    env.pop("HF_HOME", None)   # a container path
    if "model.device=cuda" in env.get("SOLRL_SET", ""):
        env[ENV_CUDA_STANDIN] = "1"   # the GPU files' device, stood in by the CPU (cuda_stand_in)
    if "PET_MASTER_ADDR" in env:
        env.update({"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(free_port())})
    files = {"/etc/solrl/run.json": ROOT / "k8s" / "base" / "run.json"}
    argv = [str(files.get(a, tmp_path / "runs" / a.removeprefix("/runs/") if a.startswith("/runs/") else a))
            for a in argv]
    cfg = _role_settings("trainer", argv[argv.index("trainer") + 1:], env, {})
    path = f"{Path(tool('solrl')).parent}{os.pathsep}{os.environ['PATH']}"   # torchrun and solrl on PATH, as in the image
    run = ServiceRun(argv, cfg, http_port, namespace, tmp_path / "trainer.log", env={**env, "PATH": path})
    try:
        run.start()
        deadline = time.monotonic() + 120
        while not grpc_serving(grpc_port):   # what the k8s readiness probe asks (rank 0 only)
            assert run.proc.poll() is None, run.text()[-3000:]
            assert time.monotonic() < deadline, f"not SERVING after 120 s: {run.text()[-3000:]}"
            time.sleep(0.3)
        assert run.wait(240) == 0, run.text()[-3000:]
    finally:
        run.close()
    out = Path(next(a for a in argv if a.startswith(str(tmp_path / "runs"))))
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    assert (f"{min(ranks, 2)} data-parallel ranks" in run.text()) == (ranks > 1)
    assert token not in run.text() and TOKEN not in run.text()
