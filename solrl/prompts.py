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
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

BUILTIN = ("shapes:train", "shapes:held-out", "shapes:all", "ocr:train", "ocr:test")
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


def _builtin(name: str) -> list[str]:
    family, _, split = name.partition(":")
    if family == "shapes":
        from solrl.world.shapes import split_prompts

        train, held = split_prompts()
        return {"train": list(train), "held-out": list(held), "all": sorted(set(train) | set(held))}[split]
    return ocr_prompts(split)


def _from_file(path: Path) -> list[str]:
    if not path.is_file():
        raise PromptSetError(f"prompt file {str(path)!r} not found (a built-in set is one of {list(BUILTIN)})")
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
                             f"({', '.join(BUILTIN)}) or a .txt / .jsonl / .json file")
    name = name.strip()
    if name in BUILTIN:
        prompts = _builtin(name)
    elif ":" in name and not Path(name).suffix and name.split(":", 1)[0] in ("shapes", "ocr"):
        raise PromptSetError(f"unknown built-in prompt set {name!r}; built-in sets: {list(BUILTIN)}")
    else:
        prompts = _from_file(Path(name).expanduser())
    prompts = list(dict.fromkeys(prompts))
    if not prompts:
        raise PromptSetError(f"prompt set {name!r} holds no prompts")
    return prompts


def is_shapes_set(name: str) -> bool:
    return name.strip().startswith("shapes:")


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
    """The sampler of a run's training prompts: for the shapes world, by caption form (its forms are
    unevenly many), `relation_share` of them relations (None: the pretraining mix's); uniform otherwise."""
    if is_shapes_set(name):
        return PromptSampler(prompts, None if relation_share is None else form_weights(relation_share))
    return UniformPromptSampler(prompts)


# the shapes world's caption forms in a run's and the pretraining's prompt mix
FORM_WEIGHTS = {"single": 0.4, "count": 0.2, "relation": 0.4}


def form_weights(relation_share: float) -> dict[str, float]:
    """Caption-form mix with `relation_share` of relations; the other forms keep FORM_WEIGHTS' proportions
    (at the default share the scale is exactly 1: FORM_WEIGHTS itself)."""
    if not 0 < relation_share < 1:
        raise ValueError(f"relation_share must be in (0, 1), got {relation_share!r}")
    scale = (1 - relation_share) / (1 - FORM_WEIGHTS["relation"])
    return {f: relation_share if f == "relation" else w * scale for f, w in FORM_WEIGHTS.items()}


class PromptSampler:
    """Form-balanced random shapes captions (deterministic given the rng): a run's training prompts and the
    shapes model's pretraining data (solrl/pretrain/shapes.py)."""

    def __init__(self, captions: list[str], weights: dict[str, float] | None = None) -> None:
        import numpy as np

        from solrl.world.shapes import parse

        self.by_form: dict[str, list[str]] = {}
        for c in captions:
            self.by_form.setdefault(parse(c).form, []).append(c)
        weights = weights or FORM_WEIGHTS
        self.forms = list(weights)
        self.p = np.array([weights[f] for f in self.forms])

    def __call__(self, rng, n: int) -> list[str]:
        forms = rng.choice(len(self.forms), size=n, p=self.p)
        out = []
        for f in forms:
            pool = self.by_form[self.forms[f]]
            out.append(pool[int(rng.integers(len(pool)))])
        return out
