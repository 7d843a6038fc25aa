"""Command-line options the service roles share, and the defaults they show.

Light on purpose: argparse, the SOLRL_* names (services.common.env) and torch-free name lists only, so
`solrl serve ROLE --help` (and any role's parser) builds without grpc, torch, diffusers or tritonclient.
The server modules import their options from services.<role>.args; the model, precision and selection
choices are static lists that tests/cli/test_cli_fast.py keeps equal to the registries."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from services.common.env import (
    ENV_QUEUE_NAMESPACE,
    ENV_REDIS_URL,
    ENV_REWARD_ADDR,
    ENV_TRAINER_URL,
    Addresses,
    add_address_arguments,
    add_run_arguments,
)
from solrl.config import MODEL_NAMES, REWARD_FRAMES
from solrl.precision.config import BACKEND_NAMES
from solrl.queue.base import QueueConfig

# the largest adapter a rollout service accepts (LoadAdapter, PUT, fetch); 0: derived at start from the served
# model's LoRA layout (services.rollout.hot_swap.adapter_cap), so a Wan2.2 A14B rank-32 adapter fits
DEFAULT_MAX_ADAPTER_BYTES = 0
# What one request may hold, per door (--max-request-bytes), sized from the largest request a run sends:
# - reward: one batch of the largest images, 64 (the default --max-batch and rollout micro-batch) x 1024 x 1024
#   x 3 uint8 = 192 MiB; 256 MiB leaves a third on top. A bigger batch (a video run scoring every frame of its
#   clips) is split by the client, services.rollout.plane.RemoteScorer, into requests within it.
# - explorer, regenerator: one call is at most max_seeds = 4096 samples: 4096 int64 seeds (32 KiB) and at most one
#   prompt each, 4 MiB at 1 KiB a prompt; 8 MiB is twice that. (Their gRPC port also takes LoadAdapter pushes,
#   so it receives up to --max-adapter-bytes.)
# A door takes a tensor of up to the limit, and a message or body of up to the limit plus MESSAGE_MARGIN (names,
# prompts, the JSON header); a body's gzip / deflate is bounded on what it decompresses to.
DEFAULT_MAX_REWARD_REQUEST_BYTES = 256 << 20
DEFAULT_MAX_ROLLOUT_REQUEST_BYTES = 8 << 20
MESSAGE_MARGIN = 1 << 20
DEFAULT_NAMESPACE = "solrl:default"    # the work queue's key namespace


def add_model_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str], *, precision: str,
                        steps: int, grpc_port: int, http_port: int) -> None:
    """Options shared by the explorer and the regenerator. Model, precisions, reward and sampling
    defaults left unset come from the run config (services.rollout.shell.settle_role_args)."""
    addr = Addresses.from_env(environ, grpc_port=grpc_port, http_port=http_port)
    p.set_defaults(role_defaults={"model": "shapes", "model_path": None, "base_precision": "bf16",
                                  "reward": "shapes", "micro_batch": 64, "precision": precision, "steps": steps,
                                  "frames": 0, "height": 0, "width": 0, "reward_frames": "first", "device": "",
                                  "compile": False})
    add_run_arguments(p, environ, "rollout")
    p.add_argument("--model", default=None, choices=list(MODEL_NAMES),
                   help="model registry name (default: the run's model.name, else shapes)")
    p.add_argument("--model-path", default=None, help="local weights directory (default: the run's model.path)")
    p.add_argument("--device", default=None,
                   help="torch device of the model, e.g. cuda (default: the run's model.device, else the model's own)")
    p.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                   help="sample through torch.compile'd denoisers, GPU only (default: the run's model.compile)")
    p.add_argument("--precision", default=None, choices=list(BACKEND_NAMES),
                   help=f"serving precision backend (default: the run's, else {precision})")
    p.add_argument("--base-precision", default=None, choices=("bf16", "fp32"),
                   help="precision the trainer holds its base weights in (default: the run's rollout.precision, "
                        "else bf16); adapters are merged into base weights rounded the same way")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="pin the LoRA rank pushed adapters must have (default: each adapter's own, from its metadata)")
    p.add_argument("--lora-alpha", type=float, default=None, help="pin the LoRA alpha (with --lora-rank)")
    p.add_argument("--lora-targets", default="",
                   help="pin the LoRA target modules, comma-separated (with --lora-rank; default: the model's)")
    p.add_argument("--reward", default=None, help="reward (scorer) name (default: the run's, else shapes)")
    p.add_argument("--reward-addr", default=environ.get(ENV_REWARD_ADDR, ""),
                   help=f"host:port of a reward service to score with (env {ENV_REWARD_ADDR}; empty: in process)")
    p.add_argument("--frames", type=int, default=None,
                   help="video models: frames per clip, 4k + 1 (default: the run's model.frames, else the model's)")
    p.add_argument("--height", type=int, default=None,
                   help="video models: clip height in pixels (default: the run's model.height, else the model's)")
    p.add_argument("--width", type=int, default=None,
                   help="video models: clip width in pixels (default: the run's model.width, else the model's)")
    p.add_argument("--reward-frames", default=None, choices=list(REWARD_FRAMES),
                   help="video models: the frames the reward scores, frame 0 or the mean over frames "
                        "(default: the run's reward_frames, else first)")
    p.add_argument("--steps", type=int, default=None, help=f"default sampling steps (default: the run's, else {steps})")
    p.add_argument("--micro-batch", type=int, default=None, help="images per model forward (default: the run's, else 64)")
    p.add_argument("--version-wait-s", type=float, default=30.0,
                   help="how long a request for a newer adapter version waits for it")
    p.add_argument("--trainer-url", default=environ.get(ENV_TRAINER_URL, ""),
                   help=f"the trainer's ops URL (env {ENV_TRAINER_URL}, e.g. http://trainer:8093): fetch the current "
                        "adapter from it at start and whenever a job needs a newer one than was pushed here")
    p.add_argument("--max-adapter-bytes", type=int, default=DEFAULT_MAX_ADAPTER_BYTES,
                   help="largest adapter payload accepted, in bytes (default 0: derived from the served model's LoRA "
                        "targets and rank: A and B of every target in FP32 plus header room)")
    add_request_limit(p, DEFAULT_MAX_ROLLOUT_REQUEST_BYTES)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_address_arguments(p, addr)
    p.add_argument("--max-workers", type=int, default=16, help="gRPC handler threads (RPCs in flight)")


def add_request_limit(p: argparse.ArgumentParser, default: int) -> None:
    """--max-request-bytes: the largest request a door takes (a tensor of up to it, a gRPC message or HTTP body,
    decompressed, of up to it plus MESSAGE_MARGIN); larger ones are refused with 413 / RESOURCE_EXHAUSTED."""
    p.add_argument("--max-request-bytes", type=int, default=default,
                   help=f"largest request accepted, gRPC or HTTP, decompressed (bytes; default {default})")
    add_inflight_limit(p)


def add_inflight_limit(p: argparse.ArgumentParser) -> None:
    """--max-inflight-bytes: the service's budget for all the requests it holds at once (services.common.budget)."""
    p.add_argument("--max-inflight-bytes", type=int, default=0,
                   help="bytes all requests in flight may hold together, both doors, as received and decompressed; "
                        "past it a request is refused at once (HTTP 503 + Retry-After, gRPC RESOURCE_EXHAUSTED) "
                        "(default 0: the largest single request a door takes, plus 1 MiB)")


def add_consumer_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """--redis-url / --queue-namespace for the rollout services (no URL: no consumer, as before)."""
    p.add_argument("--redis-url", default=environ.get(ENV_REDIS_URL, ""),
                   help=f"consume jobs from this work queue (env {ENV_REDIS_URL}; empty: serve RPCs only)")
    p.add_argument("--queue-namespace", default=environ.get(ENV_QUEUE_NAMESPACE, "") or DEFAULT_NAMESPACE,
                   help=f"queue key namespace (env {ENV_QUEUE_NAMESPACE})")
    p.add_argument("--claim-idle-ms", type=int, default=QueueConfig.claim_idle_ms,
                   help="reclaim a job another worker took but left un-acked for this long (a dead worker's)")
