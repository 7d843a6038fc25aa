"""Where the explorer's low-precision error comes from: image error per layer group and per block.

On P held-out prompts x N seeds, the reference is the BF16 model at the explore steps; each row quantizes
only one part of the layers the backend would quantize (one block, or one kind of layer in every block),
or all of them but one kind (what keeping that kind in BF16 would give), and samples the same seeds. Reported per row:
the mean absolute pixel error against the reference (0-255
scale), its share of the forward's multiply-accumulates, the error per percent of quantized work, and the
share of images whose exact reward changes. "all" quantizes every selected layer (what the explorer does).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import numpy as np
import torch

from solrl.bench.common import write_results
from solrl.config import get_preset
from solrl.engine.session import Session
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.base import denoiser_blocks, layer_macs, with_model_skips
from solrl.rollout.passes import generate_by_prompt
from solrl.rollout.workers import InferenceCopy
from solrl.shapes.metrics import eval_prompts

# layer kinds by the last part of the name (diffusers attention and feed-forward naming)
KINDS = {
    "self-attn q/k/v": ("*attn1.to_q", "*attn1.to_k", "*attn1.to_v"),
    "self-attn out": ("*attn1.to_out.0",),
    "cross-attn q/k/v": ("*attn2.to_q", "*attn2.to_k", "*attn2.to_v"),
    "cross-attn out": ("*attn2.to_out.0",),
    "feed-forward": ("*ff.*", "*mlp*"),
    "time embedding proj": ("*time_emb_proj",),
    "projections in/out": ("*proj_in", "*proj_out"),
}


def _groups(selected: list[str], module: torch.nn.Module) -> list[tuple[str, str, list[str]]]:
    """(kind of group, name, its selected layers): "all", each block, each layer kind; empty groups dropped."""
    blocks = denoiser_blocks(module) + [n for n, _ in module.named_children() if n.endswith("mid_block")]
    out = [("all", "all", selected)]
    out += [("block", b, [n for n in selected if n.startswith(b + ".")]) for b in blocks]
    out += [("kind", k, [n for n in selected if any(fnmatch.fnmatchcase(n, p) for p in pats)])
            for k, pats in KINDS.items()]
    covered = {n for kind, _, names in out[1:] if kind == "kind" for n in names}
    out.append(("kind", "other", [n for n in selected if n not in covered]))
    kinds = [g for g in out if g[0] == "kind" and g[2]]
    out += [("all but", f"all but {name}", [n for n in selected if n not in set(names)]) for _, name, names in kinds]
    return [g for g in out if g[2]]


def run(out: Path, small: bool = False, prompts: int | None = None, seeds: int | None = None,
        precisions: tuple[str, ...] | None = None, steps: tuple[int, ...] | None = None, seed: int = 0) -> dict[str, Any]:
    n_prompts = prompts or (2 if small else 8)
    n_seeds = seeds or (2 if small else 8)
    backend = (precisions or ("nvfp4-emu",))[0]
    n_steps = (steps or ((2,) if small else (6,)))[0]
    cfg = get_preset("shapes-sol-rl")
    sess = Session.build(cfg, local_explorer=False)
    model, spec = sess.model, sess.model.spec
    caps = eval_prompts(n_prompts)
    rng = np.random.default_rng(seed)
    seed_grid = rng.integers(0, 2**31 - 1, size=(n_prompts, n_seeds)).tolist()
    flat_prompts = [p for p in caps for _ in range(n_seeds)]

    def sample(module: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
        g = generate_by_prompt(model, module, caps, seed_grid, n_steps, sess.sampler, cfg.rollout.micro_batch, sess.cache)
        return g.images.astype(np.float32), np.asarray(sess.scorer(g.images, flat_prompts), dtype=np.float32)

    ref_copy = InferenceCopy(sess.adapters, PrecisionConfig(backend="bf16"))
    ref_img, ref_r = sample(ref_copy.module)
    full = with_model_skips(PrecisionConfig(backend=backend), spec.quant_skip, spec.quant_min_features)
    plain = ref_copy.module
    selected = build_backend(full).selected_layers(plain)
    x = torch.zeros(1, *spec.latent_shape)
    cond = sess.cache(caps[:1])
    macs = layer_macs(plain, lambda: model.velocity(plain, x, torch.tensor([0.5]), cond))
    total = sum(macs.values())
    rows = []
    for kind, name, names in _groups(selected, plain):
        keep = set(names)
        precision = PrecisionConfig(backend=backend, model_skip=tuple(n for n in selected if n not in keep) + full.model_skip,
                                    min_features=full.min_features)
        copy = InferenceCopy(sess.adapters, precision)
        assert sorted(copy.backend.quantized_names) == sorted(names), name
        img, r = sample(copy.module)
        err = float(np.abs(img - ref_img).mean())
        share = sum(macs.get(n, 0) for n in names) / total
        rows.append({"group": kind, "name": name, "layers": len(names), "mac_share": share, "pixel_error": err,
                     "error_per_percent": err / (100 * share) if share else None,
                     "reward_changed": float(np.mean(r != ref_r))})
    result = {"backend": backend, "steps": n_steps, "prompts": n_prompts, "seeds_per_prompt": n_seeds,
              "reference": "bf16 at the same steps and seeds", "rows": rows}
    return write_results(out, "sensitivity", result, markdown(result))


def markdown(r: dict[str, Any]) -> str:
    lines = ["| group | layers | share of forward MACs | pixel error (0-255) | error per % of MACs | exact reward changed |",
             "|---|---|---|---|---|---|"]
    for row in r["rows"]:
        per = f"{row['error_per_percent']:.3f}" if row["error_per_percent"] is not None else "-"
        lines.append(f"| {row['name']} ({row['group']}) | {row['layers']} | {row['mac_share']:.1%} | "
                     f"{row['pixel_error']:.2f} | {per} | {row['reward_changed']:.0%} |")
    return (f"`{r['backend']}` on the bundled shapes model at {r['steps']} steps, {r['prompts']} held-out prompts x "
            f"{r['seeds_per_prompt']} seeds; each row quantizes only its layers and is compared with BF16 at the same "
            f"steps and seeds (mean absolute pixel error; share of images whose exact reward differs).\n\n"
            + "\n".join(lines) + "\n")
