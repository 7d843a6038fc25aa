"""`solrl shapes pretrain`: a few real steps, checkpoints that load through the registry, EMA weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from solrl.models import load_model
from solrl.shapes.model import ShapesModel
from solrl.shapes.pretrain import PretrainConfig, lr_at, pretrain
from solrl.shapes.prompts import PromptSampler, form_weights
from solrl.shapes.world import parse, split_prompts


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.transformer.parameters()])


def test_pretrain_steps_save_loadable_checkpoints_and_ema(tmp_path):
    torch.set_num_threads(1)
    small = dict(layers=2, heads=2, eval_every=0)
    raw = pretrain(PretrainConfig(steps=4, batch_size=4, save_every=2, seed=3, **small), tmp_path / "raw",
                   progress=False)
    ema = pretrain(PretrainConfig(steps=4, batch_size=4, save_every=2, seed=3, ema_decay=0.5,
                                  t_sampling="logit_normal", **small), tmp_path / "ema", progress=False)
    logs = [json.loads(x) for x in (tmp_path / "raw" / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2, 3, 4] and all(r["loss"] > 0 for r in logs)
    for run in ("raw", "ema"):
        for step in ("step_00002", "step_00004"):
            assert load_model("shapes", tmp_path / run / step).spec.name == "shapes"
            card = json.loads((tmp_path / run / step / "card.json").read_text())
            assert card["steps_done"] == int(step[-5:])
    # the saved weights are the returned ones; with EMA they differ from any raw training state
    assert torch.equal(_params(load_model("shapes", tmp_path / "raw" / "step_00004")), _params(raw))
    assert torch.equal(_params(load_model("shapes", tmp_path / "ema" / "step_00004")), _params(ema))
    assert not torch.equal(_params(raw), _params(ema))
    # same seed -> same run (fixed-seed CPU pretraining is reproducible)
    again = pretrain(PretrainConfig(steps=4, batch_size=4, save_every=4, seed=3, **small), tmp_path / "again",
                     progress=False)
    assert torch.equal(_params(again), _params(raw))


def test_pretrain_tracks_the_exact_reward_on_both_splits(tmp_path):
    torch.set_num_threads(1)
    cfg = PretrainConfig(steps=3, batch_size=2, save_every=3, seed=1, layers=1, heads=2, eval_every=2,
                         eval_prompts=3, eval_steps=2, track_guidance=4.0)
    pretrain(cfg, tmp_path, progress=False)
    recs = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 3]  # every eval_every steps and at the end
    for r in recs:
        for split in ("heldout", "train", "heldout_guided"):
            assert set(r[split]) >= {"mean_reward", "shape_accuracy", "exact_match"}
            assert 0.0 <= r[split]["mean_reward"] <= 1.0
            assert any(k.startswith("form_") for k in r[split])


def test_guided_tracking_scores_the_guided_samples():
    """heldout_guided is the held-out evaluation sampled with CFG at track_guidance: equal to that evaluation
    run on its own, and not the unguided one (on the bundled base, which draws objects)."""
    from solrl.engine.evaluate import evaluate
    from solrl.rollout.passes import SamplerSpec
    from solrl.shapes.metrics import eval_prompts
    from solrl.shapes.pretrain import track
    from solrl.shapes.world import split_prompts

    torch.set_num_threads(1)
    model = load_model("shapes")
    cfg = PretrainConfig(eval_prompts=8, eval_steps=4, track_guidance=3.0)
    rec = track(model, cfg)
    summary, _ = evaluate(model, model.transformer, (4,), eval_prompts(8, split_prompts()[1]), 1, seed=1000,
                          sampler=SamplerSpec(guidance=3.0))
    assert rec["heldout_guided"]["mean_reward"] == round(summary["results"]["4"]["mean_reward"], 4)
    assert rec["heldout_guided"]["dense_mean"] != rec["heldout"]["dense_mean"]


def test_pretrain_rejects_a_guidance_scale_of_one_or_less(tmp_path):
    for bad in (1.0, 0.5, -2.0, float("nan")):
        with pytest.raises(ValueError, match="track_guidance"):
            pretrain(PretrainConfig(steps=1, batch_size=2, layers=1, heads=2, track_guidance=bad), tmp_path / "x",
                     progress=False)


def test_ema_warms_up():
    """d_n = min(decay, (1 + n) / (10 + n)): the first update keeps only 10% of the initial weights."""
    from solrl.shapes.pretrain import _warm_ema

    update = _warm_ema(0.999)
    ema, new, ids = torch.zeros(3), torch.ones(3), torch.tensor([1, 2])
    update([ema, ids], [new, torch.tensor([5, 6])], torch.tensor(0))
    assert torch.allclose(ema, torch.full((3,), 0.9)) and ids.tolist() == [5, 6]
    update([ema], [torch.zeros(3)], torch.tensor(10_000))
    assert torch.allclose(ema, torch.full((3,), 0.9 * 0.999))


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = PretrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(99, cfg) == pytest.approx(1e-4, rel=0.05)
    assert all(lr_at(i, cfg) >= lr_at(i + 1, cfg) for i in range(10, 99))


def test_cli_rejects_bad_sampling_choice(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "solrl.cli", "shapes", "pretrain", "--out", str(tmp_path),
                           "--steps", "1", "--t-sampling", "cosine"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--t-sampling" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "solrl.cli", "shapes", "pretrain", "--out", str(tmp_path),
                           "--steps", "1", "--track-guidance", "1"], capture_output=True, text=True)
    assert proc.returncode == 2 and "track_guidance" in proc.stderr


def test_bundled_base_is_in_the_useful_band_and_its_card_is_reproducible():
    """The RL-ready band for the base model on held-out prompts at 10 steps: it draws shapes (shape accuracy
    0.5-0.8) and sometimes gets every attribute right (exact match 0.15-0.5), with room for RL (mean exact
    reward <= 0.85); re-evaluating the bundled weights gives the numbers the card reports."""
    from solrl.config import get_preset
    from solrl.engine.session import Session

    card = json.loads((Path(__file__).resolve().parents[2] / "solrl/shapes/weights/heldout_eval.json").read_text())
    reported = card["results"]["10"]
    assert 0.5 <= reported["shape_accuracy"] <= 0.8
    assert 0.15 <= reported["exact_match"] <= 0.5
    assert reported["mean_reward"] <= 0.85
    cfg = get_preset("shapes-sol-rl")
    sess = Session.build(cfg, local_explorer=False)
    summary, _ = sess.evaluate((10,))
    got = summary["results"]["10"]
    assert got["n"] == reported["n"] == 96
    for key in ("mean_reward", "shape_accuracy", "exact_match"):
        assert got[key] == pytest.approx(reported[key], abs=0.02), key


def test_model_card_reads_the_saved_config_and_plots_the_tracking(tmp_path):
    from solrl.shapes.card import denoiser_text
    from solrl.shapes.card import main as card

    torch.set_num_threads(1)
    cfg = PretrainConfig(steps=3, batch_size=2, save_every=2, seed=0, denoiser="unet", heads=2, eval_every=1,
                         eval_prompts=2, eval_steps=2, track_guidance=2.0)
    pretrain(cfg, tmp_path / "p", progress=False)
    result = {"mean_reward": 0.5, "colour_accuracy": 0.5, "shape_accuracy": 0.25, "count_accuracy": 0.4,
              "position_accuracy": 0.6, "exact_match": 0.125}
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "eval.json").write_text(json.dumps({"prompts": 2, "seeds_per_prompt": 1,
                                                             "results": {"10": result}}))
    weights = tmp_path / "p" / "step_00002"   # a checkpoint before the run's end: --upto leaves step 3 out
    card(["--weights", str(weights), "--logs", str(tmp_path / "p" / "loss.jsonl"), "--eval", str(tmp_path / "ev"),
          "--commands", "solrl shapes pretrain --denoiser unet --heads 2", "--tracking",
          str(tmp_path / "p" / "eval.jsonl"), "--upto", "2"])
    text = (weights / "README.md").read_text()
    assert "`UNet2DConditionModel`" in text and "32/64/64 channels" in text  # from the saved config
    assert "## Tracked during pretraining" in text and "| 1 | " in text and "| 2 | " in text
    assert "| 3 | " in text and "step-2 checkpoint, chosen from this curve" in text   # the whole tracked curve
    assert "2 steps (of a 3-step learning-rate schedule) of AdamW" in text            # the weights' own steps
    assert "| 10 | 0.500 | 0.500 | 0.250 | 0.400 | 0.600 | 0.125 |" in text
    assert (weights / "tracking_curve.png").stat().st_size > 1000
    pixart = ShapesModel.random(seed=0, layers=1, heads=2).transformer.config
    assert "1 PixArt blocks" in denoiser_text(dict(pixart), 10) and "2 heads x 32" in denoiser_text(dict(pixart), 10)


def test_pretrain_device_is_checked(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ValueError, match="device 'cuda': torch sees no CUDA device here"):
        pretrain(PretrainConfig(steps=1, batch_size=2, layers=1, heads=2, eval_every=0, device="cuda"),
                 tmp_path / "never-written", progress=False)
    assert not (tmp_path / "never-written").exists()   # refused before anything is written


def test_architecture_knobs_build_train_save_and_load(tmp_path):
    """A fresh UNet with a wider, deeper text encoder and other channels trains, saves and loads through the
    registry with those shapes; the card records them."""
    torch.set_num_threads(1)
    cfg = PretrainConfig(steps=2, batch_size=2, save_every=2, seed=4, denoiser="unet", heads=2, eval_every=0,
                         text_width=32, text_layers=3, unet_channels=(16, 32, 48), relation_share=0.75)
    pretrain(cfg, tmp_path, progress=False)
    model = load_model("shapes", tmp_path / "step_00002")
    te, unet = model.text_encoder.config, model.transformer.config
    assert (te.hidden_size, te.num_hidden_layers, te.num_attention_heads) == (32, 3, 2)
    assert tuple(unet.block_out_channels) == (16, 32, 48) and unet.cross_attention_dim == 32
    assert model.encode(["a red circle"]).embeds.shape[-1] == 32
    card = json.loads((tmp_path / "step_00002" / "card.json").read_text())["config"]
    assert (card["text_width"], card["unet_channels"], card["relation_share"]) == (32, [16, 32, 48], 0.75)
    with_attn = ShapesModel.random(0, denoiser="unet", heads=2, attn_full_res=True).transformer.config
    assert with_attn.down_block_types[0] == "CrossAttnDownBlock2D" and with_attn.up_block_types[-1] == "CrossAttnUpBlock2D"


def test_relation_share_sets_the_data_mix():
    import numpy as np

    train, _ = split_prompts()
    for share in (0.4, 0.75):
        forms = [parse(c).form for c in PromptSampler(train, form_weights(share))(np.random.default_rng(0), 4000)]
        assert forms.count("relation") / 4000 == pytest.approx(share, abs=0.025)
        assert forms.count("single") / forms.count("count") == pytest.approx(2.0, rel=0.15)
    for bad in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="relation_share"):
            form_weights(bad)


def test_cli_rejects_bad_architecture_values(tmp_path):
    for args, needle in ((["--unet-channels", "32,x"], "--unet-channels"), (["--text-width", "40"], "text encoder width"),
                         (["--relation-share", "1.5"], "relation_share"), (["--unet-channels", "30,60"], "unet_channels"),
                         (["--save-every", "0"], "--save-every")):
        proc = subprocess.run([sys.executable, "-m", "solrl.cli", "shapes", "pretrain", "--out", str(tmp_path / "x"),
                               "--steps", "1", "--eval-every", "0", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr[-500:])


@pytest.mark.gpu
def test_pretraining_on_cuda_follows_the_cpu_run(tmp_path):
    """Same seed on the CPU and on a GPU: the same data, noise and timesteps (drawn on the CPU), so the
    losses agree to float tolerance step by step, and the tracking (sampled on the CPU) still runs."""
    small = dict(steps=3, batch_size=8, save_every=3, seed=5, layers=2, heads=2, eval_every=3, eval_prompts=2,
                 eval_steps=2)
    pretrain(PretrainConfig(**small), tmp_path / "cpu", progress=False)
    model = pretrain(PretrainConfig(**small, device="cuda"), tmp_path / "gpu", progress=False)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "loss.jsonl").read_text().splitlines()]
              for d in ("cpu", "gpu")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    assert next(model.transformer.parameters()).device.type == "cpu"   # returned on the CPU, ready to save
    assert (tmp_path / "gpu" / "eval.jsonl").read_text().strip()
    # tracking with its forwards on the GPU (sampling state on the CPU): the same prompts and seeds score alike
    pretrain(PretrainConfig(**small, device="cuda", track_on_device=True), tmp_path / "gpu-track", progress=False)
    on_cpu, on_gpu = (json.loads((tmp_path / d / "eval.jsonl").read_text().splitlines()[-1])["heldout"]["mean_reward"]
                      for d in ("gpu", "gpu-track"))
    assert on_gpu == pytest.approx(on_cpu, abs=0.1)


def test_stop_at_reproduces_a_longer_runs_checkpoint(tmp_path):
    """--stop-at N of a --steps M schedule saves exactly the weights the M-step run saved at step N (the bundled
    base is a checkpoint chosen from a longer run's tracked curve)."""
    torch.set_num_threads(1)
    common = dict(steps=4, batch_size=2, save_every=2, seed=2, denoiser="unet", heads=2, eval_every=0, ema_decay=0.9)
    pretrain(PretrainConfig(**common), tmp_path / "long", progress=False)
    short = pretrain(PretrainConfig(**common, stop_at=2), tmp_path / "short", progress=False)
    assert sorted(p.name for p in (tmp_path / "short").glob("step_*")) == ["step_00002"]
    assert torch.equal(_params(short), _params(load_model("shapes", tmp_path / "long" / "step_00002")))
    with pytest.raises(ValueError, match="stop_at must be in"):
        pretrain(PretrainConfig(**{**common, "stop_at": 5}), tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()
