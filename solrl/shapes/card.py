"""Writes the bundled shapes model's card (README.md + loss curve) from its pretraining logs and eval.

    python -m solrl.shapes.card --weights DIR --logs PHASE1/loss.jsonl PHASE2/loss.jsonl --eval EVAL_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def tracking_curve(path: Path, out: Path) -> list[dict]:
    """Plot the pretraining's tracked exact-reward attributes (OUT/eval.jsonl) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = _records(path, None)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    steps = [r["step"] for r in recs]
    keys = ("shape_accuracy", "exact_match", "mean_reward")
    for split, style in (("heldout", "-"), ("train", "--")):
        for j, key in enumerate(keys):
            ax.plot(steps, [r[split][key] for r in recs], style, color=f"C{j}", label=f"{key} ({split})")
    guided = [r for r in recs if "heldout_guided" in r]   # --track-guidance: the headroom guidance shows
    if guided:
        ax.plot([r["step"] for r in guided], [r["heldout_guided"]["mean_reward"] for r in guided], ":",
                color=f"C{keys.index('mean_reward')}",
                label="mean_reward (heldout, CFG)")
    ax.set_xlabel("pretraining step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return recs


def _records(path: Path, upto: int | None) -> list[dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if upto is None or r["step"] <= upto]


def denoiser_text(cfg: dict, n_params: int) -> str:
    """One sentence on the denoiser, from its diffusers config.json."""
    cls = cfg.get("_class_name", "PixArtTransformer2DModel")
    if cls == "UNet2DConditionModel":
        chans = "/".join(str(c) for c in cfg["block_out_channels"])
        attn = [b for b in cfg["down_block_types"] if b.startswith("CrossAttn")]
        return (f"diffusers `UNet2DConditionModel`, {n_params:,} parameters: {chans} channels at 32/16/8 px, "
                f"{cfg['layers_per_block']} ResNet block per level, self- and cross-attention to the text in "
                f"{len(attn)} of {len(cfg['down_block_types'])} levels (and the middle), pixel space (32x32 RGB in "
                f"[-1, 1]), sinusoidal timestep embedding (t x 1000)")
    heads, width = cfg["num_attention_heads"], cfg["attention_head_dim"]
    block = ("SANA blocks (ReLU linear self-attention, Mix-FFN with a 3x3 depthwise convolution)"
             if cls == "SanaTransformer2DModel" else "PixArt blocks (softmax self-attention, MLP)")
    return (f"diffusers `{cls}`, {n_params:,} parameters: {cfg['num_layers']} {block}, {heads} heads x {width}, "
            f"patch {cfg['patch_size']}, pixel space (32x32 RGB in [-1, 1]), AdaLN-single timestep conditioning "
            f"(t x 1000), cross-attention to the text")


def loss_curve(logs: list[Path], out: Path, upto: int | None = None) -> list[dict]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases, offset = [], 0
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for i, log in enumerate(logs):
        recs = _records(log, upto if i == len(logs) - 1 else None)
        steps = [offset + r["step"] for r in recs]
        losses = [r["loss"] for r in recs]
        k = 25
        smooth = [sum(losses[max(0, j - k): j + 1]) / len(losses[max(0, j - k): j + 1]) for j in range(len(losses))]
        ax.plot(steps, losses, alpha=0.25, lw=0.6, color=f"C{i}")
        ax.plot(steps, smooth, color=f"C{i}", label=f"phase {i + 1}")
        phases.append({"steps": len(recs), "final_loss_avg50": sum(losses[-50:]) / min(50, len(losses)),
                       "elapsed_s": recs[-1]["elapsed_s"]})
        offset = steps[-1]
    ax.set_xlabel("step")
    ax.set_ylabel("flow-matching MSE")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return phases


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", required=True)
    p.add_argument("--logs", nargs="+", required=True)
    p.add_argument("--eval", required=True, help="directory with eval.json of `solrl eval --steps 10,40`")
    p.add_argument("--commands", nargs="+", required=True, help="the commands that trained the weights")
    p.add_argument("--notes", default="", help="how it ran (threads, other load, EMA), one sentence")
    p.add_argument("--tracking", default=None, help="the pretraining's eval.jsonl (shape accuracy over steps)")
    p.add_argument("--upto", type=int, default=None,
                   help="the weights are the last phase's checkpoint at this step (logs past it are left out)")
    a = p.parse_args(argv)
    w = Path(a.weights)
    phases = loss_curve([Path(x) for x in a.logs], w / "loss_curve.png", a.upto)
    ev = json.loads((Path(a.eval) / "eval.json").read_text())
    n_tr = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(w / "transformer" / "diffusion_pytorch_model.safetensors")).values())
    n_te = sum(v.numel() for v in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(w / "text_encoder" / "model.safetensors")).values())
    res = ev["results"]
    rows = "\n".join(
        f"| {k} | {r['mean_reward']:.3f} | {r['colour_accuracy']:.3f} | {r['shape_accuracy']:.3f} | "
        f"{r['count_accuracy']:.3f} | {r['position_accuracy']:.3f} | {r['exact_match']:.3f} |"
        for k, r in res.items())
    cfg = json.loads((w / "transformer" / "config.json").read_text())
    track = ""
    if a.tracking:
        recs = tracking_curve(Path(a.tracking), w / "tracking_curve.png")
        chosen = (f" The weights are the run's step-{a.upto} checkpoint, chosen from this curve; the rows after it "
                  "show where the run went on." if a.upto else "")
        track = "\n".join(
            f"| {r['step']} | {r['heldout']['shape_accuracy']:.3f} | {r['heldout']['exact_match']:.3f} | "
            f"{r['heldout']['mean_reward']:.3f} | {r['train']['shape_accuracy']:.3f} | {r['train']['mean_reward']:.3f} |"
            for r in recs)
        track = """
## Tracked during pretraining

Every few hundred steps the saved (EMA) weights sample 48 held-out and 48 training prompts (1 fixed
seed, 10 Euler steps) and the exact reward scores them (`tracking_curve.png`).{chosen}

| step | held-out shape acc. | held-out exact match | held-out reward | train shape acc. | train reward |
|---|---|---|---|---|---|
{track}
""".replace("{track}", track).replace("{chosen}", chosen)
    total_s = sum(ph["elapsed_s"] for ph in phases)
    saved = json.loads((w / "card.json").read_text()).get("config", {}) if (w / "card.json").exists() else {}
    schedule = f" (of a {saved['steps']:,}-step learning-rate schedule)" if a.upto and saved.get("steps") else ""
    text = f"""# Model card: `shapes` (bundled)

A tiny text-to-image flow-matching model of the shapes world (`docs/shapes.md`), trained by this
project from a fixed seed; the weights in this folder are what `load_model("shapes")` loads.

- **Denoiser**: {denoiser_text(cfg, n_tr)}.
- **Text encoder**: transformers `CLIPTextModel`, {n_te:,} parameters (2 layers, width 64) over a word-level
  tokenizer of the world's closed vocabulary; "" is the unconditional prompt (10% caption dropout).
- **Objective**: rectified flow, x_t = (1-t) x0 + t noise, MSE on v = noise - x0, t ~ U(0, 1).
- **Data**: rendered on the fly from the training prompts only (held-out prompts never rendered),
  forms balanced single 0.4 / count 0.2 / relation 0.4; batch 64.
- **Training**: {' then '.join(f"{ph['steps']} steps" for ph in phases)}{schedule} of AdamW (weight decay 0.01,
  grad clip 1.0, warm-up then cosine), {total_s / 60:.0f} minutes in all on 2 CPU cores.
  {a.notes} Reproduce with:

```bash
{chr(10).join(a.commands)}
```
  (bit-identical weights need the same machine and thread count: float reductions differ otherwise.)
- **Loss**: final 50-step mean {phases[-1]['final_loss_avg50']:.4f}; curve in `loss_curve.png`.

## Held-out exact reward (Euler, no CFG)

`solrl eval --preset shapes --checkpoint base --steps 10,40`: {ev['prompts']} held-out prompts x
{ev['seeds_per_prompt']} fixed seeds.

| steps | mean reward | colour | shape | count | position | exact match |
|---|---|---|---|---|---|---|
{rows}

Held-out prompts are attribute combinations never rendered in pretraining. Scored with the
precision-aware reward (colour and shape are F1 scores: extra detections cost credit). See
docs/notes/shapes.md for what the samples get wrong.
{track}"""
    (w / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
