"""Containers, compose and Kubernetes, validated offline (no Docker engine, no cluster here).

- `docker-compose config -q` on both compose files (Debian's docker-compose runs it without an engine);
- `kubectl kustomize` of every overlay through `kubernetes-validate --strict`;
- the KEDA ScaledObject (a CRD kubernetes-validate has no schema for) against the fields KEDA documents;
- ports and environment names in compose and k8s are exactly those `solrl serve` reads;
- each Dockerfile: non-root user, HEALTHCHECK on the ops port, entry `solrl serve <role>`, protos built.
The tools are installed by `.ci/run`; elsewhere a missing tool skips with a reason, unless
SOLRL_REQUIRE_DEPLOY_TOOLS=1 (set by CI), where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.adapter_reload import ENV_ADAPTER_TOKEN
from services.common.env import ENV_GRPC_PORT, ENV_HOST, ENV_HTTP_PORT
from services.common.rollout_plane import ENV_REWARD_ADDR
from services.common.workers import DEFAULT_NAMESPACE, ENV_QUEUE_NAMESPACE, ENV_REDIS_URL
from services.explorer import server as explorer_server
from services.regenerator import server as regenerator_server
from services.reward import server as reward_server
from services.trainer import server as trainer_server
from solrl.distributed import GROUP_EXPLORERS, STREAM_EXPLORE

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"explorer": explorer_server, "regenerator": regenerator_server, "reward": reward_server,
         "trainer": trainer_server}
PORTS = {role: (m.DEFAULT_GRPC_PORT, m.DEFAULT_HTTP_PORT) for role, m in ROLES.items()}
# every SOLRL_* name a service shell reads (the constants the code uses, not a copy of them)
READ_ENV = {ENV_HOST, ENV_GRPC_PORT, ENV_HTTP_PORT, ENV_REDIS_URL, ENV_QUEUE_NAMESPACE, ENV_REWARD_ADDR,
            ENV_ADAPTER_TOKEN, trainer_server.ENV_EXPLORER_ADDRS, trainer_server.ENV_REGENERATOR_ADDRS}
REQUIRE = os.environ.get("SOLRL_REQUIRE_DEPLOY_TOOLS") == "1"


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

COMPOSE_FILES = ["docker-compose.yml", "docker-compose.cpu.yml"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_config_is_valid(name):
    exe = tool("docker-compose")
    env = {**os.environ, ENV_ADAPTER_TOKEN: "test-token"}
    proc = subprocess.run([exe, "-f", name, "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # without the token the file refuses to start rather than run unauthenticated
    env.pop(ENV_ADAPTER_TOKEN)
    proc = subprocess.run([exe, "-f", name, "config", "-q"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and ENV_ADAPTER_TOKEN in proc.stderr


def compose_services(name: str) -> dict:
    exe = tool("docker-compose")
    env = {**os.environ, ENV_ADAPTER_TOKEN: "test-token"}
    out = subprocess.run([exe, "-f", name, "config"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return yaml.safe_load(out.stdout)["services"]


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_ports_and_env_match_what_solrl_serve_reads(name):
    services = compose_services(name)
    roles = {role_of(s) for s in services} - {"redis"}
    assert roles == set(ROLES)
    for svc_name, svc in services.items():
        role = role_of(svc_name)
        if role == "redis":
            assert "--appendonly" in svc["command"] and "yes" in svc["command"]
            continue
        env = svc["environment"]
        solrl_env = {k for k in env if k.startswith("SOLRL_")}
        assert solrl_env <= READ_ENV, (svc_name, solrl_env - READ_ENV)
        grpc_port, http_port = PORTS[role]
        assert (int(env[ENV_GRPC_PORT]), int(env[ENV_HTTP_PORT])) == (grpc_port, http_port), svc_name
        assert env[ENV_REDIS_URL].startswith("redis://redis:6379")
        assert env[ENV_REWARD_ADDR] == f"reward:{PORTS['reward'][0]}"
        assert env[ENV_QUEUE_NAMESPACE] == DEFAULT_NAMESPACE
        assert svc["build"]["dockerfile"] == f"services/{role}/Dockerfile"
    trainer = services["trainer"]["environment"]
    for key, role in ((trainer_server.ENV_EXPLORER_ADDRS, "explorer"),
                      (trainer_server.ENV_REGENERATOR_ADDRS, "regenerator")):
        addrs = trainer_server.parse_addrs(trainer[key], key)
        expected = {f"{s}:{PORTS[role][0]}" for s in services if role_of(s) == role}
        assert set(addrs) == expected  # the trainer pushes adapters to every rollout service


def test_b200_compose_gives_each_gpu_to_one_service():
    services = compose_services("docker-compose.yml")
    owners: dict[str, str] = {}
    for name, svc in services.items():
        for dev in svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []):
            for gpu in dev["device_ids"]:
                assert gpu not in owners, f"GPU {gpu} given to {owners.get(gpu)} and {name}"
                owners[gpu] = name
    assert sorted(owners, key=int) == [str(i) for i in range(8)]
    assert sum(role_of(n) == "explorer" for n in owners.values()) == 4


# ------------------------------------------------------------------ kubernetes

OVERLAYS = ["cpu-demo", "b200"]


@pytest.fixture()
def k8s_tree(tmp_path):
    """A copy of k8s/ with the b200 overlay's git-ignored token file present, as a user has it."""
    tree = tmp_path / "k8s"
    shutil.copytree(ROOT / "k8s", tree)
    (tree / "overlays" / "b200" / "adapter-token.txt").write_text("test-token\n")
    return tree


def kustomize(tree: Path, overlay: str) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(tree / "overlays" / overlay)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_valid_kubernetes(k8s_tree, overlay):
    kustomize(k8s_tree, overlay)
    out = subprocess.run(f"{tool('kubectl')} kustomize {k8s_tree / 'overlays' / overlay} | "
                         f"{tool('kubernetes-validate')} --strict --quiet -", shell=True, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_ports_env_probes_and_security(k8s_tree, overlay):
    docs = kustomize(k8s_tree, overlay)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cm = by_kind[("ConfigMap", next(n for k, n in by_kind if k == "ConfigMap" and n.startswith("solrl-env")))]
    assert {k for k in cm["data"] if k.startswith("SOLRL_")} <= READ_ENV
    assert cm["data"][ENV_REDIS_URL].startswith("redis://redis:6379")
    assert cm["data"][ENV_REWARD_ADDR] == f"reward:{PORTS['reward'][0]}"
    for role in ROLES:
        kind = "Job" if role == "trainer" else "Deployment"
        workload = by_kind[(kind, role)]
        (c,) = containers(workload)
        env = {e["name"]: e for e in c.get("env", [])}
        assert {k for k in env if k.startswith("SOLRL_")} <= READ_ENV
        grpc_port, http_port = PORTS[role]
        assert (int(env[ENV_GRPC_PORT]["value"]), int(env[ENV_HTTP_PORT]["value"])) == (grpc_port, http_port)
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": grpc_port, "http": http_port}
        assert c["readinessProbe"]["grpc"]["port"] == grpc_port
        if kind == "Deployment":
            assert c["livenessProbe"]["grpc"]["port"] == grpc_port
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["resources"]["requests"] and c["resources"]["limits"]
        if overlay == "b200":
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"].endswith(":gpu")
        if role != "reward":
            ref = env[ENV_ADAPTER_TOKEN]["valueFrom"]["secretKeyRef"]
            secret = by_kind[("Secret", ref["name"])]
            assert ref["key"] in secret["data"]
        svc = by_kind[("Service", role)]
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": grpc_port, "http": http_port}
    trainer_env = {e["name"]: e.get("value") for e in containers(by_kind[("Job", "trainer")])[0]["env"]}
    for key, role in ((trainer_server.ENV_EXPLORER_ADDRS, "explorer"),
                      (trainer_server.ENV_REGENERATOR_ADDRS, "regenerator")):
        (addr,) = trainer_server.parse_addrs(trainer_env[key], key)
        assert addr == f"{trainer_server.ALL_PREFIX}{role}-pods:{PORTS[role][0]}"
        assert by_kind[("Service", f"{role}-pods")]["spec"]["clusterIP"] == "None"  # headless: every pod
    redis = by_kind[("StatefulSet", "redis")]
    assert "--appendonly" in containers(redis)[0]["args"] and redis["spec"]["volumeClaimTemplates"]
    assert {n for k, n in by_kind if k == "PodDisruptionBudget"} >= {"explorer", "regenerator", "reward"}


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
    doc = yaml.safe_load((ROOT / "k8s" / "components" / "keda" / "scaledobject.yaml").read_text())
    jsonschema.validate(doc, schema)
    meta = doc["spec"]["triggers"][0]["metadata"]
    assert meta["stream"] == f"{DEFAULT_NAMESPACE}:{STREAM_EXPLORE}" and meta["consumerGroup"] == GROUP_EXPLORERS
    assert doc["spec"]["scaleTargetRef"]["name"] == "explorer"


# ------------------------------------------------------------------ Dockerfiles

@pytest.mark.parametrize("role", sorted(ROLES))
def test_dockerfile_targets_user_healthcheck_and_entry(role):
    text = (ROOT / "services" / role / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, re.M)
    assert {"cpu", "gpu"} <= set(stages)
    for stage in ("cpu", "gpu"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert "python -m solrl.protos_build" in body  # stubs generated in the build, never committed
        user = re.search(r"^USER\s+(\S+)", body, re.M)
        assert user and user.group(1) not in ("root", "0")
        assert f"'{PORTS[role][1]}'" in re.search(r"^HEALTHCHECK.*?\n(?:\s+CMD.*)", body, re.M | re.S).group(0)
        assert f'ENTRYPOINT ["solrl", "serve", "{role}"]' in body
        assert re.search(rf"^EXPOSE {PORTS[role][0]} {PORTS[role][1]}$", body, re.M)
    assert "torch==2.13.0" in text and "transformer-engine" in text.split("AS gpu-base", 1)[1].split("FROM", 1)[0]


def test_trainer_expands_headless_service_addresses():
    addrs = trainer_server.parse_addrs("all+127.0.0.1:8011, explorer-0:8011", "x")
    assert trainer_server.expand_addrs(addrs) == ["127.0.0.1:8011", "explorer-0:8011"]
    with pytest.raises(RuntimeError, match="cannot resolve 'all\\+no-such-host.invalid:1'"):
        trainer_server.expand_addrs(["all+no-such-host.invalid:1"])
    with pytest.raises(ValueError, match="host:port"):
        trainer_server.parse_addrs("all+nohostport", "x")
