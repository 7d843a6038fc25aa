"""Rollout strategies: what one epoch's rollouts of each `rollout.mode` explore, keep, regenerate and cost.

The paper's method and its baselines (docs/method.md) are four strategies over the same code:

  sol_rl         the pool (n seeds a prompt) explored in low precision at few steps, the best and worst k kept by
                 that proxy reward, the k regenerated in BF16 at full steps
  diffusion_nft  k seeds a prompt sampled in BF16 at full steps, all kept (no exploration, no selection)
  naive_scaling  the pool sampled in BF16 at full steps, the best and worst k kept by their BF16 rewards
  naive_quant    the pool sampled in low precision at full steps, the best and worst k kept by that reward and
                 trained on as they are (no regeneration)

A strategy is a description, not a loop: the engine's session (solrl/engine/session.py) and the queue-driven loop
read it to decide which passes to run, the planner and the layout emitter to price and place them. `strategy(name)`
gives the one of a mode; `r` below is a run's RolloutConfig (`cfg.rollout`).
"""

from __future__ import annotations

from typing import Any, ClassVar

LOW, BF16 = "low", "bf16"                 # the precision of a pass: the explorer's low-precision copy, or BF16
KEEP_ALL = "all"                          # every sampled seed is trained on
KEEP_BY_PROXY = "by_proxy"                # k of the pool, chosen by the low-precision reward (rollout.selection)
KEEP_BY_BF16 = "by_bf16"                  # k of the pool, chosen by the BF16 full-step reward (rollout.selection)


class RolloutStrategy:
    """One rollout mode. Class attributes say what it does; methods say how many seeds and forwards, given `r`."""

    name: ClassVar[str]
    explores: ClassVar[bool]       # a low-precision pass over the pool, scored by the reward (the proxy)
    keeps: ClassVar[str]           # KEEP_ALL | KEEP_BY_PROXY | KEEP_BY_BF16
    regenerates: ClassVar[bool]    # the kept seeds are re-sampled in BF16 at full steps
    trains_on: ClassVar[str]       # BF16: full-step BF16 samples; LOW: the explored low-precision samples as they are
    runs_on_services: ClassVar[bool] = False   # the services' explorer -> regenerator pipeline runs it
    summary: ClassVar[str]

    @property
    def selects(self) -> bool:
        """Whether k of a larger pool are chosen (rollout.selection applies)."""
        return self.keeps != KEEP_ALL

    @property
    def samples_bf16(self) -> bool:
        """Whether a BF16 full-step pass samples the trained seeds (the regenerator's pass, or one-stage sampling)."""
        return self.trains_on == BF16

    def pool(self, r: Any) -> int:
        """Seeds drawn a prompt."""
        return r.pool

    def explored(self, r: Any) -> int:
        """Seeds a prompt sampled in low precision."""
        return self.pool(r) if self.explores else 0

    def explore_steps(self, r: Any, proxy_steps: int | None = None) -> int:
        """Solver steps of the low-precision pass (0: none); `proxy_steps`: the adaptive proxy's current candidate's."""
        if not self.explores:
            return 0
        return proxy_steps if proxy_steps is not None else r.explore_steps

    def bf16_sampled(self, r: Any) -> int:
        """Seeds a prompt sampled in BF16 at full steps (r.steps): the kept k where they are regenerated, the whole
        draw where BF16 samples are trained on without a regeneration pass, none where low-precision ones are."""
        if self.trains_on != BF16:
            return 0
        return r.kept if self.regenerates else self.pool(r)

    def forwards(self, r: Any, cfg_mult: int = 1, explore_steps: int | None = None) -> dict[str, int]:
        """Image-level denoiser forwards of one epoch's rollouts (the loop's forwards_* records): every solver step is
        one forward a seed, x2 with classifier-free guidance (`cfg_mult`); `explore_steps` as the proxy sets them."""
        steps = self.explore_steps(r) if explore_steps is None else explore_steps
        explore = r.prompts_per_epoch * self.explored(r) * steps * cfg_mult
        regenerate = r.prompts_per_epoch * self.bf16_sampled(r) * r.steps * cfg_mult
        return {"explore": explore, "regenerate": regenerate, "total": explore + regenerate}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SolRL(RolloutStrategy):
    name = "sol_rl"
    explores, keeps, regenerates, trains_on, runs_on_services = True, KEEP_BY_PROXY, True, BF16, True
    summary = "n explored in low precision at few steps, k kept by the proxy, regenerated in BF16 at full steps"


class DiffusionNFT(RolloutStrategy):
    name = "diffusion_nft"
    explores, keeps, regenerates, trains_on = False, KEEP_ALL, False, BF16
    summary = "k sampled in BF16 at full steps, all trained on"

    def pool(self, r: Any) -> int:
        # k seeds a prompt: the first k of the pool the other modes draw (the same prompts and initial noise)
        return r.kept


class NaiveScaling(RolloutStrategy):
    name = "naive_scaling"
    explores, keeps, regenerates, trains_on = False, KEEP_BY_BF16, False, BF16
    summary = "n sampled in BF16 at full steps, k kept by their BF16 rewards"


class NaiveQuant(RolloutStrategy):
    name = "naive_quant"
    explores, keeps, regenerates, trains_on = True, KEEP_BY_PROXY, False, LOW
    summary = "n sampled in low precision at full steps, k kept by that reward and trained on as they are"

    def explore_steps(self, r: Any, proxy_steps: int | None = None) -> int:
        return r.steps  # full steps, whatever the adaptive proxy's candidate explores with


STRATEGIES: dict[str, RolloutStrategy] = {s.name: s for s in (SolRL(), DiffusionNFT(), NaiveScaling(), NaiveQuant())}
MODES = tuple(STRATEGIES)


def strategy(name: str) -> RolloutStrategy:
    """The strategy of rollout.mode `name`; ValueError naming the valid modes otherwise."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown rollout.mode {name!r}; valid modes: {', '.join(MODES)}") from None


__all__ = ["BF16", "KEEP_ALL", "KEEP_BY_BF16", "KEEP_BY_PROXY", "LOW", "MODES", "STRATEGIES", "DiffusionNFT",
           "NaiveQuant", "NaiveScaling", "RolloutStrategy", "SolRL", "strategy"]
