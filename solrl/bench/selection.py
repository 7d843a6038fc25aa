"""Does selection speed learning? The two links of the two-stage claim, measured apart and paired.

Every arm trains the shapes-sol-rl preset (8 prompts an epoch, k = 8 trained seeds a prompt) with one thing changed:
how the k trained seeds are chosen from a pool of n:

- `none`: no selection, the first k of the pool (diffusion_nft; nothing else is sampled);
- `random`: k of the n at random (the n sampled in BF16 at full steps, as `oracle`);
- `oracle`: the best k/2 and worst k/2 of the n by the BF16 full-step reward (naive_scaling);
- `proxy_bf16`: best / worst by a BF16 explorer at the preset's few explore steps, the kept seeds regenerated (sol_rl);
- `proxy_nvfp4`: the same with the NVFP4-emulated explorer (the preset itself);
- `proxy_fp8`: the same with an FP8 (E4M3, per-tensor current scaling) emulated explorer at 4 explore steps (the
  paper's other low-precision proxy, cheaper in steps and dearer per quantized forward than NVFP4);
- `proxy_bf16cpu`, `proxy_bf16cpu4`: the same with the real-kernel BF16 explorer (`bf16-cpu`: torch's native BF16
  kernels, on a CPU with BF16 instructions) at 6 and 4 explore steps: the arms whose seconds are the method's.

Runs are paired: run seed s draws the same prompts and the same pool of initial noises in every arm (the `none` arm
trains the first k seeds of that pool), so an arm's difference from another is read per seed and its interval is
the paired Student-t interval over seeds. Link (a), that keeping the best and worst of a larger pool teaches more per
trained sample: `oracle` - `none` (and `oracle` - `random`, the same pool without the ranking). Link (b), that the
few-step low-precision proxy keeps enough of the ranking: `proxy_nvfp4` - `oracle` (and `proxy_bf16`, `proxy_fp8` -
`oracle`).

The primary measure was fixed before the runs: the held-out exact reward (the `eval.reward`) averaged over epochs
1..E (E = 8 by default; the sum over those epochs divided by E, so it reads on the reward's scale): speed, not the
plateau. The second: the held-out reward at equal cost (B200 bound, `curve.epoch_cost`), read per run by
interpolating its curve at the smallest final cost of the arms that pay for their choice (`random` excluded: nobody
would pay for n samples to keep k at random; at k of n it costs what `none` costs, and its learning is what `none`'s
is in expectation). Per epoch the runs record what each link passes on (the mechanism): the trained groups' reward
spread (`rollout.half_gap`, the better half minus the worse half of each prompt's k trained rewards, and
`rollout.group_std`), the advantages' mean magnitude, the gradient norm, and how far the trained velocity moved from
the old adapter's (`train.drift_old`), plus the proxy's Kendall tau on the kept seeds where there is a proxy.

Measured seconds (`timed`): every run records each epoch's wall and process CPU seconds (evaluation excluded); against
naive scaling (`oracle`) each arm's rollout and end-to-end speed-ups (paired ratios), the time its mean curve takes to
reach naive scaling's final mean reward (as a share of naive scaling's time, interval by resampling the seeds) and the
reward at equal seconds. A study with a real-kernel arm writes its own files (`selection-<reward>-timed-*`).

The power calculation: from the oracle - none paired differences' spread, the number of seeds whose 95% interval has a
half-width of at most `target_half` (0.01) — how many seeds a decisive run needs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import SMALL_RUN, write_results
from solrl.bench.curve import interval, reward_settings, reward_tag, run_all, threads_per_run

PRESET = "shapes-sol-rl"
# the constrained reward's floor on the exact shapes reward: half the credit. Rendered by the world itself, a blank canvas
# scores 0, one object where a relation asks two 0.46, one circle of three 0.44, one triangle of two 0.61, an object on
# the wrong side 0.75; of the bundled base's samples (256, training prompts, 10 steps) 15% score below 0.5. A pilot
# seed at 0.25 demoted 0-9% of the trained samples and held the reference no better than the gate (docs/results.md)
CONSTRAINT_FLOOR = 0.5
# the KL guard's weight: the reference's 1e-4 weighs under 1e-7 of the loss on this bed
# (benchmarks/results/kl_beta_cpu.md), so the guard is measured at a weight where the term acts; a pilot seed at 10
# stopped the learning (below the none arm at epoch 8)
KL_GUARD = 1.0
# arm -> (settings added to the preset's, what it is)
ARMS: dict[str, tuple[list[str], str]] = {
    "none": (["rollout.mode=diffusion_nft"], "no selection: the first k seeds of the pool"),
    "random": (["rollout.mode=naive_scaling", "rollout.selection=random"], "k of the n at random"),
    "oracle": (["rollout.mode=naive_scaling"], "best/worst k of n by the BF16 full-step reward"),
    "proxy_bf16": (["rollout.explore_precision.backend=bf16"], "best/worst by a BF16 explorer at the explore steps"),
    "proxy_nvfp4": ([], "best/worst by the NVFP4-emulated explorer at the explore steps (the preset)"),
    "proxy_fp8": (["rollout.explore_precision.backend=fp8-e4m3-emu", "rollout.explore_steps=4"],
                  "best/worst by an FP8 (E4M3) emulated explorer at 4 explore steps"),
    "proxy_bf16cpu": (["rollout.explore_precision.backend=bf16-cpu"],
                      "best/worst by the real-kernel BF16 explorer (torch's native BF16 CPU kernels) at the explore steps"),
    "proxy_bf16cpu4": (["rollout.explore_precision.backend=bf16-cpu", "rollout.explore_steps=4"],
                       "best/worst by the real-kernel BF16 explorer at 4 explore steps"),
    # the guards against reward hacking (issue: selection without hacking), each on the preset's proxy arm
    "proxy_gate": (["guard.gate=flat"], "proxy_nvfp4 with the validity gate: a blank canvas is never kept as best and "
                                        "trains as its group's worst"),
    "proxy_constrained": (["guard.reference=shapes", f"guard.reference_floor={CONSTRAINT_FLOOR}"],
                          f"proxy_nvfp4 with the constrained reward: a trained sample whose exact shapes reward is below "
                          f"{CONSTRAINT_FLOOR} trains as its group's worst"),
    "proxy_prompt_std": (["train.adv_std=prompt"], "proxy_nvfp4 with each prompt group's own reward std in the advantages "
                                                   "(per-prompt normalisation)"),
    "proxy_kl": ([f"train.kl_beta={KL_GUARD}"], f"proxy_nvfp4 with the KL term to the base at kl_beta {KL_GUARD:g}"),
}
# the arms run when --arms is not given (the guards are asked for by name: they need a reward other than shapes)
DEFAULT_ARMS = ("none", "random", "oracle", "proxy_bf16", "proxy_nvfp4", "proxy_fp8", "proxy_bf16cpu", "proxy_bf16cpu4")
GUARD_ARMS = ("proxy_gate", "proxy_constrained", "proxy_prompt_std", "proxy_kl")
# the arm the guards are measured against: the preset's proxy without a guard
GUARDED = "proxy_nvfp4"
# the arms whose explorer runs real low-precision kernels here: their seconds are the method's, not an emulation's
REAL_KERNEL_ARMS = ("proxy_bf16cpu", "proxy_bf16cpu4")
# the timed comparison's reference: naive scaling, the whole pool sampled at full steps in high precision (`oracle`)
TIMED_REFERENCE = "oracle"
# (arm, minus arm, what the difference tests)
LINKS = [("oracle", "none", "link (a): selection by the true reward against no selection"),
         ("oracle", "random", "link (a): the ranking itself (the same pool, chosen at random)"),
         ("random", "none", "control: random k of n against the first k (should be 0)"),
         ("proxy_nvfp4", "oracle", "link (b): the NVFP4 few-step proxy against the oracle's choice"),
         ("proxy_bf16", "oracle", "link (b): a BF16 few-step proxy against the oracle's choice"),
         ("proxy_fp8", "oracle", "link (b): an FP8 4-step proxy against the oracle's choice"),
         ("proxy_bf16cpu", "oracle", "link (b): the real-kernel BF16 proxy against the oracle's choice"),
         ("proxy_bf16cpu4", "oracle", "link (b): the real-kernel BF16 proxy at 4 steps against the oracle's choice"),
         ("proxy_nvfp4", "none", "the whole two-stage loop against no selection"),
         ("proxy_bf16cpu", "none", "the whole two-stage loop, real-kernel explorer, against no selection"),
         *((g, GUARDED, f"what the guard costs the proxy's learning ({g})") for g in GUARD_ARMS)]
MECHANISM = ("rollout.half_gap", "rollout.group_std", "train.advantage_abs_mean", "train.grad_norm", "train.drift_old",
             "proxy_kendall_tau", "rollout.best_flat_share", "guard.demoted_share", "train.kl")


def paired(a: list[float], b: list[float]) -> dict[str, Any]:
    """mean(a - b) over paired seeds with its 95% Student-t half-width (None with one pair) and the differences."""
    d = [x - y for x, y in zip(a, b)]
    mean, half = interval(d)
    return {"mean": round(mean, 4), "ci95": None if math.isnan(half) else round(half, 4),
            "sd": round(float(np.std(d, ddof=1)), 4) if len(d) > 1 else None, "diffs": [round(x, 4) for x in d]}


def seeds_for(sd: float, target_half: float = 0.01, most: int = 1000) -> int | None:
    """The fewest paired seeds n >= 2 whose 95% t interval half-width t(0.975, n-1) sd / sqrt(n) is <= target_half
    (None beyond `most`)."""
    from scipy import stats

    for n in range(2, most + 1):
        if stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= target_half:
            return n
    return None


def parse_arms(arms: tuple[str, ...], repeats: int) -> dict[str, int]:
    """{arm: run seeds} from "name" (`repeats` seeds) or "name:N" (the first N of them: a pilot arm run on fewer
    seeds; its differences pair over the seeds both arms ran)."""
    out: dict[str, int] = {}
    for item in arms:
        name, _, count = item.partition(":")
        if name not in ARMS:
            raise ValueError(f"--arms: unknown arm {name!r}; available: {sorted(ARMS)}")
        try:
            n = int(count) if count else repeats
        except ValueError:
            raise ValueError(f"--arms: {item!r}: the seed count after ':' must be an integer") from None
        if not 1 <= n <= repeats:
            raise ValueError(f"--arms: {item!r}: the seed count must be between 1 and --repeats ({repeats})")
        out[name] = n
    if not out:
        raise ValueError(f"--arms: no arm given; available: {sorted(ARMS)}")
    return out


def mechanism(run_dir: Path) -> dict[str, list[float | None]]:
    """Per trained epoch (1, 2, ...), the MECHANISM figures a run recorded (None where it has none)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["epoch"] > 0]
    return {k: [r.get(k) for r in recs] for k in MECHANISM}


def _term(point: dict[str, Any], term: str) -> float | None:
    """A weighted reward's term `term` (unweighted) at an evaluated point; None where the run did not record it."""
    return (point.get("components") or {}).get(term)


def primary(run: dict[str, Any], last: int, term: str | None = None) -> float:
    """The run's held-out reward (or a weighted reward's `term`) averaged over its evaluated epochs 1..last."""
    vals = [p["reward"] if term is None else _term(p, term) for p in run["points"] if 1 <= p["epoch"] <= last]
    if len(vals) != last or any(v is None for v in vals):
        what = "held-out reward" if term is None else f"term {term!r}"
        raise ValueError(f"the primary measure needs the {what} at every epoch 1..{last}; got {len(vals)}")
    return float(np.mean(vals))


def run(out: Path, small: bool = False, epochs: int | None = None, seed: int = 0, reward: str | None = None,
        repeats: int | None = None, jobs: int = 1, threads: int = 0, arms: tuple[str, ...] | None = None,
        pools: tuple[int, ...] | None = None, overrides: tuple[str, ...] = (), target_half: float = 0.01,
        extend: str | None = None) -> dict[str, Any]:
    """`repeats` run seeds (seed, seed+1, ...) per arm and pool size, `jobs` runs at once on `threads` torch threads
    each; finished runs under `out` with the same settings are reused (a study continues where it stopped).
    `extend`: an earlier result of this bench with the same settings (e.g. a committed one, whose run directories are
    gone); its runs are taken as done, so only the seeds, arms and pools it lacks are trained."""
    n_seeds = repeats or (2 if small else 3)
    counts = parse_arms(arms or DEFAULT_ARMS, n_seeds)
    chosen = tuple(counts)
    n_epochs = epochs or (2 if small else 8)
    sizes = tuple(pools or ((6,) if small else (16,)))
    kept = 4 if small else 8
    if any(n <= kept for n in sizes):
        raise ValueError(f"--pools: every pool must be larger than the {kept} kept seeds, got {list(sizes)}")
    sets = [f"epochs={n_epochs}", "eval.every=1", "tensorboard=false", f"rollout.kept={kept}"]
    sets += reward_settings(reward)
    name = f"selection-{reward_tag(reward)}" if reward and reward != "shapes" else "selection"
    if not small and any(a in REAL_KERNEL_ARMS for a in chosen):  # a timed study: its own files
        name += "-timed"
    if not small and any(a in GUARD_ARMS for a in chosen):  # a guards study: its own files
        name += "-guards"
    if not small and sizes != (16,):  # another pool study than the default gets its own files beside the default's
        name += "-n" + "-".join(map(str, sizes))
    if not small and n_epochs != 8:  # a longer (or shorter) study than the default 8 epochs: its own files too
        name += f"-e{n_epochs}"
    if small:
        sets += SMALL_RUN
    per_run = threads_per_run(jobs, threads)
    if per_run:
        sets.append(f"threads={per_run}")
    sets += list(overrides)
    from solrl.config import apply_overrides, get_preset

    for arm in chosen:  # refused now, not in a worker after other runs started
        apply_overrides(get_preset(PRESET), sets + ARMS[arm][0] + [f"rollout.pool={sizes[0]}"]).validate()
    effective = apply_overrides(get_preset(PRESET), list(sets))
    trained_on, judge = effective.reward, effective.eval.reward or effective.reward
    plan = [(arm, n, s, sets + ARMS[arm][0] + [f"rollout.pool={n}", f"seed={s}"],
             out / f"{name}_runs" / f"{arm}_n{n}_seed{s}")
            for n in sizes for s in range(seed, seed + n_seeds) for arm in chosen
            if s < seed + counts[arm]]  # seed-major: a stopped study has whole seeds to pair, and a rerun with fewer
    # --repeats reuses them
    earlier, source = _earlier(Path(extend), sets) if extend else ({}, None)
    todo = [p for p in plan if (f"n{p[1]}", p[0], p[2]) not in earlier]
    fresh = iter(run_all([(PRESET, p[3], p[4]) for p in todo], jobs))
    last = n_epochs
    table: dict[str, Any] = {}
    for arm, n, s, _, run_dir in plan:
        entry = table.setdefault(f"n{n}", {}).setdefault(arm, {"runs": []})
        record = earlier.get((f"n{n}", arm, s))
        if record is None:  # trained now: the runs in `todo`, in plan order
            res = next(fresh)
            record = {"seed": s, **res, "primary": round(primary(res, last), 4), "mechanism": mechanism(run_dir)}
        entry["runs"].append(record)
    pools_out = {key: summarise(arms_, last) for key, arms_ in table.items()}
    result = {"preset": PRESET, "arms": {a: ARMS[a][1] for a in chosen}, "seeds_per_arm": counts,
              "pools": list(sizes), "kept": kept,
              "epochs": n_epochs, "primary_epochs": [1, last], "seeds": list(range(seed, seed + n_seeds)),
              "reward": trained_on, "eval_reward": judge, "settings": sets, "jobs": jobs, "threads_per_run": per_run,
              "target_half": target_half, "by_pool": pools_out}
    if source is not None:
        reused = [f"{arm}_n{n}_seed{s}" for arm, n, s, _, _ in plan if (f"n{n}", arm, s) in earlier]
        result["extended_from"] = [*source.get("extended_from", []),
                                   {"file": Path(extend).name, "machine": source.get("machine"), "runs": reused}]
    plot(pools_out, out / f"{name}.png", judge)
    return write_results(out, name, result, markdown(result, name))


def _earlier(path: Path, sets: list[str]) -> tuple[dict[tuple[str, str, int], dict[str, Any]], dict[str, Any]]:
    """The runs of an earlier selection result by (pool key, arm, run seed), and the result itself; a clear error
    unless it was measured with the same preset and settings (runs set otherwise are not comparable)."""
    try:
        old = json.loads(path.read_text())
        pools = old["by_pool"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"--extend: cannot read a selection result from {path}: {exc}") from None
    theirs = {"preset": old.get("preset"), "settings": old.get("settings")}
    if theirs != {"preset": PRESET, "settings": sets}:
        raise ValueError(f"--extend: {path} was measured with other settings: {theirs['settings']} (now: {sets})")
    return {(key, arm, r["seed"]): r for key, pool in pools.items() for arm, a in pool["arms"].items()
            for r in a["runs"]}, old


def summarise(arms: dict[str, Any], last: int) -> dict[str, Any]:
    """Per arm: the primary measure and final reward over seeds, per-epoch means, the mechanism's per-epoch means;
    then the paired differences of LINKS, at equal cost too, the power calculation and the cost to reach none's
    final reward."""
    for arm in arms.values():
        runs = arm["runs"]
        arm["primary"] = dict(zip(("mean", "ci95"), _round(*interval([r["primary"] for r in runs]))))
        epochs = [p["epoch"] for p in runs[0]["points"]]
        arm["epochs"] = epochs
        arm["reward_by_epoch"] = [round(float(np.mean([r["points"][i]["reward"] for r in runs])), 4)
                                  for i in range(len(epochs))]
        arm["final"] = dict(zip(("mean", "ci95"), _round(*interval([r["points"][-1]["reward"] for r in runs]))))
        arm["cost_per_epoch"] = float(np.mean([r["cost_per_epoch"] for r in runs]))
        arm["mechanism"] = {k: _epoch_means([r["mechanism"].get(k) or [None] * len(epochs[1:]) for r in runs])
                            for k in MECHANISM}  # runs recorded before a figure was kept lack it
        # blank canvases and a weighted reward's terms, per epoch (runs recorded before these were kept lack them)
        arm["flat_share_by_epoch"] = _epoch_means([[p.get("flat_share") for p in r["points"]] for r in runs])
        arm["flat_share_seeds"] = [r["seed"] for r in runs if any(p.get("flat_share") is not None for p in r["points"])]
        arm["duplicate_share_by_epoch"] = _epoch_means([[p.get("duplicate_share") for p in r["points"]] for r in runs])
        refs = sorted({c for r in runs for p in r["points"] for c in (p.get("ref") or {})})
        if refs:   # the monitors' reference rewards (monitor.reference_rewards), never trained on
            arm["ref_by_epoch"] = {c: _epoch_means([[(p.get("ref") or {}).get(c) for p in r["points"]] for r in runs])
                                   for c in refs}
        terms = sorted({c for r in runs for p in r["points"] for c in (p.get("components") or {})})
        if terms:
            arm["terms_by_epoch"] = {c: _epoch_means([[_term(p, c) for p in r["points"]] for r in runs]) for c in terms}
    out: dict[str, Any] = {"arms": arms, "links": [], "at_equal_cost": None}
    for a, b, what in LINKS:
        if a in arms and b in arms:
            ra, rb = _common(arms[a]["runs"], arms[b]["runs"])
            seeds = [r["seed"] for r in ra]
            out["links"].append({"a": a, "b": b, "what": what, "seeds": seeds,
                                 **paired([r["primary"] for r in ra], [r["primary"] for r in rb])})
            for term in arms[a].get("terms_by_epoch", {}):  # each term of a weighted reward, paired the same way
                out.setdefault("term_links", []).append(
                    {"a": a, "b": b, "term": term, "seeds": seeds,
                     **paired([primary(r, last, term) for r in ra], [primary(r, last, term) for r in rb])})
    priced = [k for k in arms if k != "random"]
    if len(priced) > 1:
        budget = min(arms[k]["runs"][0]["points"][-1]["cost_bf16_fwd"] for k in priced)
        at = {k: {r["seed"]: float(np.interp(budget, [p["cost_bf16_fwd"] for p in r["points"]],
                                             [p["reward"] for p in r["points"]])) for r in arms[k]["runs"]} for k in priced}
        links = []
        for a, b, _ in LINKS:
            if a in at and b in at:
                both = [s for s in at[a] if s in at[b]]
                links.append({"a": a, "b": b, "seeds": both, **paired([at[a][s] for s in both], [at[b][s] for s in both])})
        out["at_equal_cost"] = {"cost_bf16_fwd": round(budget, 1), "links": links,
                                "reward": {k: dict(zip(("mean", "ci95"), _round(*interval(list(v.values())))))
                                           for k, v in at.items()}}
    pilot = next((x for x in out["links"] if (x["a"], x["b"]) == ("oracle", "none")), None)
    if pilot and pilot["sd"] is not None:
        out["power"] = {"sd_oracle_minus_none": pilot["sd"], "seeds_run": len(pilot["diffs"]),
                        "seeds_for_half_0.01": seeds_for(pilot["sd"]) if pilot["sd"] > 0 else 2}
    out["guards"] = guards(arms)
    out["timed"] = timed(arms)
    for arm in arms.values():
        runs = [r for r in arm["runs"] if "seconds" in r]
        if runs:
            arm["seconds_per_epoch"] = {k: round(float(np.mean([r["seconds"][k] for r in runs])) / last, 2)
                                        for k in runs[0]["seconds"]}
    if "none" in arms:
        target = arms["none"]["reward_by_epoch"][-1]
        for k in priced:
            arm = arms[k]
            costs = np.mean([[p["cost_bf16_fwd"] for p in r["points"]] for r in arm["runs"]], axis=0)
            hit = next((i for i, (e, rew) in enumerate(zip(arm["epochs"], arm["reward_by_epoch"])) if e > 0 and rew >= target),
                       None)
            arm["cost_to_none_final"] = round(float(costs[hit]), 1) if hit is not None else None
            arm["epochs_to_none_final"] = arm["epochs"][hit] if hit is not None else None
    return out


def _at_last(ra: list[dict[str, Any]], rb: list[dict[str, Any]], get) -> dict[str, Any] | None:
    """`get(point)` at the last evaluated epoch of paired runs: arm a's mean and the paired difference a - b; None where
    a run did not record it."""
    a, b = [get(r["points"][-1]) for r in ra], [get(r["points"][-1]) for r in rb]
    if any(v is None for v in a + b):
        return None
    return {"value": round(float(np.mean(a)), 4), **paired(a, b)}


def retained(guard: list[float], unguarded: list[float], base: list[float], resamples: int = 2000,
             seed: int = 0) -> dict[str, Any]:
    """The share of selection's gain a guard keeps: mean(guard - base) / mean(unguarded - base) over paired seeds, with a
    95% percentile interval from resampling the seeds (None where a resample's unguarded gain is not positive)."""
    g, u, b = (np.asarray(x, dtype=np.float64) for x in (guard, unguarded, base))

    def share(idx: np.ndarray) -> float:
        gain = float((u[idx] - b[idx]).mean())
        return float((g[idx] - b[idx]).mean()) / gain if gain > 0 else math.nan

    point = share(np.arange(len(g)))
    out: dict[str, Any] = {"share": None if math.isnan(point) else round(point, 4)}
    if len(g) > 1:
        rng = np.random.default_rng(seed)
        boots = np.array([share(rng.integers(0, len(g), len(g))) for _ in range(resamples)])
        boots = boots[~np.isnan(boots)]
        if len(boots):
            out["ci95"] = [round(float(x), 4) for x in np.percentile(boots, [2.5, 97.5])]
    return out


def guards(arms: dict[str, Any]) -> dict[str, Any] | None:
    """Each guard arm (and the unguarded proxy and the oracle) against `none` on the seeds both ran: the gain on the
    trained reward (primary measure), the share of the unguarded proxy's gain it keeps, the reference reward and the
    held-out blank share at the last epoch, each a paired difference; and the goal: >= 80% of the gain kept while the
    reference reward is not below none's (its interval reaches 0) and the blank share is within 1 point of none's."""
    if "none" not in arms or GUARDED not in arms:
        return None
    chosen = [a for a in ("oracle", GUARDED, *GUARD_ARMS) if a in arms]
    if not any(a in GUARD_ARMS for a in chosen):
        return None
    refs = sorted(arms["none"].get("ref_by_epoch", {}))
    out: dict[str, Any] = {"reference": refs, "arms": {}}
    for a in chosen:
        seeds = {r["seed"] for r in arms[a]["runs"]} & {r["seed"] for r in arms["none"]["runs"]} \
            & {r["seed"] for r in arms[GUARDED]["runs"]}
        pick = {k: sorted((r for r in arms[k]["runs"] if r["seed"] in seeds), key=lambda r: r["seed"])
                for k in (a, "none", GUARDED)}
        ra, rn, rp = pick[a], pick["none"], pick[GUARDED]
        row: dict[str, Any] = {"seeds": sorted(seeds),
                               "gain": paired([r["primary"] for r in ra], [r["primary"] for r in rn]),
                               "kept_share": retained([r["primary"] for r in ra], [r["primary"] for r in rp],
                                                      [r["primary"] for r in rn])}
        flat = _at_last(ra, rn, lambda p: p.get("flat_share"))
        if flat is not None:
            row["flat_final"] = flat
        at_last = {c: _at_last(ra, rn, lambda p, c=c: (p.get("ref") or {}).get(c)) for c in refs}
        row["ref_final"] = {c: x for c, x in at_last.items() if x is not None}
        row["goal"] = guard_goal(row) if a in GUARD_ARMS else None
        out["arms"][a] = row
    return out


def guard_goal(row: dict[str, Any]) -> dict[str, Any]:
    """Whether a guard arm meets the goal, part by part (None where the part was not measured)."""
    share = row["kept_share"]["share"]
    refs = row["ref_final"].values()
    flat = row.get("flat_final")

    def not_below(x: dict[str, Any]) -> bool:   # the paired interval reaches 0 or above, or a single pair's mean does
        return x["mean"] + (x["ci95"] or 0.0) >= 0

    parts = {"gain_kept": None if share is None else share >= 0.8,
             "reference_held": all(not_below(x) for x in refs) if refs else None,
             "blank_within_1pt": None if flat is None else flat["mean"] <= 0.01}
    return {**parts, "met": all(v is True for v in parts.values())}


def ratio(num: list[float], den: list[float]) -> dict[str, Any]:
    """The paired ratios num / den over seeds: their geometric mean and its 95% interval (a Student-t interval on the
    log ratios, taken back), and the ratios."""
    logs = [math.log(a / b) for a, b in zip(num, den)]
    mean, half = interval(logs)
    out = {"mean": round(math.exp(mean), 4), "ratios": [round(math.exp(x), 4) for x in logs]}
    if not math.isnan(half):
        out["ci95"] = [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)]
    return out


def reach_time(points: list[dict[str, Any]], target: float, key: str) -> float | None:
    """The measured seconds (`key`: wall_s or cpu_s) at which a reward curve first reaches `target`, interpolated
    linearly between evaluated epochs; None if it never does."""
    for p0, p1 in zip(points, points[1:]):
        if p1["reward"] >= target:
            if p0["reward"] >= target:
                return p0[key]
            return p0[key] + (target - p0["reward"]) / (p1["reward"] - p0["reward"]) * (p1[key] - p0[key])
    return None


def reach_share(ra: list[dict[str, Any]], rb: list[dict[str, Any]], key: str, resamples: int = 2000,
                seed: int = 0) -> dict[str, Any]:
    """How long arm a's mean curve (reward and seconds averaged over its runs, epoch by epoch) takes to reach arm b's
    final mean reward, as a share of b's mean seconds to its final epoch; a 95% percentile interval from resampling
    the paired seeds (a resample whose curve never reaches the target counts as beyond every share)."""
    rew_a = np.array([[p["reward"] for p in r["points"]] for r in ra])
    sec_a = np.array([[p[key] for p in r["points"]] for r in ra])
    final_b = np.array([r["points"][-1]["reward"] for r in rb])
    sec_b = np.array([r["points"][-1][key] for r in rb])

    def share(idx: np.ndarray) -> float:
        pts = [{"reward": w, key: t} for w, t in zip(rew_a[idx].mean(0), sec_a[idx].mean(0))]
        t = reach_time(pts, float(final_b[idx].mean()), key)
        return math.inf if t is None else t / float(sec_b[idx].mean())

    point = share(np.arange(len(ra)))
    rng = np.random.default_rng(seed)
    boots = np.array([share(rng.integers(0, len(ra), len(ra))) for _ in range(resamples)]) if len(ra) > 1 else None
    out: dict[str, Any] = {"share": None if math.isinf(point) else round(point, 4)}
    if boots is not None:
        lo, hi = np.percentile(boots, [2.5, 97.5], method="inverted_cdf")   # no interpolation: inf stays inf
        out.update({"ci95": [None if math.isinf(lo) else round(float(lo), 4), None if math.isinf(hi) else round(float(hi), 4)],
                    "unreached_resamples": round(float(np.mean(np.isinf(boots))), 4)})
    return out


def timed(arms: dict[str, Any]) -> dict[str, Any] | None:
    """Measured seconds against the timed reference (naive scaling, `oracle`), per arm over the seeds both ran with
    their seconds recorded (evaluation excluded): the rollout and end-to-end speed-ups (reference seconds / arm seconds,
    paired ratios), the time the arm's mean curve takes to reach the reference's final mean reward as a share of the
    reference's time, and the held-out reward at equal seconds (each run's curve read at the smaller of the two arms'
    mean final times, paired). CPU seconds are this run's process time: with one thread a run, what it takes on an
    idle core; wall seconds beside them."""
    ref = arms.get(TIMED_REFERENCE)
    timed_runs = {k: [r for r in a["runs"] if "seconds" in r and all("cpu_s" in p for p in r["points"])]
                  for k, a in arms.items()}
    if ref is None or not timed_runs[TIMED_REFERENCE]:
        return None
    out: dict[str, Any] = {"reference": TIMED_REFERENCE, "arms": {}}
    for k in arms:
        if k in (TIMED_REFERENCE, "random") or not timed_runs[k]:
            continue
        ra, rb = _common(timed_runs[k], timed_runs[TIMED_REFERENCE])
        if not ra:
            continue
        row: dict[str, Any] = {"seeds": [r["seed"] for r in ra]}
        for kind in ("cpu", "wall"):
            for what in ("rollout", "epoch"):
                row[f"speedup_{what}_{kind}"] = ratio([b["seconds"][f"{kind}_{what}"] for b in rb],
                                                      [a["seconds"][f"{kind}_{what}"] for a in ra])
            key = f"{kind}_s"
            row[f"reach_{kind}"] = reach_share(ra, rb, key)
            # the reference's reward one epoch before its last: a level an arm a little behind per epoch can reach
            # within its own epochs (the final one may lie past them)
            row[f"reach_{kind}_before_last"] = reach_share(ra, [dict(r, points=r["points"][:-1]) for r in rb], key)
            # and the reference's reward at each evaluated epoch: with arms run past the epoch a goal names (naive
            # scaling's epoch-8 reward, say), the time to reach it read off the same runs
            row[f"reach_{kind}_by_epoch"] = {
                str(e): reach_share(ra, [dict(r, points=[p for p in r["points"] if p["epoch"] <= e]) for r in rb], key)
                for e in [p["epoch"] for p in rb[0]["points"]] if e > 0}
            budget = min(np.mean([r["points"][-1][key] for r in ra]), np.mean([r["points"][-1][key] for r in rb]))
            at = [[float(np.interp(budget, [p[key] for p in r["points"]], [p["reward"] for p in r["points"]]))
                   for r in runs] for runs in (ra, rb)]
            row[f"at_equal_{kind}"] = {"seconds": round(float(budget), 1), **paired(*at)}
        out["arms"][k] = row
    return out or None


def _seeds(seeds: list[int]) -> str:
    """Run seeds as ranges: [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for s in sorted(seeds):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _common(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs of two arms on the run seeds both have, in seed order (the pairs)."""
    sb = {r["seed"]: r for r in b}
    ra = [r for r in a if r["seed"] in sb]
    return ra, [sb[r["seed"]] for r in ra]


def _round(mean: float, half: float) -> tuple[float, float | None]:
    return round(mean, 4), None if math.isnan(half) else round(half, 4)


def _epoch_means(series: list[list[float | None]]) -> list[float | None]:
    """Per epoch, the mean over runs of the recorded values (None where no run recorded one)."""
    out = []
    for vals in zip(*series):
        got = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
        out.append(round(float(np.mean(got)), 6) if got else None)
    return out


def verdict(link: dict[str, Any]) -> str:
    if link["ci95"] is None:
        return "one seed: no interval"
    lo, hi = link["mean"] - link["ci95"], link["mean"] + link["ci95"]
    if lo > 0:
        return f"{link['a']} is higher (interval [{lo:+.3f}, {hi:+.3f}])"
    if hi < 0:
        return f"{link['b']} is higher (interval [{lo:+.3f}, {hi:+.3f}])"
    return f"not resolved: the interval [{lo:+.3f}, {hi:+.3f}] holds 0"


def plot(by_pool: dict[str, Any], path: Path, reward: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(by_pool), 4, figsize=(17, 3.6 * len(by_pool)), dpi=100, squeeze=False)
    for row, (key, pool) in zip(axes, by_pool.items()):
        arms = pool["arms"]
        none = arms.get("none")
        for i, (arm, a) in enumerate(arms.items()):
            kw = {"color": f"C{i}", "label": arm, "marker": "o", "ms": 3}
            row[0].plot(a["epochs"], a["reward_by_epoch"], **kw)
            if none is not None and arm != "none":  # paired difference per epoch, mean and 95% interval
                ra, rn = _common(a["runs"], none["runs"])
                d = [[r["points"][j]["reward"] - n["points"][j]["reward"] for r, n in zip(ra, rn)]
                     for j in range(len(a["epochs"]))]
                m, h = np.array([interval(x) for x in d]).T
                h = np.nan_to_num(h)
                row[1].plot(a["epochs"], m, **kw)
                row[1].fill_between(a["epochs"], m - h, m + h, color=f"C{i}", alpha=0.12)
            ep = list(range(1, len(a["mechanism"]["rollout.half_gap"]) + 1))
            for ax, k in ((row[2], "rollout.half_gap"), (row[3], "train.grad_norm")):
                ax.plot(ep, [np.nan if v is None else v for v in a["mechanism"][k]], **kw)
        row[0].set_ylabel(f"{key}: held-out {reward} (mean)")
        row[1].set_ylabel("minus none (paired, 95% CI)")
        row[1].axhline(0, color="k", lw=0.6)
        row[2].set_ylabel("trained groups' half gap")
        row[3].set_ylabel("gradient norm")
        for ax in row:
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _ci(x: dict[str, Any]) -> str:
    return f"{x['mean']:+.4f} ± {x['ci95']:.4f}" if x.get("ci95") is not None else f"{x['mean']:+.4f}"


def _val(x: dict[str, Any]) -> str:
    return f"{x['mean']:.3f} ± {x['ci95']:.3f}" if x.get("ci95") is not None else f"{x['mean']:.3f}"


def markdown(r: dict[str, Any], name: str) -> str:
    lines = [f"Trained on `{r['reward']}`, judged with `{r['eval_reward']}` on the held-out prompts every epoch; preset "
             f"`{r['preset']}`, k = {r['kept']} trained seeds a prompt, pools {r['pools']}, {r['epochs']} epochs, paired run "
             f"seeds {r['seeds']} (each seed: the same prompts and pool of noises in every arm). Primary measure, fixed "
             f"before the runs: the held-out reward averaged over epochs {r['primary_epochs'][0]}-{r['primary_epochs'][1]}. "
             f"Intervals: 95% Student-t over seeds (paired for differences). Plot `{name}.png`. Arms:", ""]
    lines += [f"- `{a}` ({r['seeds_per_arm'][a]} seeds): {text}" for a, text in r["arms"].items()]
    seen: set[str] = set()
    for src in r.get("extended_from", []):  # each earlier result names the runs that were new in it
        m = src.get("machine") or {}
        new = [x for x in src["runs"] if x not in seen]
        seen.update(new)
        if new:
            lines += ["", f"Runs {', '.join(new)} are read from an earlier `{src['file']}` (same settings; measured "
                          f"{m.get('date', 'at an unrecorded date')} on {m.get('cpu', 'an unrecorded machine')}), not trained "
                          "again."]
    for key, pool in r["by_pool"].items():
        arms = pool["arms"]
        lines += ["", f"## Pool {key[1:]}", "",
                  "| arm | primary (mean ep. 1-E) | final reward | cost / epoch (BF16 fwd eq.) | epochs to none's final | "
                  "cost to reach it |", "|---|---|---|---|---|---|"]
        for a, x in arms.items():
            reach = x.get("epochs_to_none_final")
            lines.append(f"| {a} | {_val(x['primary'])} | {_val(x['final'])} | {x['cost_per_epoch']:.0f} | "
                         f"{reach if reach is not None else '-'} | "
                         f"{x['cost_to_none_final'] if x.get('cost_to_none_final') is not None else '-'} |")
        epochs = next(iter(arms.values()))["epochs"]
        lines += ["", "Held-out reward per epoch, mean over seeds:", "",
                  "| arm | " + " | ".join(map(str, epochs)) + " |", "|---|" + "---|" * len(epochs)]
        lines += [f"| {a} | " + " | ".join(f"{v:.3f}" for v in x["reward_by_epoch"]) + " |" for a, x in arms.items()]
        lines += ["", "Paired differences of the primary measure:", "",
                  "| difference | tests | mean ± 95% | per seed | verdict |", "|---|---|---|---|---|"]
        for link in pool["links"]:
            lines.append(f"| {link['a']} - {link['b']} | {link['what']} | {_ci(link)} ({len(link['diffs'])} pairs) | "
                         f"{', '.join(f'{d:+.3f}' for d in link['diffs'])} | {verdict(link)} |")
        if pool.get("term_links"):
            lines += ["", "The weighted reward's terms (each unweighted, its mean over epochs 1-E), paired:", "",
                      "| difference | term | mean ± 95% | per seed | verdict |", "|---|---|---|---|---|"]
            lines += [f"| {x['a']} - {x['b']} | `{x['term']}` | {_ci(x)} | {', '.join(f'{d:+.3f}' for d in x['diffs'])} "
                      f"| {verdict(x)} |" for x in pool["term_links"]]
        flat = {a: x["flat_share_by_epoch"] for a, x in arms.items()
                if any(v is not None for v in x.get("flat_share_by_epoch", []))}
        if flat:
            lines += ["", "Held-out images that are one flat colour (`flat_share`: blank canvases), mean over the run seeds "
                      "that recorded it (runs trained before it was recorded lack it), per epoch:", "",
                      "| arm (seeds) | " + " | ".join(map(str, epochs)) + " |", "|---|" + "---|" * len(epochs)]
            lines += [f"| {a} ({_seeds(arms[a]['flat_share_seeds'])}) | "
                      + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |" for a, vals in flat.items()]
        refs = sorted({c for x in arms.values() for c in x.get("ref_by_epoch", {})})
        for c in refs:
            lines += ["", f"Held-out reference reward `{c}` (scored on the same images, never trained on), mean over seeds, "
                      "per epoch:", "", "| arm | " + " | ".join(map(str, epochs)) + " |", "|---|" + "---|" * len(epochs)]
            lines += [f"| {a} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in x["ref_by_epoch"][c]) + " |"
                      for a, x in arms.items() if c in x.get("ref_by_epoch", {})]
        lines += guard_lines(pool.get("guards"))
        eq = pool["at_equal_cost"]
        if eq:
            lines += ["", f"At equal cost ({eq['cost_bf16_fwd']:.0f} BF16-forward equivalents, B200 bound; `random` "
                      "not priced): " + "; ".join(f"{k} {_val(v)}" for k, v in eq["reward"].items()) + ". Paired: "
                      + "; ".join(f"{x['a']} - {x['b']} {_ci(x)}" for x in eq["links"]) + "."]
        lines += timed_lines(pool.get("timed"), arms, r["epochs"])
        if "power" in pool:
            p = pool["power"]
            need = p["seeds_for_half_0.01"]
            lines += ["", f"Power: the oracle - none differences' sd is {p['sd_oracle_minus_none']:.4f} over "
                      f"{p['seeds_run']} seeds; a 95% half-width of {r['target_half']} needs "
                      f"{need if need is not None else 'more than 1000'} paired seeds."]
        lines += ["", "Mechanism, mean over seeds and epochs 1-E (per epoch in the JSON):", "",
                  "| arm | " + " | ".join(MECHANISM) + " |", "|---|" + "---|" * len(MECHANISM)]
        for a, x in arms.items():
            cells = []
            for k in MECHANISM:
                vals = [v for v in x["mechanism"][k] if v is not None]
                cells.append(f"{np.mean(vals):.4g}" if vals else "-")
            lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guard_lines(g: dict[str, Any] | None) -> list[str]:
    """The guards table (`guards`): per arm against none, on paired seeds."""
    if not g:
        return []
    refs = g["reference"]
    head = ("| arm (seeds) | gain on the trained reward | share of the proxy's gain kept | "
            + "".join(f"`{c}` at the last epoch (- none) | " for c in refs)
            + "blank share at the last epoch (- none) | goal met |")
    lines = ["", f"Guards against reward hacking, each against `none` on the seeds both ran (gain: the primary measure's "
             f"paired difference; share kept: the gain over `{GUARDED}`'s, interval by resampling the seeds). Goal: >= 80% "
             f"of the gain kept, the reference reward not below none's (its paired interval reaches 0) and the blank "
             f"share within 1 point of none's:", "", head, "|---|---|---|" + "---|" * len(refs) + "---|---|"]
    for a, row in g["arms"].items():
        k = row["kept_share"]
        kept = "-" if k["share"] is None else f"{k['share']:.2f}" + (
            f" [{k['ci95'][0]:.2f}, {k['ci95'][1]:.2f}]" if k.get("ci95") else "")
        cells = [f"{x['value']:.3f} ({_ci(x)})" if x else "-" for x in (row["ref_final"].get(c) for c in refs)]
        flat = row.get("flat_final")
        goal = row["goal"]
        missed = ", ".join({"gain_kept": "gain", "reference_held": "reference", "blank_within_1pt": "blanks"}[p]
                           for p, v in (goal or {}).items() if p != "met" and v is False)
        met = "-" if goal is None else "yes" if goal["met"] else f"no ({missed})" if missed else "not measured"
        lines.append(f"| {a} ({_seeds(row['seeds'])}) | {_ci(row['gain'])} | {kept} | " + "".join(c + " | " for c in cells)
                     + (f"{flat['value']:.3f} ({_ci(flat)})" if flat else "-") + f" | {met} |")
    return lines


def _ratio(x: dict[str, Any]) -> str:
    return f"{x['mean']:.2f}x" + (f" [{x['ci95'][0]:.2f}, {x['ci95'][1]:.2f}]" if x.get("ci95") else "")


def _share(x: dict[str, Any]) -> str:
    if x["share"] is None:
        return "not reached"
    lo, hi = (x.get("ci95") or [None, None])
    ci = "" if "ci95" not in x else f" [{'-' if lo is None else f'{lo:.2f}'}, {'never' if hi is None else f'{hi:.2f}'}]"
    return f"{x['share']:.2f}{ci}"


def timed_lines(t: dict[str, Any] | None, arms: dict[str, Any], epochs: int) -> list[str]:
    """The measured-seconds table against naive scaling (`timed`)."""
    if not t or not t["arms"]:
        return []
    ref = arms[t["reference"]].get("seconds_per_epoch", {})
    lines = ["", f"Measured seconds against naive scaling (`{t['reference']}`: the whole pool at full steps in high "
             f"precision; {ref.get('cpu_epoch', float('nan')):.1f} CPU s an epoch, of which rollout "
             f"{ref.get('cpu_rollout', float('nan')):.1f}), evaluation excluded. Speed-ups are naive scaling's seconds "
             "over the arm's (geometric mean of the paired ratios, 95% interval); time to reach is the arm's mean curve "
             "reaching naive scaling's mean reward at its last epoch (and the epoch before), as a share of naive "
             "scaling's time to it (95% interval from resampling the seeds); the reward at equal seconds is paired, "
             "arm minus naive scaling. CPU seconds: each run's process time on one thread.", "",
             "| arm (pairs) | CPU s / epoch | rollout speed-up CPU (wall) | end-to-end speed-up CPU (wall) | "
             f"time to reach epoch {epochs}, share CPU (wall) | time to reach epoch {epochs - 1}, share CPU (wall) | "
             "reward at equal CPU s |", "|---|---|---|---|---|---|---|"]
    for k, row in t["arms"].items():
        sec = arms[k].get("seconds_per_epoch", {})
        eq = row["at_equal_cpu"]
        lines.append(f"| {k} ({len(row['seeds'])}) | {sec.get('cpu_epoch', float('nan')):.1f} | "
                     f"{_ratio(row['speedup_rollout_cpu'])} ({_ratio(row['speedup_rollout_wall'])}) | "
                     f"{_ratio(row['speedup_epoch_cpu'])} ({_ratio(row['speedup_epoch_wall'])}) | "
                     f"{_share(row['reach_cpu'])} ({_share(row['reach_wall'])}) | "
                     f"{_share(row['reach_cpu_before_last'])} ({_share(row['reach_wall_before_last'])}) | "
                     f"{_ci(eq)} at {eq['seconds']:.0f} s: {verdict({**eq, 'a': k, 'b': t['reference']})} |")
    by = {k: row.get("reach_cpu_by_epoch") for k, row in t["arms"].items() if row.get("reach_cpu_by_epoch")}
    if by:
        targets = list(next(iter(by.values())))
        lines += ["", "Time to reach naive scaling's mean reward at each epoch, as a share of naive scaling's CPU seconds "
                  "to that epoch (95% interval from resampling the seeds; `never`: some resamples do not reach it "
                  "within the arm's epochs):", "",
                  "| arm | " + " | ".join(f"ep. {e}" for e in targets) + " |", "|---|" + "---|" * len(targets)]
        lines += [f"| {k} | " + " | ".join(_share(b[e]) if e in b else "" for e in targets) + " |" for k, b in by.items()]
    return lines
