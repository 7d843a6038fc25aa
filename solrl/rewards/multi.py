"""Weighted multi-reward: score = sum_i w_i * reward_i(images, prompts).

Spelled in `cfg.reward` (or `--reward`) as a spec string, so configs and the services need no new
field: `pickscore:1.0+ocr:0.5` (also `pickscore:1.0,ocr:0.5`, or the JSON object
`{"pickscore": 1.0, "ocr": 0.5}`). The reference (NVlabs/Sana `multi_score`) sums weighted scores the
same way. Prefer `+` on the services path: `solrl serve reward --rewards` is a comma-separated list.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping

import numpy as np

from solrl.rewards.inputs import check_images

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def is_spec(text: str) -> bool:
    """True for a weighted spec (as opposed to a single reward name)."""
    return isinstance(text, str) and (":" in text or "+" in text or "," in text or text.strip().startswith("{"))


def parse_spec(text: str) -> dict[str, float]:
    """{reward name: weight} of a spec string; ValueError naming the bad part."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"reward: expected a reward name or a weighted spec like 'pickscore:1.0+ocr:0.5', got {text!r}")
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"reward: bad JSON weights {text!r} ({err})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"reward: JSON weights must be an object, got {text!r}")
        items = list(raw.items())
    else:
        items = []
        for part in re.split(r"[+,]", text):
            part = part.strip()
            if not part:
                raise ValueError(f"reward: empty term in {text!r}")
            name, sep, w = part.partition(":")
            items.append((name.strip(), w.strip() if sep else "1.0"))
    weights: dict[str, float] = {}
    for name, w in items:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"reward: bad reward name {name!r} in {text!r}")
        if name in weights:
            raise ValueError(f"reward: {name!r} appears twice in {text!r}")
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise ValueError(f"reward: weight of {name!r} must be a number, got {w!r}") from None
        if not math.isfinite(weight):
            raise ValueError(f"reward: weight of {name!r} must be finite, got {w!r}")
        weights[name] = weight
    if not weights:
        raise ValueError(f"reward: no rewards in {text!r}")
    return weights


def canonical(weights: Mapping[str, float]) -> str:
    return "+".join(f"{n}:{w:g}" for n, w in weights.items())


class MultiReward:
    """Weighted sum of several scorers (built by `build`: a name -> scorer callable)."""

    needs_weights = False

    def __init__(self, weights: Mapping[str, float], build: Callable[[str], Callable]) -> None:
        if not weights:
            raise ValueError("reward: a multi-reward needs at least one reward")
        for n in weights:
            if is_spec(n):
                raise ValueError(f"reward: nested weighted specs are not supported ({n!r})")
        self.weights = dict(weights)
        self.scorers = {n: build(n) for n in self.weights}
        self.name = canonical(self.weights)
        self.needs_weights = any(getattr(s, "needs_weights", False) for s in self.scorers.values())

    def score_detailed(self, images: np.ndarray, prompts: list[str]) -> dict[str, np.ndarray]:
        """Each reward's scores and the weighted total (key 'total')."""
        images = check_images(images, len(prompts))
        parts = {n: np.asarray(s(images, list(prompts)), dtype=np.float32) for n, s in self.scorers.items()}
        total = np.zeros(len(images), dtype=np.float64)
        for n, v in parts.items():
            total += self.weights[n] * v.astype(np.float64)
        return {**parts, "total": total.astype(np.float32)}

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        return self.score_detailed(images, prompts)["total"]
