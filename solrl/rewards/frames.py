"""Image rewards on video: each clip's frames scored as images against the clip's prompt, averaged per clip.

A video model decodes, for its rewards, the frames `reward_frames` names (`solrl.models.wan.WanModel.decode`):
"first" -> frame 0 only (what the MMDanceGRPO design scores with HPSv3: the decoded video's first frame), "mean"
-> every frame, whose scores are averaged. So `score_frames` needs no mode: it averages over the frames it is
given (one frame: that frame's score, exactly). Images [B, H, W, 3] go to the scorer unchanged.

Which rewards can score a frame: any reward of an arbitrary RGB image and a prompt (HPS, PickScore, CLIPScore,
ImageReward, OCR, JPEG compressibility). The shapes world's rewards cannot: they parse renders of that world
(`RewardInfo.frames` = False), and a video run naming one is refused before any work (RunConfig.validate).
"""

from __future__ import annotations

import numpy as np

REWARD_FRAMES = ("first", "mean")


def score_frames(scorer, images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """float32 [B] rewards of images [B, H, W, 3] (`scorer(images, prompts)` as is) or of clips' frames
    [B, F, H, W, 3] (every frame scored with its clip's prompt, in one scorer call, then the mean over F)."""
    images = np.asarray(images)
    if images.ndim != 5:
        return np.asarray(scorer(images, prompts), dtype=np.float32)
    b, f = images.shape[:2]
    if len(prompts) != b:
        raise ValueError(f"got {len(prompts)} prompts for {b} clips")
    flat = scorer(images.reshape(b * f, *images.shape[2:]), [p for p in prompts for _ in range(f)])
    scores = np.asarray(flat, dtype=np.float32).reshape(b, f)
    return scores[:, 0].copy() if f == 1 else scores.mean(axis=1, dtype=np.float64).astype(np.float32)


def first_frames(images: np.ndarray) -> np.ndarray:
    """Frame 0 of each clip [B, F, H, W, 3] -> [B, H, W, 3] (images pass through): what sample grids show."""
    images = np.asarray(images)
    return images[:, 0] if images.ndim == 5 else images


def frame_incapable(name: str) -> list[str]:
    """The rewards of `name` (a registry name or a weighted spec 'a:1+b:0.5') that cannot score a video frame."""
    from solrl.rewards import reward_info
    from solrl.rewards.multi import is_spec, parse_spec

    names = list(parse_spec(name)) if is_spec(name) else [name]
    return [n for n in names if not reward_info(n).frames]


__all__ = ["REWARD_FRAMES", "first_frames", "frame_incapable", "score_frames"]
