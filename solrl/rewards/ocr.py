"""`ocr`: does the image show the text the prompt asks for? Needs no downloaded weights.

Recognition: `rapidocr_onnxruntime` (PP-OCRv4 detection + recognition, ONNX models shipped inside
the wheel, runs offline on CPU). Reward, following Flow-GRPO's OCR reward (yifan123/flow_grpo,
`flow_grpo/ocr.py`):
  target     = the text between the first pair of double quotes in the prompt
  recognised = all text boxes the OCR keeps (confidence >= 0.5), concatenated in reading order
  both have spaces removed and are lower-cased
  d = 0 if target is a substring of recognised, else Levenshtein(recognised, target), capped at len(target)
  reward = 1 - d / len(target)                                          (in [0, 1])
One difference: Flow-GRPO hands RGB arrays to an OCR that expects BGR; we convert to BGR.
Levenshtein distance: rapidfuzz.
"""

from __future__ import annotations

import re

import numpy as np

from solrl.rewards.inputs import PromptError, check_images

_QUOTED = re.compile(r'"([^"]*)"')


def quoted_text(prompt: str) -> str:
    """The text between the first pair of double quotes (PromptError if there is none or it is empty)."""
    if not isinstance(prompt, str):
        raise PromptError(f"prompts: expected a string, got {type(prompt).__name__}")
    m = _QUOTED.search(prompt)
    if m is None:
        raise PromptError(f'prompts: the ocr reward needs the text to render in double quotes, e.g. '
                          f'a sign that says "OPEN"; got {prompt!r}')
    if not normalize(m.group(1)):
        raise PromptError(f"prompts: the quoted text is empty in {prompt!r}")
    return m.group(1)


def normalize(text: str) -> str:
    """Flow-GRPO's normalisation: spaces removed, lower case."""
    return text.replace(" ", "").lower()


def text_reward(recognised: str, target: str) -> float:
    """1 - capped, target-normalised edit distance between recognised and target text (Flow-GRPO's form)."""
    from rapidfuzz.distance import Levenshtein

    rec, tgt = normalize(recognised), normalize(target)
    if not tgt:
        raise ValueError("target text is empty")
    dist = 0 if tgt in rec else min(Levenshtein.distance(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)


class OcrReward:
    """OCR reward of uint8 images [B, H, W, 3] against prompts with the text in double quotes."""

    name = "ocr"
    needs_weights = False

    def __init__(self, *, min_confidence: float = 0.5, threads: int = 0) -> None:
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as err:
            raise ImportError("the ocr reward needs rapidocr_onnxruntime and rapidfuzz: "
                              "pip install 'solrl[ocr]' (or rapidocr_onnxruntime==1.4.4 rapidfuzz==3.14.6)") from err
        kw = {"text_score": min_confidence, "print_verbose": False}
        if threads:
            kw["intra_op_num_threads"] = threads
        self._ocr = RapidOCR(**kw)

    def recognise(self, image: np.ndarray) -> str:
        """All text the OCR finds in one uint8 HWC RGB image, boxes joined in the detector's order."""
        bgr = np.ascontiguousarray(image[..., ::-1])
        result, _ = self._ocr(bgr)
        return "".join(str(box[1]) for box in result or [])

    def __call__(self, images: np.ndarray, prompts: list[str]) -> np.ndarray:
        images = check_images(images, len(prompts))
        targets = [quoted_text(p) for p in prompts]  # every prompt is checked before any OCR runs
        return np.array([text_reward(self.recognise(img), t) for img, t in zip(images, targets)], dtype=np.float32)
