"""Where reward-model weights come from: a local path or the Hugging Face cache, never the network.

A weight *source* is a local directory / file, or a Hugging Face repo id that must already be in the
local cache (`HF_HOME`); nothing is downloaded. Each scorer names an environment variable that
overrides its default source. A missing source raises `MissingWeightsError` (a FileNotFoundError)
that lists the files needed and how to provide them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class MissingWeightsError(FileNotFoundError):
    """A reward model's weights are not available locally."""


def source(env: str, default: str) -> str:
    """The weight source: the environment variable `env` if set, else `default`."""
    return os.environ.get(env, "").strip() or default


def _hint(what: str, src: str, env: str, files: Sequence[str]) -> str:
    return (f"{what}: weights not found at {src!r} (a local path, or a Hugging Face repo id already in the "
            f"local cache; nothing is downloaded). Needed: {', '.join(files)}. Set {env}=<path> to a local copy, "
            f"or fetch it on a machine with network (`hf download {src}`) and share its HF_HOME cache.")


def _cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of a Hugging Face repo, or None (local lookup only)."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def resolve_dir(src: str, *, what: str, env: str, files: Sequence[str | tuple[str, ...]]) -> Path:
    """A directory holding `files` (a tuple entry means: any one of these), from a path or the HF cache."""
    names = [f if isinstance(f, str) else " or ".join(f) for f in files]
    path = Path(src).expanduser()
    root = path if path.is_dir() else _cached_snapshot(src)
    if root is None:
        raise MissingWeightsError(_hint(what, src, env, names))
    missing = [n for f, n in zip(files, names)
               if not any((root / g).exists() for g in ((f,) if isinstance(f, str) else f))]
    if missing:
        raise MissingWeightsError(f"{what}: {root} lacks {', '.join(missing)}. " + _hint(what, src, env, names))
    return root


def resolve_file(src: str, *, what: str, env: str, filename: str) -> Path:
    """A single weights file: a local file path, or `filename` inside a local directory / cached HF repo."""
    path = Path(src).expanduser()
    if path.is_file():
        return path
    return resolve_dir(src, what=what, env=env, files=[filename]) / filename


def dir_available(src: str, files: Sequence[str | tuple[str, ...]]) -> bool:
    try:
        resolve_dir(src, what="", env="", files=files)
        return True
    except MissingWeightsError:
        return False


def file_available(src: str, filename: str) -> bool:
    try:
        resolve_file(src, what="", env="", filename=filename)
        return True
    except MissingWeightsError:
        return False


def missing_checkpoint_and_tokenizer(env: str, default: str, filename: str, tok_env: str, tok_default: str,
                                     tok_files: Sequence[str | tuple[str, ...]]) -> list[str]:
    """What a checkpoint-file + tokenizer-directory scorer lacks here (loads nothing)."""
    out = []
    src = source(env, default)
    if not file_available(src, filename):
        out.append(f"{env} ({src}: {filename})")
    tok = source(tok_env, tok_default)
    if not dir_available(tok, tok_files):
        out.append(f"{tok_env} ({tok})")
    return out


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
