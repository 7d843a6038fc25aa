"""The session: everything built from a config, and one epoch of the two-stage loop on it: sync -> explore ->
select -> regenerate -> advantages -> update -> decay (the embedded loop, solrl/engine/loop.py, runs the epochs;
the queue-driven one, solrl/engine/queue_loop.py, takes the rollouts from the services instead).

All randomness of epoch e is derived from (run seed, e), so a run is reproducible and a resumed run
continues the same trajectory. What an epoch explores, keeps and regenerates is the rollout mode's strategy
(solrl/rollout/strategies.py: sol_rl and the paper's baselines, docs/method.md, as presets of the same code).
train.algo=flow_grpo samples the trained rollouts (regeneration, or the BF16 sampling of the one-stage modes)
with the SDE and records their trajectories and log-probs; exploration stays on the ODE solver.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import record_function

from solrl.adapters import LoraAdapters, LoraSpec
from solrl.algo import prompt_kendall_taus, select
from solrl.algo.guards import below_floor, demote, gate_check, is_flat
from solrl.config import ConfigError, RunConfig, apply_overrides
from solrl.engine import data_parallel as ddp
from solrl.engine.checkpoint import latest_checkpoint, load_adapters, load_rollout_adapter, saved_epochs
from solrl.engine.evaluate import eval_prompt_set, eval_scorer, evaluate
from solrl.engine.update import Batch, NFTTrainer, build_trainer
from solrl.models import load_model
from solrl.models.base import T2IModel
from solrl.precision import build_backend
from solrl.prompts import PromptSetError, load_prompt_set, prompt_sampler
from solrl.rewards import build_reward
from solrl.rollout.passes import PromptCache, SamplerSpec, explore, regenerate
from solrl.rollout.strategies import KEEP_BY_BF16, RolloutStrategy, strategy
from solrl.rollout.workers import InferenceCopy
from solrl.telemetry import read_metrics


def epoch_rng(seed: int, epoch: int, stream: int) -> tuple[np.random.Generator, torch.Generator]:
    """Independent numpy / torch generators for (run seed, epoch, stream)."""
    ss = np.random.SeedSequence([seed, epoch, stream])
    return np.random.default_rng(ss), torch.Generator().manual_seed(int(ss.generate_state(1, np.uint64)[0] >> 1))


class PhaseClock:
    """The seconds of consecutive phases, each written to `rec` when it ends (`lap`): wall seconds as
    time_<phase>_s and this process's CPU seconds summed over its threads as cpu_<phase>_s (steadier than wall time on
    a shared machine, where another process's load stretches the wall clock but not this process's work)."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self, phase: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.rec[f"time_{phase}_s"], self.rec[f"cpu_{phase}_s"] = wall - self.wall, cpu - self.cpu
        self.wall, self.cpu = wall, cpu


@dataclass
class Session:
    """Everything built from a config: model, adapters, inference copies, trainer, scorer."""

    cfg: RunConfig
    model: T2IModel
    adapters: LoraAdapters
    trainer: NFTTrainer
    explorer: InferenceCopy | None
    scorer: Any
    sampler: SamplerSpec
    cache: PromptCache
    prompts: list[str]           # prompts.train
    prompt_sampler: Any          # draws an epoch's prompts from them
    eval_prompts: list[str]      # the first eval.prompts of prompts.eval
    version: int = 0
    _eval_scorer: Any = None     # built on the first evaluation
    _references: Any = None      # monitor.reference_rewards' scorers, built with it
    # rewards the run does not train on, by name, built once at first use: the monitors' and the constrained reward's
    # (one scorer when both name the same reward)
    _untrained: dict[str, Any] = field(default_factory=dict)
    stopped: str | None = None   # why a monitor alarm ended the run early (monitor.stop)
    proxy: Any = None            # ProxyController when rollout.explore_precision.backend is "auto"
    calibrations: list | None = None
    local_explorer: bool = True  # False: the explorer services sample (the trainer tells them the proxy)
    # rollout.staleness=1: the "old" adapter as it was before the last update (version - 1), which the next
    # epoch's rollouts are sampled with; None before the first update (epoch 1 samples with version 0)
    rollout_old: list[torch.Tensor] | None = None

    @classmethod
    def build(cls, cfg: RunConfig, local_explorer: bool = True) -> Session:
        """local_explorer=False: exploration happens elsewhere (the trainer service), so no
        low-precision inference copy is built (the adaptive proxy still calibrates here, on the trainer's
        device, and names its choice in each ExploreJob)."""
        cfg._resolve_fallbacks()   # a preset's machine-dependent explorer, where the config was not validated
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model = load_model(cfg.model.name, cfg.model.path, cfg.model.device or None,
                           **cfg.model_options())  # a video model's clip options
        spec = model.spec
        if cfg.model.compile:
            model.compile_denoiser()
        if cfg.rollout.precision.backend not in ("bf16", "fp32"):
            raise ValueError(f"rollout.precision.backend must be bf16 or fp32 (the trainer's copy), "
                             f"got {cfg.rollout.precision.backend!r}")
        # The trainer's base weights carry the regenerator's precision; in the embedded mode the
        # regenerator samples with the trainer's own model (adapter "old"), sharing one weight copy.
        build_backend(cfg.rollout.precision).prepare(model.transformer)
        lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                        target_modules=tuple(cfg.lora.targets) or spec.lora_targets, init=cfg.lora.init)
        adapters = LoraAdapters(model.transformer, lora, seed=cfg.seed)
        sampler = SamplerSpec(cfg.sampler.solver or spec.default_solver,
                              cfg.sampler.shift if cfg.sampler.shift != 1.0 else spec.default_shift,
                              cfg.sampler.guidance)
        trainer = build_trainer(model, adapters, cfg, sampler.shift, sampler.guidance)
        explorer = None
        auto = cfg.rollout.explore_precision.backend == "auto"
        if local_explorer and strategy(cfg.rollout.mode).explores and not auto:
            explorer = InferenceCopy(adapters, cfg.rollout.explore_precision, spec.quant_skip, spec.quant_min_features)
        try:  # read once; a bad eval set fails now, not after epoch 1
            prompts = load_prompt_set(cfg.prompts.train)
            eval_prompts = eval_prompt_set(cfg.prompts.eval, cfg.eval.prompts)
        except PromptSetError as exc:
            raise ConfigError(f"prompts: {exc}") from None
        return cls(cfg, model, adapters, trainer, explorer, build_reward(cfg.reward), sampler,
                   PromptCache(model, cfg.rollout.prompt_cache_entries), prompts,
                   prompt_sampler(cfg.prompts.train, prompts, cfg.prompts.relation_share),
                   eval_prompts,
                   local_explorer=local_explorer)

    # ---------------------------------------------------------------- the adaptive proxy
    def setup_proxy(self, run_dir: Path, start: int, log=print) -> dict[str, Any]:
        """With backend "auto": calibrate (or, on resume, read the calibrations and the controller's state back)
        and build the explorer of the current candidate. Returns the fields for the epoch-0 record."""
        from solrl.engine.proxy import ProxyController, calibrate

        r = self.cfg.rollout
        if r.explore_precision.backend != "auto" or not self.strategy.explores:
            return {}
        path = run_dir / "calibration.json"
        p = r.proxy
        if start > 0 and path.exists():
            self.calibrations = [c for c in json.loads(path.read_text()) if c["epoch"] <= start]
            last = next((rec for rec in read_metrics(run_dir / "metrics.jsonl") if rec.get("epoch") == start), {})
            cal = self.calibrations[-1]
            self.proxy = ProxyController(cal["ladder"], last.get("proxy.candidate", cal["chosen"]), p.target,
                                         p.patience, int(last.get("proxy.below_target_epochs", 0)))
            log(f"adaptive proxy: resumed on {self.proxy.current} (calibration.json)")
        else:
            cal = {"epoch": 0, **calibrate(self, 0)}
            self.calibrations = [cal]
            self.proxy = ProxyController(cal["ladder"], cal["chosen"], p.target, p.patience)
            log(_calibration_line(cal))
        self._save_calibrations(run_dir)
        self._build_explorer()
        return {"proxy.chosen": cal["chosen"], "proxy.met_target": cal["met_target"], **self.proxy.state()}

    def _save_calibrations(self, run_dir: Path) -> None:
        (run_dir / "calibration.json").write_text(json.dumps(self.calibrations, indent=1) + "\n")

    def _build_explorer(self) -> None:
        from solrl.models.base import compute_device
        from solrl.precision.policy import policy_config
        from solrl.rollout.candidates import parse_candidate

        if not self.local_explorer:
            return  # the explorer services build it when a job names the proxy
        c = parse_candidate(self.proxy.current)
        self.explorer = InferenceCopy(self.adapters, policy_config(c.backend, c.policy, self.model.spec,
                                                                   compute_device(self.model.transformer)))

    def rollout_sampler(self) -> SamplerSpec:
        """The sampler of the trained rollouts: the ODE solver for nft; for flow_grpo the SDE at rollout.sde_eta,
        which records every step's log-prob (exploration and evaluation keep `self.sampler`)."""
        if self.cfg.train.algo == "flow_grpo":
            return SamplerSpec("sde", self.sampler.shift, self.sampler.guidance, self.cfg.rollout.sde_eta)
        return self.sampler

    @property
    def strategy(self) -> RolloutStrategy:
        """What this run's epochs explore, keep and regenerate (rollout.mode)."""
        return strategy(self.cfg.rollout.mode)

    def explore_steps(self) -> int:
        """The low-precision pass's steps: the strategy's, or the adaptive proxy's current candidate's."""
        proxy_steps = None
        if self.proxy is not None:
            from solrl.rollout.candidates import parse_candidate

            proxy_steps = parse_candidate(self.proxy.current).steps
        return self.strategy.explore_steps(self.cfg.rollout, proxy_steps)

    def after_epoch(self, done: int, rec: dict[str, Any], run_dir: Path, log=print) -> None:
        """The proxy's decisions after an epoch: a switch when the kept-seed tau stayed below the target, or a
        new calibration every `rollout.proxy.every` epochs. Recorded in `rec` (metrics.jsonl)."""
        if self.proxy is None:
            return
        from solrl.engine.proxy import ProxyController, calibrate

        p = self.cfg.rollout.proxy
        decision = self.proxy.observe(done, rec.get("proxy_kendall_tau", float("nan")))
        if decision is not None:
            rec["proxy.switch"] = decision
            log(f"adaptive proxy, epoch {done}: {decision['from']} -> {decision['to']} ({decision['reason']})")
            self._build_explorer()
        if p.every and done % p.every == 0 and done < self.cfg.epochs:
            cal = {"epoch": done, **calibrate(self, len(self.calibrations))}
            self.calibrations.append(cal)
            self._save_calibrations(run_dir)
            self.proxy = ProxyController(cal["ladder"], cal["chosen"], p.target, p.patience)
            rec["proxy.recalibrated"] = cal["chosen"]
            log(_calibration_line(cal))
            self._build_explorer()
        rec.update(self.proxy.state())

    # ---------------------------------------------------------------- pipelined epochs (rollout.staleness)
    def rollout_version(self) -> int:
        """The adapter version this epoch's rollouts are sampled with: the current one (staleness 0), or with
        rollout.staleness=1 the one before the last update (version 0 until there was one)."""
        return self.version - 1 if self.rollout_old is not None else self.version

    def keep_rollout_adapter(self) -> None:
        """Before an update (staleness 1): keep the "old" adapter the rollouts are sampled with now, for the next
        epoch's rollouts (the services mode samples them with it while the trainer trains this epoch)."""
        if self.cfg.rollout.staleness:
            self.rollout_old = [p.detach().clone() for p in self.adapters.parameters("old")]

    def resume_rollout_adapter(self, ckpt: Path, log=print) -> None:
        """staleness 1: the adapter the next epoch's rollouts are sampled with, from the checkpoint (a checkpoint of
        a staleness-0 run has none: its next epoch then samples with the current adapter, once)."""
        if not self.cfg.rollout.staleness or self.version == 0:
            return
        state = load_rollout_adapter(ckpt)
        if state is None:
            log(f"rollout.staleness=1: {ckpt} holds no rollout adapter (saved with rollout.staleness=0); the next "
                f"epoch samples with the current adapter (version {self.version})")
            return
        self.rollout_old = state

    @contextmanager
    def sampling_adapter(self):
        """Inside: the "old" adapter is the one this epoch's rollouts are sampled with (rollout_version()); the
        trainer's own is put back, bit for bit, on the way out. Nothing changes with staleness 0."""
        if self.rollout_old is None:
            yield
            return
        params = self.adapters.parameters("old")
        own = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, v in zip(params, self.rollout_old, strict=True):
                p.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(params, own, strict=True):
                    p.copy_(v)

    # ---------------------------------------------------------------- one epoch
    def sync(self) -> None:
        """Push the "old" adapter to the inference copies (merge + requantize)."""
        if self.explorer is not None:
            with record_function("solrl.sync"):
                self.explorer.sync(self.adapters.merged_weights("old"), self.rollout_version())

    def epoch(self, epoch: int, on_stage=lambda stage: None) -> dict[str, Any]:
        """One epoch; `on_stage(name)` is called as each stage starts (for a progress display)."""
        cfg, r = self.cfg, self.cfg.rollout
        rng, tgen = epoch_rng(cfg.seed, epoch, 0)
        rec: dict[str, Any] = {"epoch": epoch + 1, "adapter_version": self.rollout_version(), "mode": r.mode}
        if r.staleness:
            rec["train.adapter_version"] = self.version  # the adapter the update starts from
        with self.sampling_adapter():
            data_x0, data_r, data_p, group, data_traj, data_lp = self.rollouts(rng, tgen, rec, on_stage)

        clock = PhaseClock(rec)
        on_stage("train")
        if self.trainer.ranks.parallel:  # data-parallel: the other ranks train on this batch too (Session.follow)
            ddp.share_batch(self.trainer.ranks, epoch, tgen, data_x0, data_r, group, data_p)
        batch = Batch(data_x0, self.cache(data_p), np.asarray(data_r, dtype=np.float32), group, data_traj, data_lp)
        self.keep_rollout_adapter()
        with record_function("solrl.train"):
            rec.update(self.trainer.update(batch, tgen))
        self.version += 1
        clock.lap("train")
        for kind in ("time", "cpu"):   # evaluation is not part of an epoch
            rec[f"{kind}_epoch_s"] = sum(rec[f"{kind}_{phase}_s"] for phase in ("sync", "explore", "regenerate", "train"))
        return rec

    def rollouts(self, rng: np.random.Generator, tgen: torch.Generator, rec: dict[str, Any],
                 on_stage=lambda stage: None) -> tuple:
        """One epoch's rollouts with the "old" adapter as it is (`epoch` wraps this in `sampling_adapter`): the
        prompts and seed pools drawn from the epoch's `rng`, sync, explore, select, regenerate. Returns (x0, rewards,
        prompts, groups, trajectories, log-probs) of the trained samples; the stage metrics go into `rec`."""
        r, s = self.cfg.rollout, self.strategy
        prompts = self.prompt_sampler(rng, r.prompts_per_epoch)
        # diffusion_nft trains k seeds a prompt, the first k of the pool the other modes draw when its pool is set
        # larger (rollout.pool > kept): a run seed then gives every mode the same prompts and initial noise
        # (`solrl bench selection` pairs its arms so); with pool <= kept it draws k seeds, as before
        pool = s.pool(r)
        seeds = rng.integers(0, 2**31 - 1, size=(len(prompts), max(r.pool, pool))).tolist()
        seeds = [row[:pool] for row in seeds]
        on_stage("sync")
        clock = PhaseClock(rec)
        self.sync()
        clock.lap("sync")
        mb = r.micro_batch
        data_traj = data_lp = None

        ex = None
        if s.explores:
            on_stage("explore")
            steps = self.explore_steps()
            if self.proxy is not None:
                rec["explore.proxy"] = self.proxy.current  # the candidate this epoch explores with
            with record_function("solrl.explore"):
                ex = explore(self.model, self.explorer.module, prompts, seeds, steps, self.sampler, self.scorer,
                             r.kept, r.selection, tgen, mb, self.cache, valid=self.gate_valid())
            rec.update({"explore.reward_mean": float(ex.scores.mean()), "explore.reward_std": float(ex.scores.std()),
                        "forwards_explore": ex.forwards})
            if self.cfg.guard.gate:
                rec["guard.failed_share"] = ex.failed / max(1, ex.scores.size)
        clock.lap("explore")

        on_stage("regenerate" if s.samples_bf16 else "select")
        if not s.samples_bf16:  # naive_quant: the kept low-precision samples are trained on as they are
            kept_flat = [p * pool + i for p, idx in enumerate(ex.kept) for i in idx]
            data_x0 = ex.generated.x0[kept_flat]
            data_r = ex.scores.reshape(-1)[kept_flat]
            data_p = [prompts[j // pool] for j in kept_flat]
            group = [j // pool for j in kept_flat]
            rec["forwards_regenerate"] = 0
        else:
            regen_seeds = ex.kept_seeds() if s.regenerates else seeds
            with self.adapters.use("old"), record_function("solrl.regenerate"):
                rg = regenerate(self.model, self.model.transformer, prompts, regen_seeds, r.steps,
                                self.rollout_sampler(), self.scorer, mb, self.cache)
            rec["forwards_regenerate"] = rg.forwards
            if s.keeps == KEEP_BY_BF16:
                rs = rg.rewards.reshape(len(prompts), pool)
                valid = self.gate_valid()
                ok = valid(rg.images).reshape(len(prompts), pool) if valid is not None else None
                kept = [select(torch.from_numpy(rs[p]), r.kept, r.selection, generator=tgen,
                               valid=ok[p].tolist() if ok is not None else None)
                        for p in range(len(prompts))]
                if ok is not None:
                    rec["guard.failed_share"] = float((~ok).mean())
                flat = [p * pool + i for p, idx in enumerate(kept) for i in idx]
                rec.update({"explore.reward_mean": float(rs.mean()), "explore.reward_std": float(rs.std())})
            else:
                flat = list(range(len(rg.seeds)))
            data_x0, data_r = rg.x0[flat], rg.rewards[flat]
            if rg.trajectory is not None:  # flow_grpo: the SDE trajectories and their log-probs
                data_traj, data_lp = rg.trajectory[flat], rg.log_probs[flat]
            data_p, group = [rg.prompts[j] for j in flat], [rg.group[j] for j in flat]
            if s.regenerates:  # the kept seeds have both a proxy and a BF16 reward
                kept_proxy = np.stack([ex.scores[p][idx] for p, idx in enumerate(ex.kept)])
                rec.update(proxy_agreement(kept_proxy, rg.rewards.reshape(len(prompts), r.kept)))
        clock.lap("regenerate")
        rec["rollout.reward_mean"] = float(np.mean(data_r))
        rec["rollout.reward_std"] = float(np.std(data_r))
        by_prompt = np.asarray(data_r).reshape(len(prompts), -1)  # [P, k] trained rewards
        images = ex.generated.images[kept_flat] if not s.samples_bf16 else rg.images[flat]
        if s.selects:
            rec.update(selection_contrast(by_prompt, r.selection))
        rec.update(trained_spread(by_prompt))
        data_r = self.screen_trained(images, data_p, by_prompt, rec).reshape(-1)
        rec["forwards_rollout_total"] = rec.get("forwards_explore", 0) + rec["forwards_regenerate"]
        return data_x0, data_r, data_p, group, data_traj, data_lp

    # ---------------------------------------------------------------- guards against reward hacking (cfg.guard)
    def screen_trained(self, images: np.ndarray, prompts: list[str], by_prompt: np.ndarray,
                       rec: dict[str, Any]) -> np.ndarray:
        """What the trained rollouts' images say before the update, in the embedded loop and the services' trainer
        alike: their monitors (`rollout_monitors`) into `rec`, and the trained rewards [P, k] after the guards
        (`guard_rewards`)."""
        flat = is_flat(images)   # once: the monitors and the validity gate read it
        rec.update(rollout_monitors(images, by_prompt, flat))
        return self.guard_rewards(images, prompts, by_prompt, rec, flat)

    def reads_trained_images(self) -> bool:
        """Whether anything before the update reads the trained samples' images: a guard, or an alarm on the
        trained rollouts' blank share. The services' trainer receives latents only and decodes them for these."""
        g = self.cfg.guard
        return bool(g.gate or g.reference or self.cfg.monitor.flat_share_max)

    def gate_valid(self):
        """The validity gate's check (images -> bool, whether each passes) or None without one."""
        return gate_check(self.cfg.guard.gate)

    def untrained_scorer(self, name: str):
        """The scorer of a reward the run does not train on (a monitor's reference, the constrained reward's), built
        once."""
        if name not in self._untrained:
            self._untrained[name] = build_reward(name)
        return self._untrained[name]

    def guard_rewards(self, images: np.ndarray, prompts: list[str], by_prompt: np.ndarray,
                      rec: dict[str, Any], flat: np.ndarray | None = None) -> np.ndarray:
        """The trained rewards [P, k] after the guards (solrl/algo/guards.py): a sample that fails the gate, or whose
        reference reward is below the floor, scores as its group's lowest. Records what each guard did. `flat`: the
        images' `is_flat`, where the caller has it."""
        g = self.cfg.guard
        if not (g.gate or g.reference):
            return by_prompt
        bad = np.zeros(by_prompt.shape, dtype=bool)
        if g.gate:
            failed = (is_flat(images) if flat is None else np.asarray(flat, dtype=bool)).reshape(by_prompt.shape)
            rec["guard.gate_trained_share"] = float(failed.mean())
            bad |= failed
        if g.reference:
            scorer = self.untrained_scorer(g.reference)
            ref = np.asarray(scorer(images, list(prompts)), dtype=np.float64).reshape(by_prompt.shape)
            under = below_floor(ref, g.reference_floor)
            rec.update({"guard.reference_mean": float(ref.mean()), "guard.reference_below_share": float(under.mean())})
            bad |= under
        out, n = demote(by_prompt, bad)
        rec["guard.demoted_share"] = n / bad.size
        return out

    def follow(self, epoch: int) -> None:
        """Epoch `epoch` on a data-parallel rank > 0: rank 0's rollouts (and its generator's state), then this
        rank's share of the update. Nothing is sampled, evaluated or written here."""
        _, tgen = epoch_rng(self.cfg.seed, epoch, 0)
        x0, rewards, group, prompts = ddp.share_batch(self.trainer.ranks, epoch, tgen)
        for p in dict.fromkeys(prompts):   # one prompt per encoding, as rank 0's rollouts (generate_by_prompt)
            self.cache([p])
        self.trainer.update(Batch(x0, self.cache(prompts), rewards, group), tgen)
        self.version += 1

    def evaluate(self, steps: tuple[int, ...] | None = None, n_prompts: int | None = None,
                 seeds_per_prompt: int | None = None) -> tuple[dict[str, Any], dict[int, np.ndarray]]:
        """The EMA adapter on the held-out prompt set (`prompts.eval`) with the evaluation reward."""
        e = self.cfg.eval
        if self._eval_scorer is None:
            self._eval_scorer = eval_scorer(self.cfg, self.scorer)
            self._references = {name: self.untrained_scorer(name) for name in self.cfg.monitor.reference_rewards}
        prompts = (self.eval_prompts if not n_prompts or n_prompts == e.prompts
                   else eval_prompt_set(self.cfg.prompts.eval, n_prompts))
        with self.adapters.use("ema"):
            return evaluate(self.model, self.model.transformer, steps or e.steps, prompts,
                            seeds_per_prompt or e.seeds_per_prompt, e.seed, self.sampler, self._eval_scorer,
                            self.cfg.rollout.micro_batch, self.cache, references=self._references)


def _calibration_line(cal: dict[str, Any]) -> str:
    rows = ", ".join(f"{c['candidate']} tau {c['kendall_tau']:.2f}" for c in cal["candidates"])
    met = "meets" if cal["met_target"] else "is the best tau; none meets"
    return (f"adaptive proxy (calibration {cal['index']}, {cal['device']} costs): {rows} -> {cal['chosen']} "
            f"({met} the target {cal['target']})")


def rollout_monitors(images: np.ndarray, by_prompt: np.ndarray, flat: np.ndarray | None = None) -> dict[str, float]:
    """The trained rollouts' blank canvases (solrl/engine/monitors.py): `rollout.flat_share` over all of them and
    `rollout.best_flat_share` over each prompt's better half by reward, where a ranking that favours a hack puts it.
    `flat`: the images' `is_flat`, where the caller has it."""
    flat = (is_flat(images) if flat is None else np.asarray(flat, dtype=bool)).reshape(by_prompt.shape)
    order = np.argsort(-by_prompt, axis=1, kind="stable")[:, : max(1, by_prompt.shape[1] // 2)]
    return {"rollout.flat_share": float(flat.mean()),
            "rollout.best_flat_share": float(np.take_along_axis(flat, order, axis=1).mean())}


def selection_contrast(kept_rewards: np.ndarray, selection: str) -> dict[str, float]:
    """best_worst keeps the k/2 best by the proxy, then the k/2 worst: the BF16 rewards of each half (the
    contrast a bigger pool or a better proxy buys). {} for other selections. kept_rewards: [P, k]."""
    if selection != "best_worst" or kept_rewards.ndim != 2 or kept_rewards.shape[1] < 2:
        return {}
    h = kept_rewards.shape[1] // 2
    return {"rollout.reward_best_half": float(kept_rewards[:, :h].mean()),
            "rollout.reward_worst_half": float(kept_rewards[:, h:].mean())}


def trained_spread(rewards: np.ndarray) -> dict[str, float]:
    """What a prompt group of trained rewards ([P, k]) offers the advantages, whatever chose it: the mean within-group
    (population) std, and the mean gap between the better and the worse half of each group sorted by its own reward
    (with best_worst selection and a proxy that ranks right, the kept contrast; with no selection, what k draws
    happen to spread)."""
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        return {}
    h = rewards.shape[1] // 2
    ordered = np.sort(rewards, axis=1)
    return {"rollout.group_std": float(rewards.std(axis=1).mean()),
            "rollout.half_gap": float((ordered[:, -h:].mean(axis=1) - ordered[:, :h].mean(axis=1)).mean())}


def proxy_agreement(proxy: np.ndarray, bf16_rewards: np.ndarray) -> dict[str, float]:
    """Proxy (low precision) vs BF16 rewards on the kept seeds ([P, k] each): mean gap and mean per-prompt
    Kendall tau (the embedded loop and the services' driver alike)."""
    taus = prompt_kendall_taus(proxy, bf16_rewards)
    return {"proxy_gap": float((proxy - bf16_rewards).mean()),
            "proxy_kendall_tau": float(np.mean(taus)) if taus else float("nan")}


def load_run_for_eval(run_dir: Path, epoch: int | None = None, overrides: list[str] | None = None) -> Session:
    """A session with the run's config and the adapters of its checkpoint after `epoch` (default: the
    latest; 0: the untrained adapters, i.e. the base model), for `solrl eval`. `overrides` change the
    evaluation settings (e.g. eval.reward, prompts.eval)."""
    cfg = RunConfig.load(run_dir / "config.json")
    if overrides:
        cfg = apply_overrides(cfg, overrides).validate()
    if epoch is None:
        ckpt = run_dir if (run_dir / "adapters.safetensors").exists() else latest_checkpoint(run_dir)
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint found in {run_dir}")
    elif epoch < 0:
        raise ValueError(f"--epoch must be >= 0, got {epoch}")
    elif epoch == 0:
        ckpt = None
    else:
        ckpt = run_dir / "checkpoints" / f"epoch_{epoch:04d}"
        if not (ckpt / "adapters.safetensors").exists():
            raise FileNotFoundError(f"{run_dir} has no checkpoint of epoch {epoch}; "
                                    f"saved epochs: {saved_epochs(run_dir) or 'none'}")
    sess = Session.build(cfg)
    if ckpt is not None:
        load_adapters(ckpt, sess.adapters)
    return sess


__all__ = ["Session", "epoch_rng", "load_run_for_eval", "proxy_agreement", "selection_contrast", "trained_spread"]
