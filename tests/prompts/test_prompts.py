"""Prompt sets: built-in sets, prompt files, their errors, the epoch draw, and evaluation with any reward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from solrl.config import ConfigError, RunConfig, apply_overrides, get_preset
from solrl.engine.evaluate import eval_prompt_set, evaluate
from solrl.prompts import (
    BUILTIN,
    PromptSetError,
    UniformPromptSampler,
    load_prompt_set,
    ocr_prompts,
    prompt_sampler,
)
from solrl.shapes.metrics import eval_prompts
from solrl.shapes.world import split_prompts


def test_builtin_sets():
    train, held = split_prompts()
    assert load_prompt_set("shapes:train") == list(train)
    assert load_prompt_set("shapes:held-out") == list(held)
    assert set(load_prompt_set("shapes:all")) == set(train) | set(held)
    ocr_train, ocr_test = load_prompt_set("ocr:train"), load_prompt_set("ocr:test")
    assert ocr_train == ocr_prompts("train") and len(ocr_train) > len(ocr_test) > 0
    def quoted(p: str) -> str:
        return p.split('"')[1]

    assert all(p.count('"') == 2 for p in ocr_train + ocr_test)
    assert not {quoted(p) for p in ocr_train} & {quoted(p) for p in ocr_test}  # held-out texts
    assert set(BUILTIN) >= {"shapes:train", "ocr:test"}


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("# pickscore-style prompt file\na red fox in snow\n\n  a lighthouse at dusk  \na red fox in snow\n")
    assert load_prompt_set(str(txt)) == ["a red fox in snow", "a lighthouse at dusk"]  # stripped, deduplicated
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": p, "tag": "x"}) for p in ("one cat", "two dogs")) + "\n")
    assert load_prompt_set(str(jsonl)) == ["one cat", "two dogs"]
    js = tmp_path / "l.json"
    js.write_text(json.dumps(["a", {"prompt": "b"}]))
    assert load_prompt_set(str(js)) == ["a", "b"]


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "not found"),
    ("p.csv", "a\n", "unsupported suffix '.csv'"),
    ("e.txt", "# only a comment\n\n", "holds no prompts"),
    ("bad.jsonl", '{"prompt": "ok"}\nnot json\n', "line 2: not JSON"),
    ("nokey.jsonl", '{"caption": "x"}\n', 'line 1: expected an object with a "prompt" field'),
    ("num.json", '["ok", 3]', "item 1: the prompt must be a non-empty string"),
    ("obj.json", '{"prompt": "x"}', "expected a JSON list"),
])
def test_bad_prompt_files_name_the_problem(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(PromptSetError, match=message):
        load_prompt_set(str(path))


def test_unknown_builtin_and_empty_name():
    with pytest.raises(PromptSetError, match="unknown built-in prompt set 'ocr:val'"):
        load_prompt_set("ocr:val")
    with pytest.raises(PromptSetError, match="a prompt set is required"):
        load_prompt_set("")


def test_real_presets_require_prompt_sets():
    with pytest.raises(ConfigError, match=r"prompts.train is required for model 'flux1-dev'.*--set prompts.train="):
        get_preset("flux1-sol-rl").validate()
    cfg = apply_overrides(get_preset("flux1-sol-rl"), ["prompts.train=ocr:train"])
    with pytest.raises(ConfigError, match="prompts.eval is required"):
        cfg.validate()


def test_configs_written_before_prompt_sets_still_load():
    data = get_preset("shapes-sol-rl").to_dict()
    del data["prompts"]
    assert RunConfig.from_dict({**data, "prompt_split": "all"}).prompts.train == "shapes:all"
    assert RunConfig.from_dict({**data, "prompt_split": "train"}).prompts.train == "shapes:train"


def test_uniform_draw_is_deterministic_and_distinct():
    prompts = ocr_prompts("train")
    draw = UniformPromptSampler(prompts)
    a, b = draw(np.random.default_rng(3), 48), draw(np.random.default_rng(3), 48)
    assert a == b and len(set(a)) == 48  # distinct when the set is large enough
    small = UniformPromptSampler(["x", "y"])(np.random.default_rng(0), 5)
    assert len(small) == 5 and set(small) <= {"x", "y"}
    assert type(prompt_sampler("ocr:train", prompts)) is UniformPromptSampler
    assert type(prompt_sampler("shapes:train", list(split_prompts()[0]))) is not UniformPromptSampler


def test_shapes_relation_share():
    """prompts.relation_share sets the share of relation captions in an epoch's shapes prompts; the default
    draws exactly what the form-balanced sampler drew before the setting existed (same rng, same prompts)."""
    from solrl.shapes.prompts import FORM_WEIGHTS, PromptSampler
    from solrl.shapes.world import parse

    train = list(split_prompts()[0])
    default = RunConfig().prompts.relation_share
    rng = lambda: np.random.default_rng(5)  # noqa: E731
    assert prompt_sampler("shapes:train", train, default)(rng(), 64) == PromptSampler(train, FORM_WEIGHTS)(rng(), 64)
    for share in (0.2, 0.6):
        forms = [parse(c).form for c in prompt_sampler("shapes:train", train, share)(np.random.default_rng(0), 4000)]
        assert abs(forms.count("relation") / 4000 - share) < 0.03
        assert abs(forms.count("single") / forms.count("count") - 2.0) < 0.3  # the rest stays 2:1
    for bad in ("0", "1", "1.5"):
        with pytest.raises(ConfigError, match="prompts.relation_share"):
            apply_overrides(get_preset("shapes-sol-rl"), [f"prompts.relation_share={bad}"]).validate()
    with pytest.raises(ConfigError, match="shapes world's prompt sets only"):
        apply_overrides(get_preset("shapes-sol-rl"), ["prompts.train=ocr:train", "prompts.relation_share=0.2"]).validate()
    apply_overrides(get_preset("shapes-sol-rl"), ["prompts.train=ocr:train"]).validate()  # the default is no error


def test_eval_prompt_sets():
    assert eval_prompt_set("shapes:held-out", 12) == eval_prompts(12)
    assert eval_prompt_set("ocr:test", 5) == ocr_prompts("test")[:5]
    with pytest.raises(ValueError, match="positive"):
        eval_prompt_set("ocr:test", 0)


def test_evaluate_with_another_reward_and_a_multi_reward():
    """The bundled shapes model on shapes prompts, scored by a non-shapes reward and a weighted mix."""
    import torch

    from solrl.engine.session import Session
    from solrl.rewards import build_reward

    torch.set_num_threads(1)
    cfg = apply_overrides(get_preset("shapes-sol-rl"), ["tensorboard=false", "eval.reward=jpeg_compressibility",
                                                         "eval.prompts=3", "eval.seeds_per_prompt=1",
                                                         "eval.steps=2"]).validate()
    sess = Session.build(cfg)
    summary, grids = sess.evaluate()
    assert summary["reward"] == "jpeg_compressibility" and summary["n"] == 3 and "colour_accuracy" not in summary
    assert -10 < summary["mean_reward"] < 0 and set(grids) == {2}

    mix = build_reward("shapes:1+jpeg_compressibility:0.5")
    prompts = eval_prompts(3)
    with sess.adapters.use("ema"):
        s, _ = evaluate(sess.model, sess.model.transformer, (2,), prompts, 1, 7, sess.sampler, mix)
        plain, _ = evaluate(sess.model, sess.model.transformer, (2,), prompts, 1, 7, sess.sampler)
    res = s["results"]["2"]
    assert set(res["components"]) == {"shapes", "jpeg_compressibility"}
    assert res["components"]["shapes"] == pytest.approx(plain["mean_reward"], abs=1e-6)
    assert res["mean_reward"] == pytest.approx(res["components"]["shapes"] + 0.5 * res["components"]["jpeg_compressibility"],
                                               abs=1e-5)
