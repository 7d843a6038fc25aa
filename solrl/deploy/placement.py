"""Placement search: the colocated layout and every disaggregated split, and the plan (`make_plan`): the layout with
the shortest epoch that fits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from solrl.config import RunConfig
from solrl.deploy.facts import ModelFacts, _facts
from solrl.deploy.memory import ROLES, MemoryModel, memory_model
from solrl.deploy.recipe import PlanError, Recipe, get_gpu, recipe_from_config
from solrl.deploy.timing import CALIBRATION, Calibration, Stage, stages
from solrl.hardware import USABLE_HBM, Gpu


@dataclass(frozen=True)
class Layout:
    kind: str                   # colocated | disaggregated
    gpus: int
    explorers: int              # GPUs (one explorer replica each); colocated: every GPU
    regenerators: int
    trainer_ranks: int
    reward: int
    stage_s: dict[str, float]   # explore, regenerate, rollout, train
    epoch_s: float
    pipelined_s: float          # with rollout.staleness = 1 (rollouts of e+1 beside training of e):
                                # the same as epoch_s when the stages share the GPUs
    memory_gb: dict[str, float]  # per GPU, by role (colocated: one entry)
    fits: bool
    unused: int = 0
    gradient_checkpointing: bool = False   # the trainer recomputes activations (only where it would not fit)
    over_gb: dict[str, float] = field(default_factory=dict)   # roles that do not fit: GB beyond the usable memory

    @property
    def label(self) -> str:
        if self.kind == "colocated":
            return f"colocated on {self.gpus} GPUs (trainer ranks {self.trainer_ranks})"
        return (f"disaggregated: explorers {self.explorers}, regenerators {self.regenerators}, trainer ranks "
                f"{self.trainer_ranks}, reward {self.reward}" + (f", {self.unused} unused" if self.unused else ""))


COLOCATED = "colocated, each GPU"
COLOCATED_SERVICES = "as services, a process per role (busiest GPU)"


def _over(memory: dict[str, float], hbm_gb: float, roles: tuple[str, ...]) -> dict[str, float]:
    return {k: v - hbm_gb * USABLE_HBM for k, v in memory.items() if k in roles and v > hbm_gb * USABLE_HBM}


def with_checkpointing_if_needed(make: Callable[[MemoryModel], Layout], mem: MemoryModel) -> Layout:
    """The layout without gradient checkpointing if it fits, else with it (the recomputation priced in)."""
    plain = make(mem)
    return plain if plain.fits else make(mem.checkpointed())


def colocated(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, gpus: int, hbm_gb: float,
              max_ranks: int) -> Layout:
    ranks = min(gpus, max_ranks)
    t = {k: s.seconds(cal, gpus if k != "train" else ranks) for k, s in st.items()}
    t["train"] *= mem.train_time_factor
    rollout = t.get("explore", 0.0) + t.get("regenerate", 0.0)
    used = mem.role("colocated", ranks)
    # as services (docker-compose.colocated.yml): a process per role on each GPU, each with its own weights, and the
    # reward service on one of them
    roles = ("explorer",) * ("explore" in st) + ("regenerator",) * ("regenerate" in st) + ("trainer", "reward")
    memory = {COLOCATED: used, COLOCATED_SERVICES: sum(mem.role(r, ranks) for r in roles)}
    over = _over(memory, hbm_gb, (COLOCATED,))
    return Layout("colocated", gpus, gpus if "explore" in st else 0, gpus if "regenerate" in st else 0, ranks, gpus,
                  {**t, "rollout": rollout}, rollout + t["train"], rollout + t["train"], memory, not over,
                  gradient_checkpointing=mem.checkpointing, over_gb=over)


def disaggregated(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, explorers: int, regenerators: int,
                  trainer_ranks: int, hbm_gb: float, unused: int = 0) -> Layout:
    t: dict[str, float] = {}
    if "explore" in st:
        t["explore"] = st["explore"].seconds(cal, explorers)
    if "regenerate" in st:
        t["regenerate"] = st["regenerate"].seconds(cal, regenerators)
    if len(t) == 2:  # streamed: the slower stage plus one prompt of the other (filling / draining the pipe)
        ex, rg = st["explore"], st["regenerate"]
        fill = rg.seconds(cal, rg.units) if t["explore"] >= t["regenerate"] else ex.seconds(cal, ex.units)
        rollout = max(t.values()) + fill
    else:
        rollout = sum(t.values())
    t["train"] = st["train"].seconds(cal, trainer_ranks) * mem.train_time_factor
    memory = {"explorer": mem.role("explorer")} if explorers else {}
    if regenerators:
        memory["regenerator"] = mem.role("regenerator")
    memory.update({"trainer": mem.role("trainer", trainer_ranks), "reward": mem.role("reward")})
    gpus = explorers + regenerators + trainer_ranks + 1 + unused
    over = _over(memory, hbm_gb, ROLES)
    return Layout("disaggregated", gpus, explorers, regenerators, trainer_ranks, 1, {**t, "rollout": rollout},
                  rollout + t["train"], max(rollout, t["train"]), memory, not over, unused,
                  gradient_checkpointing=mem.checkpointing, over_gb=over)


def disaggregated_layouts(st: dict[str, Stage], cal: Calibration, mem: MemoryModel, gpus: int, hbm_gb: float,
                          max_ranks: int, explorers: int | None = None, regenerators: int | None = None,
                          trainer_ranks: int | None = None) -> list[Layout]:
    """Every split of `gpus` - 1 (one for the reward service) over the roles with work, at most `max_ranks`
    trainer ranks (ddp.max_ranks); pinned counts stay."""
    prompts = next(iter(s.units for k, s in st.items() if k != "train"), 0)
    free = gpus - 1
    e_range = [0] if "explore" not in st else [explorers] if explorers else range(1, min(prompts, free) + 1)
    r_range = [0] if "regenerate" not in st else [regenerators] if regenerators else range(1, min(prompts, free) + 1)
    out = []
    for e in e_range:
        for r in r_range:
            rest = free - e - r
            t = trainer_ranks or min(rest, max_ranks)
            if t < 1 or rest < t:
                continue
            out.append(with_checkpointing_if_needed(
                lambda m, e=e, r=r, t=t, rest=rest: disaggregated(st, cal, m, e, r, t, hbm_gb, unused=rest - t), mem))
    return out


# -------------------------------------------------------------------- the plan

@dataclass
class Plan:
    recipe: Recipe
    gpu: str
    gpus: int
    facts: ModelFacts
    calibration: Calibration
    stage_one_gpu_s: dict[str, float]
    memory: MemoryModel
    best: Layout
    colocated: Layout | None
    disaggregated: Layout | None
    eval_s: float
    notes: list[str] = field(default_factory=list)
    pipelined: Layout | None = None     # the disaggregated split that would be best with rollout.staleness = 1

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the trainer must checkpoint activations in the chosen layout (off wherever it fits without)."""
        return self.best.gradient_checkpointing

    def role_memory(self, x: Layout | None = None) -> dict[str, dict[str, float]]:
        """GB by piece of each role's process on its GPU in layout `x` (default: the best)."""
        x = x or self.best
        mem = self.memory.checkpointed() if x.gradient_checkpointing else self.memory
        if x.kind == "colocated":
            return {"colocated": mem.parts("colocated", x.trainer_ranks)}
        roles = [r for r, n in (("explorer", x.explorers), ("regenerator", x.regenerators)) if n]
        return {r: mem.parts(r, x.trainer_ranks if r == "trainer" else 1) for r in (*roles, "trainer", "reward")}


def make_plan(cfg: RunConfig, preset: str, gpu_kind: str, gpus: int, *, layout: str = "auto",
              explorers: int | None = None, regenerators: int | None = None, trainer_ranks: int | None = None,
              cal: Calibration | None = None) -> Plan:
    """Stage times per epoch and the layout with the shortest epoch (see solrl/deploy/__init__.py)."""
    gpu = get_gpu(gpu_kind)
    cal = cal or CALIBRATION
    if gpus < 1:
        raise PlanError(f"--gpus must be at least 1, got {gpus}")
    if layout not in ("auto", "colocated", "disaggregated"):
        raise PlanError(f"layout must be auto, colocated or disaggregated, got {layout!r}")
    recipe, pc = recipe_from_config(cfg, preset, gpu)
    for name, value in (("explorers", explorers), ("regenerators", regenerators), ("trainer ranks", trainer_ranks)):
        if value is not None and value < 1:
            raise PlanError(f"{name} must be at least 1, got {value}")
    most = recipe.max_trainer_ranks
    if trainer_ranks is not None and trainer_ranks > most:
        raise PlanError(f"{trainer_ranks} trainer ranks, but an optimizer step can hold as few as {most} samples "
                        f"({recipe.ranks_rule}): every rank trains on at least one sample of every step "
                        f"(solrl/engine/data_parallel.py); use at most {most} ranks, fewer optimizer steps or more kept samples")
    if trainer_ranks is not None and trainer_ranks > gpus:
        raise PlanError(f"{trainer_ranks} trainer ranks do not fit on {gpus} GPUs")
    if explorers and not recipe.explored:
        raise PlanError(f"mode {recipe.mode} has no explore stage: drop --explorers")
    pinned = any(v is not None for v in (explorers, regenerators))
    if pinned and layout == "colocated":
        raise PlanError("--explorers / --regenerators place roles on their own GPUs: use --layout disaggregated")
    facts = _facts(cfg, pc)
    st = stages(facts, recipe, gpu)
    mem = memory_model(facts, recipe)
    hbm = gpu.hbm_gb

    colo = None
    if layout in ("auto", "colocated") and not pinned:
        if trainer_ranks is not None and trainer_ranks != min(gpus, most):
            if layout == "colocated":
                raise PlanError(f"colocated, the trainer runs on every GPU ({min(gpus, most)} ranks), not "
                                f"{trainer_ranks}")
        else:
            colo = with_checkpointing_if_needed(lambda m: colocated(st, cal, m, gpus, hbm, most), mem)
    roles = 1 + ("explore" in st) + ("regenerate" in st) + 1
    dis = []
    if layout in ("auto", "disaggregated"):
        need = (explorers or ("explore" in st)) + (regenerators or ("regenerate" in st)) + (trainer_ranks or 1) + 1
        if gpus < need:
            if layout == "disaggregated":
                raise PlanError(f"a disaggregated layout needs at least {need} GPUs here (one per role with work, "
                                f"the pinned counts, one for the reward service), got {gpus}")
        else:
            dis = disaggregated_layouts(st, cal, mem, gpus, hbm, most, explorers, regenerators, trainer_ranks)
    candidates = [x for x in [colo, *dis] if x is not None]
    if not candidates:
        raise PlanError(f"no layout of {gpus} GPUs can run this recipe ({roles} roles disaggregated)")
    fitting = [x for x in candidates if x.fits]
    if not fitting:
        raise PlanError(_memory_error(mem, recipe, gpu, candidates))
    best = min(fitting, key=lambda x: (x.epoch_s, x.kind))
    best_dis = min((x for x in dis if x.fits), key=lambda x: x.epoch_s, default=None)
    notes = list(recipe.notes)
    if colo is not None and not colo.fits:
        notes.append("colocated does not fit, even with gradient checkpointing: " + _over_text(colo))
    if colo is not None and colo.fits and colo.memory_gb[COLOCATED_SERVICES] > hbm * USABLE_HBM:
        m = mem.checkpointed() if colo.gradient_checkpointing else mem
        per = m.train_activations / m.train_micro_batch
        mb = int((hbm * USABLE_HBM - colo.memory_gb[COLOCATED_SERVICES] + m.train_activations) // per)
        notes.append(f"colocated as services (docker-compose.colocated.yml: a process per role, each with its own "
                     f"weights) needs {colo.memory_gb[COLOCATED_SERVICES]:.0f} GB on the reward's GPU, "
                     f"{hbm * USABLE_HBM:.0f} usable: run it with --set train.micro_batch={mb}" if mb >= 1 else
                     "colocated as services (a process per role) does not fit even at train.micro_batch=1: it "
                     "needs one process holding every role, as the paper")
    if dis and best_dis is None:
        notes.append("no disaggregated split fits in memory, even with gradient checkpointing: " + _over_text(dis[0]))
    if best.gradient_checkpointing:
        plain = mem.role("colocated" if best.kind == "colocated" else "trainer", best.trainer_ranks)
        notes.append(f"gradient checkpointing on: without it the trainer's GPU needs {plain:.1f} GB, "
                     f"{plain - hbm * USABLE_HBM:.2g} GB beyond the {hbm * USABLE_HBM:.1f} usable; it recomputes every "
                     f"trainable forward (training x{mem.checkpointed().train_time_factor:.2f}, priced in)")
    if colo is not None and colo.trainer_ranks < gpus:
        notes.append(f"an optimizer step can hold as few as {most} samples ({recipe.ranks_rule}): the trainer "
                     f"uses {colo.trainer_ranks} of the {gpus} GPUs")
    ev = recipe.eval_forwards * recipe.cfg_mult * facts.forward.flops / (gpu.tflops["bf16"] * 1e12) / cal.eta_rollout
    pipelined = min((x for x in dis if x.fits), key=lambda x: x.pipelined_s, default=None)
    return Plan(recipe, gpu_kind, gpus, facts, cal, {k: s.seconds(cal) for k, s in st.items()}, mem, best,
                colo if colo is not None and colo.fits else None, best_dis, ev, notes, pipelined)


def _over_text(x: Layout) -> str:
    return ", ".join(f"{k} {x.memory_gb[k]:.0f} GB, {v:.0f} GB over" for k, v in x.over_gb.items())


def _memory_error(mem: MemoryModel, recipe: Recipe, gpu: Gpu, candidates: list[Layout]) -> str:
    """Why no layout fits: per role of the closest colocated and disaggregated candidates, by how much."""
    hbm = gpu.hbm_gb
    weights = mem.denoiser + sum(mem.components.values())
    head = (f"{recipe.model} does not fit on one {gpu.name} ({hbm:.0f} GB, {hbm * USABLE_HBM:.0f} usable) in any "
            f"layout, even with gradient checkpointing: ")
    if weights > hbm * USABLE_HBM:
        return head + (f"its BF16 weights and text encoders alone take {weights:.0f} GB (sharding the model, FSDP, "
                       f"is not modelled)")
    shown = [min((c for c in candidates if c.kind == kind), key=lambda c: sum(c.over_gb.values()), default=None)
             for kind in ("colocated", "disaggregated")]
    parts = [f"{c.kind}: {_over_text(c)}" for c in shown if c is not None]
    fix = []
    ckpt = mem.checkpointed()
    mb = max(ckpt.max_train_micro_batch(hbm, colocated=False), ckpt.max_train_micro_batch(hbm, colocated=True))
    if mb < recipe.train_micro_batch:
        fix.append(f"--set train.micro_batch={mb}" if mb >= 1 else "a GPU with more memory (not even one training "
                   "sample's activations fit beside the weights)")
    if mem.role("regenerator") > hbm * USABLE_HBM or mem.role("explorer") > hbm * USABLE_HBM:
        fix.append("a smaller rollout.micro_batch")
    return head + "; ".join(parts) + (". Try " + " and ".join(fix) if fix else "")
