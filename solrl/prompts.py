"""Prompt sets: what a run trains on (`prompts.train`) and evaluates on (`prompts.eval`).

A prompt set is named by a string:

  shapes:train | shapes:held-out | shapes:all   the shapes world's captions (its fixed split)
  ocr:train | ocr:test                          text-rendering prompts for the `ocr` reward, built here
                                                from templates and phrases; the test set's phrases
                                                never occur in the training set
  PATH.txt                                      one prompt per line (blank lines and lines starting
                                                with '#' are skipped)
  PATH.jsonl                                    one JSON object per line with a "prompt" string (the
                                                layout of GenEval-style metadata files)
  PATH.json                                     a list of strings, or of objects with a "prompt"

Real models have no default: their presets leave `prompts.train` empty and a run asks for one
(e.g. the PickScore prompt files the reference trains HPSv2 on, as a .txt). Order is kept as
written; exact duplicates are dropped (the first one stays).

Built-in sets come in families (`FAMILY:SPLIT`), registered by name (`register_prompt_family`). A family
may bring its own sampler of an epoch's training prompts and its own choice of evaluation prompts, as
"module:attr" names imported when used: the shapes family is the shapes bed's (solrl/shapes/prompts.py),
which sits above the core and is never imported by it otherwise.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from solrl.registry import load_entry

FILE_SUFFIXES = (".txt", ".jsonl", ".json")
MAX_PROMPT_CHARS = 4096

# Text-rendering prompts: a scene with a surface carrying quoted text, the `ocr` reward's input
# (reward = 1 - normalised edit distance between the quoted text and what OCR reads in the image).
_OCR_TEMPLATES = (
    'A wooden sign by a country road that says "{}"',
    'A neon sign in a dark shop window reading "{}"',
    'A coffee mug printed with the words "{}"',
    'A chalkboard menu in a cafe with "{}" written on it',
    'A white T-shirt with "{}" printed across the chest',
    'A movie poster with the title "{}"',
    'A birthday cake with "{}" written in icing',
    'A street banner that reads "{}"',
    'A book cover with the title "{}" in bold letters',
    'A road sign on a highway showing "{}"',
    'A sticky note on a monitor that says "{}"',
    'A storefront awning with the name "{}"',
)
_OCR_PHRASES = (
    "OPEN", "CLOSED", "SALE", "HELLO", "WELCOME", "EXIT", "STOP", "COFFEE", "BAKERY", "LIBRARY",
    "GOOD MORNING", "THANK YOU", "NO PARKING", "FRESH BREAD", "HAPPY BIRTHDAY", "DREAM BIG",
    "STAY CALM", "LOST AND FOUND", "SUMMER", "MOUNTAIN", "RIVER", "GARDEN", "STATION", "HOTEL",
    "PIZZA", "BOOKS", "MUSIC", "CINEMA", "MARKET", "TICKETS", "SOLAR", "ROBOT", "OCEAN VIEW",
    "TAXI", "PHARMACY", "BICYCLE", "LEMONADE", "DINER", "GALLERY", "HARBOR",
)


class PromptSetError(ValueError):
    """A prompt set that cannot be used: unknown name, missing or malformed file, no prompts."""


def _held_out_phrase(phrase: str) -> bool:
    """One phrase in five is held out for ocr:test (by hash, so the split does not depend on order)."""
    bucket = int(hashlib.sha256(phrase.encode()).hexdigest(), 16) % 5
    return bucket == 0


def ocr_prompts(split: str) -> list[str]:
    if split not in ("train", "test"):
        raise PromptSetError(f"ocr split must be 'train' or 'test', got {split!r}")
    phrases = [p for p in _OCR_PHRASES if _held_out_phrase(p) == (split == "test")]
    return [t.format(p) for p in phrases for t in _OCR_TEMPLATES]


@dataclass(frozen=True)
class PromptFamily:
    """Built-in prompt sets `NAME:SPLIT`. Each callable may be given as "module:attr", imported when first used.

    load         (split) -> the split's prompts
    sampler      (prompts, relation_share) -> an epoch's sampler (rng, n) -> prompts; None: uniform draws
                 (UniformPromptSampler), and the family takes no prompts.relation_share
    eval_subset  (n, prompts) -> the n evaluation prompts of a set; None: its first n
    """

    name: str
    splits: tuple[str, ...]
    load: Callable[[str], list[str]] | str
    sampler: Callable[..., Any] | str | None = None
    eval_subset: Callable[[int, list[str]], list[str]] | str | None = None


_FAMILIES: dict[str, PromptFamily] = {}


def register_prompt_family(name: str, splits: tuple[str, ...], load: Callable[[str], list[str]] | str, *,
                           sampler: Callable[..., Any] | str | None = None,
                           eval_subset: Callable[[int, list[str]], list[str]] | str | None = None) -> None:
    if not name or ":" in name or name in _FAMILIES:
        raise ValueError(f"prompt family {name!r}: a new name without ':' is required")
    _FAMILIES[name] = PromptFamily(name, tuple(splits), load, sampler, eval_subset)


def builtin_sets() -> tuple[str, ...]:
    """Every built-in set's name, `FAMILY:SPLIT`, in registration order."""
    return tuple(f"{f.name}:{s}" for f in _FAMILIES.values() for s in f.splits)


def prompt_family(name: str) -> PromptFamily | None:
    """The family of the built-in set `name` (FAMILY:SPLIT), None for a file or an unknown family."""
    return _FAMILIES.get(name.strip().partition(":")[0]) if ":" in name else None


def _from_file(path: Path) -> list[str]:
    if not path.is_file():
        raise PromptSetError(f"prompt file {str(path)!r} not found (a built-in set is one of {list(builtin_sets())})")
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise PromptSetError(f"prompt file {str(path)!r}: unsupported suffix {suffix!r}; use one of {FILE_SUFFIXES}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PromptSetError(f"prompt file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    items: list[tuple[str, object]] = []   # (where, value)
    if suffix == ".txt":
        items = [(f"line {i}", line.strip()) for i, line in enumerate(text.splitlines(), 1)
                 if line.strip() and not line.lstrip().startswith("#")]
    elif suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptSetError(f"prompt file {str(path)!r} line {i}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise PromptSetError(f"prompt file {str(path)!r} line {i}: expected an object with a \"prompt\" field")
            items.append((f"line {i}", obj["prompt"]))
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"prompt file {str(path)!r}: not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(data, list):
            raise PromptSetError(f"prompt file {str(path)!r}: expected a JSON list of prompts")
        for i, obj in enumerate(data):
            items.append((f"item {i}", obj.get("prompt") if isinstance(obj, dict) else obj))
    prompts = []
    for where, value in items:
        if not isinstance(value, str) or not value.strip():
            raise PromptSetError(f"prompt file {str(path)!r} {where}: the prompt must be a non-empty string")
        if len(value) > MAX_PROMPT_CHARS:
            raise PromptSetError(f"prompt file {str(path)!r} {where}: prompt longer than {MAX_PROMPT_CHARS} characters")
        prompts.append(value.strip())
    return prompts


def load_prompt_set(name: str) -> list[str]:
    """The prompts of a built-in set or a file (see the module docstring); PromptSetError otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise PromptSetError("a prompt set is required: a built-in name "
                             f"({', '.join(builtin_sets())}) or a .txt / .jsonl / .json file")
    name = name.strip()
    family = prompt_family(name)
    if name in builtin_sets():
        prompts = list(load_entry(family.load)(name.partition(":")[2]))
    elif family is not None and not Path(name).suffix:
        raise PromptSetError(f"unknown built-in prompt set {name!r}; built-in sets: {list(builtin_sets())}")
    else:
        prompts = _from_file(Path(name).expanduser())
    prompts = list(dict.fromkeys(prompts))
    if not prompts:
        raise PromptSetError(f"prompt set {name!r} holds no prompts")
    return prompts


def takes_relation_share(name: str) -> bool:
    """Whether the set's sampler takes prompts.relation_share (a family with its own sampler: the shapes world's)."""
    family = prompt_family(name)
    return family is not None and family.sampler is not None


def eval_subset(name: str, n: int) -> list[str]:
    """The `n` evaluation prompts of the set `name`: its family's choice (the shapes world: a fixed,
    form-stratified subset), else its first `n`."""
    family = prompt_family(name)
    if family is not None and family.eval_subset is not None:
        return load_entry(family.eval_subset)(n, load_prompt_set(name))
    return load_prompt_set(name)[:n]


class UniformPromptSampler:
    """An epoch's prompts: `n` distinct prompts drawn uniformly (with replacement only when the set
    holds fewer than `n`); deterministic given the rng."""

    def __init__(self, prompts: list[str]) -> None:
        if not prompts:
            raise PromptSetError("the prompt set holds no prompts")
        self.prompts = list(prompts)

    def __call__(self, rng, n: int) -> list[str]:
        idx = rng.choice(len(self.prompts), size=n, replace=n > len(self.prompts))
        return [self.prompts[int(i)] for i in idx]


def prompt_sampler(name: str, prompts: list[str], relation_share: float | None = None):
    """The sampler of a run's training prompts: the set's family's own (the shapes world's: by caption form,
    `relation_share` of them relations, None: the pretraining mix's), else uniform."""
    family = prompt_family(name)
    if family is not None and family.sampler is not None:
        return load_entry(family.sampler)(prompts, relation_share)
    return UniformPromptSampler(prompts)


# the built-in families; the shapes bed's (solrl/shapes/prompts.py) is imported when one of its sets is used
register_prompt_family("shapes", ("train", "held-out", "all"), "solrl.shapes.prompts:prompt_set",
                       sampler="solrl.shapes.prompts:prompt_sampler", eval_subset="solrl.shapes.metrics:eval_prompts")
register_prompt_family("ocr", ("train", "test"), ocr_prompts)
BUILTIN = builtin_sets()   # the sets registered here (with any registered later: builtin_sets())
