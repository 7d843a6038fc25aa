"""The k8s base's NetworkPolicies, read as a cluster's network plugin reads them.

No cluster runs here, so `allowed()` evaluates the rendered policies with the rules of the Kubernetes API
(networking.k8s.io/v1): a pod selected by a policy of a direction is isolated in it, and a connection passes
when both the source's egress and the destination's ingress allow it. Written by hand: no maintained Python
package evaluates NetworkPolicies offline. The flows the run needs are not listed here but derived from the
rendered manifests (the addresses in each role's environment, through the Services to pods and ports), and
every other pair of pods and ports is checked to be refused."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest

from services.common.env import ENV_REDIS_URL, ENV_REWARD_ADDR, ENV_TRAINER_URL
from services.trainer import server as trainer_server
from tests.deploy.test_deploy import OVERLAYS, container_env, containers, k8s_copy, kustomize

NAMESPACE = "solrl"
WORKLOADS = ("Deployment", "StatefulSet", "Job")


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict = field(hash=False)
    ports: dict = field(default_factory=dict, hash=False)   # container port name -> (number, protocol)
    annotations: dict = field(default_factory=dict, hash=False)

    def numbers(self) -> set[tuple[int, str]]:
        return set(self.ports.values())


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, policy_ns: str, pod: Pod) -> bool:
    if "ipBlock" in peer:
        return False   # pods here have no fixed addresses: an ipBlock names none of them
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod.namespace}):
            return False
    elif pod.namespace != policy_ns:
        return False
    return selects(peer.get("podSelector"), pod.labels)


def port_matches(ports: list[dict] | None, dst: Pod, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):   # a named port: resolved on the destination pod
            if dst.ports.get(want) == (port, protocol):
                return True
        elif want <= port <= p.get("endPort", want):
            return True
    return False


def types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def allowed(policies: list[dict], src: Pod, dst: Pod, port: int, protocol: str = "TCP") -> bool:
    def side(pod: Pod, direction: str, rules_key: str, peers_key: str, other: Pod) -> bool:
        mine = [p for p in policies if p["metadata"].get("namespace", NAMESPACE) == pod.namespace
                and direction in types(p) and selects(p["spec"]["podSelector"], pod.labels)]
        if not mine:
            return True   # not isolated in this direction
        return any((not rule.get(peers_key) or any(peer_matches(peer, p["metadata"].get("namespace", NAMESPACE),
                                                                 other) for peer in rule[peers_key]))
                   and port_matches(rule.get("ports"), dst, port, protocol)
                   for p in mine for rule in p["spec"].get(rules_key) or [])

    return side(src, "Egress", "egress", "to", dst) and side(dst, "Ingress", "ingress", "from", src)


# ---------------------------------------------------------------------- the rendered run


@dataclass
class Run:
    pods: list[Pod]
    policies: list[dict]
    by_kind: dict

    def workload_of(self, pod: Pod) -> str:
        return pod.labels["app.kubernetes.io/name"]


def run_of(docs: list[dict]) -> Run:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    pods = []
    for (kind, name), d in by_kind.items():
        if kind not in WORKLOADS:
            continue
        template = d["spec"]["template"]
        ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
                 for c in template["spec"]["containers"] for p in c.get("ports", []) if "name" in p}
        replicas = d["spec"].get("completions", 1) if kind == "Job" else max(1, d["spec"].get("replicas", 1))
        for i in range(replicas):
            labels = dict(template["metadata"]["labels"])
            if kind == "Job":
                labels["batch.kubernetes.io/job-completion-index"] = str(i)
            pods.append(Pod(f"{name}-{i}", d["metadata"].get("namespace", NAMESPACE), labels, ports,
                            template["metadata"].get("annotations", {})))
    return Run(pods, [d for d in docs if d["kind"] == "NetworkPolicy"], by_kind)


def resolve(run: Run, host: str, port: int) -> list[tuple[Pod, int]]:
    """The pods and container ports behind `host:port`: a Service, or `<pod>.<headless service>`."""
    parts = host.split(".")
    names = [parts[0]] + parts[1:2]
    svc = next(run.by_kind[("Service", n)] for n in names if ("Service", n) in run.by_kind)
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    target = sp.get("targetPort", port)
    out = []
    for pod in run.pods:
        if pod.namespace == NAMESPACE and selects({"matchLabels": svc["spec"]["selector"]}, pod.labels):
            number = pod.ports[target][0] if isinstance(target, str) else target
            out.append((pod, number))
    assert out, f"{host}:{port} reaches no pod"
    return out


def needed_flows(run: Run) -> set[tuple[str, str, int]]:
    """(source pod, destination pod, port) for every address a role's environment names."""
    flows = set()
    for (kind, name), d in run.by_kind.items():
        if kind not in WORKLOADS or name == "redis":
            continue
        env = container_env(containers(d)[0], run.by_kind)
        addrs = []
        if ENV_REDIS_URL in env:
            u = urlsplit(env[ENV_REDIS_URL])
            addrs.append((u.hostname, u.port or 6379))
        if ENV_TRAINER_URL in env:
            u = urlsplit(env[ENV_TRAINER_URL])
            addrs.append((u.hostname, u.port))
        for key in (ENV_REWARD_ADDR, trainer_server.ENV_EXPLORER_ADDRS, trainer_server.ENV_REGENERATOR_ADDRS):
            for a in trainer_server.parse_addrs(env.get(key, ""), key):
                host, _, port = a.removeprefix(trainer_server.ALL_PREFIX).rpartition(":")
                addrs.append((host, int(port)))
        if "PET_MASTER_ADDR" in env:
            addrs.append((env["PET_MASTER_ADDR"], int(env["PET_MASTER_PORT"])))
        for src in (p for p in run.pods if run.workload_of(p) == name):
            for host, port in addrs:
                flows.update((src.name, dst.name, number) for dst, number in resolve(run, host, port))
    return flows


def collective(run: Run, src: Pod, dst: Pod) -> bool:
    """Pods of one torchrun job: NCCL and gloo connect on ports of their own choosing."""
    return run.workload_of(src) == run.workload_of(dst) == "trainer"


PROMETHEUS = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = Pod("coredns-0", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")})
STRANGER = Pod("curious-0", "default", {"app": "curious"}, {"https": (443, "TCP")})
KEDA = Pod("keda-operator-0", "keda", {"app": "keda-operator"})


# ---------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of k8s/ with the GPU overlays' git-ignored secret files, as a user has them."""
    return k8s_copy(tmp_path_factory.mktemp("netpol"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_through_exactly_what_the_run_needs(tree, overlay):
    run = run_of(kustomize(tree, overlay))
    assert run.policies, "no NetworkPolicy rendered"
    need = needed_flows(run)
    by_name = {p.name: p for p in run.pods}
    assert {(run.workload_of(by_name[s]), run.workload_of(by_name[d])) for s, d, _ in need} >= {
        ("trainer", "redis"), ("explorer", "redis"), ("regenerator", "redis"), ("explorer", "reward"),
        ("regenerator", "reward"), ("trainer", "explorer"), ("trainer", "regenerator"), ("explorer", "trainer"),
        ("regenerator", "trainer")}
    for s, d, port in sorted(need):
        assert allowed(run.policies, by_name[s], by_name[d], port), f"{overlay}: {s} -> {d}:{port} refused"
    for src in run.pods:
        for dst in run.pods:
            if collective(run, src, dst):
                assert allowed(run.policies, src, dst, 29500) and allowed(run.policies, src, dst, 40123)
                continue
            for port, protocol in dst.numbers():
                if (src.name, dst.name, port) not in need:
                    assert not allowed(run.policies, src, dst, port, protocol), \
                        f"{overlay}: {src.name} -> {dst.name}:{port} is let through but nothing needs it"
        # every pod resolves names; nothing else leaves the namespace
        assert allowed(run.policies, src, KUBE_DNS, 53, "UDP") and allowed(run.policies, src, KUBE_DNS, 53, "TCP")
        assert not allowed(run.policies, src, STRANGER, 443), f"{src.name} reaches outside the namespace"
        # nobody outside the namespace reaches a pod, except Prometheus on the port its annotation names
        metrics = int(src.annotations["prometheus.io/port"]) if "prometheus.io/port" in src.annotations else None
        for port, protocol in src.numbers():
            assert not allowed(run.policies, STRANGER, src, port, protocol), f"{overlay}: anyone reaches {src.name}:{port}"
            assert allowed(run.policies, PROMETHEUS, src, port, protocol) == (port == metrics), (src.name, port)


def test_a_policy_left_out_cuts_a_flow_the_run_needs(tree):
    """The check above can fail: without the Redis policy no role reaches the queue; without the default
    deny, a stranger reaches Redis."""
    run = run_of(kustomize(tree, "cpu-demo"))
    by_name = {p.name: p for p in run.pods}
    trainer, redis = by_name["trainer-0"], by_name["redis-0"]
    assert allowed(run.policies, trainer, redis, 6379)
    assert not allowed([p for p in run.policies if p["metadata"]["name"] != "redis"], trainer, redis, 6379)
    assert not allowed(run.policies, STRANGER, redis, 6379)
    # a pod no policy selects (no default deny) takes anything
    assert allowed([p for p in run.policies if p["metadata"]["name"] not in ("default-deny", "redis")],
                   STRANGER, redis, 6379)


def test_keda_component_lets_the_operator_reach_redis_only(tree):
    overlay = tree / "overlays" / "cpu-demo-keda"
    shutil.copytree(tree / "overlays" / "cpu-demo", overlay)
    text = (overlay / "kustomization.yaml").read_text()
    (overlay / "kustomization.yaml").write_text(text.replace("  - ../../components/grafana",
                                                             "  - ../../components/grafana\n  - ../../components/keda"))
    with_keda, without = (run_of(kustomize(tree, o)) for o in ("cpu-demo-keda", "cpu-demo"))
    redis = next(p for p in with_keda.pods if p.name == "redis-0")
    assert allowed(with_keda.policies, KEDA, redis, 6379) and not allowed(without.policies, KEDA, redis, 6379)
    for pod in with_keda.pods:
        if pod is not redis:
            assert not any(allowed(with_keda.policies, KEDA, pod, port, proto) for port, proto in pod.numbers())
