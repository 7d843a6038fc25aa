"""A LoRA exported by solrl loads with diffusers' `pipe.load_lora_weights` and acts as solrl's merge does.

Tiny SANA, SD3 and FLUX pipelines (the real classes, seeded) are saved in the diffusers layout. solrl loads
them through its registry loader, gives the denoiser a LoRA (peft, seeded), exports it with
`export_diffusers_lora`, and diffusers loads that file into a fresh pipeline. Checked: the denoiser
outputs agree with solrl's merged inference copy, and a full diffusers pipeline call (its own scheduler,
prompt encoding, VAE decode) reproduces solrl's sampled images from the same noise, which also pins
solrl's timestep / shift / packing conventions to diffusers'.
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import safetensors
import torch

from solrl.adapters import (
    LoraAdapters,
    LoraSpec,
    apply_merged,
    encode_adapter,
    export_diffusers_lora,
    make_inference_copy,
)
from solrl.models import load_model
from solrl.models.diffusers_t2i import FAMILIES
from solrl.models.diffusers_tiny import save_tiny
from solrl.rollout.passes import SamplerSpec, generate
from solrl.sampling import flow_sigmas, noise_for_seeds

PROMPTS = ["a red circle", "two blue squares"]
SEEDS = [11, 12]
STEPS = 3


@pytest.fixture(scope="module", params=list(FAMILIES))
def setup(request, tmp_path_factory):
    torch.set_num_threads(1)
    name = request.param
    d = save_tiny(name, tmp_path_factory.mktemp(name.replace(".", "_")))
    model = load_model(name, d)
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=model.spec.lora_targets)
    adapters = LoraAdapters(model.transformer, spec, seed=0)
    with torch.no_grad():  # a non-trivial adapter (B is zero at init)
        g = torch.Generator().manual_seed(3)
        for p in adapters.parameters("default"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    lora_file = export_diffusers_lora(encode_adapter(adapters.state_dict("default"), 7, spec),
                                      d / "lora" / "pytorch_lora_weights.safetensors")
    merged = make_inference_copy(adapters, type(model.transformer), model.transformer.config)
    apply_merged(merged, adapters.merged_weights("default"))
    base = make_inference_copy(adapters, type(model.transformer), model.transformer.config)
    pipe = getattr(diffusers, model.family.pipeline).from_pretrained(d, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_file))
    return name, model, pipe, merged, base, lora_file


def test_exported_file_is_a_plain_diffusers_lora(setup):
    _name, model, pipe, *_, lora_file = setup
    with safetensors.safe_open(str(lora_file), "pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
                        for k in keys)
    assert not any(k.startswith("solrl.") for k in meta) and "lora_adapter_metadata" in meta
    cfg = pipe.transformer.peft_config[pipe.get_active_adapters()[0]]
    assert (cfg.r, cfg.lora_alpha) == (4, 8.0)  # alpha / rank read from the metadata, not assumed
    assert set(cfg.target_modules) == set(model.spec.lora_targets)


def test_diffusers_lora_matches_solrl_merge_on_the_denoiser(setup):
    _name, model, pipe, merged, base, _ = setup
    cond = model.encode(PROMPTS)
    x = torch.randn(2, *model.spec.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.8, 0.35])
    with torch.no_grad():
        v_pipe = model.velocity(pipe.transformer, x, t, cond)
        v_merged = model.velocity(merged, x, t, cond)
        v_base = model.velocity(base, x, t, cond)
    change = (v_merged - v_base).abs().max().item()
    assert change > 1e-3  # the adapter matters
    assert (v_pipe - v_merged).abs().max().item() < 1e-3 * change + 1e-5


def _pipeline_images(name, model, pipe) -> np.ndarray:
    """The diffusers pipeline's own sampling from solrl's noise on solrl's sigma grid (no CFG)."""
    noise = noise_for_seeds(SEEDS, model.spec.latent_shape)
    unshifted = torch.linspace(1.0, 0.0, STEPS + 1)[:-1].tolist()  # the scheduler applies the shift itself
    side = model.resolution
    common = {"prompt": PROMPTS, "num_inference_steps": STEPS, "sigmas": unshifted, "height": side, "width": side,
                  "output_type": "np", "max_sequence_length": model.max_sequence_length()}
    if name == "flux1-dev":
        b, c, h, w = noise.shape
        latents = pipe._pack_latents(noise, b, c, h, w)
        out = pipe(latents=latents, guidance_scale=model.guidance, **common)
    elif name == "sana1.5-1.6b":
        pipe.scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=model.spec.default_shift)
        out = pipe(latents=noise, guidance_scale=1.0, use_resolution_binning=False, **common)
    else:
        out = pipe(latents=noise, guidance_scale=1.0, **common)
    return (out.images * 255).round().astype(np.uint8)


def test_diffusers_pipeline_reproduces_solrl_sampling_with_the_lora(setup):
    name, model, pipe, merged, base, _ = setup
    if model.spec.default_solver != "euler":
        # diffusers' pipelines sample with Euler (FlowMatchEulerDiscreteScheduler); compare on the same solver
        assert model.spec.default_solver == "dpm2"
    sampler = SamplerSpec("euler", model.spec.default_shift)
    ours = generate(model, merged, PROMPTS, SEEDS, STEPS, sampler)
    theirs = _pipeline_images(name, model, pipe)
    assert theirs.shape == ours.images.shape
    diff = np.abs(theirs.astype(int) - ours.images.astype(int))
    assert diff.max() <= 1, diff.max()  # equal up to uint8 rounding of float noise
    without = generate(model, base, PROMPTS, SEEDS, STEPS, sampler)
    assert np.abs(without.images.astype(int) - ours.images.astype(int)).max() > 1  # the LoRA changed the images
    # and solrl's grid is the scheduler's: the same shifted sigmas
    torch.testing.assert_close(pipe.scheduler.sigmas.double(), flow_sigmas(STEPS, model.spec.default_shift),
                               rtol=1e-6, atol=1e-6)
