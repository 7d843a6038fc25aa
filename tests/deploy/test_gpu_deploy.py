"""Every GPU deployment file's roles load their models on the device its run settings give them.

docker-compose.yml, docker-compose.colocated.yml and the b200 / hopper overlays (rendered by kustomize): each role
started as a local process with its own command and environment, as tests/deploy/test_deploy.py runs the CPU compose file
(its ComposeAsProcesses, container_env, kustomize, the trainer's settings as _role_settings resolves them), then
asked what it loaded on: the reward and rollout services' /v1/info, the rollout services' Info RPC through the
trainer's own start-up check (check_workers, which refuses a service on another device than model.device), the
trainer's run config as its entry resolves it.

What is stood in: this machine has no GPU, so SOLRL_TEST_CUDA_ON_CPU=1 (solrl.models.ENV_CUDA_STANDIN, read only
where a device is resolved) lets a run config name model.device=cuda here, loads each model on the CPU instead and
builds a CUDA-only precision (nvfp4, fp8) as its CPU emulation of the same format. Each role still reports the device
it was asked to load on ("device", what these assertions read) and that the CPU stood in ("device_stand_in"). So this
shows that the device reaches every role from the files, not that CUDA kernels run (the tests marked gpu do that).
Each role is started to SERVING and asked, no epoch is run. The compose files and the b200 overlay run the shapes
preset they ship. The hopper overlay trains SD3.5-Large (SOLRL_PRESET=sd35l-sol-rl, model.path on the HF cache
volume), whose weights cannot exist here: its pods start with only the model's settings substituted (run_on_shapes:
SOLRL_PRESET -> shapes-sol-rl, SOLRL_SET without model.path and the prompt files, the reward service's --rewards ->
the shapes run's reward); every other part of each command and environment, model.device=cuda and the FP8 explorer
included, is as rendered, after asserting that the rendered run names SD3.5-Large's preset, path and device.
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.request
from pathlib import Path

import pytest

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
)
from services.trainer import server as trainer_server
from solrl.models import ENV_CUDA_STANDIN
from tests.deploy.test_deploy import (
    COMPOSE_ENV,
    COMPOSE_SECRETS,
    TOKEN,
    ComposeAsProcesses,
    _redis_or_skip,
    _redis_server_or_skip,
    _role_settings,
    container_env,
    containers,
    dockerfile_image,
    free_port,
    k8s_copy,
    kustomize,
    role_args,
    start_container_process,
    trainer_entry,
)

WANT = "cuda"   # the device every role of a GPU file loads on
ROLLOUT = ("explorer", "regenerator")


@pytest.fixture()
def cuda_stand_in(monkeypatch):
    monkeypatch.setenv(ENV_CUDA_STANDIN, "1")   # inherited by every process this test starts


def v1_info(http_port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/info", timeout=10) as r:
        return json.loads(r.read())


def check_devices(where: str, infos: dict[str, dict], workers: list[dict], trainer_cfg) -> None:
    """Each service's /v1/info and each rollout service's Info RPC say WANT (stood in by the CPU); the trainer's run
    config names it."""
    got = {name: (info.get("device"), info.get("device_stand_in")) for name, info in infos.items()}
    assert got == {name: (WANT, "cpu") for name in infos}, f"{where}: {got}"
    assert sorted(w["role"] for w in workers) == sorted(ROLLOUT) and all(w["device"] == WANT for w in workers), \
        f"{where}: {workers}"
    assert trainer_server.run_device(trainer_cfg) == WANT, f"{where}: the trainer's model.device"


# the settings that name a real model's files (its weights, its prompt sets), which cannot exist here
REAL_MODEL_FILES = ("model.path=", "prompts.train=", "prompts.eval=")
SHAPES = "shapes-sol-rl"


def run_on_shapes(run_env: dict[str, str], env: dict[str, str], args: list[str]) -> tuple[dict[str, str], list[str]]:
    """A container's environment and args with only the model of a real-model run (run_env: the deployment's
    SOLRL_PRESET / SOLRL_SET) substituted, as the module docstring says: the shapes preset, SOLRL_SET without the
    model's files, and (the reward service) --rewards the shapes run's reward. A shapes run's are returned as they
    are. The rendered run is checked first: a real preset with its weights' path on the HF cache volume, on CUDA,
    whose reward the reward service serves."""
    from solrl.config import get_preset

    preset = run_env.get("SOLRL_PRESET", "")
    if not preset or preset.startswith("shapes-"):
        return env, args
    sets = shlex.split(run_env["SOLRL_SET"])
    assert "model.device=cuda" in sets and any(s.startswith("model.path=/cache/hf/") for s in sets), sets
    if "SOLRL_PRESET" in env:
        assert (env["SOLRL_PRESET"], env["SOLRL_SET"]) == (preset, run_env["SOLRL_SET"])
        env = {**env, "SOLRL_PRESET": SHAPES,
               "SOLRL_SET": shlex.join(s for s in sets if not s.startswith(REAL_MODEL_FILES))}
    if "--rewards" in args:
        i = args.index("--rewards") + 1
        assert get_preset(preset).reward in args[i].split(","), args
        args = [*args[:i], get_preset(SHAPES).reward, *args[i + 1:]]
    return env, args


def _trainer_cfg(source: str, tmp: Path):
    argv, env = trainer_entry(source, tmp, run_set=None)   # the file's own run settings
    env, _ = run_on_shapes(env, env, [])
    return _role_settings("trainer", argv[argv.index("trainer") + 1:], env,
                          {"/etc/solrl/run.json": tmp / "k8s" / "base" / "run.json"})


@pytest.mark.slow
@pytest.mark.parametrize("file", ["docker-compose.yml", "docker-compose.colocated.yml"])
def test_gpu_compose_roles_load_on_the_file_s_device(file, tmp_path, cuda_stand_in):
    """The file's Redis, reward, explorer-0 and regenerator-0 with their commands and environments (the file's own
    SOLRL_PRESET / SOLRL_SET: nothing is set for them here but the secrets)."""
    _redis_server_or_skip()
    names = ("reward", "explorer-0", "regenerator-0", "trainer")
    stack = ComposeAsProcesses(tmp_path, COMPOSE_ENV,   # the secrets' files (SOLRL_SECRETS_DIR)
                               f"solrl-test-gpu-{os.getpid()}-{free_port()}", file=file, names=names)
    try:
        stack.start_redis()
        for name in names[:3]:
            stack.start(name)
        infos = {n: v1_info(stack.port(n, ENV_HTTP_PORT)) for n in names[:3]}
        pusher = trainer_server.AdapterPusher([f"127.0.0.1:{stack.port('explorer-0', ENV_GRPC_PORT)}"],
                                              [f"127.0.0.1:{stack.port('regenerator-0', ENV_GRPC_PORT)}"],
                                              COMPOSE_SECRETS[ENV_ADAPTER_TOKEN],   # the adapter token's file
                                              data_token=COMPOSE_SECRETS[ENV_DATA_TOKEN])   # the doors' token
        cfg = _trainer_cfg(file, tmp_path)
        try:
            workers = trainer_server.check_workers(pusher, cfg, timeout_s=30)   # the trainer's start-up check
        finally:
            pusher.close()
    finally:
        stack.stop()
    check_devices(file, infos, workers, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["b200", "hopper"])
def test_gpu_overlay_pods_load_on_the_overlay_s_device(overlay, tmp_path, cuda_stand_in):
    """The overlay's reward, explorer and regenerator Deployments' containers: the entry of the image their role builds
    (services/Dockerfile, gpu) with the container's args and env (ConfigMaps, Secrets as the overlay's files give
    them); what the cluster gives is moved here (ports to free ones on 127.0.0.1, the run config to its file, the
    reward's Service to the local reward). Redis: the local test one, without ACL users or signing, as the torchrun
    entry test (tests/queue/test_queue_security.py and the CPU compose test run the secured queue). A real-model overlay
    (hopper: SD3.5-Large) starts with only its model substituted by the shapes run's (run_on_shapes), the rest as
    rendered."""
    redis_url = "redis://127.0.0.1:6379/0"
    _redis_or_skip(redis_url)
    tree = k8s_copy(tmp_path, TOKEN)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in kustomize(tree, overlay)}
    files = {"/etc/solrl/run.json": str(tree / "base" / "run.json")}
    (run_env,) = [d["data"] for (kind, name), d in by_kind.items() if kind == "ConfigMap"
                  and name.startswith("solrl-run-env")]
    ports = {role: (free_port(), free_port()) for role in ("reward", *ROLLOUT)}
    procs = []
    try:
        for role in ("reward", *ROLLOUT):
            (c,) = containers(by_kind[("Deployment", role)])
            env = container_env(c, by_kind)
            env.pop(ENV_REDIS_PASSWORD, None)
            env.pop(ENV_QUEUE_KEY, None)
            env = {k: TOKEN if v == "<secret>" else v for k, v in env.items()}
            env.update({ENV_HOST: "127.0.0.1", ENV_GRPC_PORT: str(ports[role][0]), ENV_HTTP_PORT: str(ports[role][1])})
            if ENV_REDIS_URL in env:
                env.update({ENV_REDIS_URL: redis_url, ENV_QUEUE_NAMESPACE: f"solrl-test-gpu-{overlay}-{os.getpid()}"})
            if ENV_REWARD_ADDR in env:
                env[ENV_REWARD_ADDR] = f"127.0.0.1:{ports['reward'][0]}"
            env.pop("HF_HOME", None)   # a container path
            env, args = run_on_shapes(run_env, env, c.get("args", []))
            image = dockerfile_image(role_args(role, "gpu"), "gpu")
            argv = [*image.entrypoint, *[files.get(a, a) for a in args]]
            procs.append(start_container_process(argv, {**{k: v for k, v in image.env.items()
                                                           if k.startswith("SOLRL_")}, **env},
                                                 tmp_path / f"{role}.log", tmp_path, ports[role][0]))
        infos = {role: v1_info(ports[role][1]) for role in ("reward", *ROLLOUT)}
        pusher = trainer_server.AdapterPusher([f"127.0.0.1:{ports['explorer'][0]}"],
                                              [f"127.0.0.1:{ports['regenerator'][0]}"], TOKEN,
                                              data_token=TOKEN)   # every Secret is TOKEN here, the doors' too
        cfg = _trainer_cfg(f"k8s/overlays/{overlay}", tmp_path / "trainer")
        try:
            workers = trainer_server.check_workers(pusher, cfg, timeout_s=30)
        finally:
            pusher.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    check_devices(overlay, infos, workers, cfg)


@pytest.mark.parametrize("global_state", [True, False])
def test_explorer_calls_take_turns_on_a_backend_with_process_global_state(monkeypatch, global_state):
    """Transformer Engine's autocast state is process-global (TransformerEngineBackend.global_state): concurrent
    Explore calls on such a backend run their model calls one at a time; on a backend without it they overlap. Here the
    NVFP4 emulation declares it (no TE on this machine); every call is the real explore, timed."""
    import threading
    import time

    from services.explorer import dataplane
    from solrl.models import load_model
    from solrl.precision import PrecisionConfig
    from solrl.precision.emulated import NVFP4EmuBackend
    from solrl.rewards import build_reward

    monkeypatch.setattr(NVFP4EmuBackend, "global_state", global_state)
    real, lock = dataplane.explore, threading.Lock()
    active, peak = [0], [0]

    def timed(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.3)   # long enough that unserialised calls meet
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(dataplane, "explore", timed)
    plane = dataplane.ExplorerDataPlane(load_model("shapes"), PrecisionConfig("nvfp4-emu"), None,
                                        build_reward("shapes"), steps=1, kept=2)
    assert plane.serialised() == global_state
    outcomes, errors = [], []

    def call():
        try:
            outcomes.append(plane.explore(["a red circle"], seeds=[[1, 2]], kept=2))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(outcomes) == 4
    assert peak[0] == 1 if global_state else peak[0] > 1
    assert len({tuple(o.scores.ravel().tolist()) for o in outcomes}) == 1   # same seeds, same result either way
