"""`solrl up`: the whole distributed loop on one machine, as local processes.

Starts the reward, explorer, regenerator and trainer services (`python -m services.<role>.server`) on
free ports, wired to each other and to one Redis, waits for each to be ready (/readyz), prefixes and
streams their logs, and stops them all on Ctrl-C / SIGTERM (SIGTERM to each, then SIGKILL after a
grace period). Exit status: 0 when the trainer finishes its run; the failing child's status (or 1)
when a child dies; 128 + signal number when stopped by a signal.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from solrl.config import RunConfig, resolve_run
from solrl.queue.base import redact_url

ROLES = ("reward", "explorer", "regenerator", "trainer")
HOST = "127.0.0.1"


@dataclass
class ChildSpec:
    """One process to supervise: its role (the log prefix), command, extra environment and readiness URL."""

    role: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None   # polled until it answers 200; None: ready once started


def free_port(host: str = HOST) -> int:
    """A port the OS reports free now (another process could take it before the child binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Supervisor:
    """Start children stage by stage, stream their logs, and stop all of them together."""

    def __init__(self, stages: Sequence[Sequence[ChildSpec]], *, out: TextIO | None = None,
                 startup_timeout_s: float = 300.0, grace_s: float = 15.0, done_role: str | None = None) -> None:
        if not stages or not all(stages):
            raise ValueError("stages must be a non-empty list of non-empty lists of ChildSpec")
        if not startup_timeout_s > 0 or not grace_s > 0:
            raise ValueError(f"startup_timeout_s and grace_s must be > 0, got {startup_timeout_s}, {grace_s}")
        self.stages, self.out = [list(s) for s in stages], out or sys.stdout
        self.startup_timeout_s, self.grace_s, self.done_role = float(startup_timeout_s), float(grace_s), done_role
        self.stop_requested = threading.Event()
        self.signal_number = 0
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self.width = max(len(c.role) for s in self.stages for c in s)

    def say(self, role: str, line: str) -> None:
        with self._log_lock:
            self.out.write(f"{role:>{self.width}} | {line.rstrip()}\n")
            self.out.flush()

    def request_stop(self, signum: int = 0) -> None:
        """Ask run() to stop every child (safe from a signal handler)."""
        self.signal_number = self.signal_number or signum
        self.stop_requested.set()

    def _start(self, spec: ChildSpec) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        # own session: a terminal's Ctrl-C reaches only us, and we stop the children in order
        proc = subprocess.Popen(spec.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True)
        self.procs[spec.role] = proc
        reader = threading.Thread(target=self._pump, args=(spec.role, proc), name=f"log-{spec.role}", daemon=True)
        reader.start()
        self._readers.append(reader)
        self.say("up", f"started {spec.role} (pid {proc.pid})")

    def _pump(self, role: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.say(role, line)

    def _dead(self) -> tuple[str, int] | None:
        """The first child that has exited, with its status."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                return role, proc.returncode
        return None

    def _wait_ready(self, specs: Sequence[ChildSpec]) -> tuple[str, int] | None:
        """Poll the readiness URLs; a dead child or a stop request ends the wait early."""
        deadline = time.monotonic() + self.startup_timeout_s
        waiting = [s for s in specs if s.ready_url]
        while waiting:
            if self.stop_requested.is_set():
                return None
            dead = self._dead()
            if dead is not None:
                return dead
            if time.monotonic() > deadline:
                self.say("up", f"{', '.join(s.role for s in waiting)} not ready after {self.startup_timeout_s:.0f} s")
                return waiting[0].role, 1
            waiting = [s for s in waiting if not _answers_200(s.ready_url)]
            if waiting:
                self.stop_requested.wait(0.25)
        for s in specs:
            self.say("up", f"{s.role} ready")
        return None

    def run(self) -> int:
        """Start every stage, then wait until `done_role` exits 0, a child dies, or a stop is requested."""
        failure: tuple[str, int] | None = None
        try:
            for stage in self.stages:
                for spec in stage:
                    self._start(spec)
                failure = self._wait_ready(stage)
                if failure is not None or self.stop_requested.is_set():
                    break
            while failure is None and not self.stop_requested.is_set():
                failure = self._dead()
                if failure is None:
                    self.stop_requested.wait(0.2)
        finally:
            self.shutdown()
        if failure is not None:
            role, rc = failure
            if role == self.done_role and rc == 0:
                self.say("up", f"{role} finished; all services stopped")
                return 0
            self.say("up", f"{role} exited with status {rc}; all services stopped")
            return rc or 1
        self.say("up", "stopped")
        return 128 + self.signal_number if self.signal_number else 0

    def shutdown(self) -> None:
        """SIGTERM every running child (the last started first), wait up to grace_s, then SIGKILL."""
        running = [p for p in reversed(list(self.procs.values())) if p.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + self.grace_s
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for r in self._readers:
            r.join(2.0)


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def plan(cfg: RunConfig, *, redis_url: str, namespace: str, run_dir: Path, trainer_args: Sequence[str],
         token: str, threads: int = 1, port: Callable[[], int] = free_port,
         python: str = sys.executable, explorers: int = 1) -> list[list[ChildSpec]]:
    """The services' commands for `cfg`: reward, then explorer(s) + regenerator, then the trainer.
    With several explorers they are named explorer-1, explorer-2, ... and share the explore stream."""
    if explorers < 1:
        raise ValueError(f"explorers must be >= 1, got {explorers}")
    names = {"explorer": ["explorer"] if explorers == 1 else [f"explorer-{i + 1}" for i in range(explorers)]}
    ports = {name: (port(), port()) for role in ROLES for name in names.get(role, [role])}   # (gRPC, HTTP)

    def spec(role: str, args: list[str], env: Mapping[str, str] = {}, name: str | None = None) -> ChildSpec:
        grpc_port, http_port = ports[name or role]
        argv = [python, "-m", f"services.{role}.server", *args, "--host", HOST,
                "--grpc-port", str(grpc_port), "--http-port", str(http_port)]
        return ChildSpec(name or role, argv, dict(env), f"http://{HOST}:{http_port}/readyz")

    r = cfg.rollout
    model = ["--model", cfg.model.name, *(["--model-path", cfg.model.path] if cfg.model.path else []),
             "--base-precision", r.precision.backend,   # the LoRA layout comes with each pushed adapter
             "--reward", cfg.reward, "--reward-addr", f"{HOST}:{ports['reward'][0]}",
             "--micro-batch", str(r.micro_batch), "--threads", str(threads), "--queue-namespace", namespace,
             *video_args(cfg)]
    # secrets travel in the environment, never on a command line (`ps` shows those): the token and the
    # Redis URL, which may carry a password
    secret = {"SOLRL_ADAPTER_TOKEN": token, "SOLRL_REDIS_URL": redis_url}
    explorer_args = [*model, "--precision", r.explore_precision.backend, "--steps", str(r.explore_steps),
                     "--kept", str(r.kept), "--selection", r.selection]
    explorer_specs = [spec("explorer", explorer_args, secret, name) for name in names["explorer"]]
    regenerator = spec("regenerator", [*model, "--precision", r.precision.backend, "--steps", str(r.steps)], secret)
    trainer = spec("trainer", [*trainer_args, "--out", str(run_dir), "--queue-namespace", namespace,
                               "--explorer-addrs", ",".join(f"{HOST}:{ports[n][0]}" for n in names["explorer"]),
                               "--regenerator-addrs", f"{HOST}:{ports['regenerator'][0]}"],
                   secret)
    return [[spec("reward", ["--rewards", cfg.reward])], [*explorer_specs, regenerator], [trainer]]


def video_args(cfg: RunConfig) -> list[str]:
    """A video run's clip and reward frames for the rollout services (what `RunConfig.model_options` gives the
    trainer's loader); none for an image model."""
    options = cfg.model_options()
    return [a for key, value in options.items() for a in (f"--{key.replace('_', '-')}", str(value))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`solrl up`'s options."""
    p.add_argument("--redis-url", required=True, help="the Redis the services share, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--preset", default=None, help="run preset (default shapes-sol-rl)")
    p.add_argument("--config", default=None, help="a config JSON instead of a preset")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override, e.g. rollout.pool=48")
    p.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint (its saved config plus --set)")
    p.add_argument("--namespace", default=None, help="queue key namespace (default: solrl:<run directory name>)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rollout service (0: torch's default)")
    p.add_argument("--explorers", type=int, default=1, help="explorer processes sharing the explore stream")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="how long each service may take to be ready")
    p.add_argument("--grace-s", type=float, default=15.0, help="how long stopped services get before SIGKILL")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run `solrl up` until the trainer finishes, a service dies, or SIGINT / SIGTERM."""
    from solrl.rollout.strategies import STRATEGIES, strategy  # imported here: solrl.rollout loads torch, --help must not

    cfg, run_dir = resolve_run(args.preset, args.config, list(args.set or []), args.out, args.resume)
    if not strategy(cfg.rollout.mode).runs_on_services:
        on = " or ".join(repr(n) for n, s in STRATEGIES.items() if s.runs_on_services)
        raise ValueError(f"solrl up runs rollout.mode {on} (explorer + regenerator), got {cfg.rollout.mode!r}")
    namespace = args.namespace or f"solrl:{run_dir.name}"
    head = ["--resume", str(run_dir)] if args.resume else [
        *(["--preset", args.preset] if args.preset else []), *(["--config", args.config] if args.config else [])]
    trainer_args = [*head, *[a for s in (args.set or []) for a in ("--set", s)]]
    token = os.environ.get("SOLRL_ADAPTER_TOKEN") or secrets.token_urlsafe(24)
    sup = Supervisor(plan(cfg, redis_url=args.redis_url, namespace=namespace, run_dir=run_dir,
                          trainer_args=trainer_args, token=token, threads=args.threads,
                          explorers=args.explorers),
                     out=out, startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s, done_role="trainer")
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: sup.request_stop(signum))
    try:
        sup.say("up", f"{cfg.name}: {cfg.epochs} epochs -> {run_dir} (queue {redact_url(args.redis_url)}, namespace {namespace})")
        return sup.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="solrl up", description="run every solrl service locally against one Redis")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
