"""`fp8-torchao`: FP8 W8A8 on torchao's FP8 GEMM, the `fp8` format where Transformer Engine is absent.

CPU: layer selection (TE `fp8`'s rule, the same layers as `fp8-e4m3-emu` on the families' stand-ins), the errors a
machine without CUDA / an FP8 GPU gets (naming the backend and what to use instead), name resolution (`fp8` without
TE, `same_format`, the CUDA stand-in), packed weight bytes, and, through torch's CPU `_scaled_mm`, the layer's
numerics against `fp8-e4m3-emu` and the in-place re-quantization of an adapter push. GPU (marked, skipped here):
the same numerics on CUDA up to accumulation order, the in-place push there, and `fp8` building this backend.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from solrl.models import ENV_CUDA_STANDIN
from solrl.models.diffusers_t2i import FAMILIES
from solrl.models.diffusers_tiny import TINY
from solrl.precision import BACKEND_NAMES, PrecisionConfig, available_backends, build_backend, runnable_backends
from solrl.precision.base import denoiser_blocks
from solrl.precision.emulated_te import FP8E4M3EmuBackend, FP8E4M3EmuLinear
from solrl.precision.registry import same_format
from solrl.precision.torchao_fp8 import FP8TorchaoBackend, FP8TorchaoLinear, torchao_fp8_requirement_error

HAS_CUDA = torch.cuda.is_available()
HAS_TE = importlib.util.find_spec("transformer_engine") is not None
CAP = torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)


def _cpu_scaled_mm() -> bool:
    try:
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones(1, 1)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


needs_cpu_scaled_mm = pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")


def spread(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Values over several orders of magnitude, signs mixed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, k, generator=g))


def family_cfg(name: str, backend: str, **kw) -> PrecisionConfig:
    f = FAMILIES[name]
    return PrecisionConfig(**{"backend": backend, "model_skip": f.quant_skip, "min_features": f.quant_min_features,
                              **kw})


# ------------------------------------------------------------------------------------------ selection

@pytest.fixture(scope="module")
def transformers():
    torch.set_num_threads(1)
    return {name: TINY[name](0).transformer for name in FAMILIES}


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("policy", [{}, {"keep_first_blocks": 1}, {"min_features": 0}])
def test_selection_is_fp8_e4m3_emus_and_te_fp8s(name, policy, transformers):
    model = transformers[name]
    names = FP8TorchaoBackend(family_cfg(name, "fp8-torchao", **policy)).selected_layers(model)
    assert names == build_backend(family_cfg(name, "fp8-e4m3-emu", **policy)).selected_layers(model)
    from solrl.precision.transformer_engine import FP8TEBackend

    assert names == FP8TEBackend(family_cfg(name, "fp8", **policy)).selected_layers(model)
    if not policy:
        assert names   # the families' feed-forwards are selected
    if policy.get("keep_first_blocks"):   # the denoiser's first block stays in high precision
        first = denoiser_blocks(model)[0] + "."
        assert not any(n.startswith(first) for n in names)
        assert any(n.startswith(first) for n in FP8TorchaoBackend(family_cfg(name, "fp8-torchao")).selected_layers(model))


def test_selection_needs_in_and_out_features_multiple_of_16():
    # _scaled_mm's rule; the emulation takes any width
    model = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 32), torch.nn.Linear(32, 32))
    assert build_backend(PrecisionConfig(backend="fp8-torchao")).selected_layers(model) == ["2"]
    assert build_backend(PrecisionConfig(backend="fp8-e4m3-emu")).selected_layers(model) == ["0", "1", "2"]
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8TorchaoLinear(torch.randn(24, 32))


def test_selection_rejects_a_skip_pattern_that_matches_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="skip pattern '\\*typo\\*' matches no Linear"):
        build_backend(PrecisionConfig(backend="fp8-torchao", skip=("*typo*",))).selected_layers(model)


# ---------------------------------------------------------------------------------------------- errors

@pytest.mark.skipif(HAS_CUDA, reason="checks the error path of a machine without CUDA")
@pytest.mark.parametrize("backend", ["fp8-torchao"] + ([] if HAS_TE else ["fp8"]))
def test_prepare_on_a_cpu_machine_names_cuda_and_the_alternatives_and_leaves_the_model(backend, transformers):
    model = transformers["sd3.5-large"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=f"'{backend}' needs a CUDA GPU") as err:
        build_backend(family_cfg("sd3.5-large", backend)).prepare(model)
    assert "'fp8-e4m3-emu'" in str(err.value) and "'bf16'" in str(err.value)
    if backend == "fp8":   # says why the TE name ran on torchao
        assert "Transformer Engine is not installed" in str(err.value) and "'fp8-torchao'" in str(err.value)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert "fp8-torchao" not in runnable_backends() and "fp8" not in runnable_backends()


def test_requirement_errors_name_capability_and_alternatives():
    old = torchao_fp8_requirement_error("fp8-torchao", cuda_available=True, capability=(8, 0), scaled_mm=True)
    assert ">= 8.9" in old and "has 8.0" in old and "'fp8-e4m3-emu'" in old and "'bf16'" in old
    assert torchao_fp8_requirement_error("fp8", cuda_available=False, capability=None, scaled_mm=True).startswith(
        "precision backend 'fp8' needs a CUDA GPU")
    assert "torch._scaled_mm" in torchao_fp8_requirement_error("fp8-torchao", cuda_available=True, capability=(9, 0),
                                                               scaled_mm=False)
    for cap in ((8, 9), (9, 0), (10, 0)):   # Ada, Hopper, Blackwell
        assert torchao_fp8_requirement_error("fp8-torchao", cuda_available=True, capability=cap, scaled_mm=True) is None


def test_weight_only_is_refused_naming_the_field_and_the_emulation():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="quantize_activations=False .*'fp8-e4m3-emu'"):
        build_backend(PrecisionConfig(backend="fp8-torchao", quantize_activations=False)).prepare(model)
    assert isinstance(model[0], torch.nn.Linear)


# ------------------------------------------------------------------------------------------------ names

def test_registry_and_format_names():
    assert "fp8-torchao" in available_backends() and list(BACKEND_NAMES) == available_backends()
    assert same_format("fp8-torchao", "fp8") and same_format("fp8-torchao", "fp8-e4m3-emu")
    assert not same_format("fp8-torchao", "nvfp4") and not same_format("fp8-torchao", "fp8-e5m2-emu")
    be = build_backend(PrecisionConfig(backend="fp8"))
    # fp8 is Transformer Engine's where it is installed, torchao's FP8 GEMM where it is not; the config keeps "fp8"
    assert type(be).__name__ == ("FP8TEBackend" if HAS_TE else "FP8TorchaoBackend") and be.cfg.backend == "fp8"
    assert be.quantizes and not FP8TorchaoBackend.global_state


@pytest.mark.skipif(HAS_CUDA, reason="the CUDA stand-in applies on machines without CUDA")
def test_cuda_stand_in_builds_the_emulation(monkeypatch):
    monkeypatch.setenv(ENV_CUDA_STANDIN, "1")
    for name in ("fp8-torchao", "fp8"):
        assert isinstance(build_backend(PrecisionConfig(backend=name)), FP8E4M3EmuBackend)


# --------------------------------------------------------------------- the layer, on torch's CPU _scaled_mm

@needs_cpu_scaled_mm
def test_layer_matches_the_emulation_and_packs_the_same_weight():
    w, b = spread(48, 64, 1), torch.randn(48, generator=torch.Generator().manual_seed(2))
    ours, emu = FP8TorchaoLinear(w, b), FP8E4M3EmuLinear(w, b)
    assert ours.weight_q.qdata.dtype == torch.float8_e4m3fn and ours.weight_q.scale.numel() == 1
    assert torch.equal(ours.weight_q.qdata.view(torch.uint8), emu.weight_q.qdata.view(torch.uint8))
    assert torch.equal(ours.weight_q.scale, emu.weight_q.scale)
    assert ours.packed_weight_bytes() == 48 * 64 + 4 == emu.packed_weight_bytes()
    for x in (spread(37, 64, 3).reshape(1, 37, 64), 1e-3 * spread(5, 64, 4), torch.zeros(3, 64)):
        y = ours(x)
        assert y.shape == (*x.shape[:-1], 48) and y.dtype == x.dtype
        torch.testing.assert_close(y, emu(x), rtol=1e-5, atol=1e-5 * float(y.abs().max()))
    assert ours(torch.zeros(0, 64)).shape == (0, 48)
    with pytest.raises(ValueError, match="last dim 32"):
        ours(torch.zeros(2, 32))


@needs_cpu_scaled_mm
def test_requantize_loads_a_push_in_place_and_validates_first():
    torch.manual_seed(0)
    model = torch.nn.Sequential(FP8TorchaoLinear(spread(32, 64, 5), torch.randn(32)), torch.nn.Linear(32, 16))
    be = build_backend(PrecisionConfig(backend="fp8-torchao"))
    qdata, scale = model[0].weight_q.qdata, model[0].weight_q.scale
    ptrs = (qdata.data_ptr(), scale.data_ptr())
    x = spread(7, 64, 6)
    before = model[0](x)
    w_new = spread(32, 64, 7) * 3
    be.requantize(model, {"0": w_new})
    assert (model[0].weight_q.qdata.data_ptr(), model[0].weight_q.scale.data_ptr()) == ptrs   # in place
    fresh = FP8TorchaoLinear(w_new, model[0].bias)
    assert torch.equal(model[0].weight_q.qdata.view(torch.uint8), fresh.weight_q.qdata.view(torch.uint8))
    torch.testing.assert_close(model[0](x), fresh(x), rtol=0, atol=0)
    assert not torch.allclose(model[0](x), before)
    # a bad entry (wrong shape) changes nothing, also in the layers listed before it
    after = model[0](x)
    with pytest.raises(ValueError, match="expected \\(16, 32\\)"):
        be.requantize(model, {"0": spread(32, 64, 8), "1": torch.randn(32, 16)})
    torch.testing.assert_close(model[0](x), after, rtol=0, atol=0)
    with pytest.raises(ValueError, match="Float8Tensor of shape"):
        model[0].load_packed(torch.zeros(32, 64))


@needs_cpu_scaled_mm
def test_weight_bytes_count_one_byte_per_value_and_the_scale():
    model = torch.nn.Sequential(FP8TorchaoLinear(spread(32, 64), torch.randn(32)), torch.nn.Linear(32, 16))
    wb = build_backend(PrecisionConfig(backend="fp8-torchao")).weight_bytes(model)
    assert wb["quantized"] == 32 * 64 + 4 and wb["quantized_bf16"] == 2 * 32 * 64
    assert wb["other"] == 4 * (32 + 16 * 32 + 16) and wb["total"] == wb["quantized"] + wb["other"]


# ------------------------------------------------------------------------------------------- GPU (skipped here)
needs_fp8_gpu = pytest.mark.skipif(not HAS_CUDA or CAP < (8, 9), reason="needs a CUDA GPU of compute capability >= 8.9")


@pytest.fixture
def full_fp32_matmul():
    """The emulation's FP32 GEMM in full FP32: TF32, which allow_tf32 turns on process-wide, would round its
    operands (a setting, not an attribute, so pytest's monkeypatch cannot restore it)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_outputs_match_the_emulation_up_to_accumulation_order_and_push_in_place(full_fp32_matmul):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    ours = build_backend(PrecisionConfig(backend="fp8-torchao")).prepare(copy.deepcopy(base))
    emu_be = build_backend(PrecisionConfig(backend="fp8-e4m3-emu"))
    emu = emu_be.prepare(copy.deepcopy(base))
    assert all(isinstance(ours[i], FP8TorchaoLinear) for i in (0, 2))
    x = torch.randn(3, 37, 256, device="cuda")
    for i in (0, 2):   # layer by layer on the same FP32 input: the same FP8 operands, only the summation differs
        xi = x if i == 0 else torch.nn.functional.gelu(emu[0](x))
        a, e = ours[i](xi), emu[i](xi)
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4 * float(e.abs().max()))
    # the whole model in bf16, as the explorer runs it: far closer to the emulation than FP8 is to bf16
    xb = x.bfloat16()
    ref = base.bfloat16()(xb).float()
    y, ye = ours(xb).float(), emu(xb).float()
    assert y.dtype == torch.float32 and ours(xb).dtype == torch.bfloat16
    to_emu, to_bf16 = ((y - ye).norm() / ye.norm()).item(), ((ye - ref).norm() / ref.norm()).item()
    assert to_emu < to_bf16 / 5 and 0 < to_bf16 < 0.1, (to_emu, to_bf16)
    # an adapter push re-quantizes in place: storage kept, outputs those of a layer built from the merged weight
    ptr = ours[0].weight_q.qdata.data_ptr()
    w_new = ours[0].dequantized_weight() + 0.1 * torch.randn(512, 256, device="cuda")
    be = build_backend(PrecisionConfig(backend="fp8-torchao"))
    be.requantize(ours, {"0": w_new})
    assert ours[0].weight_q.qdata.data_ptr() == ptr
    torch.testing.assert_close(ours[0](x), FP8TorchaoLinear(w_new, ours[0].bias)(x), rtol=0, atol=0)
    emu_be.requantize(emu, {"0": w_new})
    torch.testing.assert_close(ours[0](x), emu[0](x), rtol=1e-4, atol=1e-4 * float(emu[0](x).abs().max()))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.skipif(HAS_TE, reason="fp8 runs Transformer Engine where it is installed")
def test_gpu_fp8_without_transformer_engine_runs_torchao():
    assert "fp8" in runnable_backends() and "fp8-torchao" in runnable_backends()
    name = "sd3.5-large"
    model = TINY[name](0).transformer.cuda()
    be = build_backend(family_cfg(name, "fp8"))
    be.prepare(model)
    assert {n for n, m in model.named_modules() if isinstance(m, FP8TorchaoLinear)} == set(be.quantized_names) != set()
    assert be.weight_bytes(model)["quantized"] > 0
