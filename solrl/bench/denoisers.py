"""Cost of the shapes model's denoiser families: one pretraining step (batch 64, AdamW) and one no-grad
forward of a 16-seed batch, for the bundled UNet, the PixArt transformer bundled before it, and a SANA
transformer, each from a seeded random initialisation of the architecture `solrl shapes pretrain` builds;
plus the share of a forward's multiply-accumulates that sits in the Linear layers the NVFP4 explorer
quantizes (convolutions stay in high precision).

Timings are medians over repeats after a warm-up call, on this machine's CPU.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from solrl.bench.common import write_results

# name -> (denoiser, architecture); the bundled UNet, the PixArt base bundled until 2026-11-24, SANA at patch 2.
FAMILIES: dict[str, tuple[str, dict[str, int]]] = {
    "unet 32/64/64 (bundled)": ("unet", {"heads": 4}),
    "pixart patch 4, 6 x 128 (before)": ("pixart", {"layers": 6, "heads": 4, "patch": 4}),
    "sana patch 2, 4 x 128": ("sana", {"layers": 4, "heads": 4, "patch": 2}),
}


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(denoiser: str, arch: dict[str, int], batch: int, forward_batch: int, repeats: int) -> dict[str, Any]:
    from solrl.precision import PrecisionConfig, build_backend
    from solrl.precision.base import quantized_mac_share
    from solrl.shapes.model import SPEC, ShapesModel

    model = ShapesModel.random(seed=0, denoiser=denoiser, **arch)
    tr = model.transformer
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=gen)
    t = torch.rand(batch, generator=gen)
    model.text_encoder.eval().requires_grad_(False)   # the text is fixed here; only the denoiser trains
    cond = model.encode(["a red circle to the left of a blue square"] * batch)
    opt = torch.optim.AdamW(tr.parameters(), lr=1e-4)

    def step() -> None:
        tr.train()
        loss = model.velocity(tr, x, t, cond).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    fc = cond.index(slice(0, forward_batch))

    def forward() -> None:
        tr.eval()
        with torch.no_grad():
            model.velocity(tr, x[:forward_batch], t[:forward_batch], fc)

    train_s = _median_s(step, repeats)
    forward_s = _median_s(forward, repeats * 2)
    backend = build_backend(PrecisionConfig(backend="nvfp4-emu", model_skip=SPEC.quant_skip))
    share = quantized_mac_share(tr, backend.selected_layers(tr), forward)
    return {"denoiser": denoiser, "arch": arch, "class": type(tr).__name__,
            "parameters": sum(p.numel() for p in tr.parameters()), "train_step_s": round(train_s, 4),
            "forward_s": round(forward_s, 5), "nvfp4_quantized_mac_share": round(share, 4)}


def run(out: Path, small: bool = False) -> dict[str, Any]:
    batch, forward_batch, repeats = (8, 4, 1) if small else (64, 16, 5)
    rows = {name: measure(d, arch, batch, forward_batch, repeats) for name, (d, arch) in FAMILIES.items()}
    ref = rows["pixart patch 4, 6 x 128 (before)"]
    for r in rows.values():
        r["train_step_vs_pixart"] = round(r["train_step_s"] / ref["train_step_s"], 2)
        r["forward_vs_pixart"] = round(r["forward_s"] / ref["forward_s"], 2)
    lines = [f"| denoiser | class | parameters | train step (batch {batch}) | forward of {forward_batch} | "
             "vs PixArt (step / forward) | NVFP4-quantized share of a forward |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | `{r['class']}` | {r['parameters']:,} | {r['train_step_s']:.3f} s | "
                     f"{r['forward_s'] * 1000:.1f} ms | {r['train_step_vs_pixart']:.2f}x / {r['forward_vs_pixart']:.2f}x | "
                     f"{r['nvfp4_quantized_mac_share']:.0%} |")
    body = (f"Median of {repeats} pretraining steps and {2 * repeats} forwards after a warm-up, seeded random "
            "weights of each architecture. The share is of the forward's Linear and Conv2d multiply-accumulates "
            "that run in the layers the `nvfp4-emu` explorer quantizes (the rest stays high precision and "
            "gains nothing from FP4).\n\n" + "\n".join(lines) + "\n")
    return write_results(out, "denoisers", {"batch": batch, "forward_batch": forward_batch, "repeats": repeats,
                                            "rows": rows}, body)
