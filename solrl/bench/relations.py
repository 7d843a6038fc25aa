"""Does a shapes model read a relation's word? Held-out relation prompts sampled seed for seed beside the same
prompts with the opposite relation ("to the left of" <-> "to the right of", "above" <-> "below").

Per model (the bundled base by default, or `models`: shapes model directories such as `solrl shapes pretrain`'s
step_NNNNN), unguided and with classifier-free guidance:
- the relation reward and its position sub-score (exact reward, both sides of every pair);
- relation order: over the images holding exactly the two prompted colours, the share in the prompted order
  (`solrl.shapes.metrics.relation_order`; about 0.5 for a model that places the objects by its noise alone);
- the mean pixel change between a pair's two images (0-255 scale): how much the word changes the drawing;
- pairs right both ways: over the pairs whose two images both hold exactly the two colours, the share in the
  prompted order on both sides. A model blind to the word draws (nearly) the same image twice, so at most one
  side is right and this is near 0; a model that reads it scores near 1.

And, per model, a teacher-forced probe that needs no sampling (`loss_gap`): ground-truth renders of the prompts,
noised to a high noise level t, where the layout is decided; the denoiser's velocity error with the reversed
caption minus with the true one (0: the word is not read), beside the same with the two objects' colours swapped
(what reading the colours is worth, for scale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from solrl.bench.common import write_results
from solrl.shapes.world import reverse_relation as opposite  # the caption with its relation reversed


def held_relations() -> list[str]:
    from solrl.shapes.metrics import caption_form
    from solrl.shapes.world import split_prompts

    return [p for p in split_prompts()[1] if caption_form(p) == "relation"]


def relation_prompts(n: int, seed: int) -> list[str]:
    """`n` held-out relation captions, drawn without replacement by a seeded generator."""
    held = held_relations()
    if not 0 < n <= len(held):
        raise ValueError(f"prompts must be in [1, {len(held)}] (held-out relation captions), got {n}")
    rng = np.random.default_rng(seed)
    return [held[i] for i in sorted(rng.choice(len(held), n, replace=False))]


def right_both_ways(detail_a: list[dict[str, float]], detail_b: list[dict[str, float]]) -> tuple[float | None, int]:
    """Over the pairs (a caption's image, its opposite's image on the same seed) whose two images both hold exactly
    the two prompted colours, the share in the prompted order on both sides; and how many pairs qualified."""
    both = [pa["position"] >= 0.999 and pb["position"] >= 0.999 for pa, pb in zip(detail_a, detail_b)
            if pa["colour"] >= 0.999 and pb["colour"] >= 0.999]
    return (float(np.mean(both)) if both else None), len(both)


def measure(model: Any, prompts: list[str], seeds: int, guidance: float, steps: int = 10,
            seed: int = 0) -> dict[str, Any]:
    """The figures of the module docstring for one model and guidance scale."""
    from solrl.rollout.passes import SamplerSpec, generate
    from solrl.shapes.metrics import relation_order
    from solrl.shapes.reward import ShapesReward

    flat = [p for p in prompts for _ in range(seeds)]
    flip = [opposite(p) for p in flat]
    noise_seeds = [seed * 1_000_003 + i for i in range(len(flat))]
    sampler = SamplerSpec(guidance=guidance)
    a = generate(model, model.transformer, flat, noise_seeds, steps, sampler, 128).images
    b = generate(model, model.transformer, flip, noise_seeds, steps, sampler, 128).images
    reward = ShapesReward()
    da, db = reward.score_detailed(a, flat), reward.score_detailed(b, flip)
    order, n_order = relation_order(da + db, flat + flip)
    both, n_pairs = right_both_ways(da, db)
    return {
        "guidance": guidance, "images": 2 * len(flat),
        "relation_reward": float(np.mean([d["total"] for d in da + db])),
        "relation_position": float(np.mean([d["position"] for d in da + db])),
        "relation_order": order, "relation_order_n": n_order,
        "pixel_change": float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean()),
        "pairs_right_both_ways": both, "pairs_n": n_pairs,
    }


def _swap_colours(caption: str) -> str:
    import dataclasses

    from solrl.shapes.world import ObjectSpec, parse

    spec = parse(caption)
    a, b = spec.objects
    return dataclasses.replace(spec, objects=(ObjectSpec(b.color, a.shape), ObjectSpec(a.color, b.shape))).caption()


def loss_gap(model: Any, prompts: list[str], seed: int = 0, ts: tuple[float, ...] = (0.9, 0.95)) -> dict[str, Any]:
    """Per t: mean velocity MSE with the reversed caption minus with the true one, and with the colours swapped
    minus with the true one, over one ground-truth render per prompt noised with the same noise."""
    import torch

    from solrl.shapes.model import images_to_latents
    from solrl.shapes.world import parse, render

    rng = np.random.default_rng(seed)
    x0 = images_to_latents(np.stack([render(parse(p), rng) for p in prompts]))
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    out: dict[str, Any] = {"images": len(prompts)}
    with torch.no_grad():
        conds = {k: model.encode(c) for k, c in (("true", prompts), ("reversed", [opposite(p) for p in prompts]),
                                                  ("colour_swap", [_swap_colours(p) for p in prompts]))}
        for t in ts:
            xt = (1 - t) * x0 + t * noise
            tt = torch.full((len(prompts),), t)
            err = {k: float(((model.velocity(model.transformer, xt, tt, c) - (noise - x0)) ** 2).mean())
                   for k, c in conds.items()}
            out[f"t{t:g}"] = {"reversed_gap": err["reversed"] - err["true"],
                              "colour_swap_gap": err["colour_swap"] - err["true"]}
    return out


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def run(out: Path, small: bool = False, prompts: int | None = None, seeds: int | None = None,
        seed: int = 0, models: tuple[str, ...] = ()) -> dict[str, Any]:
    from solrl.shapes.model import WEIGHTS_DIR, ShapesModel

    n_prompts = prompts or (2 if small else 64)
    n_seeds = seeds or (2 if small else 4)
    if n_seeds < 1:
        raise ValueError(f"seeds must be positive, got {n_seeds}")
    guidances = (1.0,) if small else (1.0, 3.0)
    chosen = relation_prompts(n_prompts, seed)
    # every model is loaded before any sampling, so a bad path fails at once
    loaded = [("bundled base" if Path(path).resolve() == WEIGHTS_DIR.resolve() else str(path), ShapesModel.load(path))
              for path in models or (str(WEIGHTS_DIR),)]
    rows = [{"model": label, **measure(model, chosen, n_seeds, g, seed=seed)}
            for label, model in loaded for g in guidances]
    probe_prompts = held_relations()   # every held-out relation prompt, one render each
    probes = [{"model": label, **loss_gap(model, probe_prompts, seed)} for label, model in loaded]
    result = {"prompts": chosen, "seeds_per_prompt": n_seeds, "steps": 10, "rows": rows, "loss_gap": probes}
    lines = ["| model | CFG | relation reward | position | relation order (images) | pixel change (0-255) | "
             "pairs right both ways (pairs) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['guidance']:g} | {r['relation_reward']:.3f} | {r['relation_position']:.3f} | "
                     f"{_f(r['relation_order'])} ({r['relation_order_n']}) | {r['pixel_change']:.2f} | "
                     f"{_f(r['pairs_right_both_ways'])} ({r['pairs_n']}) |")
    probe_lines = ["| model | reversed caption, t = 0.9 / 0.95 | colours swapped, t = 0.9 / 0.95 |", "|---|---|---|"]
    for r in probes:
        probe_lines.append(f"| {r['model']} | {r['t0.9']['reversed_gap']:+.4f} / {r['t0.95']['reversed_gap']:+.4f} | "
                           f"{r['t0.9']['colour_swap_gap']:+.4f} / {r['t0.95']['colour_swap_gap']:+.4f} |")
    body = (f"{n_prompts} held-out relation prompts x {n_seeds} seeds, each sampled beside the same prompt with the "
            "opposite relation on the same seeds (10 Euler steps). Relation order is about 0.5, and pairs right both "
            "ways about 0, for a model that places the two objects by its noise alone.\n\n" + "\n".join(lines)
            + f"\n\nTeacher-forced probe (one ground-truth render of each of the {len(probe_prompts)} held-out relation "
            "prompts, noised to t "
            "with the same noise): velocity MSE with the reversed caption minus with the true one (0: the relation "
            "word is not read), and with the two objects' colours swapped (for scale).\n\n" + "\n".join(probe_lines))
    return write_results(out, "relations", result, body)
