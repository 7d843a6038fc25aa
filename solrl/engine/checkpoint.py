"""Checkpoints: safetensors + JSON only (never pickle), exact resume.

Layout of `RUN/checkpoints/epoch_NNNN/`:
  adapters.safetensors   "<adapter>/<diffusers LoRA key>" for default, old and ema
  optimizer.safetensors  AdamW tensors as "state.<param index>.<name>"
  state.json             epoch, global step, adapter version, optimizer param groups and scalars
  rollout_adapter.safetensors   rollout.staleness=1 only: the "old" adapter before the last update (version - 1),
                         which the next epoch's rollouts are sampled with, as "old/<param index>" (layout order)
All other randomness of a run is derived from (seed, epoch), so these files are the whole state.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from solrl.adapters import LoraAdapters
from solrl.adapters.wire import canonical_safetensors

ROLLOUT_ADAPTER = "rollout_adapter.safetensors"


def _opt_to_flat(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{k}"] = v.detach().contiguous().clone()
            else:
                scalars.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _opt_from_flat(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, k = key.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    for idx, sc in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(sc)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(run_dir: Path, epoch: int, adapters: LoraAdapters, opt: torch.optim.Optimizer,
                    global_step: int, version: int, rollout_adapter: list[torch.Tensor] | None = None) -> Path:
    """Write epoch `epoch` (1-based count of finished epochs) atomically, then point `latest` at it.
    `rollout_adapter` (rollout.staleness=1): the "old" adapter's tensors the next epoch's rollouts are sampled with."""
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"epoch_{epoch:04d}"
    tmp = ckpt_root / f".tmp_epoch_{epoch:04d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ad = {f"{name}/{k}": v.detach().contiguous() for name in adapters.ADAPTERS
          for k, v in adapters.state_dict(name).items()}
    _write(tmp / "adapters.safetensors", ad, {"format": "solrl-adapters", "epoch": str(epoch)})
    tensors, meta = _opt_to_flat(opt)
    _write(tmp / "optimizer.safetensors", tensors, {"format": "solrl-optimizer"})
    state = {"epoch": epoch, "global_step": global_step, "adapter_version": version, "optimizer": meta}
    if rollout_adapter is not None:
        _write(tmp / ROLLOUT_ADAPTER, {f"old/{i}": t.detach().contiguous() for i, t in enumerate(rollout_adapter)},
               {"format": "solrl-rollout-adapter", "version": str(version - 1)})
        state["rollout_adapter_version"] = version - 1
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (ckpt_root / "latest").write_text(final.name + "\n")
    return final


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    path.write_bytes(canonical_safetensors(save(tensors, metadata=metadata)))


def saved_epochs(run_dir: Path) -> list[int]:
    """Epochs whose checkpoint holds adapters, in order."""
    root = run_dir / "checkpoints"
    return sorted(int(p.name.split("_")[1]) for p in root.glob("epoch_[0-9]*") if (p / "adapters.safetensors").exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if path.exists() else None


def load_adapters(path: Path, adapters: LoraAdapters, names: tuple[str, ...] | None = None) -> None:
    flat = load_file(str(path / "adapters.safetensors"))
    for name in names or adapters.ADAPTERS:
        pre = f"{name}/"
        adapters.load_state_dict(name, {k[len(pre):]: v for k, v in flat.items() if k.startswith(pre)})


def load_rollout_adapter(path: Path) -> list[torch.Tensor] | None:
    """The rollout adapter a checkpoint holds (save_checkpoint's `rollout_adapter`), None if it holds none."""
    f = path / ROLLOUT_ADAPTER
    if not f.exists():
        return None
    flat = load_file(str(f))
    return [flat[f"old/{i}"] for i in range(len(flat))]


def load_checkpoint(path: Path, adapters: LoraAdapters, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Restore adapters and optimizer in place; returns state.json."""
    state = json.loads((path / "state.json").read_text())
    load_adapters(path, adapters)
    _opt_from_flat(opt, load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    return state
