"""The embedded loop: determinism, exact resume, the four modes, forward counts, and run outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from solrl.config import get_preset
from solrl.engine.loop import train
from solrl.engine.session import Session
from solrl.rollout.passes import SamplerSpec, generate
from solrl.shapes.model import ShapesModel
from solrl.telemetry import read_metrics, strip_timings

# jpeg_compressibility gives a random model real reward differences (the shapes reward would be 0 for all).
TINY = ["reward=jpeg_compressibility", "rollout.prompts_per_epoch=2", "rollout.pool=6", "rollout.kept=4",
        "rollout.explore_steps=2",
        "rollout.steps=3", "train.micro_batch=4", "eval.prompts=3", "eval.seeds_per_prompt=1", "eval.every=0",
        "tensorboard=false", "lora.rank=4", "lora.alpha=8"]


@pytest.fixture(scope="module")
def random_model_dir(tmp_path_factory) -> Path:
    """A seeded random shapes model: the loop's mechanics do not need trained weights."""
    d = tmp_path_factory.mktemp("rand_shapes")
    ShapesModel.random(seed=0, layers=6, heads=4).save(d)
    return d


def tiny_cfg(model_dir: Path, preset: str = "shapes-sol-rl", epochs: int = 2, extra: list[str] | None = None):
    from solrl.config import apply_overrides

    return apply_overrides(get_preset(preset), TINY + [f"model.path={model_dir}", f"epochs={epochs}"]
                           + (extra or [])).validate()


def test_same_seed_gives_identical_metrics_and_adapters(random_model_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny_cfg(random_model_dir), a, progress=False, log=lambda *_: None)
    train(tiny_cfg(random_model_dir), b, progress=False, log=lambda *_: None)
    ma = [strip_timings(r) for r in read_metrics(a / "metrics.jsonl")]
    mb = [strip_timings(r) for r in read_metrics(b / "metrics.jsonl")]
    assert ma == mb
    assert len(ma) == 3  # epoch 0 (evaluation before training) + 2 epochs
    assert (a / "adapter_ema.safetensors").read_bytes() == (b / "adapter_ema.safetensors").read_bytes()
    # and a different seed gives a different trajectory
    c = tmp_path / "c"
    train(tiny_cfg(random_model_dir, extra=["seed=1"]), c, progress=False, log=lambda *_: None)
    assert [strip_timings(r) for r in read_metrics(c / "metrics.jsonl")][1:] != ma[1:]


def test_resume_continues_the_same_trajectory(random_model_dir, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train(tiny_cfg(random_model_dir, epochs=3), full, progress=False, log=lambda *_: None)
    train(tiny_cfg(random_model_dir, epochs=1), part, progress=False, log=lambda *_: None)
    # resume with more epochs, as `solrl train --resume DIR --epochs 3` does
    cfg = tiny_cfg(random_model_dir, epochs=3)
    train(cfg, part, resume=True, progress=False, log=lambda *_: None)
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        assert (full / "checkpoints/epoch_0003" / name).read_bytes() == (part / "checkpoints/epoch_0003" / name).read_bytes()
    assert (full / "adapter_ema.safetensors").read_bytes() == (part / "adapter_ema.safetensors").read_bytes()
    # the 1-epoch run also evaluated at its end (epoch 1); compare everything else
    def train_only(path):
        return [{k: v for k, v in strip_timings(r).items() if not k.startswith("eval.")}
                for r in read_metrics(path / "metrics.jsonl")]

    assert train_only(full) == train_only(part)
    assert len(train_only(part)) == 4


def test_resume_without_checkpoint_is_a_clear_error(random_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(tiny_cfg(random_model_dir), tmp_path / "empty", resume=True, progress=False)


@pytest.mark.parametrize("preset", ["shapes-sol-rl", "shapes-diffusion-nft", "shapes-naive-scaling",
                                    "shapes-naive-quant"])
def test_modes_run_and_count_forwards(random_model_dir, tmp_path, preset):
    cfg = tiny_cfg(random_model_dir, preset, epochs=1)
    s = train(cfg, tmp_path / preset, progress=False, log=lambda *_: None)
    rec = read_metrics(tmp_path / preset / "metrics.jsonl")[-1]
    P, n, k, es, fs = 2, 6, 4, 2, 3  # prompts, pool, kept, explore steps, full steps (TINY)
    expected = {
        "shapes-sol-rl": (P * n * es, P * k * fs),
        "shapes-diffusion-nft": (0, P * k * fs),
        "shapes-naive-scaling": (0, P * n * fs),
        "shapes-naive-quant": (P * n * fs, 0),
    }[preset]
    assert (rec.get("forwards_explore", 0), rec["forwards_regenerate"]) == expected
    assert rec["train.samples"] == P * k
    assert np.isfinite(rec["train.loss"])
    assert rec["rollout.reward_std"] > 0 and rec["train.grad_norm"] > 0
    if preset == "shapes-sol-rl":
        assert "proxy_gap" in rec and "proxy_kendall_tau" in rec
        assert s["explorer_weight_bytes"]["quantized"] <= 0.30 * s["explorer_weight_bytes"]["quantized_bf16"]
    for f in ("config.json", "summary.json", "reward_curve.png", "adapter_ema.safetensors",
              "checkpoints/latest", "eval/epoch_0001/eval.json", "eval/epoch_0001/grid_10steps.png"):
        assert (tmp_path / preset / f).exists(), f


def test_regeneration_is_batch_independent(random_model_dir):
    sess = Session.build(tiny_cfg(random_model_dir))
    prompts = ["a red circle", "two blue squares", "a green triangle above a cyan circle"] * 3
    seeds = list(range(100, 109))
    sampler = SamplerSpec("euler")
    with sess.adapters.use("old"):
        whole = generate(sess.model, sess.model.transformer, prompts, seeds, 3, sampler, micro_batch=16)
        alone = generate(sess.model, sess.model.transformer, prompts[4:5], seeds[4:5], 3, sampler, micro_batch=1)
        chunks = generate(sess.model, sess.model.transformer, prompts, seeds, 3, sampler, micro_batch=4)
    torch.testing.assert_close(alone.x0[0], whole.x0[4], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunks.x0, whole.x0, rtol=0, atol=1e-5)
    assert np.array_equal(alone.images[0], whole.images[4])


def test_training_changes_the_adapter_and_old_follows(random_model_dir):
    sess = Session.build(tiny_cfg(random_model_dir))
    before = [p.clone() for p in sess.adapters.parameters("default")]
    old_before = [p.clone() for p in sess.adapters.parameters("old")]
    rec = sess.epoch(0)
    after = sess.adapters.parameters("default")
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    # once at the end of the epoch: old <- d * old + (1 - d) * new, d = min(0.001 * global step, 0.5)
    d = min(0.001 * sess.trainer.global_step, 0.5)
    assert sess.trainer.global_step == rec["train.optimizer_steps"] >= 1
    for o, ob, n in zip(sess.adapters.parameters("old"), old_before, after):
        torch.testing.assert_close(o, d * ob + (1 - d) * n, rtol=1e-5, atol=1e-7)
    assert rec["adapter_version"] == 0 and sess.version == 1


def test_no_selection_trains_the_first_k_seeds_of_the_pool_the_other_modes_draw(random_model_dir):
    """A run seed gives diffusion_nft (pool set above kept) and the selecting modes the same prompts and pool of noises:
    its k trained samples of each prompt are the first k of the pool naive_scaling samples (kept = pool: all of it)."""
    from solrl.engine.session import epoch_rng

    def first_epoch(extra):
        sess = Session.build(tiny_cfg(random_model_dir, extra=extra))
        rng, tgen = epoch_rng(sess.cfg.seed, 0, 0)
        with sess.sampling_adapter():
            x0, rewards, prompts, group, *_ = sess.rollouts(rng, tgen, {})
        return x0, prompts, group

    none_x0, none_p, none_g = first_epoch(["rollout.mode=diffusion_nft"])
    all_x0, all_p, all_g = first_epoch(["rollout.mode=naive_scaling", "rollout.kept=6"])
    assert len(none_x0) == 2 * 4 and len(all_x0) == 2 * 6 and sorted(set(none_p)) == sorted(set(all_p))
    for g in set(none_g):
        mine = none_x0[[i for i, x in enumerate(none_g) if x == g]]
        pool = all_x0[[i for i, x in enumerate(all_g) if x == g]]
        # each trained sample is one of the pool's (naive_scaling orders its kept by reward), and they are distinct
        match = [int(torch.cdist(m.reshape(1, -1), pool.reshape(len(pool), -1)).argmin()) for m in mine]
        assert len(set(match)) == 4
        for m, j in zip(mine, match):
            torch.testing.assert_close(m, pool[j], rtol=0, atol=1e-5)


def test_trained_spread_reads_each_groups_halves():
    from solrl.engine.session import trained_spread

    got = trained_spread(np.array([[0.0, 1.0, 0.5, 0.5], [0.2, 0.2, 0.2, 0.2]]))
    assert got["rollout.half_gap"] == pytest.approx((0.75 - 0.25 + 0.0) / 2)
    assert got["rollout.group_std"] == pytest.approx((np.std([0, 1, 0.5, 0.5]) + 0.0) / 2)
    assert trained_spread(np.array([[0.3], [0.4]])) == {}


def test_run_dir_outputs(random_model_dir, tmp_path):
    run = tmp_path / "r"
    train(tiny_cfg(random_model_dir, extra=["tensorboard=true"]), run, progress=False, log=lambda *_: None)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["rollout"]["pool"] == 6
    recs = read_metrics(run / "metrics.jsonl")
    keys = set(recs[-1])
    for k in ("explore.reward_mean", "explore.reward_std", "rollout.reward_mean", "rollout.reward_std",
              "proxy_gap", "proxy_kendall_tau", "time_explore_s", "time_regenerate_s", "time_train_s",
              "forwards_explore", "forwards_regenerate", "train.loss", "train.grad_norm", "adapter_version"):
        assert k in keys, k
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_cli_train_then_eval_of_the_run(random_model_dir, tmp_path, capsys):
    from solrl.cli.app import main

    run = tmp_path / "cli_run"
    args = ["train", "--out", str(run), "--epochs", "1", "--no-progress"]
    # an explorer that travels between machines: BF16 kernels where this CPU has them, else the NVFP4 emulation
    for o in TINY + [f"model.path={random_model_dir}", "rollout.explore_precision.backend=bf16-cpu",
                     "rollout.explore_precision.fallback=nvfp4-emu"]:
        args += ["--set", o]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out reward (EMA adapter)" in out
    saved = json.loads((run / "config.json").read_text())["rollout"]["explore_precision"]
    # the explorer that ran, as the run's config names it (with why, where a fallback was resolved)
    assert f"explorer: {saved['backend']} at 2 steps ({saved['note']})" in out and saved["fallback"] == ""
    assert saved["backend"] in ("bf16-cpu", "nvfp4-emu") and saved["note"].startswith(saved["backend"])
    assert main(args) == 2  # the same --out again: refuses to overwrite a run
    assert "already holds a run" in capsys.readouterr().err
    out = tmp_path / "ev"
    assert main(["eval", "--checkpoint", str(run), "--out", str(out), "--steps", "2", "--prompts", "2"]) == 0
    ev = json.loads((out / "eval.json").read_text())
    assert ev["checkpoint"] == str(run) and ev["adapter"] == "ema" and ev["n"] == 2
    assert 0.0 <= ev["mean_reward"] <= 1.0 and (out / "grid_2steps.png").exists()
    # any saved epoch, not only the latest: 0 is the untrained adapter, a missing one names what is saved
    from safetensors.torch import load_file

    from solrl.engine.session import load_run_for_eval

    saved = load_file(str(run / "checkpoints" / "epoch_0001" / "adapters.safetensors"))
    ema1 = load_run_for_eval(run, 1).adapters.state_dict("ema")
    ema0 = load_run_for_eval(run, 0).adapters.state_dict("ema")
    assert all(torch.equal(v, saved[f"ema/{k}"]) for k, v in ema1.items())
    assert any(not torch.equal(v, ema0[k]) for k, v in ema1.items())
    assert main(["eval", "--checkpoint", str(run), "--epoch", "0", "--out", str(tmp_path / "e0"), "--steps", "2",
                 "--prompts", "2", "--seeds-per-prompt", "2", "--set", "eval.reward=shapes"]) == 0
    ev0 = json.loads((tmp_path / "e0" / "eval.json").read_text())
    assert ev0["epoch"] == 0 and ev0["reward"] == "shapes" and "shape_accuracy" in ev0
    groups = ev0["results"]["2"]["groups_by_form"]   # 2 seeds per prompt: each form's group statistics
    assert sum(g["prompts"] for g in groups.values()) == 2 and set(groups) == set(ev0["results"]["2"]["by_form"])
    assert main(["eval", "--checkpoint", str(run), "--epoch", "7", "--out", str(tmp_path / "e7")]) == 2
    assert "no checkpoint of epoch 7; saved epochs: [1]" in capsys.readouterr().err
    assert main(["eval", "--epoch", "1", "--out", str(tmp_path / "e1")]) == 2
    assert "--epoch needs --checkpoint RUN_DIR" in capsys.readouterr().err


def test_evaluation_copies_the_summary_fields_its_scorer_reports():
    """The core does not know a scorer's metric names: what `score_with_metrics` says sums an evaluation up is in the
    summary and the run's records (eval.<field>), of the first step count; its other metrics only in the results."""
    from solrl.engine.evaluate import eval_metrics, evaluate

    class Lit:
        name = "lit"

        def __call__(self, images, prompts):
            return np.full(len(prompts), 0.25, dtype=np.float32)

        def score_with_metrics(self, images, prompts, seeds_per_prompt=1):
            lit = float(images.mean())
            return np.full(len(prompts), 0.25), {"lit": lit, "lit_by_seed": list(images.mean(axis=(1, 2, 3)))}, \
                {"lit": lit, "scored": len(prompts) // seeds_per_prompt}

    model = ShapesModel.random(seed=0, layers=1, heads=2)
    summary, _ = evaluate(model, model.transformer, (2, 3), ["a red circle", "two blue squares"], 2, 7, SamplerSpec(),
                          Lit())
    r2, r3 = summary["results"]["2"], summary["results"]["3"]
    assert eval_metrics(summary) == {"eval.mean_reward": 0.25, "eval.flat_share": r2["flat_share"],
                                     "eval.mean_reward_not_flat": r2["mean_reward_not_flat"],
                                     "eval.diversity": r2["diversity"], "eval.duplicate_share": r2["duplicate_share"],
                                     "eval.lit": r2["lit"], "eval.scored": 2}
    assert list(r2) == ["mean_reward", "n", "flat_share", "mean_reward_not_flat", "sample_time_s", "lit", "lit_by_seed",
                        "diversity", "duplicate_share"]
    assert r2["lit"] != r3["lit"] and r2["mean_reward_not_flat"] in (0.25, None)
    assert summary["reward"] == "lit" and "lit_by_seed" not in summary


def test_a_weighted_rewards_terms_reach_the_records():
    """A weighted multi-reward's evaluation sums itself up by each term's (unweighted) mean, so a run's records
    carry them (eval.reward_<term>) beside the weighted total."""
    from solrl.engine.evaluate import eval_metrics, evaluate
    from solrl.rewards import build_reward

    model = ShapesModel.random(seed=0, layers=1, heads=2)
    summary, _ = evaluate(model, model.transformer, (2,), ["a red circle", "two blue squares"], 2, 7, SamplerSpec(),
                          build_reward("shapes:1+jpeg_compressibility:0.5"))
    rec = eval_metrics(summary)
    shapes, jpeg = rec["eval.reward_shapes"], rec["eval.reward_jpeg_compressibility"]
    assert jpeg < 0 and 0 <= shapes <= 1 and rec["eval.mean_reward"] == pytest.approx(shapes + 0.5 * jpeg, abs=1e-5)
    assert summary["results"]["2"]["components"] == {"shapes": shapes, "jpeg_compressibility": jpeg}


def test_flat_share_counts_blank_images_whatever_the_reward(monkeypatch):
    from solrl.algo.guards import FLAT_STD, is_flat
    from solrl.engine.evaluate import evaluate, flat_share

    rng = np.random.default_rng(0)
    blank = np.clip(240 + rng.normal(0, 2, size=(3, 32, 32, 3)), 0, 255).astype(np.uint8)  # a canvas, noise of 2
    drawn = blank.copy()
    drawn[:, 12:18, 12:18] = (200, 30, 30)  # one small red square: 3.5% of the image
    assert blank.reshape(3, -1).std(axis=1).max() < FLAT_STD < drawn.reshape(3, -1).std(axis=1).min()
    assert flat_share(np.concatenate([blank[:1], drawn])) == 0.25 and flat_share(blank) == 1.0
    assert flat_share(drawn[:, None].repeat(2, axis=1)) == 0.0  # clips: all their frames
    assert flat_share(blank[:0]) == 0.0

    class Canvas:  # rewards a flat canvas 1 and anything drawn 0
        name = "canvas"

        def __call__(self, images, prompts):
            return is_flat(images).astype(np.float32)

    import solrl.engine.evaluate as ev

    real = ev.generate

    def half_blank(*a, **k):  # the model's own images, every second one replaced by a blank canvas
        g = real(*a, **k)
        g.images[::2] = blank[0]
        return g

    monkeypatch.setattr(ev, "generate", half_blank)
    model = ShapesModel.random(seed=0, layers=1, heads=2)
    summary, _ = evaluate(model, model.transformer, (2,), ["a red circle", "two blue squares"], 2, 7, SamplerSpec(),
                          Canvas())
    assert summary["flat_share"] >= 0.5 and summary["mean_reward"] == summary["flat_share"]
    assert summary["mean_reward_not_flat"] in (0.0, None)


def test_group_stats_per_caption_form():
    """eval.json's groups_by_form (seeds_per_prompt > 1): per form, the share of prompts with an exactly right
    seed, the mean group std and the mean best-minus-mean, from hand-computed groups."""
    from solrl.shapes.metrics import group_stats

    prompts = ["a red circle on the left"] * 3 + ["a blue square above a red circle"] * 3 + \
              ["a green triangle to the left of a red square"] * 3
    totals = np.array([1.0, 0.5, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0, 0.25])
    got = group_stats(totals, prompts, 3)
    assert set(got) == {"position", "relation"}
    assert got["position"] == pytest.approx({"prompts": 1, "with_an_exact_seed": 1.0, "group_std": np.std([1, .5, 0]),
                                             "best_minus_mean": 0.5})
    assert got["relation"] == pytest.approx({"prompts": 2, "with_an_exact_seed": 0.5,
                                             "group_std": (0.0 + np.std([1, 1, .25])) / 2,
                                             "best_minus_mean": (0.0 + 0.25) / 2})


def test_relation_order_reads_the_relation_word_apart_from_the_objects():
    """relation_order: over relation images holding exactly the two prompted colours, the share in the prompted
    order. Ground truth scores 1; the same renders scored against the opposite relation score 0; images that
    miss a colour and other forms are not counted; none qualifying gives None."""
    from solrl.bench.relations import opposite
    from solrl.shapes.metrics import relation_order
    from solrl.shapes.reward import ShapesReward
    from solrl.shapes.world import parse, render

    rng = np.random.default_rng(5)
    captions = ["a red circle to the left of a blue square", "a green triangle above a yellow circle",
                "a purple square below a cyan triangle", "a blue circle to the right of a red triangle"] * 3
    images = np.stack([render(parse(c), rng) for c in captions])
    swapped = [opposite(c) for c in captions]
    reward = ShapesReward()
    assert relation_order(reward.score_detailed(images, captions), captions) == (1.0, 12)
    assert relation_order(reward.score_detailed(images, swapped), swapped) == (0.0, 12)
    # half the images in the prompted order, half reversed: 0.5, the level of a model that ignores the word
    mixed = captions[:6] + swapped[6:]
    assert relation_order(reward.score_detailed(images, mixed), mixed) == (0.5, 12)
    # a blank canvas (no colours found) and a single-object prompt do not count
    blank = np.full_like(images[:2], 255)
    extra = [captions[0], "a red circle on the left"]
    detail = reward.score_detailed(np.concatenate([images, blank]), captions + extra)
    assert relation_order(detail, captions + extra) == (1.0, 12)
    assert relation_order(reward.score_detailed(blank, extra), extra) == (None, 0)


def test_model_device_is_checked_and_cpu_runs_as_the_default(random_model_dir, tmp_path):
    from solrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.device='gpu0'"):
        tiny_cfg(random_model_dir, extra=["model.device=gpu0"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="model.device='cuda'.*no CUDA device"):
            tiny_cfg(random_model_dir, extra=["model.device=cuda"])
    # an explicit cpu is the default's trajectory, byte for byte
    a, b = tmp_path / "default", tmp_path / "cpu"
    train(tiny_cfg(random_model_dir, epochs=1), a, progress=False, log=lambda *_: None)
    train(tiny_cfg(random_model_dir, epochs=1, extra=["model.device=cpu"]), b, progress=False, log=lambda *_: None)
    assert (a / "adapter_ema.safetensors").read_bytes() == (b / "adapter_ema.safetensors").read_bytes()


@pytest.mark.gpu
def test_shapes_run_on_cuda(tmp_path):
    """The bundled base on a GPU (model.device=cuda): the denoiser in real bf16 there, the LoRA trained, and the
    held-out reward the CPU run starts from (the same noise, drawn on the CPU; kernels differ by rounding only)."""
    from solrl.config import apply_overrides

    sets = ["epochs=2", "eval.every=2", "eval.prompts=8", "eval.seeds_per_prompt=1", "tensorboard=false",
            "rollout.prompts_per_epoch=4"]
    cuda = apply_overrides(get_preset("shapes-sol-rl"), sets + ["model.device=cuda"]).validate()
    sess = Session.build(cuda)
    p = next(sess.model.transformer.parameters())
    assert p.is_cuda and p.dtype == torch.bfloat16
    before = [t.detach().clone() for t in sess.adapters.parameters("default")]
    assert all(t.is_cuda for t in before)
    rec = sess.epoch(0)
    assert np.isfinite(rec["train.loss"]) and rec["train.grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, sess.adapters.parameters("default")))
    s_gpu = train(cuda, tmp_path / "cuda", progress=False, log=lambda *_: None)
    s_cpu = train(apply_overrides(get_preset("shapes-sol-rl"), sets + ["epochs=0"]).validate(), tmp_path / "cpu",
                  progress=False, log=lambda *_: None)
    assert abs(s_gpu["eval_before"] - s_cpu["eval_before"]) < 0.1  # 8 prompts: bf16 may flip a few detections
    assert np.isfinite(s_gpu["eval_after"])
