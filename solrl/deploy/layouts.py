"""A plan's layout as the deployment files run it: `solrl plan --emit compose` (a whole docker-compose file) and
`solrl plan --emit kustomize` (a kustomize Component an overlay lists). docker-compose.yml,
docker-compose.colocated.yml and k8s/overlays/b200/plan/ are this module's output for the shipped preset
(tests/deploy/test_deploy.py regenerates them and compares): change the layout here, not in those files.

- disaggregated: one explorer / regenerator container (or pod) per GPU, the reward service on its own GPU, and
  the trainer on `trainer_ranks` GPUs as one container (pod) running `torchrun --no-python solrl serve trainer`
  with PET_NPROC_PER_NODE ranks (torchrun reads its options from PET_* variables; rank 0 is the service).
- colocated (compose only): every GPU runs one explorer, one regenerator and one trainer rank, which take turns
  as the epoch's stages do (on-policy: explore, regenerate, then train); the reward service sits on the last GPU.
  Kubernetes gives whole GPUs to pods, so sharing one needs the device plugin's time-slicing, which does not
  promise a multi-GPU trainer pod distinct GPUs: no overlay is emitted for it.
"""

from __future__ import annotations

import shlex
from typing import Any

from solrl.deploy.placement import Plan
from solrl.deploy.recipe import PlanError
from solrl.deploy.report import seconds_text

PORTS = {"reward": (8001, 8080), "explorer": (8011, 8091), "regenerator": (8021, 8092), "trainer": (8031, 8093)}
# services/Dockerfile's ENGINE build argument: Transformer Engine in the explorer's image only (its NVFP4 / FP8)
ENGINE = {"explorer": "ENGINE: te, ", "regenerator": "", "reward": "", "trainer": ""}
TRAINER_ENTRY = ["torchrun", "--standalone", "--no-python", "solrl", "serve", "trainer"]


def plan_command(p: Plan, kind: str, sets: list[str]) -> str:
    """The `solrl plan` command that emits this file (its header, and what tests/deploy/test_deploy.py re-runs)."""
    args = ["solrl", "plan", "--preset", p.recipe.preset, *[a for s in sets for a in ("--set", s)],
            "--gpu", p.gpu, "--gpus", str(p.gpus), "--layout", p.best.kind, "--emit", kind]
    return shlex.join(args)


def _seconds(v: float) -> str:
    return f"{seconds_text(v)} s"


def _plan_lines(p: Plan) -> list[str]:
    x = p.best
    stages = ", ".join(f"{k} {_seconds(v)}" for k, v in x.stage_s.items() if k != "rollout")
    return [f"The plan for {p.recipe.model} ({p.recipe.preset}) on {p.gpus}x {p.gpu.upper()}: {x.label};",
            f"predicted epoch {_seconds(x.epoch_s)} ({stages}).",
            "docs/deploy.md gives the plans of the real models: regenerate with --preset <theirs> to train one."]


def _ids(gpus: list[int]) -> str:
    return "[" + ", ".join(f'"{g}"' for g in gpus) + "]"


def _devices(gpus: list[int], indent: str) -> str:
    return (f"{indent}deploy:\n{indent}  resources:\n{indent}    reservations:\n"
            f"{indent}      devices: [{{driver: nvidia, device_ids: {_ids(gpus)}, capabilities: [gpu]}}]\n")


def _build(role: str) -> str:
    grpc, http = PORTS[role]
    return ("    build:\n      context: .\n      dockerfile: services/Dockerfile\n      target: gpu\n"
            f'      args: {{FLAVOR: gpu, {ENGINE[role]}ROLE: {role}, GRPC_PORT: "{grpc}", HTTP_PORT: "{http}"}}\n'
            f"    image: solrl/{role}:gpu\n")


def placement(p: Plan) -> dict[str, Any]:
    """GPU ids per container: explorers and regenerators (one GPU each), the trainer's, the reward's."""
    x = p.best
    if x.kind == "colocated":
        every = list(range(x.gpus))
        return {"explorers": [[g] for g in every][:x.explorers], "regenerators": [[g] for g in every][:x.regenerators],
                "trainer": every[:x.trainer_ranks], "reward": [every[-1]]}
    e, r, t = x.explorers, x.regenerators, x.trainer_ranks
    return {"explorers": [[g] for g in range(e)], "regenerators": [[g] for g in range(e, e + r)],
            "trainer": list(range(e + r, e + r + t)), "reward": [e + r + t]}


def check_mode(p: Plan) -> None:
    """The services run the modes whose strategy runs on them (the two-stage mode; solrl/engine/queue_loop.py): a plan
    of another has no deployment file."""
    from solrl.rollout.strategies import STRATEGIES, strategy

    if not strategy(p.recipe.mode).runs_on_services:
        on = " or ".join(repr(n) for n, s in STRATEGIES.items() if s.runs_on_services)
        raise PlanError(f"rollout.mode={p.recipe.mode!r}: the services (and so the compose and kustomize files) run "
                        f"rollout.mode={on} only; plan the embedded loop's layout without --emit")


def compose(p: Plan, sets: list[str]) -> str:
    """The whole docker-compose file of the plan's layout (one node)."""
    check_mode(p)
    x, where = p.best, placement(p)
    colocated = x.kind == "colocated"
    name = "docker-compose.colocated.yml" if colocated else "docker-compose.yml"
    run_set = " ".join(sets)
    if colocated:
        layout = [f"Colocated: every GPU runs one explorer, one regenerator and one trainer rank (torchrun, "
                  f"{x.trainer_ranks} ranks),",
                  "which take turns as the epoch's stages do; the reward service shares the last GPU. Each role is",
                  "its own process, so each GPU holds a copy of the weights per role (the plan's note says whether",
                  "that fits; the paper's single process shares one)."]
    else:
        ids = ",".join(map(str, where["trainer"]))
        layout = [f"Disaggregated: explorers on GPUs {_span(where['explorers'])}, regenerators on "
                  f"{_span(where['regenerators'])}, the trainer on {ids}",
                  f"({x.trainer_ranks} torchrun ranks in one container), reward on {where['reward'][0]}."]
    head = [f"# solrl on one {p.gpus}x {p.gpu.upper()} node: `docker compose -f {name} up` (or `docker-compose`).",
            f"# Generated by `{plan_command(p, 'compose', sets)}`:",
            "# edit solrl/deploy/layouts.py, not this file (tests/deploy/test_deploy.py checks it equals the command's output).",
            *(f"# {line}" for line in _plan_lines(p) + layout)]
    out = "\n".join(head) + "\n" + COMPOSE_COMMON.format(preset=p.recipe.preset, run_set=run_set, device_set=DEVICE_SET,
                                                        threads=THREADS) + "\nservices:\n"
    out += REDIS
    out += "  reward:\n" + _build("reward") + REWARD_ENV + limits("reward") + _devices(where["reward"], "    ")
    for role, key in (("explorer", "explorers"), ("regenerator", "regenerators")):
        for i, gpus in enumerate(where[key]):
            out += (f"\n  {role}-{i}:\n    <<: *{role}\n    deploy: {{resources: {{reservations: {{devices: "
                    f"[{{driver: nvidia, device_ids: {_ids(gpus)}, capabilities: [gpu]}}]}}}}}}\n")
    explorers = [f"explorer-{i}" for i in range(len(where["explorers"]))]
    regenerators = [f"regenerator-{i}" for i in range(len(where["regenerators"]))]
    out += "\n  trainer:\n" + _build("trainer")
    out += (f"    # torchrun, {x.trainer_ranks} data-parallel ranks (PET_NPROC_PER_NODE), one per GPU; rank 0 is the "
            "service\n    # (services/trainer/README.md)\n")
    out += "    entrypoint: [" + ", ".join(f'"{a}"' for a in TRAINER_ENTRY) + "]\n"
    out += ("    <<: *hardened\n" + limits("trainer", x.trainer_ranks)
            + f"    secrets: [{', '.join(role_secrets('trainer'))}]\n")
    out += ("    environment:\n      <<: [*base-env, *run-env, *queue-env]\n" + redis_user("trainer", "      ") +
            f'      SOLRL_GRPC_PORT: "{PORTS["trainer"][0]}"\n      SOLRL_HTTP_PORT: "{PORTS["trainer"][1]}"\n'
            f"      SOLRL_EXPLORER_ADDRS: {','.join(f'{s}:8011' for s in explorers)}\n"
            f"      SOLRL_REGENERATOR_ADDRS: {','.join(f'{s}:8021' for s in regenerators)}\n"
            f'      PET_NPROC_PER_NODE: "{x.trainer_ranks}"\n')
    out += TRAINER_REST + "".join(f"      {s}: {{condition: service_healthy}}\n" for s in explorers + regenerators)
    out += ("    # restarted after a crash, it resumes the run from its last checkpoint (same arguments)\n"
            "    restart: on-failure\n    shm_size: 16gb\n" + _devices(where["trainer"], "    "))
    return out + "\nvolumes:\n  redis-data:\n  runs:\n" + SECRETS_SECTION


def _span(groups: list[list[int]]) -> str:
    ids = [g for group in groups for g in group]
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])


def kustomize(p: Plan, sets: list[str]) -> str:
    """A kustomize Component with the plan's replicas and the trainer Job's ranks and GPUs (an overlay lists it
    after components/gpu)."""
    check_mode(p)
    x = p.best
    if x.kind == "colocated":
        raise PlanError("a colocated layout has no overlay: Kubernetes gives a pod whole GPUs, so roles sharing one "
                        "need the device plugin's time-slicing, which does not promise a multi-GPU trainer pod "
                        "distinct GPUs; use --layout disaggregated (or docker-compose.colocated.yml on one node)")
    lines = [f"# Generated by `{plan_command(p, 'kustomize', sets)}`:",
             "# edit solrl/deploy/layouts.py, not this file (tests/deploy/test_deploy.py checks it equals the command's output).",
             *(f"# {line}" for line in _plan_lines(p)),
             "# The trainer: one pod of an indexed Job running torchrun with PET_NPROC_PER_NODE ranks, one GPU each.",
             "apiVersion: kustomize.config.k8s.io/v1alpha1", "kind: Component", "replicas:",
             f"  - {{name: explorer, count: {x.explorers}}}", f"  - {{name: regenerator, count: {x.regenerators}}}",
             "patches:", "  - patch: |-", "      apiVersion: batch/v1", "      kind: Job",
             "      metadata: {name: trainer, namespace: solrl}", "      spec:", "        template:", "          spec:",
             "            containers:", "              - name: trainer", "                env:",
             f'                  - {{name: PET_NPROC_PER_NODE, value: "{x.trainer_ranks}"}}',
             "                resources:",
             f"                  requests: {{nvidia.com/gpu: {x.trainer_ranks}}}",
             f"                  limits: {{nvidia.com/gpu: {x.trainer_ranks}}}"]
    return "\n".join(lines) + "\n"


def _braces_escaped(text: str) -> str:
    """`text` as a str.format template that gives it back (COMPOSE_COMMON is formatted once)."""
    return text.replace("{", "{{").replace("}", "}}")


def redis_user(role: str, indent: str) -> str:
    """A queue role's Redis connection in compose: its own ACL user in the URL, its password apart, as a file."""
    return (f"{indent}SOLRL_REDIS_URL: redis://{role}@redis:6379/0\n"
            f"{indent}SOLRL_REDIS_PASSWORD_FILE: /run/secrets/redis_{role}_password\n")


def role_secrets(role: str) -> list[str]:
    """The compose secrets a role reads: every role the data planes' token, the queue roles the adapter token, the
    queue key and their own Redis password."""
    if role == "reward":
        return ["data_token"]
    return ["data_token", "adapter_token", "queue_key", f"redis_{role}_password"]


def limits(role: str, ranks: int = 1, indent: str = "    ") -> str:
    """A role's memory and CPU limits in compose (LIMITS; the trainer's per rank)."""
    mem, cpus = LIMITS[role]
    if role == "trainer":
        mem, cpus = f"{int(mem[:-1]) * ranks}g", cpus * ranks
    return f"{indent}mem_limit: {mem}\n{indent}cpus: {cpus}\n"


# each role's memory and CPU limit (compose `mem_limit`, `cpus`): those of the k8s GPU component
# (k8s/components/gpu/gpu.yaml); the trainer's per torchrun rank, each rank loading the model through host memory
LIMITS = {"explorer": ("128g", 32), "regenerator": ("128g", 32), "reward": ("64g", 16), "trainer": ("128g", 16)}
SECRETS = ("adapter_token", "data_token", "queue_key", "redis_trainer_password", "redis_explorer_password",
           "redis_regenerator_password")
DEVICE_SET = "model.device=cuda"   # every role of a GPU layout loads its model on its GPU
THREADS = 8                        # OMP_NUM_THREADS of each process (a 8-GPU node's cores / 8, with headroom)
# the health check's grace for a model load: a 34 GB checkpoint read at ~100 MB/s from a network volume, moved to the
# GPU and quantized (the image's HEALTHCHECK start period is for the CPU images)
START_PERIOD_S = 900

COMPOSE_COMMON = """# Environment names and ports are exactly those `solrl serve <role>` reads.
# Secrets are files, one line each, in SOLRL_SECRETS_DIR (compose `secrets:`, at /run/secrets/<name> in the containers,
# named by the roles' SOLRL_*_FILE variables), so none is in a container's inspected environment:
#   mkdir -m 700 secrets && for s in adapter_token data_token queue_key redis_trainer_password \\
#     redis_explorer_password redis_regenerator_password; do openssl rand -hex 32 > secrets/$s; done
#   chmod 644 secrets/*   # the roles' users read them in the containers; the directory keeps others out; never commit it
#   SOLRL_SECRETS_DIR=./secrets docker compose -f <this file> up
# The file refuses to start without SOLRL_SECRETS_DIR; a role refuses to start without its files: the adapter token, the
# data planes' token, the HMAC key of every queue message, and each role's Redis ACL user's password (docs/deploy.md).
# Hardened as docker-compose.cpu.yml (tests/deploy/test_deploy.py checks every role): a non-root user on a read-only
# root filesystem, writing only to its volumes, tmpfs (/tmp, HOME: compile and kernel caches) and /dev/shm, no
# capability, no privilege gain, memory, CPU and PID limits (LIMITS in solrl/deploy/layouts.py, those of the k8s GPU
# component).
# Weights: SOLRL_WEIGHTS_DIR and SOLRL_HF_CACHE on the host (offline).
# One set of run settings drives every role: SOLRL_PRESET and SOLRL_SET (KEY=VALUE overrides separated by
# spaces, e.g. SOLRL_SET="model.path=/weights/sana prompts.train=/weights/prompts.txt"). The trainer trains
# them, the rollout services serve them (model, path, precisions, reward, sampling defaults), and the
# trainer checks at start that they agree. The LoRA layout travels with each pushed adapter.

# Each role gets exactly the SOLRL_* names its `solrl serve` reads (tests/deploy/test_deploy.py checks it):
# every role its bind address and ports; the queue roles Redis (their own ACL user), the queue key and the
# token; rollout roles the reward.
# OMP_NUM_THREADS: torch's CPU threads per process (torchrun would set 1 per rank; a node's cores over its GPUs).
x-base-env: &base-env
  SOLRL_BIND_HOST: 0.0.0.0
  HF_HOME: /cache/hf
  HF_HUB_OFFLINE: "1"
  SOLRL_DATA_TOKEN_FILE: /run/secrets/data_token   # the data planes' doors
  OMP_NUM_THREADS: "{threads}"

x-hardened: &hardened
  read_only: true
  tmpfs: ["/tmp", "/home/solrl"]
  cap_drop: [ALL]
  security_opt: ["no-new-privileges:true"]
  pids_limit: 4096

# model.device=cuda always comes first (every role loads on its GPU, and the trainer checks that the rollout services
# say so); a SOLRL_SET you export replaces the default after it.
x-run-env: &run-env
  SOLRL_PRESET: ${{SOLRL_PRESET:-{preset}}}
  SOLRL_SET: {device_set} ${{SOLRL_SET:-{run_set}}}

x-queue-env: &queue-env
  SOLRL_QUEUE_NAMESPACE: ${{SOLRL_QUEUE_NAMESPACE:-solrl:default}}
  SOLRL_ADAPTER_TOKEN_FILE: /run/secrets/adapter_token
  SOLRL_QUEUE_KEY_FILE: /run/secrets/queue_key

x-volumes: &solrl-volumes
  - ${{SOLRL_WEIGHTS_DIR:-./weights}}:/weights:ro
  - ${{SOLRL_HF_CACHE:-~/.cache/huggingface}}:/cache/hf:ro
""" + "".join(f"""
x-{role}: &{role}
  build:
    context: .
    dockerfile: services/Dockerfile
    target: gpu
    args: {{{{FLAVOR: gpu, {ENGINE[role]}ROLE: {role}, GRPC_PORT: "{PORTS[role][0]}", HTTP_PORT: "{PORTS[role][1]}"}}}}
  image: solrl/{role}:gpu
  <<: *hardened
{limits(role, indent="  ")}  secrets: [{", ".join(role_secrets(role))}]
  environment:
    <<: [*base-env, *run-env, *queue-env]
""" + _braces_escaped(redis_user(role, "    ")) + f"""    SOLRL_REWARD_ADDR: reward:8001
    SOLRL_TRAINER_URL: http://trainer:8093
    SOLRL_GRPC_PORT: "{PORTS[role][0]}"
    SOLRL_HTTP_PORT: "{PORTS[role][1]}"
  volumes: *solrl-volumes
  depends_on:
    redis: {{{{condition: service_healthy}}}}
    reward: {{{{condition: service_healthy}}}}
  restart: unless-stopped
  shm_size: 8gb
  healthcheck: {{{{start_period: {START_PERIOD_S}s}}}}   # the model's load (START_PERIOD_S in solrl/deploy/layouts.py)
""" for role in ("explorer", "regenerator"))

REDIS = """  redis:
    image: ${SOLRL_REDIS_IMAGE:-redis:7.2-bookworm}
    # one ACL user per role, each only on its streams: k8s/base/redis-acl.sh writes the ACL file from these
    # passwords at start (hashes only, no password on a command line); `default` may only PING (the health check)
    user: redis
    command: ["sh", "/usr/local/bin/solrl-redis-acl.sh", "/tmp/users.acl",
              "redis-server", "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--dir", "/data",
              "--protected-mode", "no"]
    secrets: [redis_trainer_password, redis_explorer_password, redis_regenerator_password]
    environment:
      SOLRL_QUEUE_NAMESPACE: ${SOLRL_QUEUE_NAMESPACE:-solrl:default}
""" + "".join(f"      SOLRL_REDIS_{r.upper()}_PASSWORD_FILE: /run/secrets/redis_{r}_password\n"
              for r in ("trainer", "explorer", "regenerator")) + """\
    volumes: [redis-data:/data, ./k8s/base/redis-acl.sh:/usr/local/bin/solrl-redis-acl.sh:ro]
    healthcheck:
      test: ["CMD", "redis-cli", "ping"]
      interval: 10s
      timeout: 3s
      retries: 5
    read_only: true
    tmpfs: ["/tmp"]   # the ACL file
    cap_drop: [ALL]
    security_opt: ["no-new-privileges:true"]
    pids_limit: 64
    mem_limit: 4g
    cpus: 2
    restart: unless-stopped

"""

# the secrets' files, in SOLRL_SECRETS_DIR (one line each; the top of the file)
SECRETS_SECTION = "\n# the secrets' files, in SOLRL_SECRETS_DIR (one line each; the top of this file)\nsecrets:\n" + "".join(
    f'  {name}: {{file: "${{SOLRL_SECRETS_DIR:?set SOLRL_SECRETS_DIR (a directory of the secrets\' files; see the top '
    f'of this file)}}/{name}"}}\n' for name in SECRETS)

REWARD_ENV = f"""    command: ["--device", "cuda"]   # its scorers' models on its GPU
    healthcheck: {{start_period: {START_PERIOD_S}s}}
    <<: *hardened
    secrets: [data_token]
    environment:
      <<: *base-env
      SOLRL_GRPC_PORT: "8001"
      SOLRL_HTTP_PORT: "8080"
    volumes: *solrl-volumes
    ports: ["8001:8001", "8080:8080"]   # Triton protocol (tritonclient / perf_analyzer) and ops
    restart: unless-stopped
"""

TRAINER_REST = """    command: ["--out", "/runs/${SOLRL_RUN_ID:-run}"]
    volumes:
      - ${SOLRL_WEIGHTS_DIR:-./weights}:/weights:ro
      - ${SOLRL_HF_CACHE:-~/.cache/huggingface}:/cache/hf:ro
      - runs:/runs   # a named volume: created from the image's /runs, owned by its uid 10001
    ports: ["8031:8031", "8093:8093"]
    depends_on:
      redis: {condition: service_healthy}
"""


def emit(p: Plan, kind: str, sets: list[str] | tuple[str, ...] = ()) -> str:
    """The chosen layout as the deployment files run it (this module): `compose`, a whole docker-compose file
    (docker-compose.yml and docker-compose.colocated.yml are this output for the shipped preset), or `kustomize`, a
    Component an overlay lists (k8s/overlays/b200/plan). `sets`: the plan's --set overrides, which become the
    file's default SOLRL_SET."""
    if kind == "compose":
        return compose(p, list(sets))
    if kind == "kustomize":
        return kustomize(p, list(sets))
    raise PlanError(f"--emit must be compose or kustomize, got {kind!r}")
