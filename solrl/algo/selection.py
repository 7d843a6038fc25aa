"""Choosing which explored seeds to regenerate, from their proxy scores."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

SELECTION_MODES: tuple[str, ...] = ("best_worst", "random", "mean_deviation", "extremes_random")


def _score_list(scores: Sequence[float] | Tensor) -> list[float]:
    if isinstance(scores, Tensor):
        if scores.ndim != 1:
            raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
        values = scores.detach().cpu().double().tolist()
    elif isinstance(scores, Sequence) and not isinstance(scores, (str, bytes)):
        values = list(scores)
    else:
        raise ValueError(f"scores must be a sequence of floats or a 1-D Tensor, got {type(scores).__name__}")
    if not values:
        raise ValueError("scores must not be empty")
    if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) for v in values):
        raise ValueError("scores must be finite floats")
    return [float(v) for v in values]


def _descending(keys: list[float]) -> list[int]:
    """Indices by key, largest first; equal keys keep the lower index first."""
    return sorted(range(len(keys)), key=lambda i: (-keys[i], i))


def _ascending(keys: list[float]) -> list[int]:
    return sorted(range(len(keys)), key=lambda i: (keys[i], i))


def select(
    scores: Sequence[float] | Tensor,
    k: int,
    mode: str = "best_worst",
    generator: torch.Generator | None = None,
    valid: Sequence[bool] | None = None,
) -> list[int]:
    """Indices of the k scores to keep.

    Modes, as NVlabs/Sana `train_scripts/sol_rl/train_utils.py::select_indices_by_mode` defines them:
    - "best_worst": the k/2 highest, then the k/2 lowest (k must be even; the two halves are disjoint).
    - "random": k indices uniformly without replacement (from `generator`).
    - "mean_deviation": the k scores farthest from the mean, farthest first.
    - "extremes_random": the argmax and argmin (sorted by index, one if they coincide), then random
      others to make k; if k is no more than the extremes, the first k of them.
    Ties go to the lower index. Unlike the reference, an out-of-range k is an error, not clamped.

    `valid` (one bool a score; the validity gate, `guard.gate`): the failing candidates are left out while k valid
    ones remain; when fewer remain, as many failing ones as k needs are taken (the lowest-scored first) and a
    best_worst selection puts them in its worst half. None: every candidate is valid.
    """
    values = _score_list(scores)
    n = len(values)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}] (the number of scores), got {k}")
    if mode not in SELECTION_MODES:
        raise ValueError(f"mode must be one of {SELECTION_MODES}, got {mode!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    k = int(k)
    if valid is not None:
        return _gated(values, k, mode, generator, valid)

    if mode == "best_worst":
        if k % 2:
            raise ValueError(f"k must be even for mode 'best_worst', got {k}")
        best = _descending(values)[: k // 2]
        taken = set(best)
        worst = [i for i in _ascending(values) if i not in taken][: k // 2]
        return best + worst
    if mode == "random":
        return torch.randperm(n, generator=generator).tolist()[:k]
    if mode == "mean_deviation":
        mean = math.fsum(values) / n
        return _descending([abs(v - mean) for v in values])[:k]
    extremes = sorted({_descending(values)[0], _ascending(values)[0]})
    if k <= len(extremes):
        return extremes[:k]
    rest = [i for i in range(n) if i not in extremes]
    picks = torch.randperm(len(rest), generator=generator).tolist()[: k - len(extremes)]
    return extremes + [rest[j] for j in picks]


def _gated(values: list[float], k: int, mode: str, generator: torch.Generator | None, valid: Sequence[bool]) -> list[int]:
    ok = [bool(v) for v in valid]
    if len(ok) != len(values):
        raise ValueError(f"valid must have one entry a score ({len(values)}), got {len(ok)}")
    keep = [i for i in range(len(values)) if ok[i]]
    if len(keep) < k:   # too few pass: the failing ones that k needs, lowest-scored first
        keep += sorted((i for i in range(len(values)) if not ok[i]), key=lambda i: (values[i], i))[: k - len(keep)]
    if mode == "best_worst":
        best = sorted(keep, key=lambda i: (not ok[i], -values[i], i))[: k // 2]
        taken = set(best)
        return best + sorted((i for i in keep if i not in taken), key=lambda i: (values[i], i))[: k // 2]
    sub = select([values[i] for i in keep], k, mode, generator)
    return [keep[j] for j in sub]


# ---------------------------------------------------------------- how well a proxy's scores select

def prompt_kendall_taus(proxy, reference) -> list[float]:
    """Kendall tau-b of each prompt's proxy scores against its reference scores ([P, N] each), for the prompts
    where both sides vary (a constant side has no correlation)."""
    import numpy as np
    from scipy import stats

    return [float(stats.kendalltau(a, b).statistic) for a, b in zip(proxy, reference)
            if np.ptp(a) > 0 and np.ptp(b) > 0]


def kept_contrast(proxy, reference, kept: int = 8) -> float:
    """Mean over prompts of the reference score of the proxy's best kept/2 seeds minus its worst kept/2: the
    contrast a best-worst selection of `kept` seeds hands the trainer ([P, N] arrays)."""
    import numpy as np

    h = max(1, min(kept, proxy.shape[1]) // 2)
    return float(np.mean([r[np.argsort(-c, kind="stable")[:h]].mean() - r[np.argsort(c, kind="stable")[:h]].mean()
                          for c, r in zip(proxy, reference)]))
