"""Tests for solrl.precision: registry, bf16/fp32 backends and the FP4 fake-quant backends.

Expected values come from torchao's own quantizers called directly, from hand-written
format facts (OCP MX v1.0 E2M1 encoding, NVFP4 two-level scaling) or from the definitions.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import MXTensor
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
from torchao.quantization import Float8Tensor

from solrl.precision import (
    EmuQuantLinear,
    MXFP4EmuLinear,
    NVFP4EmuLinear,
    PrecisionConfig,
    available_backends,
    build_backend,
)
from solrl.precision.transformer_engine import requirement_error

# E2M1 magnitudes by 3-bit code (OCP MX spec v1.0, table of FP4 E2M1); bit 3 is the sign.
E2M1_BY_CODE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_GRID = torch.cat([-E2M1_BY_CODE.flip(0), E2M1_BY_CODE]).double()
NVFP4_TENSOR_DIVISOR = 448.0 * 6.0  # E4M3 max * E2M1 max: per-tensor scale = amax / 2688


def nearest_grid_distance(y: torch.Tensor) -> torch.Tensor:
    """|y - nearest E2M1 value| elementwise (float64)."""
    return (y.double().unsqueeze(-1) - E2M1_GRID).abs().amin(-1)


def decode_e2m1_bytes(qdata: torch.Tensor) -> torch.Tensor:
    """Hand decode of packed E2M1 pairs: low nibble is the even element, high the odd one."""
    nibbles = torch.stack([qdata & 0x0F, qdata >> 4], dim=-1).flatten(-2).long()
    magnitude = E2M1_BY_CODE[nibbles & 0x7]
    return torch.where((nibbles & 0x8) != 0, -magnitude, magnitude)


def blockwise(scale_MB: torch.Tensor, block: int) -> torch.Tensor:
    """Expand one scale per block [M, K/block] to one per element [M, K]."""
    return scale_MB.repeat_interleave(block, dim=-1)


def ref_nvfp4(t_MK: torch.Tensor) -> NVFP4Tensor:
    pts = t_MK.abs().amax().float() / NVFP4_TENSOR_DIVISOR
    return NVFP4Tensor.to_nvfp4(t_MK.contiguous(), block_size=16, per_tensor_scale=pts)


def ref_mxfp4(t_MK: torch.Tensor) -> MXTensor:
    return MXTensor.to_mx(
        t_MK.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.RCEIL
    )


FORMATS = [(NVFP4EmuLinear, ref_nvfp4), (MXFP4EmuLinear, ref_mxfp4)]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Module()
        self.attn.to_q = nn.Linear(d, d)
        self.attn.to_out = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn.to_out(torch.tanh(self.attn.to_q(h)))
        return x + self.ff(h)


class Toy(nn.Module):
    """Names shaped like a diffusion transformer's; widths chosen for the selection rules."""

    def __init__(self) -> None:
        super().__init__()
        self.caption_projection = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32))
        self.adapter = nn.Linear(24, 32)  # in_features 24: not a multiple of 16 or 32
        self.blocks = nn.ModuleList([Block(32), Block(32)])
        self.proj_out = nn.Linear(32, 8)

    def forward(self, cap: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        x = self.caption_projection(cap) + self.adapter(extra)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


def toy_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 24, generator=g)


def toy_model() -> Toy:
    torch.manual_seed(0)
    return Toy()


def prepared(backend: str, **cfg) -> tuple[nn.Module, object]:
    be = build_backend(PrecisionConfig(backend=backend, **cfg))
    return be.prepare(toy_model()), be


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, quantized weights as (packed values, scales)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, (NVFP4Tensor, MXTensor, Float8Tensor)):
            out[name + ".qdata"] = t.qdata.view(torch.uint8).clone()
            out[name + ".scale"] = (t.scale.view(torch.uint8) if t.scale.element_size() == 1 else t.scale).clone()
            if getattr(t, "per_tensor_scale", None) is not None:
                out[name + ".per_tensor_scale"] = t.per_tensor_scale.clone()
        else:
            out[name] = t.detach().clone()
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- registry and config


def test_registry_has_the_cpu_backends() -> None:
    cpu = ("fp32", "bf16", "nvfp4-emu", "mxfp4-emu", "nvfp4-te-emu", "fp8-e4m3-emu", "fp8-e5m2-emu")
    assert set(cpu) <= set(available_backends())
    for name in cpu:
        assert build_backend(PrecisionConfig(backend=name)).name == name


def test_unknown_backend_lists_available() -> None:
    with pytest.raises(ValueError) as err:
        build_backend(PrecisionConfig(backend="int3"))
    msg = str(err.value)
    assert "int3" in msg
    for name in ("fp32", "bf16", "nvfp4-emu", "mxfp4-emu"):
        assert name in msg


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        ({"skip": "*proj*"}, TypeError, "skip"),
        ({"skip": ("a", 3)}, TypeError, "skip"),
        ({"min_features": -1}, ValueError, "min_features"),
        ({"min_features": 2.5}, TypeError, "min_features"),
        ({"quantize_activations": 1}, TypeError, "quantize_activations"),
        ({"backend": None}, TypeError, "backend"),
    ],
)
def test_config_rejects_bad_fields(kwargs: dict, exc: type, word: str) -> None:
    with pytest.raises(exc, match=word):
        PrecisionConfig(**kwargs)


def test_config_accepts_list_of_patterns() -> None:
    assert PrecisionConfig(skip=["a*", "b"]).skip == ("a*", "b")


# ---------------------------------------------------------------- format facts


def test_nvfp4_packed_weight_values_and_scales() -> None:
    torch.manual_seed(0)
    w = torch.randn(8, 64) * 0.2
    w[3, 5] = 1.7  # one large entry: its block scale hits E4M3's top, others stay small
    layer = NVFP4EmuLinear(w)
    packed = layer.weight_q
    assert isinstance(packed, NVFP4Tensor)
    assert packed.qdata.dtype == torch.uint8 and packed.qdata.shape == (8, 32)  # 2 per byte
    assert packed.scale.dtype == torch.float8_e4m3fn and packed.scale.shape == (8, 4)

    # Per-tensor scale: amax / (448 * 6), NVFP4's two-level scaling.
    assert packed.per_tensor_scale.item() == pytest.approx(1.7 / NVFP4_TENSOR_DIVISOR, rel=1e-6)
    # Block scales are E4M3 values: the round trip through float8_e4m3fn is the identity.
    scale_f32 = packed.scale.float()
    assert torch.equal(scale_f32.to(torch.float8_e4m3fn).float(), scale_f32)
    # ...and each is the block's amax / 6 in units of the tensor scale, rounded to E4M3.
    block_amax = w.abs().reshape(8, 4, 16).amax(-1)
    expected = (block_amax / 6.0 / packed.per_tensor_scale).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale_f32, expected)
    assert scale_f32.max().item() == 448.0

    # Dequantized / block scale / tensor scale lies on the E2M1 grid (up to fp32 rounding).
    dq = layer.dequantized_weight()
    eff = blockwise(scale_f32.double() * packed.per_tensor_scale.double(), 16)
    y = dq.double() / eff
    assert (nearest_grid_distance(y) <= 1e-6 * y.abs().clamp(min=1)).all()
    # The packed bytes decode by hand to exactly those grid values.
    codes = decode_e2m1_bytes(packed.qdata)
    eff_f32 = blockwise(packed.per_tensor_scale * scale_f32, 16)
    assert torch.equal(codes * eff_f32, dq)


def test_mxfp4_packed_weight_values_and_scales() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 96)
    layer = MXFP4EmuLinear(w)
    packed = layer.weight_q
    assert isinstance(packed, MXTensor)
    assert packed.qdata.dtype == torch.uint8 and packed.qdata.shape == (6, 48)
    assert packed.scale.dtype == torch.float8_e8m0fnu and packed.scale.shape == (6, 3)

    # E8M0 scales: 2 ** (byte - 127), powers of two, chosen as 2 ** ceil(log2(amax / 6)).
    scale = torch.pow(2.0, packed.scale.view(torch.uint8).double() - 127)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()
    block_amax = w.double().abs().reshape(6, 3, 32).amax(-1)
    assert torch.equal(scale, torch.pow(2.0, torch.ceil(torch.log2(block_amax / 6.0))))

    # A power-of-two scale divides out exactly: the values are E2M1 grid points.
    y = layer.dequantized_weight().double() / blockwise(scale, 32)
    assert (nearest_grid_distance(y) == 0).all()
    assert torch.equal(decode_e2m1_bytes(packed.qdata).double(), y)


@pytest.mark.parametrize("layer_cls, ref", FORMATS)
@pytest.mark.parametrize("quantize_activations", [True, False])
def test_layer_matches_torchao_bit_for_bit(layer_cls, ref, quantize_activations: bool) -> None:
    torch.manual_seed(0)
    k = 64
    w, b = torch.randn(24, k), torch.randn(24)
    x = torch.randn(2, 3, k) * 3
    layer = layer_cls(w, b, quantize_activations=quantize_activations)

    x_MK = x.reshape(-1, k)
    x_used = ref(x_MK).dequantize(torch.float32) if quantize_activations else x_MK
    expected = F.linear(x_used, ref(w).dequantize(torch.float32), b).reshape(2, 3, 24)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("layer_cls, ref", FORMATS)
def test_layer_handles_any_leading_shape(layer_cls, ref) -> None:
    torch.manual_seed(0)
    w, b = torch.randn(5, 32), torch.randn(5)
    layer = layer_cls(w, b)
    x = torch.randn(2, 2, 3, 32)
    y = layer(x)
    assert y.shape == (2, 2, 3, 5)
    flat = F.linear(ref(x.reshape(-1, 32)).dequantize(torch.float32),
                    ref(w).dequantize(torch.float32), b)
    assert torch.equal(y.reshape(-1, 5), flat)
    assert layer(x[0, 0, 0]).shape == (5,)
    assert layer(torch.zeros(0, 32)).shape == (0, 5)
    assert torch.equal(layer(torch.zeros(4, 32)), b.expand(4, 5))  # zeros: finite, bias only
    with pytest.raises(ValueError, match="last dim"):
        layer(torch.randn(2, 31))


@pytest.mark.parametrize("layer_cls, block", [(NVFP4EmuLinear, 16), (MXFP4EmuLinear, 32)])
def test_quantization_error_within_e2m1_bound(layer_cls: type[EmuQuantLinear], block: int) -> None:
    """Bound from E2M1's spacing. With y = x / s (s the block's effective scale), the
    spacing is 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6], so rounding moves y by at most
    0.25 below 2 and at most |y| / 4 above; NVFP4's E4M3-rounded scale can leave
    |y| <= 6 * 16/15 = 6.4 before the clamp to 6, an error of 0.4 <= |y| / 4. Hence
        |x - q(x)| <= max(s / 4, |x| / 4)          (elementwise)
        ||x - q(x)|| / ||x|| <= sqrt(1 + sum s^2 / sum x^2) / 4   (squares summed).
    bf16 rounding (8-bit significand) moves each value by at most 2^-9 relative."""
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    packed = layer_cls.quantize(x)
    dq = packed.dequantize(torch.float32).double()
    if layer_cls is NVFP4EmuLinear:
        s = blockwise(packed.scale.double() * packed.per_tensor_scale.double(), block)
    else:
        s = blockwise(torch.pow(2.0, packed.scale.view(torch.uint8).double() - 127), block)
    xd = x.double()
    err = (xd - dq).abs()
    assert (err <= torch.maximum(s / 4, xd.abs() / 4) * (1 + 1e-6)).all()

    rel = (err.norm() / xd.norm()).item()
    bound = math.sqrt(1 + (s**2).sum().item() / (xd**2).sum().item()) / 4
    rel_bf16 = ((xd - x.to(torch.bfloat16).double()).norm() / xd.norm()).item()
    assert rel <= bound
    assert rel_bf16 <= 2.0**-9
    assert rel > 20 * rel_bf16, (rel, rel_bf16)


# ---------------------------------------------------------------- layer selection


def test_skip_patterns_min_features_and_block_divisibility() -> None:
    model = toy_model()
    all_16 = [
        "caption_projection.0",
        "caption_projection.2",
        "blocks.0.attn.to_q",
        "blocks.0.attn.to_out",
        "blocks.0.ff.0",
        "blocks.0.ff.2",
        "blocks.1.attn.to_q",
        "blocks.1.attn.to_out",
        "blocks.1.ff.0",
        "blocks.1.ff.2",
        "proj_out",
    ]  # "adapter" (in_features 24) never fits a block
    nv = build_backend(PrecisionConfig(backend="nvfp4-emu"))
    assert nv.selected_layers(model) == all_16
    mx = build_backend(PrecisionConfig(backend="mxfp4-emu"))
    assert mx.selected_layers(model) == [n for n in all_16 if n != "caption_projection.0"]

    skipping = build_backend(PrecisionConfig(
        backend="nvfp4-emu", skip=("*proj_out*", "caption_projection.*", "blocks.1.attn.*")
    ))
    assert skipping.selected_layers(model) == [
        "blocks.0.attn.to_q", "blocks.0.attn.to_out", "blocks.0.ff.0", "blocks.0.ff.2",
        "blocks.1.ff.0", "blocks.1.ff.2",
    ]
    # min_features compares max(in, out): the ff layers are 32 -> 64 and 64 -> 32.
    big = build_backend(PrecisionConfig(backend="nvfp4-emu", min_features=64))
    assert big.selected_layers(model) == ["blocks.0.ff.0", "blocks.0.ff.2",
                                          "blocks.1.ff.0", "blocks.1.ff.2"]
    for name in ("fp32", "bf16"):
        assert build_backend(PrecisionConfig(backend=name)).selected_layers(model) == []


def test_prepare_replaces_exactly_the_selected_layers() -> None:
    model, be = prepared("nvfp4-emu", skip=("proj_out",))
    quantized = [n for n, m in model.named_modules() if isinstance(m, NVFP4EmuLinear)]
    assert quantized == list(be.quantized_names)
    assert "proj_out" not in quantized and "adapter" not in quantized
    assert type(model.proj_out) is nn.Linear and type(model.adapter) is nn.Linear
    assert model.blocks[0].attn.to_q.in_features == 32
    assert model.blocks[0].ff[0].out_features == 64


def test_prepare_rejects_a_bare_linear() -> None:
    with pytest.raises(TypeError, match="wrap it"):
        build_backend(PrecisionConfig(backend="nvfp4-emu")).prepare(nn.Linear(32, 32))
    with pytest.raises(TypeError, match="model"):
        build_backend(PrecisionConfig(backend="bf16")).prepare("not a model")


# ---------------------------------------------------------------- bytes


def test_packed_weight_bytes_are_under_30_percent_of_bf16() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 96, bias=False),
                          nn.LayerNorm(96), nn.Linear(96, 7))
    other_fp32 = 4 * (128 + 96 + 96 + 96 * 7 + 7)  # biases, LayerNorm, the skipped 96 -> 7
    nv_be = build_backend(PrecisionConfig(backend="nvfp4-emu", skip=("4",)))
    nv = nv_be.weight_bytes(nv_be.prepare(copy.deepcopy(model)))
    # NVFP4: half a byte per value, one E4M3 byte per 16 values, 4 bytes of tensor scale.
    nv_expected = sum(o * i // 2 + o * i // 16 + 4 for o, i in [(128, 256), (96, 128)])
    bf16_bytes = 2 * (128 * 256 + 96 * 128)
    assert nv == {"quantized": nv_expected, "quantized_bf16": bf16_bytes,
                  "other": other_fp32, "total": nv_expected + other_fp32}
    mx_be = build_backend(PrecisionConfig(backend="mxfp4-emu", skip=("4",)))
    mx = mx_be.weight_bytes(mx_be.prepare(copy.deepcopy(model)))
    # MXFP4: half a byte per value, one E8M0 byte per 32 values.
    mx_expected = sum(o * i // 2 + o * i // 32 for o, i in [(128, 256), (96, 128)])
    assert mx["quantized"] == mx_expected and mx["quantized_bf16"] == bf16_bytes
    nv_ratio, mx_ratio = nv["quantized"] / bf16_bytes, mx["quantized"] / bf16_bytes
    print(f"packed/bf16 weight bytes: nvfp4 {nv_ratio:.4f}, mxfp4 {mx_ratio:.4f}")
    assert nv_ratio <= 0.30 and mx_ratio <= 0.30

    fp32 = build_backend(PrecisionConfig(backend="fp32")).weight_bytes(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert fp32 == {"quantized": 0, "quantized_bf16": 0, "other": 4 * n_params,
                    "total": 4 * n_params}


# ---------------------------------------------------------------- fp32 / bf16


def test_fp32_backend_leaves_model_bitwise_unchanged() -> None:
    model = toy_model()
    before = snapshot(model)
    be = build_backend(PrecisionConfig(backend="fp32"))
    assert be.prepare(model) is model
    assert_same(before, snapshot(model))
    assert be.quantized_names == ()


def test_bf16_backend_rounds_every_float_tensor_to_bf16() -> None:
    model = toy_model()
    model.register_buffer("table", torch.randn(3, 3))
    model.register_buffer("steps", torch.arange(4))
    caps, extra = toy_inputs()
    ref = model(caps, extra)
    be = build_backend(PrecisionConfig(backend="bf16"))
    assert be.prepare(model) is model
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            assert t.dtype == torch.float32, name  # CPU: fp32 storage, bf16 values
            assert torch.equal(t, t.to(torch.bfloat16).float()), name
    assert torch.equal(model.steps, torch.arange(4))
    out = model(caps, extra)
    assert not torch.equal(out, ref)
    assert torch.allclose(out, ref, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------- requantize


def new_weights(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(model.get_submodule(n).out_features,
                           model.get_submodule(n).in_features, generator=g) for n in names}


@pytest.mark.parametrize("backend", ["nvfp4-emu", "mxfp4-emu", "nvfp4-te-emu", "fp8-e4m3-emu", "fp8-e5m2-emu", "bf16",
                                     "fp32"])
def test_requantize_equals_preparing_from_the_new_weights(backend: str) -> None:
    names = ["blocks.0.attn.to_q", "blocks.1.ff.2", "proj_out", "adapter"]
    model, be = prepared(backend, skip=("proj_out",))
    caps, extra = toy_inputs()
    before = model(caps, extra)
    weights = new_weights(model, names)
    be.requantize(model, weights)

    fresh = toy_model()
    with torch.no_grad():
        for n, w in weights.items():
            fresh.get_submodule(n).weight.copy_(w)
    build_backend(PrecisionConfig(backend=backend, skip=("proj_out",))).prepare(fresh)
    after = model(caps, extra)
    assert not torch.equal(after, before)
    assert torch.equal(after, fresh(caps, extra))
    assert_same(snapshot(model), snapshot(fresh))


@pytest.mark.parametrize(
    "bad, exc, word",
    [
        ({"blocks.0.attn.nope": torch.zeros(32, 32)}, ValueError, "blocks.0.attn.nope"),
        ({"blocks.0.norm": torch.zeros(32, 32)}, ValueError, "blocks.0.norm"),
        ({"blocks.0.ff.0": torch.zeros(32, 64)}, ValueError, "blocks.0.ff.0"),
        ({"proj_out": torch.zeros(8, 33)}, ValueError, "proj_out"),
        ({"proj_out": torch.full((8, 32), float("nan"))}, ValueError, "proj_out"),
        ({"proj_out": torch.zeros(8, 32, dtype=torch.int64)}, TypeError, "proj_out"),
    ],
)
def test_requantize_rejects_bad_entries_atomically(bad: dict, exc: type, word: str) -> None:
    model, be = prepared("nvfp4-emu", skip=("proj_out",))
    caps, extra = toy_inputs()
    out_before, state_before = model(caps, extra), snapshot(model)
    good = new_weights(model, ["blocks.0.attn.to_q", "adapter"])  # valid, listed first
    with pytest.raises(exc, match=word.replace(".", r"\.")):
        be.requantize(model, {**good, **bad})
    assert_same(state_before, snapshot(model))
    assert torch.equal(model(caps, extra), out_before)


def test_set_weight_rejects_wrong_shape() -> None:
    layer = NVFP4EmuLinear(torch.randn(4, 16))
    with pytest.raises(ValueError, match="weight_OI"):
        layer.set_weight(torch.randn(4, 17))
    with pytest.raises(ValueError, match="in_features=17"):
        NVFP4EmuLinear(torch.randn(4, 17))
    with pytest.raises(ValueError, match="bias_O"):
        MXFP4EmuLinear(torch.randn(4, 32), torch.randn(5))


# ---------------------------------------------------------------- copies


@pytest.mark.parametrize("backend", ["nvfp4-emu", "mxfp4-emu", "nvfp4-te-emu", "fp8-e4m3-emu", "bf16"])
def test_deepcopy_of_prepared_model_is_identical_and_independent(backend: str) -> None:
    model, be = prepared(backend)
    caps, extra = toy_inputs()
    clone = copy.deepcopy(model)
    assert torch.equal(clone(caps, extra), model(caps, extra))
    before = model(caps, extra)
    be.requantize(clone, new_weights(clone, ["blocks.0.ff.0"]))
    assert not torch.equal(clone(caps, extra), before)
    assert torch.equal(model(caps, extra), before)


def test_quantized_bias_stays_fp32_and_rest_is_bf16() -> None:
    model, _ = prepared("nvfp4-emu")
    raw = toy_model()
    assert torch.equal(model.blocks[0].attn.to_q.bias, raw.blocks[0].attn.to_q.bias)
    assert model.blocks[0].attn.to_q.bias.dtype == torch.float32
    norm_w = model.blocks[0].norm.weight
    assert torch.equal(model.adapter.weight, raw.adapter.weight.to(torch.bfloat16).float())
    assert torch.equal(norm_w, norm_w.to(torch.bfloat16).float())


# ---------------------------------------------------------------- Transformer Engine backends


@pytest.mark.parametrize(
    "backend, facts, words",
    [
        ("nvfp4", dict(cuda_available=False, capability=None, te_installed=True), ["CUDA"]),
        ("nvfp4", dict(cuda_available=True, capability=(9, 0), te_installed=True),
         ["10.0", "9.0"]),
        ("fp8", dict(cuda_available=True, capability=(8, 6), te_installed=True), ["8.9", "8.6"]),
        ("fp8", dict(cuda_available=True, capability=(9, 0), te_installed=False),
         ["transformer_engine"]),
        ("fp8", dict(cuda_available=True, capability=(8, 9), te_installed=True), None),
        ("nvfp4", dict(cuda_available=True, capability=(12, 0), te_installed=True), None),
    ],
)
def test_requirement_error_names_what_is_missing(backend: str, facts: dict, words) -> None:
    min_capability = {"nvfp4": (10, 0), "fp8": (8, 9)}[backend]
    error = requirement_error(backend, min_capability=min_capability, **facts)
    if words is None:
        assert error is None
    else:
        assert backend in error and all(w in error for w in words), error


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a CUDA-less machine")
@pytest.mark.parametrize("backend", ["nvfp4", "fp8"])
def test_te_backends_refuse_to_prepare_without_cuda(backend: str) -> None:
    model = toy_model()
    before = snapshot(model)
    be = build_backend(PrecisionConfig(backend=backend, skip=("proj_out",)))
    assert be.selected_layers(model) == build_backend(
        PrecisionConfig(backend="nvfp4-emu", skip=("proj_out",))).selected_layers(model)
    with pytest.raises(RuntimeError, match="CUDA"):
        be.prepare(model)
    assert_same(before, snapshot(model))


def test_importing_precision_does_not_import_transformer_engine() -> None:
    assert "transformer_engine" not in sys.modules


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_emulation_and_te_checks() -> None:
    model = build_backend(PrecisionConfig(backend="bf16")).prepare(toy_model().cuda())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    caps, extra = toy_inputs()
    assert model(caps.cuda().bfloat16(), extra.cuda().bfloat16()).dtype == torch.bfloat16

    torch.manual_seed(0)
    w, b, x = torch.randn(24, 64), torch.randn(24), torch.randn(5, 64)
    for layer_cls in (NVFP4EmuLinear, MXFP4EmuLinear):
        on_gpu = layer_cls(w.cuda(), b.cuda())
        assert on_gpu.weight_q.qdata.is_cuda
        assert torch.allclose(on_gpu(x.cuda()).cpu(), layer_cls(w, b)(x), rtol=1e-4, atol=1e-4)

    te_installed = importlib.util.find_spec("transformer_engine") is not None
    for name in ("nvfp4", "fp8"):
        be = build_backend(PrecisionConfig(backend=name))
        # fp8 without Transformer Engine is built on torchao's FP8 GEMM (fp8-torchao), which needs no TE
        needs_te = be.name != "fp8-torchao"
        if torch.cuda.get_device_capability() < be.min_capability or (needs_te and not te_installed):
            with pytest.raises(RuntimeError, match=name):
                be.check_environment()
        else:
            be.check_environment()


# ---------------------------------------------------------------- fast activation path
def test_fast_nvfp4_fake_quant_is_bit_identical_to_torchao():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    from solrl.precision.emulated import NVFP4EmuLinear, round_e2m1

    v = torch.linspace(-6, 6, 24001)
    assert torch.equal(round_e2m1(v), f4_unpacked_to_f32(f32_to_f4_unpacked(v)))
    # every multiple of 2^-16 in [0, 6], and each tie between grid points with its two fp32 neighbours: the
    # rounding's segment edges (2, 4) and its ties-to-even decisions
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.0, 4.0, 6.0])
    v = torch.cat([torch.arange(0, 6 * 2**16 + 1) / 2**16, ties, torch.nextafter(ties, torch.tensor(0.0)),
                   torch.nextafter(ties, torch.tensor(7.0)).clamp(max=6.0)])
    assert torch.equal(round_e2m1(v), f4_unpacked_to_f32(f32_to_f4_unpacked(v)))
    assert torch.equal(round_e2m1(-v), f4_unpacked_to_f32(f32_to_f4_unpacked(-v)))
    gen = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-3, 80.0):
        x = torch.randn(64, 96, generator=gen) * scale
        x[3, :16] = 0.0  # an all-zero block
        ref = NVFP4EmuLinear.quantize(x).dequantize(torch.float32)
        assert torch.equal(NVFP4EmuLinear.fake_quantize(x), ref)


def test_cached_dequantized_weight_follows_requantize():
    from solrl.precision.emulated import NVFP4EmuLinear

    gen = torch.Generator().manual_seed(1)
    layer = NVFP4EmuLinear(torch.randn(32, 64, generator=gen))
    w2 = torch.randn(32, 64, generator=gen)
    layer.set_weight(w2)
    assert torch.equal(layer.dequantized_weight(), layer.weight_q.dequantize(torch.float32))
    assert torch.equal(layer.dequantized_weight(), NVFP4EmuLinear.quantize(w2).dequantize(torch.float32))
