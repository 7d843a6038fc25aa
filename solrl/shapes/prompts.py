"""The shapes world's prompt sets and how a run and the pretraining draw from them.

`shapes:train`, `shapes:held-out` and `shapes:all` are the world's captions in its fixed split; `solrl.prompts`
holds them as a registered family ("module:attr" names that import this module when a shapes set is used).
"""

from __future__ import annotations

import numpy as np

from solrl.shapes.world import parse, split_prompts


def is_shapes_set(name: str) -> bool:
    return name.strip().startswith("shapes:")


def prompt_set(split: str) -> list[str]:
    """The captions of one split: train, held-out, or all (sorted)."""
    train, held = split_prompts()
    return {"train": list(train), "held-out": list(held), "all": sorted(set(train) | set(held))}[split]


def prompt_sampler(prompts: list[str], relation_share: float | None = None) -> PromptSampler:
    """The sampler of a run's training prompts, by caption form (the forms are unevenly many), `relation_share` of
    them relations (None: the pretraining mix's)."""
    return PromptSampler(prompts, None if relation_share is None else form_weights(relation_share))


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
    shapes model's pretraining data (solrl/shapes/pretrain.py)."""

    def __init__(self, captions: list[str], weights: dict[str, float] | None = None) -> None:
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
