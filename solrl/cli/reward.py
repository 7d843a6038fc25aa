"""`solrl reward score`: PNGs scored against a prompt with one reward."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from solrl.config import ConfigError


def cmd_reward_score(a: argparse.Namespace) -> int:
    """Score PNG(s) against a prompt with one reward (or a weighted spec) and print JSON."""
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    from solrl.rewards import build_reward

    images = []
    for path in a.image:
        if not Path(path).is_file():
            raise ConfigError(f"--image {path}: no such file")
        try:
            with Image.open(path) as im:
                images.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
        except UnidentifiedImageError:
            raise ConfigError(f"--image {path}: not an image PIL can read") from None
    if len({im.shape for im in images}) != 1:
        raise ConfigError(f"--image: all images must have the same size, got {[list(im.shape[:2]) for im in images]}")
    try:
        scorer = build_reward(a.reward)
        batch = np.stack(images)
        prompts = [a.prompt] * len(images)
        detail = scorer.score_detailed(batch, prompts) if hasattr(scorer, "weights") else None
        scores = np.asarray(scorer(batch, prompts), dtype=np.float64) if detail is None else detail["total"]
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"--reward {a.reward}: {err}") from None
    # the same keys for one image or many: one entry per --image, in order
    out = {"reward": getattr(scorer, "name", a.reward), "prompt": a.prompt, "images": list(a.image),
           "scores": [float(x) for x in scores]}
    if detail is not None:
        out["components"] = {k: [float(x) for x in v] for k, v in detail.items() if k != "total"}
        out["weights"] = scorer.weights
    print(json.dumps(out))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    rw = sub.add_parser("reward", help="score images with a reward")
    rsub = rw.add_subparsers(dest="reward_cmd", required=True)
    rs = rsub.add_parser("score", help="score PNG(s) against a prompt; prints JSON: reward, prompt, images, scores")
    rs.add_argument("--reward", required=True, help="a reward name (solrl rewards list) or 'pickscore:1.0+ocr:0.5'")
    rs.add_argument("--image", required=True, action="append", help="a PNG (repeat for several)")
    rs.add_argument("--prompt", required=True, help="the prompt the images were drawn for")
    rs.set_defaults(fn=cmd_reward_score)

