"""Real model families (SANA-1.5, SD3.5-Large, FLUX.1-dev) on tiny seeded configs of the same classes.

Each tiny pipeline is saved in the diffusers layout and loaded through the registry's real loader
(`--set model.path=DIR`); one epoch then runs through the presets' own code: Session.build -> explore
(nvfp4-emu) -> select -> regenerate (bf16) -> DiffusionNFT step -> adapter export -> merge + requantize.
"""

from __future__ import annotations

import fnmatch

import numpy as np
import pytest
import torch

from solrl.adapters import decode_adapter, encode_adapter, merge_lora
from solrl.config import PRESETS, apply_overrides, get_preset
from solrl.engine.session import Session
from solrl.models import available_models, load_model
from solrl.models.diffusers_t2i import FAMILIES, MissingModelWeightsError, missing_files
from solrl.models.diffusers_tiny import save_tiny
from solrl.precision import EmuQuantLinear
from solrl.precision.base import round_to_bf16
from solrl.rollout.passes import SamplerSpec, generate

FAMILY_PRESET = {"sana1.5-1.6b": "sana", "sd3.5-large": "sd35l", "flux1-dev": "flux1"}
TINY_RUN = ["reward=jpeg_compressibility", "rollout.explore_precision.backend=nvfp4-emu",
            "rollout.prompts_per_epoch=2", "rollout.pool=4", "rollout.kept=2", "rollout.explore_steps=2",
            "rollout.steps=2", "rollout.micro_batch=4", "train.micro_batch=4", "train.timestep_fraction=0.5",
            "lora.rank=4", "lora.alpha=8", "tensorboard=false", "threads=1", "prompts.train=ocr:train",
            "prompts.eval=ocr:test"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    torch.set_num_threads(1)
    return {name: save_tiny(name, tmp_path_factory.mktemp(name.replace(".", "_"))) for name in FAMILIES}


def expected_quantized(model: torch.nn.Module, spec) -> set[str]:
    """The selection rule written out: plain Linear, not skipped, max(in, out) >= minimum, in % 16 == 0."""
    out = set()
    for name, m in model.named_modules():
        if (type(m) is torch.nn.Linear and name and not any(fnmatch.fnmatchcase(name, p) for p in spec.quant_skip)
                and max(m.in_features, m.out_features) >= spec.quant_min_features and m.in_features % 16 == 0):
            out.add(name)
    return out


def test_registry_lists_the_real_models_and_presets():
    assert {"sana1.5-1.6b", "sd3.5-large", "flux1-dev", "shapes"} <= set(available_models())
    for fam in ("sana", "flux1", "sd35l"):
        for mode in ("sol-rl", "diffusion-nft", "naive-scaling", "naive-quant"):
            assert f"{fam}-{mode}" in PRESETS
    sana, flux, sd = get_preset("sana-sol-rl"), get_preset("flux1-sol-rl"), get_preset("sd35l-sol-rl")
    assert (sana.train.micro_batch, sana.train.timestep_fraction, sana.train.max_grad_norm) == (16, 0.6, 1.0)
    assert (flux.train.micro_batch, flux.train.timestep_fraction, flux.eval.steps) == (12, 0.4, (28,))
    assert (sd.train.micro_batch, sd.train.max_grad_norm, sd.eval.steps) == (4, 0.002, (40,))
    for cfg in (sana, flux, sd):
        assert (cfg.rollout.pool, cfg.rollout.kept, cfg.rollout.explore_steps, cfg.rollout.steps) == (96, 24, 6, 10)
        assert (cfg.lora.rank, cfg.lora.alpha, cfg.rollout.explore_precision.backend) == (32, 64.0, "nvfp4")
    assert get_preset("sd35l-diffusion-nft").rollout.pool == 24
    assert get_preset("flux1-naive-quant").rollout.mode == "naive_quant"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_missing_weights_error_lists_files_and_how_to_get_them(name, tmp_path, monkeypatch):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(MissingModelWeightsError) as err:
        load_model(name, tmp_path)
    msg = str(err.value)
    assert "model_index.json" in msg and "vae/" in msg and "transformer/*.safetensors" in msg
    assert FAMILIES[name].repo_id in msg and "model.path" in msg and "HF_HOME" in msg
    # nothing in the HF cache either: the error names the cache and the repo, and nothing is downloaded
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(MissingModelWeightsError, match="Hugging Face cache"):
        load_model(name, None)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_model_loads_through_the_real_loader(name, tiny_dirs):
    assert missing_files(tiny_dirs[name], FAMILIES[name]) == []
    m = load_model(name, tiny_dirs[name])
    fam = FAMILIES[name]
    assert type(m.transformer).__name__ == {"sana1.5-1.6b": "SanaTransformer2DModel",
                                            "sd3.5-large": "SD3Transformer2DModel",
                                            "flux1-dev": "FluxTransformer2DModel"}[name]
    assert m.spec.default_solver == ("euler" if name.startswith("sana") else "dpm2")
    assert m.spec.lora_targets == fam.lora_targets and m.spec.quant_min_features == fam.quant_min_features
    if name == "flux1-dev":  # dynamic shift exp(mu) at the image sequence length (4x4 packed tokens = 16)
        assert m.spec.default_shift == pytest.approx(np.exp(0.5 + (1.15 - 0.5) / 3840 * (16 - 256)))
    else:
        assert m.spec.default_shift == 3.0
    c = m.encode(["a red circle", "two blue squares"])
    assert c.embeds.shape[0] == 2 and torch.isfinite(c.embeds).all()
    assert (c.pooled is None) == name.startswith("sana")
    assert not torch.equal(c.embeds[0], c.embeds[1])
    # velocity is deterministic, batch-independent and depends on the prompt
    x = torch.randn(2, *m.spec.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.7, 0.7])
    with torch.no_grad():
        v = m.velocity(m.transformer, x, t, c)
        v0 = m.velocity(m.transformer, x[:1], t[:1], c.index(slice(0, 1)))
        v_swap = m.velocity(m.transformer, x, t, c.index([1, 0]))
    assert v.shape == x.shape
    torch.testing.assert_close(v[:1], v0, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(v, v_swap)
    # sampling and decoding give images of the model's resolution
    gen = generate(m, m.transformer, ["a red circle"] * 2, [1, 2], 2, SamplerSpec(m.spec.default_solver,
                                                                                    m.spec.default_shift))
    side = m.spec.latent_shape[1] * m.vae_scale_factor
    assert gen.images.shape == (2, side, side, 3) and gen.images.dtype == np.uint8
    assert gen.images[0].std() > 0 and not np.array_equal(gen.images[0], gen.images[1])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_epoch_through_the_preset_code(name, tiny_dirs):
    """explore -> regenerate -> one training step -> adapter export -> merge and requantize (nvfp4-emu)."""
    preset = f"{FAMILY_PRESET[name]}-sol-rl"
    cfg = apply_overrides(get_preset(preset), TINY_RUN + [f"model.path={tiny_dirs[name]}", "epochs=1"]).validate()
    sess = Session.build(cfg)
    spec = sess.model.spec
    assert sess.sampler.solver == spec.default_solver and sess.sampler.shift == spec.default_shift

    # the explorer quantized exactly the layers the family's rules select, and some on both sides
    quantized = {n for n, mod in sess.explorer.module.named_modules() if isinstance(mod, EmuQuantLinear)}
    base_copy = type(sess.model.transformer).from_config(sess.model.transformer.config)
    want = expected_quantized(base_copy, spec)
    assert quantized == want == set(sess.explorer.backend.quantized_names)
    n_linear = sum(type(mod) is torch.nn.Linear for mod in base_copy.modules())
    assert 0 < len(quantized) < n_linear

    before = [p.detach().clone() for p in sess.adapters.trainable_parameters()]
    rec = sess.epoch(0)
    # one denoiser evaluation per step for both solvers (dpm2 is the multistep form)
    assert rec["forwards_explore"] == 2 * 4 * 2 and rec["forwards_regenerate"] == 2 * 2 * 2
    assert np.isfinite(rec["train.loss"]) and rec["train.grad_norm"] > 0
    after = sess.adapters.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, after))

    # adapter export (the wire format) -> merge into plain base weights -> requantize the explorer
    state = sess.adapters.state_dict("old")
    payload = decode_adapter(encode_adapter(state, 1, sess.adapters.spec))
    base = sess.adapters.merged_weights(None)  # the plain base weights of the LoRA targets
    merged = merge_lora(base, payload.state, payload.spec)
    ref = sess.adapters.merged_weights("old")
    assert merged.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(merged[k], ref[k], rtol=0, atol=1e-6)
    assert any(not torch.equal(merged[k], base[k]) for k in ref)
    old = {k: sess.explorer.module.get_submodule(k) for k in ref}
    old_w = {k: (m.dequantized_weight() if isinstance(m, EmuQuantLinear) else m.weight).detach().clone()
             for k, m in old.items()}
    sess.explorer.sync(merged, 1)
    assert sess.explorer.version == 1
    for k, m in old.items():
        if isinstance(m, EmuQuantLinear):  # re-quantized from the merged weight
            want = type(m)(merged[k], None).dequantized_weight()
            torch.testing.assert_close(m.dequantized_weight(), want, rtol=0, atol=0)
            now = m.dequantized_weight()
        else:  # a high-precision layer of the bf16 explorer: the merged weight, bf16-rounded
            now = m.weight
            torch.testing.assert_close(now, round_to_bf16(merged[k]), rtol=0, atol=0)
        assert not torch.equal(now, old_w[k]) or torch.equal(merged[k], base[k])
    # SANA's LoRA targets include NVFP4 layers (cross-attention, out projections); SD3.5 / FLUX hold theirs
    # in bf16 at these widths (their quantized layers here are the feed-forwards)
    assert bool(set(ref) & quantized) == name.startswith("sana")


def test_same_seed_same_epoch(tiny_dirs):
    """Two sessions from the same config run the same epoch bit for bit (SD3.5: the cheapest family)."""
    from solrl.telemetry import strip_timings

    def cfg():
        return apply_overrides(get_preset("sd35l-sol-rl"),
                               TINY_RUN + [f"model.path={tiny_dirs['sd3.5-large']}"]).validate()

    a, b = Session.build(cfg()), Session.build(cfg())
    ra, rb = strip_timings(a.epoch(0)), strip_timings(b.epoch(0))
    assert ra == rb
    for x, y in zip(a.adapters.trainable_parameters(), b.adapters.trainable_parameters()):
        assert torch.equal(x, y)


def test_bad_inputs_name_the_problem(tiny_dirs):
    from solrl.models.base import Cond
    from solrl.models.diffusers_t2i import SD3Model

    m = load_model("sd3.5-large", tiny_dirs["sd3.5-large"])
    c = m.encode(["a red circle"])
    x = torch.zeros(2, *m.spec.latent_shape)
    with pytest.raises(ValueError, match="cond has 1 prompts for a batch of 2"):
        m.velocity(m.transformer, x, torch.tensor([0.5, 0.5]), c)
    with pytest.raises(ValueError, match="t has 3 entries"):
        m.velocity(m.transformer, x, torch.tensor([0.5, 0.5, 0.5]), Cond.cat([c, c]))
    with pytest.raises(ValueError, match="resolution 20 must be a positive multiple of 8"):
        SD3Model(m.pipe, resolution=20)
    with pytest.raises(ValueError, match="with and without a pooled"):
        Cond.cat([c, Cond(c.embeds, c.mask)])
    assert m.decode(torch.zeros(0, *m.spec.latent_shape)).shape == (0, 32, 32, 3)


def test_evaluation_on_a_prompt_file_with_the_ocr_reward(tiny_dirs, tmp_path):
    """A real family evaluated the way a user runs it: prompts from a file, scored by the run's reward."""
    prompts = tmp_path / "eval.txt"
    prompts.write_text('# held-out text prompts\nA sign that says "OPEN"\nA mug printed with "HELLO"\nunused\n')
    cfg = apply_overrides(get_preset("sd35l-sol-rl"), TINY_RUN + [
        f"model.path={tiny_dirs['sd3.5-large']}", "reward=ocr", f"prompts.eval={prompts}", "eval.prompts=2",
        "eval.seeds_per_prompt=1", "eval.steps=2"]).validate()
    sess = Session.build(cfg)
    summary, grids = sess.evaluate()
    assert summary["reward"] == "ocr" and summary["prompts"] == 2 and summary["n"] == 2
    assert 0.0 <= summary["mean_reward"] <= 1.0 and "colour_accuracy" not in summary
    assert grids[2].ndim == 3 and grids[2].dtype == np.uint8
    # a run's prompts come from prompts.train (ocr:train), drawn uniformly and distinct
    drawn = sess.prompt_sampler(np.random.default_rng(0), 4)
    assert len(set(drawn)) == 4 and all(p in sess.prompts and '"' in p for p in drawn)
