"""Wan2.2 text-to-video through diffusers' WanPipeline: TI2V-5B (one transformer) and T2V-A14B (two experts).

Tiny seeded pipelines of the real classes (solrl/models/wan_tiny.py) are saved in the diffusers layout and loaded
as a user's local path through the registry's real loader. Checked here on the CPU: video latents [C, F, H, W]
(seed -> noise batch-invariant), the expert switch at boundary_ratio and TI2V's per-token timesteps, first-frame
decoding (exactly the whole clip's frame 0), first-frame / mean-over-frames rewards, config errors before any
work, the whole loop explore -> select -> regenerate -> train -> export -> merge -> reload (nvfp4-emu explorer on
the 3-D transformer), and the exported LoRA in diffusers' `WanPipeline.load_lora_weights` (both experts), plus
diffusers' own sampling loop reproducing solrl's. The real checkpoints need a GPU and their weights: the last test.
"""

from __future__ import annotations

import fnmatch
import re

import diffusers
import numpy as np
import pytest
import torch

from solrl.adapters import (
    apply_merged,
    decode_adapter,
    encode_adapter,
    export_diffusers_lora,
    export_expert_loras,
    make_inference_copy,
    merge_lora,
)
from solrl.config import ConfigError, apply_overrides, get_preset, resolve
from solrl.engine.session import Session
from solrl.models import load_model
from solrl.models.diffusers_t2i import MissingModelWeightsError, missing_files
from solrl.models.wan import WAN_FAMILIES, WanExperts
from solrl.models.wan_tiny import save_tiny_wan
from solrl.precision import EmuQuantLinear, PrecisionConfig, build_backend
from solrl.precision.base import round_to_bf16
from solrl.rewards.frames import score_frames
from solrl.rollout.passes import SamplerSpec, generate
from solrl.sampling import SeedNoise, noise_for_seeds, sample

NAMES = ("wan2.2-ti2v-5b", "wan2.2-t2v-a14b")
FAMILY = {"wan2.2-ti2v-5b": "wan22-ti2v5b", "wan2.2-t2v-a14b": "wan22-a14b"}
SIDE = {"wan2.2-ti2v-5b": 32, "wan2.2-t2v-a14b": 16}   # the smallest size of each: one latent token per frame
FRAMES = 9                                              # 4k + 1: 3 latent frames
PROMPTS = ["a red circle", "two blue squares"]
TINY_RUN = ["reward=jpeg_compressibility", "rollout.explore_precision.backend=nvfp4-emu",
            "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2", "rollout.explore_steps=2",
            "rollout.steps=3", "rollout.micro_batch=4", "train.micro_batch=4", "train.timestep_fraction=1.0",
            "train.lr=0.05", "lora.rank=4", "lora.alpha=8", "tensorboard=false", "threads=1",
            "prompts.train=ocr:train", "prompts.eval=ocr:test", f"model.frames={FRAMES}"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return {n: save_tiny_wan(n, tmp_path_factory.mktemp(n.replace(".", "_"))) for n in NAMES}


def tiny(name, dirs, **options):
    return load_model(name, dirs[name], frames=FRAMES, height=SIDE[name], width=SIDE[name], **options)


def run_cfg(name, dirs, preset="sol-rl", extra=()):
    return apply_overrides(get_preset(f"{FAMILY[name]}-{preset}"), TINY_RUN + [
        f"model.path={dirs[name]}", f"model.height={SIDE[name]}", f"model.width={SIDE[name]}", *extra]).validate()


def test_video_noise_is_seed_deterministic_and_batch_invariant():
    shape = (16, 3, 2, 4)   # C, F, H, W
    a = noise_for_seeds([5, 9, 11], shape)
    b = noise_for_seeds([11, 5], shape)
    assert a.shape == (3, *shape)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0]) and not torch.equal(a[0], a[1])
    # one draw over the whole clip per seed: the per-seed generator's first tensor of this shape
    assert torch.equal(a[1], torch.randn(shape, generator=torch.Generator().manual_seed(9)))
    # the SDE's per-step streams too
    s1, s2 = SeedNoise([5, 9, 11], shape), SeedNoise([9], shape)
    assert torch.equal(s1.initial(), a) and torch.equal(s2.initial()[0], a[1])
    assert torch.equal(s1.step()[1], s2.step()[0])


@pytest.mark.parametrize("name", NAMES)
def test_missing_weights_name_what_is_missing(name, tmp_path, monkeypatch):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(MissingModelWeightsError) as err:
        load_model(name, tmp_path, frames=FRAMES)
    msg = str(err.value)
    assert "model_index.json" in msg and "vae/" in msg and "transformer/*.safetensors" in msg
    assert ("transformer_2/" in msg) == (name == "wan2.2-t2v-a14b")
    assert WAN_FAMILIES[name].repo_id in msg and "model.path" in msg
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingModelWeightsError, match="Hugging Face cache"):
        load_model(name, None)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_wan_loads_through_the_real_loader(name, tiny_dirs):
    assert missing_files(tiny_dirs[name], WAN_FAMILIES[name]) == []
    m = tiny(name, tiny_dirs)
    two = name == "wan2.2-t2v-a14b"
    assert isinstance(m.transformer, WanExperts) == two
    assert m.spec.latent_shape == ((16, 3, 2, 2) if two else (48, 3, 2, 2)) and m.spec.is_video
    assert m.spec.default_shift == (3.0 if two else 5.0) and m.spec.default_solver == "dpm2"
    assert m.boundary_ratio == (0.875 if two else None) and m.expand_timesteps == (not two)
    c = m.encode(PROMPTS)
    assert c.embeds.shape == (2, 32, 32) and not torch.equal(c.embeds[0], c.embeds[1])
    x = torch.randn(3, *m.spec.latent_shape, generator=torch.Generator().manual_seed(0))
    c3 = m.encode(PROMPTS + PROMPTS[:1])
    t = torch.tensor([0.95, 0.5, 0.875])   # high, low, exactly the boundary (-> high, as WanPipeline's t >= b)
    with torch.no_grad():
        v = m.velocity(m.transformer, x, t, c3)
        rows = [m.velocity(m.transformer, x[i: i + 1], t[i: i + 1], c3.index(slice(i, i + 1))) for i in range(3)]
        v_swap = m.velocity(m.transformer, x, t, c3.index([1, 0, 1]))
        # the expert of each row, called as WanPipeline calls it
        def direct(module, i):
            ts = t[i: i + 1] * 1000.0
            if m.expand_timesteps:   # one timestep per latent token: F * (H/2) * (W/2)
                ts = ts[:, None].expand(1, 3)
            return module(hidden_states=x[i: i + 1], timestep=ts, encoder_hidden_states=c3.embeds[i: i + 1],
                          return_dict=False)[0]
        high = m.transformer.transformer if two else m.transformer
        low = m.transformer.transformer_2 if two else m.transformer
        want = [direct(high, 0), direct(low, 1), direct(high, 2)]
        other = direct(high, 1)
    assert v.shape == x.shape
    for i in range(3):
        torch.testing.assert_close(v[i: i + 1], rows[i], rtol=1e-4, atol=1e-5)   # batch-independent
        torch.testing.assert_close(v[i: i + 1], want[i], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(v, v_swap)   # the prompt matters
    assert two != torch.allclose(want[1], other, atol=1e-5)   # A14B's experts differ
    # sampling gives each clip's first frame for the rewards, the model's size
    gen = generate(m, m.transformer, PROMPTS, [1, 2], 2, SamplerSpec("euler", m.spec.default_shift))
    assert gen.images.shape == (2, 1, SIDE[name], SIDE[name], 3) and gen.images.dtype == np.uint8
    assert not np.array_equal(gen.images[0], gen.images[1])


@pytest.mark.parametrize("name", NAMES)
def test_first_frame_decode_is_exactly_the_clips_frame_0(name, tiny_dirs):
    first, mean = tiny(name, tiny_dirs), tiny(name, tiny_dirs, reward_frames="mean")
    z = torch.randn(2, *first.spec.latent_shape, generator=torch.Generator().manual_seed(1))
    clip = first.decode_video(z)
    assert clip.shape == (2, FRAMES, SIDE[name], SIDE[name], 3)
    assert np.array_equal(first.decode(z), clip[:, :1])    # the causal VAE: frame 0 from latent frame 0 alone
    assert np.array_equal(mean.decode(z), clip) and clip[:, 0].std() > 0 and not np.array_equal(clip[:, 0], clip[:, 4])


def test_frame_rewards_first_and_mean():
    calls = []

    def scorer(images, prompts):   # a per-image reward: mean pixel value + the prompt's length
        calls.append(images.shape)
        return images.reshape(len(images), -1).mean(axis=1) + np.array([len(p) for p in prompts])

    clips = np.zeros((2, 3, 4, 4, 3), dtype=np.uint8)
    clips[0, :, :, :] = np.array([10, 20, 60])[:, None, None, None]    # frames of clip 0: 10, 20, 60
    clips[1, :, :, :] = 7
    got = score_frames(scorer, clips, ["ab", "abcd"])
    np.testing.assert_allclose(got, [30 + 2, 7 + 4])       # mean over frames, each frame with its clip's prompt
    assert calls[-1] == (6, 4, 4, 3) and got.dtype == np.float32
    np.testing.assert_allclose(score_frames(scorer, clips[:, :1], ["ab", "abcd"]), [10 + 2, 7 + 4])   # frame 0
    images = clips[:, 0]
    assert np.array_equal(score_frames(scorer, images, ["ab", "abcd"]), scorer(images, ["ab", "abcd"]))
    with pytest.raises(ValueError, match="3 prompts for 2 clips"):
        score_frames(scorer, clips, ["a", "b", "c"])


@pytest.mark.parametrize("overrides, message", [
    (["model.frames=80"], r"model.frames=80: wan2.2-t2v-a14b's VAE makes clips of 4k \+ 1 frames \(e.g. 77 or 81\)"),
    (["model.height=500"], "model.height=500 must be a multiple of 16 pixels"),
    (["reward=shapes"], r"reward='shapes': \['shapes'\] cannot score video frames"),
    (["reward=hpsv2:1+shapes_dense:0.5"], r"reward='hpsv2:1\+shapes_dense:0.5': \['shapes_dense'\] cannot score"),
    (["eval.reward=shapes"], r"eval.reward='shapes': \['shapes'\] cannot score"),
    (["reward=nosuch"], "reward: unknown reward 'nosuch'"),
    (["reward_frames=last"], r"reward_frames must be one of \('first', 'mean'\)"),
])
def test_bad_video_settings_fail_before_any_work(overrides, message):
    real = ["prompts.train=/data/train.txt", "prompts.eval=/data/test.txt"]
    with pytest.raises(ConfigError, match=message):
        resolve("wan22-a14b-sol-rl", None, real + overrides)


def test_video_settings_on_an_image_model_and_the_cli(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"model.frames=81 applies to the video models"):
        resolve("shapes-sol-rl", None, ["model.frames=81"])
    with pytest.raises(ConfigError, match=r"reward_frames='mean' applies to the video models"):
        resolve("shapes-sol-rl", None, ["reward_frames=mean"])
    with pytest.raises(ConfigError, match="model.frames=8: wan2.2-ti2v-5b's VAE"):
        resolve("shapes-sol-rl", None, ["model.name=wan2.2-ti2v-5b", "model.frames=8", "reward=hpsv2"])
    with pytest.raises(ConfigError, match=r"reward='shapes'.*cannot score video frames"):   # the shapes preset's reward
        resolve("shapes-sol-rl", None, ["model.name=wan2.2-ti2v-5b"])
    from solrl.cli.app import main

    out = tmp_path / "run"
    assert main(["train", "--preset", "wan22-ti2v5b-sol-rl", "--out", str(out), "--set", "model.frames=120",
                 "--set", "prompts.train=/p.txt", "--set", "prompts.eval=/p.txt"]) == 2
    assert "model.frames=120" in capsys.readouterr().err and not out.exists()
    # and the loader itself refuses what the VAE cannot make (a model built without the config's check)
    with pytest.raises(ValueError, match="model.frames=6"):
        from solrl.models.wan import check_clip
        check_clip(6, 32, 32, 4, 32, "wan2.2-ti2v-5b", 16)


def test_presets_carry_the_wan_defaults():
    real = ["prompts.train=/data/train.txt", "prompts.eval=/data/test.txt"]
    ti2v = apply_overrides(get_preset("wan22-ti2v5b-sol-rl"), real).validate()
    a14b = apply_overrides(get_preset("wan22-a14b-sol-flow-grpo"), real).validate()
    assert (ti2v.model.frames, ti2v.model.height, ti2v.model.width, ti2v.eval.steps) == (121, 704, 1280, (50,))
    assert (a14b.model.frames, a14b.model.height, a14b.model.width, a14b.eval.steps) == (81, 480, 832, (40,))
    for cfg in (ti2v, a14b):
        assert cfg.reward == "hpsv3" and cfg.reward_frames == "first" and cfg.rollout.steps == 10
        assert cfg.model_options() == {"frames": cfg.model.frames, "height": cfg.model.height,
                                       "width": cfg.model.width, "reward_frames": "first"}
    assert ti2v.rollout.mode == "sol_rl" and (ti2v.rollout.pool, ti2v.rollout.kept) == (32, 8)
    assert a14b.train.algo == "flow_grpo" and a14b.rollout.sde_eta == 0.7
    assert get_preset("sd35l-sol-rl").model_options() == {}   # image models load as before


def expected_quantized(module, spec) -> set[str]:
    """The explorer's selection rule written out for the plain copy: Linear, not skipped, max dim >= minimum."""
    return {n for n, mod in module.named_modules()
            if type(mod) is torch.nn.Linear and n and not any(fnmatch.fnmatchcase(n, p) for p in spec.quant_skip)
            and max(mod.in_features, mod.out_features) >= spec.quant_min_features and mod.in_features % 16 == 0}


@pytest.mark.parametrize("name", NAMES)
def test_whole_loop_export_merge_reload_and_diffusers_lora(name, tiny_dirs, tmp_path):
    """explore (nvfp4-emu on the 3-D transformer) -> select -> regenerate -> train -> export -> merge -> reload,
    and the exported LoRA in WanPipeline.load_lora_weights gives the merged model's outputs (both A14B experts)."""
    two = name == "wan2.2-t2v-a14b"
    ffn = ["lora.targets=to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2"] if two else []
    cfg = run_cfg(name, tiny_dirs, extra=ffn)
    sess = Session.build(cfg)
    m, spec = sess.model, sess.model.spec
    assert isinstance(m.transformer, WanExperts) == two and m.frames == FRAMES
    # LoRA on the attention of every block, in both experts
    lora_keys = sess.adapters.layout()
    where = [re.fullmatch(r"transformer\.(transformer(?:_2)?\.)?blocks\.0\.(.+)\.lora_[AB]\.weight", k)
             for k in lora_keys]
    assert all(where) and {w.group(1) for w in where} == ({"transformer.", "transformer_2."} if two else {None})
    attn = {f"attn{i}.{p}" for i in (1, 2) for p in ("to_q", "to_k", "to_v", "to_out.0")}
    assert {w.group(2) for w in where} == attn | ({"ffn.net.0.proj", "ffn.net.2"} if two else set())
    # the explorer quantized exactly the rule's layers: the feed-forwards (at the family's width), not attention
    base_copy = WanExperts.from_config(m.transformer.config) if two else type(m.transformer).from_config(
        m.transformer.config)
    quantized = {n for n, mod in sess.explorer.module.named_modules() if isinstance(mod, EmuQuantLinear)}
    assert quantized == expected_quantized(base_copy, spec) == set(sess.explorer.backend.quantized_names)
    assert quantized and all(".ffn.net." in n for n in quantized) and len(quantized) == (4 if two else 2)
    x = torch.randn(2, *spec.latent_shape, generator=torch.Generator().manual_seed(3))
    t, c = torch.tensor([0.95, 0.4]), m.encode(PROMPTS)
    with torch.no_grad():
        v_bf16 = m.velocity(m.transformer, x, t, c)
        v_fp4 = m.velocity(sess.explorer.module, x, t, c)
    err = ((v_fp4 - v_bf16).norm() / v_bf16.norm()).item()
    assert 0 < err < 0.5, err   # the emulated NVFP4 explorer is close to, not equal to, the BF16 model

    before = {k: p.detach().clone() for k, p in zip(lora_keys, sess.adapters.trainable_parameters())}
    rec = sess.epoch(0)
    assert rec["forwards_explore"] == 2 * 4 * 2 and rec["forwards_regenerate"] == 2 * 2 * 3
    assert np.isfinite(rec["train.loss"]) and rec["train.grad_norm"] > 0
    assert np.isfinite(rec["explore.reward_mean"]) and np.isfinite(rec["rollout.reward_mean"])
    changed = {k.split(".")[1] for k, p in zip(lora_keys, sess.adapters.trainable_parameters())
               if not torch.equal(p, before[k])}
    # 3 rollout steps at shift 3 (sigmas 1, 0.857, 0.6): the first is the high-noise expert's, the others the low
    assert changed == ({"transformer", "transformer_2"} if two else {"blocks"})

    # export (the wire format) -> merge into plain base weights -> hot-reload the explorer (requantize)
    state = sess.adapters.state_dict("old")
    payload = decode_adapter(encode_adapter(state, 1, sess.adapters.spec))
    base = sess.adapters.merged_weights(None)
    merged = merge_lora(base, payload.state, payload.spec)
    ref = sess.adapters.merged_weights("old")
    for k in ref:
        torch.testing.assert_close(merged[k], ref[k], rtol=0, atol=1e-6)
    sess.explorer.sync(merged, 1)
    assert sess.explorer.version == 1
    for k in ref:
        mod = sess.explorer.module.get_submodule(k)
        if isinstance(mod, EmuQuantLinear):   # a quantized LoRA target: re-quantized from the merged weight
            torch.testing.assert_close(mod.dequantized_weight(), type(mod)(merged[k], None).dequantized_weight(),
                                       rtol=0, atol=0)
        else:                                 # a high-precision one: the merged weight, bf16-rounded
            torch.testing.assert_close(mod.weight, round_to_bf16(merged[k]), rtol=0, atol=0)
    # A14B's run adds the feed-forwards to the LoRA targets (lora.targets), so some targets are NVFP4 layers
    assert bool(set(ref) & quantized) == two
    # reload: a fresh session with the adapter file's tensors gives the trained model's velocity
    fresh = Session.build(cfg)
    fresh.adapters.load_state_dict("default", decode_adapter(encode_adapter(
        sess.adapters.state_dict("default"), 2, sess.adapters.spec)).state)
    with torch.no_grad(), sess.adapters.use("default"), fresh.adapters.use("default"):
        torch.testing.assert_close(fresh.model.velocity(fresh.model.transformer, x, t, c),
                                   m.velocity(m.transformer, x, t, c), rtol=0, atol=0)

    # the trained adapter ("default") in diffusers: one LoRA file per expert, loaded by WanPipeline
    adapter = encode_adapter(sess.adapters.state_dict("default"), 3, sess.adapters.spec)
    pipe = diffusers.WanPipeline.from_pretrained(tiny_dirs[name], local_files_only=True)
    for expert in (pipe.transformer, pipe.transformer_2):   # the run's base weights are bf16 (rollout.precision)
        if expert is not None:
            build_backend(PrecisionConfig("bf16")).prepare(expert)
    if two:
        files = export_expert_loras(adapter, tmp_path / "lora")
        pipe.load_lora_weights(str(tmp_path / "lora"), weight_name=files["transformer"].name)
        pipe.load_lora_weights(str(tmp_path / "lora"), weight_name=files["transformer_2"].name,
                               load_into_transformer_2=True)
        assert files["transformer_2"].name == "pytorch_lora_weights_transformer_2.safetensors"
    else:
        pipe.load_lora_weights(str(export_diffusers_lora(adapter, tmp_path / "lora" / "lora.safetensors")))
    plain = make_inference_copy(sess.adapters, type(m.transformer), m.transformer.config)
    base_out = {}
    with torch.no_grad():
        for tt in (0.95, 0.4):   # the high-noise expert's timestep, then the low-noise one's
            tb = torch.full((2,), tt)
            base_out[tt] = m.velocity(plain, x, tb, c)
    apply_merged(plain, sess.adapters.merged_weights("default"))
    with torch.no_grad():
        for tt, expert in ((0.95, pipe.transformer), (0.4, pipe.transformer_2 if two else pipe.transformer)):
            tb = torch.full((2,), tt)
            v_pipe = m.velocity(expert, x, tb, c)
            v_merged = m.velocity(plain, x, tb, c)
            change = (v_merged - base_out[tt]).abs().max().item()
            assert change > 1e-3, change   # the LoRA matters at this timestep
            assert (v_pipe - v_merged).abs().max().item() < 1e-3 * change + 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_diffusers_sampling_loop_reproduces_solrl(name, tiny_dirs):
    """WanPipeline's own loop (scheduler, expert switch, per-token timesteps, VAE un-normalisation) from solrl's
    noise, against solrl's sampler on the scheduler's sigma grid: the same frames."""
    m = tiny(name, tiny_dirs)
    pipe = diffusers.WanPipeline.from_pretrained(tiny_dirs[name], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=m.spec.default_shift)
    steps = 4
    pipe.scheduler.set_timesteps(steps)
    sigmas = pipe.scheduler.sigmas.clone()
    if name == "wan2.2-t2v-a14b":   # the grid crosses the boundary: both experts denoise
        assert (sigmas[:-1] >= 0.875).any() and (sigmas[:-1] < 0.875).any()
    noise = noise_for_seeds([3, 4], m.spec.latent_shape)
    with torch.no_grad():
        ours = sample(m.velocity_fn(m.transformer, m.encode(PROMPTS)), noise, sigmas, "euler").x0
    clips = m.decode_video(ours)
    out = pipe(prompt=PROMPTS, latents=noise, guidance_scale=1.0, num_inference_steps=steps, height=SIDE[name],
               width=SIDE[name], num_frames=FRAMES, output_type="np", max_sequence_length=m.max_sequence_length())
    theirs = (out.frames * 255).round().astype(np.uint8)
    assert theirs.shape == clips.shape == (2, FRAMES, SIDE[name], SIDE[name], 3)
    assert np.abs(theirs.astype(int) - clips.astype(int)).max() <= 1


@pytest.mark.parametrize("name", NAMES)
def test_mean_over_frames_run_scores_every_frame(name, tiny_dirs):
    """reward_frames=mean in a one-stage FlowGRPO run (the MMDanceGRPO algorithm): SDE rollouts of clips."""
    cfg = run_cfg(name, tiny_dirs, preset="flow-grpo", extra=["reward_frames=mean"])
    assert cfg.train.algo == "flow_grpo" and cfg.rollout.mode == "diffusion_nft"
    sess = Session.build(cfg)
    assert sess.model.reward_frames == "mean"
    gen = generate(sess.model, sess.model.transformer, PROMPTS, [1, 2], 2, sess.sampler)
    assert gen.images.shape[:2] == (2, FRAMES)
    per_frame = sess.scorer(gen.images.reshape(-1, *gen.images.shape[2:]), [p for p in PROMPTS for _ in range(FRAMES)])
    np.testing.assert_allclose(score_frames(sess.scorer, gen.images, PROMPTS),
                               np.asarray(per_frame).reshape(2, FRAMES).mean(axis=1), rtol=1e-6)
    rec = sess.epoch(0)
    assert np.isfinite(rec["train.loss"]) and rec["forwards_regenerate"] == 2 * 2 * 3
    # the recorded SDE log-probs of the clips are the policy's: the epoch's first step sees a ratio of 1
    assert rec["train.ratio_max_dev_first_step"] < 1e-5
    summary, grids = sess.evaluate(steps=(2,), n_prompts=1, seeds_per_prompt=1)
    assert np.isfinite(summary["mean_reward"]) and grids[2].ndim == 3   # the grid shows each clip's frame 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_real_wan_weights_one_epoch_on_a_gpu(name):
    """The real checkpoint (local HF cache or SOLRL_WAN_PATH_<A14B|TI2V5B>) for one tiny epoch on a CUDA GPU: bf16
    denoiser(s), fp32 VAE; TI2V-5B two-stage with an nvfp4-emu explorer, A14B one-stage (its two 14B experts take
    56 GB in bf16, and an explorer copy as much again: more than an 80 GB GPU). Skipped without weights (nothing is
    downloaded)."""
    import os

    from solrl.models.diffusers_t2i import resolve_weights

    env = "SOLRL_WAN_PATH_" + ("A14B" if "a14b" in name else "TI2V5B")
    try:
        root = resolve_weights(WAN_FAMILIES[name], os.environ.get(env))
    except MissingModelWeightsError as exc:
        pytest.skip(f"no {name} weights on this machine: {exc}")
    side = {"wan2.2-ti2v-5b": (704, 1280), "wan2.2-t2v-a14b": (480, 832)}[name]
    mode = "diffusion-nft" if "a14b" in name else "sol-rl"
    cfg = apply_overrides(get_preset(f"{FAMILY[name]}-{mode}"), TINY_RUN + [
        f"model.path={root}", "model.frames=17", f"model.height={side[0]}", f"model.width={side[1]}",
        "rollout.micro_batch=1", "train.micro_batch=1"]).validate()
    sess = Session.build(cfg)
    rec = sess.epoch(0)
    assert np.isfinite(rec["train.loss"]) and rec["train.grad_norm"] > 0


def test_precision_policies_see_each_expert_as_a_denoiser(tiny_dirs):
    """keep-first / keep-last block policies keep each A14B expert's own first / last block in high precision."""
    from solrl.precision.base import denoiser_blocks, policy_kept_blocks
    from solrl.precision.policy import policy_config

    m = tiny("wan2.2-t2v-a14b", tiny_dirs)
    assert denoiser_blocks(m.transformer) == ["transformer.blocks.0", "transformer_2.blocks.0"]
    ref = build_backend(policy_config("nvfp4-emu", "reference", m.spec)).selected_layers(m.transformer)
    assert sorted(ref) == [f"{e}.blocks.0.ffn.net.{i}" for e in ("transformer", "transformer_2")
                           for i in ("0.proj", "2")]
    cfg = policy_config("nvfp4-emu", "keep-first-block", m.spec)
    assert policy_kept_blocks(m.transformer, cfg) == ["transformer.blocks.0", "transformer_2.blocks.0"]
    assert build_backend(cfg).selected_layers(m.transformer) == []   # one block per tiny expert: all kept
