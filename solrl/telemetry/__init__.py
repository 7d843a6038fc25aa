"""Run telemetry: metrics.jsonl, TensorBoard event files, a reward-curve PNG and captioned image grids."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# Keys whose values depend on wall-clock or CPU time; determinism checks compare everything else.
TIMING_PREFIXES = ("time_", "cpu_", "wall_", "elapsed")


class MetricsWriter:
    """Appends one JSON object per epoch to metrics.jsonl and mirrors scalars to TensorBoard, and to Weights &
    Biases when `wandb` is "offline" or "online" (`wandb_run`: project, run name and config of that run)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, truncate_after_epoch: int | None = None,
                 wandb: str = "", wandb_run: dict[str, Any] | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        if truncate_after_epoch is not None and self.path.exists():
            # On resume, keep only the epochs the checkpoint already covers.
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["epoch"] <= truncate_after_epoch]
            self.path.write_text("".join(line + "\n" for line in keep))
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._wb = _wandb_run(run_dir, wandb, wandb_run or {}, resumed=truncate_after_epoch not in (None, -1)) \
            if wandb else None

    def write(self, record: dict[str, Any]) -> None:
        # strict JSON: a non-finite value (e.g. Kendall tau of a constant ranking) is written as null
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        step = int(record["epoch"])
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "epoch"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k.replace(".", "/"), v, step)
            self._tb.flush()
        if self._wb is not None:
            self._wb.log(scalars, step=step)

    def add_image(self, tag: str, image: np.ndarray, step: int) -> None:
        if self._tb is not None:
            self._tb.add_image(tag, image, step, dataformats="HWC")
        if self._wb is not None:
            import wandb

            self._wb.log({tag: wandb.Image(image)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wb is not None:
            self._wb.finish()


def _wandb_run(run_dir: Path, mode: str, run: dict[str, Any], resumed: bool):
    """A Weights & Biases run for `run_dir` (files under RUN_DIR/wandb). Its id is kept in RUN_DIR/wandb_id, so a
    resumed solrl run continues the same W&B run; step = epoch. Offline runs upload later with `wandb sync`."""
    import uuid

    import wandb

    id_file = run_dir / "wandb_id"
    if not (resumed and id_file.exists()):
        id_file.write_text(uuid.uuid4().hex[:12] + "\n")
    return wandb.init(project=run.get("project", "solrl"), name=run.get("name"), config=run.get("config"),
                      dir=str(run_dir), mode=mode, id=id_file.read_text().strip(), resume="allow",
                      settings=wandb.Settings(silent=True, console="off"))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def strip_timings(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}


def image_grid(images: np.ndarray, captions: list[str], scale: int = 3, cols: int = 8,
               scores: list[float] | None = None) -> np.ndarray:
    """uint8 [B, H, W, 3] -> one uint8 grid image, each tile upscaled and captioned underneath."""
    n, h, w, _ = images.shape
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    tw, th = w * scale, h * scale
    line_h, lines = 10, 4
    cap_h = line_h * lines + 2
    grid = Image.new("RGB", (cols * (tw + 4) + 4, rows * (th + cap_h + 4) + 4), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    chars = max(8, tw // 6)
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = 4 + c * (tw + 4), 4 + r * (th + cap_h + 4)
        grid.paste(Image.fromarray(images[i]).resize((tw, th), Image.NEAREST), (x, y))
        text = captions[i] + (f" [{scores[i]:.2f}]" if scores is not None else "")
        words, cur, out = text.split(), "", []
        for wd in words:
            if len(cur) + len(wd) + 1 > chars:
                out.append(cur)
                cur = wd
            else:
                cur = f"{cur} {wd}".strip()
        out.append(cur)
        for j, line in enumerate(out[:lines]):
            draw.text((x, y + th + 1 + j * line_h), line, fill=(0, 0, 0), font=font)
    return np.asarray(grid)


def save_png(image: np.ndarray, path: Path) -> None:
    Image.fromarray(image).save(path)


def plot_reward_curve(records: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Reward per epoch (explore proxy, BF16 regenerated) and held-out evaluation of the EMA adapter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ep = [r["epoch"] for r in records]
    for key, label in (("explore.reward_mean", "explore (low precision, proxy)"),
                       ("rollout.reward_mean", "rollouts trained on"),
                       ("eval.mean_reward", "held-out eval (EMA)")):
        pts = [(e, r[key]) for e, r in zip(ep, records) if key in r and r[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if key.startswith("eval") else None, ms=4, label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("exact reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
