"""The forward's avoidable cost (issue 39, item 4), checked on the CPU where the logic runs here.

- Transformer Engine's autocast entered once per denoiser forward (`ForwardScope`), not per selected layer: the
  scope's hooks on a real tiny denoiser with the TE backends' own layer selection (TE itself is GPU-only: the
  numerics are in tests/precision/test_te.py, gpu-marked).
- The sampler's state on the denoiser's device, noise still drawn on the CPU per seed (the CUDA half gpu-marked).
- Classifier-free guidance: one batched forward on a GPU (its arithmetic checked here against two forwards), two
  on the CPU (batching changes the CPU's last bits: the CPU runs are the bit-for-bit references); the empty
  prompt encoded once.
- Emulated backends resolve to this GPU's kernel (the capability an input, no CUDA needed).
- model.compile wires a compiled denoiser into sampling and is refused on the CPU.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from solrl.config import ConfigError, get_preset
from solrl.models.base import Velocity
from solrl.models.diffusers_tiny import TINY
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.config import EMULATES, kernel_backend
from solrl.precision.policy import machine_backend, policy_config
from solrl.precision.registry import BACKENDS, available_backends
from solrl.precision.transformer_engine import ForwardScope, forward_modules
from solrl.sampling import cfg_velocity, flow_sigmas, noise_for_seeds, sample
from solrl.shapes.model import ShapesModel

HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------ autocast once per forward

class Counting:
    """A context that counts how often it is entered and whether it is open (what the scope enters)."""

    def __init__(self) -> None:
        self.entries = self.open = 0

    def __call__(self):
        outer = self

        class _Ctx:
            def __enter__(self):
                outer.entries += 1
                outer.open += 1

            def __exit__(self, *exc):
                outer.open -= 1

        return _Ctx()


def _scoped_sd3(backend: str = "fp8"):
    """The tiny SD3 denoiser with a ForwardScope on its forward and, on each layer the TE backend selects, a hook
    that asks the scope for its layer context (what TEQuantLinear.forward does) and records whether it was open."""
    transformer = TINY["sd3.5-large"]().transformer.eval()
    names = build_backend(PrecisionConfig(backend)).selected_layers(transformer)
    assert names, "the TE layer selection picks layers of the tiny SD3"
    ctx = Counting()
    scope = ForwardScope(ctx)
    handles = scope.attach(transformer)
    seen = []

    def layer(module, inputs):
        with scope.layer_context():
            seen.append(ctx.open)

    for n in names:
        transformer.get_submodule(n).register_forward_pre_hook(layer)
    return transformer, names, ctx, scope, seen, handles


def _sd3_inputs(transformer, batch: int = 2) -> dict:
    c = transformer.config
    return {"hidden_states": torch.randn(batch, c.in_channels, 8, 8),
            "encoder_hidden_states": torch.randn(batch, 5, c.joint_attention_dim),
            "pooled_projections": torch.randn(batch, c.pooled_projection_dim), "timestep": torch.full((batch,), 500.0)}


def test_autocast_is_entered_once_per_forward_not_per_layer():
    transformer, names, ctx, scope, seen, _ = _scoped_sd3()
    with torch.no_grad():
        for i in range(3):
            transformer(**_sd3_inputs(transformer), return_dict=False)
            assert ctx.entries == i + 1          # once per forward, whatever the number of selected layers
    assert len(seen) == 3 * len(names) and set(seen) == {1}   # every selected layer ran inside the one context
    assert ctx.open == 0 and scope.depth == 0


def test_a_layer_called_on_its_own_enters_its_own_context():
    transformer, names, ctx, scope, seen, _ = _scoped_sd3()
    layer = transformer.get_submodule(names[0])
    with torch.no_grad():
        layer(torch.randn(3, layer.in_features))
    assert (ctx.entries, seen, ctx.open) == (1, [1], 0)


def test_the_context_is_left_when_the_forward_raises():
    transformer, _, ctx, scope, _, _ = _scoped_sd3()
    bad = _sd3_inputs(transformer)
    bad["encoder_hidden_states"] = torch.randn(2, 5, 3)   # wrong width: the forward raises inside the scope
    with pytest.raises(RuntimeError), torch.no_grad():
        transformer(**bad, return_dict=False)
    assert (ctx.entries, ctx.open, scope.depth) == (1, 0, 0)
    with torch.no_grad():   # and the next forward enters it again
        transformer(**_sd3_inputs(transformer), return_dict=False)
    assert (ctx.entries, ctx.open) == (2, 0)


def test_nested_attached_forwards_enter_once():
    inner = torch.nn.Sequential(torch.nn.Linear(16, 16))
    outer = torch.nn.Sequential(inner, torch.nn.Linear(16, 16))
    ctx = Counting()
    scope = ForwardScope(ctx)
    for m in (outer, inner):
        scope.attach(m)
    outer(torch.randn(2, 16))
    assert (ctx.entries, ctx.open, scope.depth) == (1, 0, 0)


def test_forward_modules_are_the_experts_of_a_container():
    from solrl.models.wan import WanExperts

    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    assert forward_modules(WanExperts(a, b)) == [a, b]
    assert forward_modules(a) == [a]


# ------------------------------------------------------------------ -emu only when named

def test_emulates_table_matches_the_backends():
    assert EMULATES == {n: c.emulates for n, c in BACKENDS.items() if c.emulates} and set(EMULATES) <= set(
        available_backends())


@pytest.mark.parametrize(("backend", "capability", "te", "want"), [
    ("nvfp4-emu", (10, 0), True, "nvfp4"),       # B200: the kernel
    ("nvfp4-te-emu", (12, 0), True, "nvfp4"),
    ("nvfp4-emu", (9, 0), True, "fp8"),          # H100: no FP4, TE's FP8
    ("fp8-e4m3-emu", (9, 0), True, "fp8"),
    ("fp8-e4m3-emu", (8, 9), True, "fp8"),       # Ada
    ("fp8-e4m3-emu", (8, 0), True, "bf16"),      # A100: neither
    ("nvfp4-emu", (10, 0), False, "fp8"),        # no Transformer Engine: no NVFP4, torchao's FP8
    ("fp8-e4m3-emu", (9, 0), False, "fp8"),      # Hopper without Transformer Engine: torchao's FP8 (fp8-torchao)
    ("fp8-e4m3-emu", (8, 0), False, "bf16"),
    ("mxfp4-emu", (10, 0), True, "bf16"),        # no kernel of ours
    ("bf16", (9, 0), True, "bf16"),
    ("nvfp4", (10, 0), True, "nvfp4"),           # kernels stay as named
])
def test_kernel_backend_on_each_gpu(backend, capability, te, want):
    got, why = kernel_backend(backend, capability, te)
    assert got == want
    assert backend in why
    if got == "bf16" and backend.endswith("-emu"):
        assert "GPU" in why or "installed" in why
    if got == "fp8" and not te:
        assert "torchao" in why and "Transformer Engine is not installed" in why


def test_the_cpu_keeps_the_emulations():
    spec = ShapesModel.spec
    for name in EMULATES:
        assert machine_backend(name, "cpu") == name
        assert policy_config(name, "reference", spec, torch.device("cpu")).backend == name
    if not HAS_CUDA:
        assert machine_backend("nvfp4-emu") == "nvfp4-emu"   # the default device here is the CPU


@pytest.mark.gpu
def test_auto_candidates_run_this_gpus_kernel():
    want, _ = kernel_backend("nvfp4-emu", torch.cuda.get_device_capability(),
                             importlib.util.find_spec("transformer_engine") is not None)
    assert policy_config("nvfp4-emu", "reference", ShapesModel.spec, "cuda").backend == want != "nvfp4-emu"


# ------------------------------------------------------------------ classifier-free guidance

class GpuChoice(Velocity):
    """The GPU's choice (one batched forward over [uncond; cond]), taken on the CPU to check its arithmetic."""

    def paired(self, uncond):
        return self.joined(uncond)


def test_cfg_is_two_forwards_on_the_cpu_and_one_batched_forward_on_a_gpu():
    model = ShapesModel.random(0)
    cond = model.encode(["a red circle", "a blue square", "a green triangle"])
    vc, vu = model.velocity_fn(model.transformer, cond), model.velocity_fn(model.transformer, model.encode_uncond(3))
    assert vc.paired(vu) is None and cfg_velocity(vc, vu, 4.0).batched is False   # CPU: bit-for-bit references
    calls = []
    model.transformer.register_forward_pre_hook(lambda m, a, k: calls.append(a[0].shape[0]), with_kwargs=True)
    x, t = torch.randn(3, *model.spec.latent_shape), torch.full((3,), 0.6)
    with torch.no_grad():
        two = cfg_velocity(vc, vu, 4.0)(x, t)
        assert calls == [3, 3]
        guided = cfg_velocity(GpuChoice(model, model.transformer, cond), vu, 4.0)
        assert guided.batched
        one = guided(x, t)
    assert calls == [3, 3, 6]
    # batching changes the CPU GEMMs' last bits only (the CPU keeps two forwards for its bit-equality)
    torch.testing.assert_close(one, two, rtol=0, atol=1e-4)
    # other text shapes, another denoiser: no shared forward
    other = model.velocity_fn(copy.deepcopy(model.transformer), cond)
    assert GpuChoice(model, model.transformer, cond).joined(other) is None


def test_the_empty_prompt_is_encoded_once():
    model = ShapesModel.random(0)
    model.text_encoder.requires_grad_(False)   # as loaded for a run (ShapesModel.load)
    calls = []
    model.text_encoder.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape[0]),
                                                 with_kwargs=True)
    a, b = model.encode_uncond(4), model.encode_uncond(2)
    assert calls == [1] and len(a) == 4 and len(b) == 2
    torch.testing.assert_close(a.embeds[3], model.encode([""]).embeds[0], rtol=0, atol=1e-6)
    # while the text encoder trains (shapes pretraining) it is encoded every time
    trained = ShapesModel.random(0)
    trained.text_encoder.requires_grad_(True)
    trained.encode_uncond(1)
    assert trained.encode_uncond(1).embeds.requires_grad
    assert "_uncond" not in vars(trained)


# ------------------------------------------------------------------ the sampler's state on the denoiser's device

def test_sample_comes_back_on_the_callers_device_and_steps_stay_exact():
    model = ShapesModel.random(0)
    vfn = model.velocity_fn(model.transformer, model.encode(["a red circle"] * 2))
    assert vfn.device == torch.device("cpu")
    noise = noise_for_seeds([1, 2], model.spec.latent_shape)
    with torch.no_grad():
        a = sample(vfn, noise, flow_sigmas(3), "euler")
        b = sample(lambda x, t: vfn(x, t), noise, flow_sigmas(3), "euler")   # a plain function: no device
    assert a.x0.device.type == "cpu" and torch.equal(a.x0, b.x0)


@pytest.mark.gpu
def test_sampler_state_lives_on_the_gpu_and_noise_stays_the_seeds():
    model = ShapesModel.random(0)
    model.transformer.cuda()
    model.text_encoder.cuda()
    vfn = model.velocity_fn(model.transformer, model.encode(["a red circle"] * 2))
    where = []
    noise = noise_for_seeds([1, 2], model.spec.latent_shape)
    assert torch.equal(noise, noise_for_seeds([1, 2], model.spec.latent_shape, device="cuda").cpu())

    def spy(x, t):
        where.append((x.device.type, t.device.type))
        return vfn(x, t)

    spy.device = vfn.device
    with torch.no_grad():
        res = sample(spy, noise, flow_sigmas(4), "dpm2", return_trajectory=True)
    assert set(where) == {("cuda", "cuda")} and res.x0.device.type == "cpu" and res.trajectory.device.type == "cpu"


# ------------------------------------------------------------------ torch.compile of the denoiser

def test_compile_wires_a_compiled_denoiser_into_sampling():
    model = ShapesModel.random(0)
    assert model.denoiser(model.transformer) is model.transformer   # off by default
    with pytest.raises(ValueError, match="GPU roles"):
        model.compile_denoiser()                                    # the CPU is refused, with the reason
    model.compile_options = {"backend": "eager"}   # what compile_denoiser sets on a GPU (not run here: slow on CPU)
    compiled = model.denoiser(model.transformer)
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is model.transformer
    assert model.denoiser(model.transformer) is compiled and model.denoiser(compiled) is compiled
    clone = copy.deepcopy(model.transformer)                        # a copy (an explorer's build) compiles its own
    assert model.denoiser(clone)._orig_mod is clone


def test_compile_setting_is_refused_without_a_gpu():
    cfg = get_preset("shapes-sol-rl")
    cfg.model.compile = True
    cfg.model.device = "cpu"
    with pytest.raises(ConfigError, match="model.compile"):
        cfg.validate()
    cfg.model.compile = "yes"
    with pytest.raises(ConfigError, match="true or false"):
        cfg.validate()



def test_the_rollout_services_take_model_compile_from_the_run():
    """An explorer or regenerator takes model.compile from the run as it takes model.device (refused on a machine
    without CUDA, as the trainer's run is); --compile asks for it alone, and a compiling service's model is refused
    where it computes on the CPU."""
    import argparse

    from services.common.args import add_model_arguments
    from services.rollout.shell import load_served_model, settle_role_args
    from solrl.config import ConfigError

    def settled(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_model_arguments(p, {}, precision="nvfp4-emu", steps=6, grpc_port=0, http_port=0)
        return settle_role_args(p.parse_args(["--preset", "shapes-sol-rl", *argv]), "explorer")

    assert settled().compile is False and settled("--compile").compile is True
    with pytest.raises(ConfigError, match="model.compile"):
        settled("--set", "model.compile=true")
    with pytest.raises(ValueError, match="model.compile"):
        load_served_model(settled("--compile"))   # the model computes on the CPU: compile_denoiser refuses it
