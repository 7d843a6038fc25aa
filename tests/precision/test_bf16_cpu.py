"""The real-kernel BF16 CPU explorer (`bf16-cpu`): machine detection and its clear error, real bfloat16 tensors, the
bundled model's velocity against FP32, hot reload (merge and cast) and its atomicity, the explore pass on it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from solrl.precision import PrecisionConfig, build_backend, runnable_backends
from solrl.precision.reference import native_bf16_error
from solrl.telemetry.machine import cpu_flags, describe_machine

NATIVE = native_bf16_error(cpu_flags()) is None
needs_bf16_cpu = pytest.mark.skipif(not NATIVE, reason="this CPU has no BF16 instructions (avx512_bf16 / amx_bf16)")

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n"
ZEN3 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n"
SPR = "flags\t\t: avx2 avx512f amx_bf16 amx_tile amx_int8\n"


def test_cpu_flags_read_the_first_processor():
    assert cpu_flags(ZEN4) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert cpu_flags("no flags here") == frozenset()
    assert "avx2" in describe_machine()["cpu_flags"] or not cpu_flags()  # the machine's own flags are recorded


@pytest.mark.parametrize("text, ok, has", [(ZEN4, True, ""), (SPR, True, ""), (ZEN3, False, "AVX2"),
                                           ("flags : avx2 avx512f\n", False, "AVX-512"), ("flags : sse2\n", False, "neither")])
def test_native_bf16_error_names_the_flags_and_the_emulations(text, ok, has):
    err = native_bf16_error(cpu_flags(text))
    assert (err is None) == ok
    if not ok:
        assert has in err and "avx512_bf16" in err and "nvfp4-emu" in err and "'bf16'" in err


def test_runnable_follows_the_machine():
    assert ("bf16-cpu" in runnable_backends()) == NATIVE


@pytest.mark.skipif(NATIVE, reason="this CPU runs BF16 natively: the refusal is checked on other machines and above")
def test_prepare_refuses_without_bf16_instructions():
    with pytest.raises(RuntimeError, match="BF16 instructions"):
        build_backend(PrecisionConfig("bf16-cpu")).prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@needs_bf16_cpu
def test_every_float_tensor_becomes_bfloat16_and_sync_casts_in_atomically():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    be = build_backend(PrecisionConfig("bf16-cpu"))
    be.prepare(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert be.weight_bytes(model)["total"] == 2 * sum(p.numel() for p in model.parameters())
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    before = model(x)
    w = torch.randn(8, 32)
    be.requantize(model, {"2": w})
    assert model[2].weight.dtype == torch.bfloat16 and torch.equal(model[2].weight, w.to(torch.bfloat16))
    changed = model(x)
    assert not torch.equal(changed, before)
    with pytest.raises(ValueError, match="'0'"):   # a bad entry after a good one changes nothing
        be.requantize(model, {"2": torch.zeros(8, 32), "0": torch.zeros(5, 5)})
    assert torch.equal(model(x), changed)


@needs_bf16_cpu
def test_bundled_model_velocity_is_close_to_fp32_and_answers_in_fp32():
    from solrl.shapes.model import ShapesModel

    model = ShapesModel.load()
    fast = copy.deepcopy(model.transformer)
    build_backend(PrecisionConfig("bf16-cpu")).prepare(fast)
    x = torch.randn(4, *model.spec.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 0.6)
    cond = model.encode(["a red circle", "a blue square", "two green triangles", "a red circle above a blue square"])
    with torch.no_grad():
        ref = model.velocity(model.transformer, x, t, cond)
        out = model.velocity(fast, x, t, cond)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.02, rel   # BF16 arithmetic, not FP32 relabelled, and close to it


@needs_bf16_cpu
def test_a_session_explores_on_the_real_kernel_copy_and_syncs_the_adapter():
    from solrl.config import apply_overrides, get_preset
    from solrl.engine.session import Session

    cfg = apply_overrides(get_preset("shapes-sol-rl"), [
        "rollout.explore_precision.backend=bf16-cpu", "rollout.prompts_per_epoch=2", "rollout.pool=4",
        "rollout.kept=2", "rollout.explore_steps=2", "rollout.steps=3", "tensorboard=false", "lora.rank=4"]).validate()
    sess = Session.build(cfg)
    assert {p.dtype for p in sess.explorer.module.parameters()} == {torch.bfloat16}
    rec = sess.epoch(0)
    assert rec["forwards_explore"] == 2 * 4 * 2 and np.isfinite(rec["explore.reward_mean"])
    for kind in ("time", "cpu"):   # wall and process CPU seconds per phase, the epoch their sum
        assert rec[f"{kind}_epoch_s"] == pytest.approx(sum(rec[f"{kind}_{p}_s"] for p in
                                                           ("sync", "explore", "regenerate", "train")))
        assert rec[f"{kind}_explore_s"] > 0
    # the adapter trained in epoch 1 reaches the explorer: its merged weights, cast to BF16
    sess.sync()
    merged = sess.adapters.merged_weights("old")
    name, w = next(iter(merged.items()))
    assert torch.equal(sess.explorer.module.get_submodule(name).weight, w.to(torch.bfloat16))


# ---------------------------------------------------------------- an explorer that falls back where it cannot run
PORTABLE = ["rollout.explore_precision.backend=bf16-cpu", "rollout.explore_precision.fallback=nvfp4-emu"]


def test_bf16_cpu_with_a_fallback_runs_where_the_cpu_has_it(tmp_path):
    from solrl.config import RunConfig, resolve

    assert resolve("shapes-sol-rl").rollout.explore_precision.backend == "nvfp4-emu"   # the presets' own
    cfg = resolve("shapes-sol-rl", overrides=PORTABLE)
    ep = cfg.rollout.explore_precision
    assert ep.fallback == ""   # resolved once, when validated
    if NATIVE:
        assert ep.backend == "bf16-cpu" and ep.note.startswith("bf16-cpu: it runs here (BF16 instructions on this CPU")
    else:
        assert ep.backend == "nvfp4-emu" and "nvfp4-emu instead of bf16-cpu" in ep.note and "BF16 instructions" in ep.note
    cfg.save(tmp_path / "config.json")   # what ran is what the run directory's config names; a resume keeps it
    again = RunConfig.load(tmp_path / "config.json").validate().rollout.explore_precision
    assert (again.backend, again.fallback, again.note) == (ep.backend, "", ep.note)


def test_the_fallback_is_taken_without_bf16_instructions(monkeypatch):
    import solrl.precision.reference as reference
    from solrl.config import resolve

    monkeypatch.setattr(reference, "cpu_flags", lambda: cpu_flags(ZEN3))   # a CPU of AVX2 only (not this one)
    ep = resolve("shapes-sol-rl", overrides=PORTABLE).rollout.explore_precision
    assert ep.backend == "nvfp4-emu" and ep.fallback == ""
    assert ep.note == ("nvfp4-emu instead of bf16-cpu: precision backend 'bf16-cpu' needs a CPU with BF16 instructions "
                       "(avx512_bf16 or amx_bf16 in /proc/cpuinfo); this one has AVX2 without them, where a BF16 "
                       "forward is slower than FP32")
    # the backend named again afterwards drops the fallback: an explicit choice fails on its own when prepared
    ep = resolve("shapes-sol-rl", overrides=PORTABLE + ["rollout.explore_precision.backend=bf16-cpu"]
                 ).rollout.explore_precision
    assert (ep.backend, ep.fallback, ep.note) == ("bf16-cpu", "", "")
    with pytest.raises(RuntimeError, match="BF16 instructions"):
        build_backend(ep).prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_on_cuda_the_fallback_is_taken_and_unresolved_choices_are_refused():
    from solrl.config import apply_overrides, get_preset
    from solrl.precision import cannot_run_here

    cfg = apply_overrides(get_preset("shapes-sol-rl"), PORTABLE)
    with pytest.raises(ValueError, match="validate the run's config first"):
        build_backend(cfg.rollout.explore_precision)
    cfg.model.device = "cuda"     # resolved alone: this machine has no GPU for the whole validation
    cfg._resolve_fallbacks()
    ep = cfg.rollout.explore_precision
    assert ep.backend == "nvfp4-emu"
    assert ep.note == "nvfp4-emu instead of bf16-cpu: 'bf16-cpu' runs on the CPU and the model is on cuda"
    assert cannot_run_here("bf16", "cuda") is None and "no precision backend 'nope'" in cannot_run_here("nope", "cpu")
    assert (cannot_run_here("bf16-cpu", "cpu") is None) == NATIVE
