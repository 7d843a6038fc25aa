"""The adaptive proxy's candidates: FORMAT@STEPS[/POLICY] parsed, labelled and checked, and priced per explored seed
under a GPU device model.

What the config, the planner and the rollout services need of the proxy without the calibration or the controller
(solrl/engine/proxy.py): every check here needs no model, so the config runs them when it is validated. The
device model is the hardware table's (solrl/hardware.py):

  b200           FP4 1/4 and FP8 1/2 of a BF16 forward for the quantized share of its multiply-accumulates
  h100 / h200    FP8 1/2; no FP4 (such candidates are left out)
"""

from __future__ import annotations

from dataclasses import dataclass

from solrl.hardware import GPUS, format_cost, forward_cost

DEVICES = (*GPUS, "cpu")


@dataclass(frozen=True)
class Candidate:
    backend: str
    steps: int
    policy: str = "reference"

    @property
    def name(self) -> str:
        return f"{self.backend}@{self.steps}" + (f"/{self.policy}" if self.policy != "reference" else "")

    @property
    def label(self) -> str:
        """The precision part of the name (what an explorer reports it sampled with)."""
        return proxy_label(self.backend, self.policy)


def proxy_label(backend: str, policy: str = "") -> str:
    """"BACKEND" or "BACKEND/POLICY" (the reference policy is left out)."""
    return backend if policy in ("", "reference") else f"{backend}/{policy}"


class ProxyPartError(ValueError):
    """An unknown format or policy; `part` says which ("format" | "policy"), so a caller can name its field."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def check_proxy_parts(backend: str, policy: str = "") -> str:
    """The policy ("reference" when empty) after checking that both the format and the policy exist."""
    from solrl.precision import available_backends
    from solrl.precision.policy import POLICIES

    if backend not in available_backends():
        raise ProxyPartError("format", f"unknown format {backend!r}; available: {available_backends()}")
    policy = policy or "reference"
    if policy not in POLICIES:
        raise ProxyPartError("policy", f"unknown policy {policy!r}; available: {sorted(POLICIES)}")
    return policy


def parse_candidate(text: str) -> Candidate:
    """FORMAT@STEPS or FORMAT@STEPS/POLICY, e.g. nvfp4-emu@6 or fp8-e4m3-emu@4/keep-first-block."""
    head, _, policy = str(text).partition("/")
    backend, at, steps = head.partition("@")
    if not at or not steps.isdigit() or int(steps) < 1:
        raise ValueError(f"rollout.proxy.candidates: {text!r} is not FORMAT@STEPS[/POLICY] (e.g. nvfp4-emu@6)")
    try:
        policy = check_proxy_parts(backend, policy)
    except ProxyPartError as exc:
        raise ValueError(f"rollout.proxy.candidates: {text!r}: {exc}") from None
    return Candidate(backend, int(steps), policy)


def check_proxy_config(p, full_steps: int) -> list[Candidate]:
    """Every check that needs no model: runs when the config is validated, before any work."""
    if not p.candidates:
        raise ValueError("rollout.proxy.candidates: at least one candidate is needed")
    cands = [parse_candidate(c) for c in p.candidates]
    for c in cands:
        if c.steps > full_steps:
            raise ValueError(f"rollout.proxy.candidates: {c.name} explores with more steps than the full "
                             f"rollout (rollout.steps={full_steps})")
    if not (isinstance(p.target, (int, float)) and 0 < p.target <= 1):
        raise ValueError(f"rollout.proxy.target must be in (0, 1] (a Kendall tau), got {p.target!r}")
    if p.device not in DEVICES:
        raise ValueError(f"rollout.proxy.device must be one of {DEVICES}, got {p.device!r}")
    if p.prompts < 1 or p.seeds < 4:
        raise ValueError(f"rollout.proxy.prompts must be >= 1 and rollout.proxy.seeds >= 4, got {p.prompts}, {p.seeds}")
    if p.patience < 1 or p.every < 0:
        raise ValueError(f"rollout.proxy.patience must be >= 1 and rollout.proxy.every >= 0, got {p.patience}, "
                         f"{p.every}")
    if p.device in ("h100", "h200") and all(format_cost(c.backend, p.device) is None for c in cands):
        raise ValueError(f"rollout.proxy.candidates: none can run on {p.device} (no FP4 on Hopper): add an FP8 or "
                         f"BF16 candidate")
    return cands


def model_cost(c: Candidate, device: str, share: float) -> float | None:
    """BF16-forward equivalents per explored seed under a GPU device model (None: cannot run there)."""
    cost = forward_cost(c.backend, share, device)
    return None if cost is None else c.steps * cost
