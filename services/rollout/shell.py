"""The shell shared by the rollout services (explorer, regenerator): start-up with the adapter
endpoint, the model and serving options, and the serve loop with the optional stream consumer."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from services.common.args import add_model_arguments  # noqa: F401 (re-exported: the options live there, light)
from services.common.auth import read_data_token
from services.common.budget import InflightBudget, budget_for
from services.common.env import ENV_ADAPTER_TOKEN, ENV_QUEUE_KEY, ENV_REDIS_PASSWORD, secret, split_overrides
from services.common.grpc_server import GrpcServer
from services.common.lifecycle import RunningService, serve_until_stopped
from services.common.metrics import ServiceMetrics
from services.common.ops import HttpServer, create_ops_app
from services.rollout.adapter_endpoint import AdapterEndpoint, AdapterFetcher
from services.rollout.consumers import StreamWorker, start_consumer
from services.rollout.hot_swap import HotSwapModel
from services.rollout.plane import build_scorer
from solrl.adapters import LoraSpec
from solrl.config import REWARD_FRAMES, VIDEO_MODELS, ConfigError, resolve
from solrl.models import available_models, load_model
from solrl.models.base import T2IModel
from solrl.pb.solrl.common.v1 import common_pb2
from solrl.precision import PrecisionConfig, build_backend
from solrl.queue import Queue


class RolloutRPCs:
    """The RPCs both rollout servicers share (common.v1): Info from the plane's info(), LoadAdapter through the
    AdapterEndpoint. A servicer lists it before its generated base and sets `plane` and `adapters`."""

    plane: Any
    adapters: AdapterEndpoint

    def Info(self, request: common_pb2.InfoRequest, context: grpc.ServicerContext) -> common_pb2.InfoResponse:
        info = self.plane.info()
        return common_pb2.InfoResponse(
            model=info["model"], precision=info["precision"], reward=info["reward"],
            base_precision=info["base_precision"], model_path=info["model_path"],
            adapter_version=common_pb2.AdapterVersion(version=info["adapter_version"], sha256=info["adapter_sha256"]),
            resident_weight_bytes=info["resident_weight_bytes"], available_precisions=info["available_precisions"],
            frames=info.get("frames", 0), height=info.get("height", 0), width=info.get("width", 0),
            reward_frames=info.get("reward_frames", ""), device=info["device"],
            device_stand_in=info.get("device_stand_in", ""))

    def LoadAdapter(self, request: common_pb2.LoadAdapterRequest,
                    context: grpc.ServicerContext) -> common_pb2.LoadAdapterResponse:
        result = self.adapters.grpc_load(context, request.safetensors, request.version, request.sha256)
        return common_pb2.LoadAdapterResponse(
            adapter_version=common_pb2.AdapterVersion(version=result.version, sha256=result.sha256),
            swap_ms=result.swap_ms)


@dataclass
class RolloutService(RunningService):
    """A running explorer or regenerator: a `RunningService` with its adapter endpoint."""

    adapters: AdapterEndpoint | None = None


def serve(plane: Any, hot: HotSwapModel, metrics: ServiceMetrics,
          build: Callable[[AdapterEndpoint, InflightBudget], GrpcServer], *, host: str, http_port: int,
          adapter_token: str | None, max_adapter_bytes: int, max_request_bytes: int, max_inflight_bytes: int = 0,
          mount: Callable[[Any], None] | None = None) -> RolloutService:
    """Start `build(adapters, budget)`'s gRPC server and the ops app with /v1/adapter (and whatever `mount` adds
    to it: the explorer's KServe REST door); on failure the plane is closed. Shared by the explorer and the
    regenerator. Both doors share one budget for the requests in flight: max_inflight_bytes, or with 0 the largest
    request or adapter push plus a margin (services.common.budget)."""
    stopping = threading.Event()

    def ready() -> bool:
        return not stopping.is_set() and plane.ready()

    server: GrpcServer | None = None
    http: HttpServer | None = None
    try:
        adapters = AdapterEndpoint(hot, token=adapter_token, max_bytes=max_adapter_bytes, metrics=metrics)
        budget = budget_for(max_inflight_bytes, max(max_request_bytes, adapters.max_bytes))
        server = build(adapters, budget)
        grpc_port = server.port
        app = create_ops_app(metrics=metrics, ready=ready,
                             info=lambda: {**plane.info(), "ready": ready(), "grpc_port": grpc_port,
                                           "adapter_loading": adapters.enabled})
        adapters.mount(app)
        if mount is not None:
            mount(app)
        http = HttpServer(app, host, http_port, budget=budget)
        server.start()
        http.start()
    except BaseException:
        for part in (http, server):
            if part is not None:
                part.stop(0)
        plane.close()
        raise
    return RolloutService(plane, server, http, metrics, stopping, budget, adapters=adapters)


def _explorer_start(c) -> tuple[str, int]:
    """The explorer's own precision and steps for a run: with the adaptive proxy (backend "auto"), its first
    candidate's (each ExploreJob then names the chosen one)."""
    ep = c.rollout.explore_precision.backend
    if ep != "auto":
        return ep, c.rollout.explore_steps
    from solrl.rollout.candidates import parse_candidate

    first = parse_candidate(c.rollout.proxy.candidates[0])
    return first.backend, first.steps


# Role settings a run config gives (RunConfig attribute paths); unset flags take them from --preset /
# SOLRL_PRESET + SOLRL_SET, the same settings the trainer resolves, else the role's own defaults.
_FROM_RUN = {
    "model": lambda c, role: c.model.name,
    "model_path": lambda c, role: c.model.path or None,
    "device": lambda c, role: c.model.device,
    "compile": lambda c, role: c.model.compile,
    "base_precision": lambda c, role: c.rollout.precision.backend,
    "reward": lambda c, role: c.reward,
    "micro_batch": lambda c, role: c.rollout.micro_batch,
    "precision": lambda c, role: _explorer_start(c)[0] if role == "explorer" else c.rollout.precision.backend,
    "steps": lambda c, role: _explorer_start(c)[1] if role == "explorer" else c.rollout.steps,
    "kept": lambda c, role: c.rollout.kept,
    "selection": lambda c, role: c.rollout.selection,
    # video models: the clip (0 = the model's default) and the frames the reward scores
    "frames": lambda c, role: c.model.frames,
    "height": lambda c, role: c.model.height,
    "width": lambda c, role: c.model.width,
    "reward_frames": lambda c, role: c.reward_frames,
}


def settle_role_args(args: argparse.Namespace, role: str) -> argparse.Namespace:
    """Fill the settings left unset: from the run config (--preset / SOLRL_PRESET or --config, then
    SOLRL_SET and --set) when one is given, so every role serves what the trainer trains from one set
    of values; else the role's defaults. Explicit flags always win (the trainer's Info check then says if they disagree)."""
    overrides = [*split_overrides(getattr(args, "env_set", "")), *(getattr(args, "set", None) or [])]
    preset, config = getattr(args, "preset", None), getattr(args, "config", None)
    cfg = resolve(preset, config, overrides) if (preset or config or overrides) else None
    defaults = {**getattr(args, "role_defaults", {}), "kept": 24, "selection": "best_worst"}
    for name, default in defaults.items():
        if not hasattr(args, name) or getattr(args, name) is not None:
            continue
        setattr(args, name, _FROM_RUN[name](cfg, role) if cfg is not None else default)
    if args.model not in available_models():
        raise ValueError(f"model {args.model!r} (from the run config) is not one of {available_models()}")
    model_options(args)   # a clip the model cannot make is refused here, before anything is loaded
    return args


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The loader options of the served model (`solrl.models.load_model`), as `RunConfig.model_options` gives the
    trainer's: for a video model its clip (frames, height, width; 0 = the model's default) and reward_frames, none
    for an image model. ConfigError (a ValueError; `solrl serve` prints it and exits 2), naming the setting, for a
    clip the model cannot make (the checks of RunConfig.validate: 4k + 1 frames, sizes in the VAE x patch multiple)
    and for clip settings on an image model."""
    clip = {k: int(getattr(args, k, 0) or 0) for k in ("frames", "height", "width")}
    reward_frames = getattr(args, "reward_frames", None) or "first"
    if reward_frames not in REWARD_FRAMES:
        raise ConfigError(f"--reward-frames must be one of {REWARD_FRAMES}, got {reward_frames!r}")
    if args.model not in VIDEO_MODELS:
        given = [f"--{k}={v}" for k, v in clip.items() if v]
        given += [f"--reward-frames={reward_frames}"] if reward_frames != "first" else []
        if given:
            raise ConfigError(f"{', '.join(given)} (model.frames / height / width, reward_frames) apply to the video "
                              f"models {sorted(VIDEO_MODELS)}, not {args.model!r}")
        return {}
    from solrl.models.wan import WAN_FAMILIES, check_clip

    fam, (temporal, multiple) = WAN_FAMILIES[args.model], VIDEO_MODELS[args.model]
    try:
        check_clip(*fam.clip(clip["frames"], clip["height"], clip["width"]), temporal, multiple, args.model)
    except ValueError as exc:
        raise ConfigError(f"the served clip (--frames / --height / --width, else the run's): {exc}") from None
    return {**{k: v for k, v in clip.items() if v}, "reward_frames": reward_frames}


def pinned_lora(args: argparse.Namespace, model: T2IModel) -> LoraSpec | None:
    """The LoRA layout pinned by --lora-rank / --lora-alpha / --lora-targets, or None (the usual case):
    then every pushed adapter brings its own layout in its metadata, so a worker started with no LoRA
    flags serves whatever the trainer trains."""
    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    if args.lora_rank is None and args.lora_alpha is None and not targets:
        return None
    if args.lora_rank is None or args.lora_alpha is None:
        raise ValueError("--lora-rank and --lora-alpha pin the LoRA layout together: give both or neither")
    return LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=targets or model.spec.lora_targets)


def load_served_model(args: argparse.Namespace) -> tuple[T2IModel, LoraSpec | None]:
    """The model with its base weights rounded as the trainer holds them, and the pinned LoRA spec (if any)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, args.model_path, args.device or None, **model_options(args))   # a video's clip
    if args.compile:
        model.compile_denoiser()   # as the trainer's Session does for model.compile (refused on the CPU)
    build_backend(PrecisionConfig(args.base_precision)).prepare(model.transformer)
    return model, pinned_lora(args, model)


def run_rollout_role(role: str, args: argparse.Namespace, stop: threading.Event | None,
                     environ: Mapping[str, str] | None, start: Callable[..., RolloutService],
                     build_plane: Callable[[T2IModel, LoraSpec, Any], Any],
                     worker: Callable[[Queue, Any], StreamWorker]) -> int:
    """Load the model, build the role's data plane, serve it (and consume its stream with `worker(queue, plane)`,
    the role's stream consumer, when --redis-url is set) until SIGTERM / SIGINT or `stop`."""
    environ = os.environ if environ is None else environ
    log = logging.getLogger(f"solrl.services.{role}")
    settle_role_args(args, role)
    model, lora = load_served_model(args)
    data_token = read_data_token(environ)   # the doors' and the reward service's (one token for the data planes)
    plane = build_plane(model, lora, build_scorer(args.reward, args.reward_addr or None, token=data_token))
    plane.model_name, plane.base_precision, plane.model_path = args.model, args.base_precision, args.model_path or ""
    metrics = ServiceMetrics(role)
    token = secret(environ, ENV_ADAPTER_TOKEN)   # the pushes' and the fetcher's
    svc = start(plane, metrics, host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                max_workers=args.max_workers, adapter_token=token,
                max_adapter_bytes=args.max_adapter_bytes, max_request_bytes=args.max_request_bytes,
                data_token=data_token, max_inflight_bytes=args.max_inflight_bytes)
    if getattr(args, "trainer_url", ""):
        # before any job is taken: a pod that starts or restarts mid-run serves the run's current adapter
        plane.hot.fetcher = AdapterFetcher(args.trainer_url, token, plane.hot)
        plane.hot.fetcher.fetch()
    consumer = start_consumer(role, lambda queue: worker(queue, plane), args.redis_url, args.queue_namespace, args.claim_idle_ms,
                              password=secret(environ, ENV_REDIS_PASSWORD),
                              signing_key=secret(environ, ENV_QUEUE_KEY),
                              on_reject=lambda d, reason: metrics.observe_rejected(d.stream, reason)) \
        if getattr(args, "redis_url", "") else None
    if not svc.adapters.enabled:
        log.warning("%s is not set: adapter hot reload is refused (403)", ENV_ADAPTER_TOKEN)
    info = plane.info()   # once: it sums the served weights
    banner = (f"solrl {role}: grpc {svc.grpc.address}, http {svc.http.host}:{svc.http.port}, "
              f"model {plane.model_name} ({plane.hot.backend}) on {info['device']}, reward {info['reward']}")
    try:
        return serve_until_stopped(stop, banner, svc.stop, log)
    finally:
        if consumer is not None:
            consumer.stop()
