"""The adaptive proxy: choose the explorer's precision, explore steps and layer policy by measurement, and
keep the choice honest during the run.

`calibrate` samples `prompts` x `seeds` (training prompts, fixed seeds) with the trainer's BF16 copy at the
full rollout steps (the reference) and with every candidate proxy (FORMAT@STEPS[/POLICY]) through the
explorer's own `explore` call, and measures per prompt the Kendall tau of the proxy's rewards against the
reference's and the kept-set contrast (the reference reward of the proxy's best k/2 minus its worst k/2:
what the trainer is given). Each candidate (parsed and checked in solrl/rollout/candidates.py) costs `steps`
forwards per seed, priced by a device model (the hardware table's format costs, solrl/hardware.py):

  b200           FP4 1/4 and FP8 1/2 of a BF16 forward for the quantized share of its multiply-accumulates
  h100 / h200    FP8 1/2; no FP4 (such candidates are left out)
  cpu            the measured seconds per seed (emulation: FP4 costs more than BF16 here)

The choice is the cheapest candidate whose tau reaches the target; if none does, the one with the highest
tau (the record says so). Candidates that can run are ordered by cost into a ladder; during the run the
`ProxyController` watches the loop's per-epoch tau (on the kept seeds) and, after `patience` epochs in a row
below the target, moves one rung up. Every decision is written to metrics.jsonl and the log; the
calibration to RUN_DIR/calibration.json, which a resumed run reads back (with the controller's state from
the last kept metrics record) instead of measuring again, so a resumed run continues the same choices.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from solrl.rollout.candidates import check_proxy_config, model_cost


def _price(row: dict[str, Any], cost: float | None, target: float) -> dict[str, Any]:
    """`row` with its cost per seed on a device (None: cannot run there) and whether it meets the target."""
    tau = row["kendall_tau"]
    return {**row, "cost_per_seed": cost, "runs_on_device": cost is not None,
            "meets_target": bool(cost is not None and not math.isnan(tau) and tau >= target)}


def calibrate(sess, index: int = 0) -> dict[str, Any]:
    """Measure every candidate of `sess.cfg.rollout.proxy` against BF16 at full steps and choose (module doc).
    `index` numbers the calibrations of a run (its prompts and seeds differ from one to the next)."""
    from solrl.adapters import make_inference_copy
    from solrl.algo import kept_contrast, prompt_kendall_taus
    from solrl.models.base import compute_device
    from solrl.precision.base import layer_macs
    from solrl.precision.policy import policy_config
    from solrl.rollout.passes import explore, regenerate
    from solrl.rollout.workers import InferenceCopy

    cfg, r = sess.cfg, sess.cfg.rollout
    p = r.proxy
    cands = check_proxy_config(p, r.steps)
    model, spec = sess.model, sess.model.spec
    rng = np.random.default_rng([cfg.seed, 7919, index])
    prompts = sess.prompt_sampler(rng, p.prompts)
    seeds = rng.integers(0, 2**31 - 1, size=(len(prompts), p.seeds)).tolist()
    t0 = time.perf_counter()
    with sess.adapters.use("old"):
        rg = regenerate(model, model.transformer, prompts, seeds, r.steps, sess.sampler, sess.scorer, r.micro_batch,
                        sess.cache)
    ref = rg.rewards.reshape(len(prompts), p.seeds)
    ref_s = time.perf_counter() - t0
    merged = sess.adapters.merged_weights("old")
    plain = make_inference_copy(sess.adapters, type(sess.adapters.model), sess.adapters.model.config)
    x = torch.zeros(1, *spec.latent_shape)
    cond = sess.cache(prompts[:1])
    macs = layer_macs(plain, lambda: model.velocity(plain, x, torch.tensor([0.5]), cond))
    total = max(1, sum(macs.values()))
    rows = []
    for c in cands:
        # the model's own skips included; on a GPU the kernel the candidate's format names
        copy = InferenceCopy(sess.adapters, policy_config(c.backend, c.policy, spec, compute_device(model.transformer)))
        share = sum(macs.get(n, 0) for n in copy.backend.quantized_names) / total
        copy.sync(merged, sess.version)
        t0 = time.perf_counter()
        ex = explore(model, copy.module, prompts, seeds, c.steps, sess.sampler, sess.scorer, min(r.kept, p.seeds),
                     r.selection, torch.Generator().manual_seed(index), r.micro_batch, sess.cache)
        seconds = time.perf_counter() - t0
        taus = prompt_kendall_taus(ex.scores, ref)
        row = {"candidate": c.name, "backend": c.backend, "steps": c.steps, "policy": c.policy,
               "kendall_tau": float(np.mean(taus)) if taus else float("nan"),
               "kept_contrast": kept_contrast(ex.scores, ref, r.kept), "quantized_share": round(share, 4),
               "seconds": round(seconds, 2)}
        rows.append(_price(row, seconds / ref.size if p.device == "cpu" else model_cost(c, p.device, share), p.target))
    chosen, ladder, met = choose(rows)
    by_device = {}  # the same measurements under each GPU cost model (what a B200 or a Hopper run would pick)
    for device in ("b200", "h100"):
        alt = [_price(row, model_cost(c, device, row["quantized_share"]), p.target) for row, c in zip(rows, cands)]
        try:
            by_device[device] = choose(alt)[0]
        except ValueError:
            by_device[device] = None
    order = {c.name: i for i, c in enumerate(cands)}
    return {"index": index, "device": p.device, "target": p.target, "prompts": prompts, "seeds_per_prompt": p.seeds,
            "reference": {"backend": r.precision.backend, "steps": r.steps, "reward_mean": float(ref.mean()),
                          "seconds": round(ref_s, 2)},
            "candidates": sorted(rows, key=lambda r_: order[r_["candidate"]]), "ladder": ladder,
            "chosen": chosen, "met_target": met, "chosen_by_device": by_device,
            "cost_unit": "seconds per seed (measured)" if p.device == "cpu" else "BF16-forward equivalents per seed"}


def choose(rows: list[dict[str, Any]]) -> tuple[str, list[str], bool]:
    """(chosen candidate, ladder, whether it meets the target) from calibration rows (each with `candidate`,
    `kendall_tau`, `cost_per_seed`, `runs_on_device`, `meets_target`): the cheapest that meets the target,
    else the highest tau among those that run on the device; the ladder orders those by cost (ties keep
    the candidates' order)."""
    runnable = [r for r in rows if r["runs_on_device"]]
    if not runnable:
        raise ValueError("rollout.proxy.candidates: none can run on this device")
    ladder = [r["candidate"] for r in sorted(runnable, key=lambda r: r["cost_per_seed"])]
    meeting = [r for r in runnable if r["meets_target"]]
    if meeting:
        return min(meeting, key=lambda r: r["cost_per_seed"])["candidate"], ladder, True
    best = max(runnable, key=lambda r: -math.inf if math.isnan(r["kendall_tau"]) else r["kendall_tau"])
    return best["candidate"], ladder, False


@dataclass
class ProxyController:
    """Where on the ladder the explorer is, and how many epochs in a row its tau was below the target."""

    ladder: list[str]
    current: str
    target: float
    patience: int
    below: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)

    def observe(self, epoch: int, tau: float) -> dict[str, Any] | None:
        """One epoch's kept-seed tau; returns the switch decision when one is made (NaN taus change nothing)."""
        if tau is None or math.isnan(tau):
            return None
        self.below = self.below + 1 if tau < self.target else 0
        if self.below < self.patience:
            return None
        i = self.ladder.index(self.current)
        if i + 1 >= len(self.ladder):
            return None  # already the dearest candidate: stay (the count keeps growing, the record shows it)
        decision = {"epoch": epoch, "from": self.current, "to": self.ladder[i + 1],
                    "reason": f"kept-seed Kendall tau below {self.target} for {self.below} epochs"}
        self.current, self.below = self.ladder[i + 1], 0
        self.history.append(decision)
        return decision

    def state(self) -> dict[str, Any]:
        return {"proxy.candidate": self.current, "proxy.below_target_epochs": self.below}


def format_calibration(cal: dict[str, Any]) -> str:
    """The calibration as a table (what `solrl calibrate` prints)."""
    lines = [f"{len(cal['prompts'])} prompts x {cal['seeds_per_prompt']} seeds against {cal['reference']['backend']} at "
             f"{cal['reference']['steps']} steps; target Kendall tau {cal['target']}; costs: {cal['device']} "
             f"({cal['cost_unit']})",
             f"  {'candidate':<34}{'tau':>7}{'kept contrast':>15}{'quantized':>11}{'cost/seed':>11}  meets",
             ]
    for c in cal["candidates"]:
        cost = "n/a" if c["cost_per_seed"] is None else f"{c['cost_per_seed']:.3f}"
        lines.append(f"  {c['candidate']:<34}{c['kendall_tau']:>7.3f}{c['kept_contrast']:>15.3f}"
                     f"{c['quantized_share']:>11.1%}{cost:>11}  {'yes' if c['meets_target'] else 'no'}")
    why = "the cheapest that meets the target" if cal["met_target"] else "none meets the target: the best tau"
    lines.append(f"chosen: {cal['chosen']} ({why}); "
                 f"ladder: {' < '.join(cal['ladder'])}")
    if cal.get("chosen_by_device"):
        lines.append("with the same measurements, " + ", ".join(f"{d} costs would choose {c or 'nothing'}"
                                                              for d, c in cal["chosen_by_device"].items()))
    return "\n".join(lines)
