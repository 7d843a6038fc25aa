"""The Transformer Engine recipe emulations: FP8 current scaling (E4M3, E5M2) and NVFP4BlockScaling."""

from __future__ import annotations

import pytest
import torch

from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.emulated import NVFP4EmuLinear
from solrl.precision.emulated_te import (
    FP8E4M3EmuLinear,
    FP8E5M2EmuLinear,
    NVFP4TEEmuLinear,
    fp8_current_scaling,
    nvfp4_te_quantize,
)

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
FP8 = [(FP8E4M3EmuLinear, torch.float8_e4m3fn, 3), (FP8E5M2EmuLinear, torch.float8_e5m2, 2)]


def spread(m: int, k: int, seed: int = 0) -> torch.Tensor:
    """Values over several orders of magnitude, signs mixed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, k, generator=g))


@pytest.mark.parametrize("cls, dtype, mantissa", FP8)
def test_fp8_agrees_with_torch_float8_casts(cls, dtype, mantissa) -> None:
    x = spread(24, 40)
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / x.abs().max()
    expected = (x * scale).to(dtype)  # torch's own cast of the TE-scaled tensor
    q, scale_inv = fp8_current_scaling(x, dtype)
    assert q.dtype == dtype and torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert scale_inv.item() == pytest.approx(1 / scale.item(), rel=1e-7)
    assert q.float().abs().max().item() == fp8_max  # the amax lands on the format's largest value
    # values on the grid: a dequantized value times the scale is an FP8 number
    dq = cls.fake_quantize(x)
    on_grid = dq / scale_inv
    assert torch.equal(on_grid.to(dtype).float(), on_grid)
    # error within the format's bound: half an ulp (2^-(mantissa+1) relative) for normal values, half the
    # smallest subnormal step below
    tiny = torch.finfo(dtype).smallest_normal * 2.0 ** -mantissa
    bound = 2.0 ** -(mantissa + 1) * x.abs() + tiny / 2 * scale_inv
    assert bool(((dq - x).abs() <= bound * (1 + 1e-6)).all())
    # the packed resident weight holds those values: one byte each plus one FP32 scale
    layer = cls(x)
    assert torch.equal(layer.dequantized_weight(), dq)
    assert layer.packed_weight_bytes() == 24 * 40 + 4


def test_fp8_zero_and_e5m2_coarser_than_e4m3() -> None:
    q, scale_inv = fp8_current_scaling(torch.zeros(4, 4), torch.float8_e4m3fn)
    assert scale_inv.item() == 1.0 and not q.float().any()
    x = spread(64, 64, seed=1)
    e4 = (FP8E4M3EmuLinear.fake_quantize(x) - x).abs().mean()
    e5 = (FP8E5M2EmuLinear.fake_quantize(x) - x).abs().mean()
    assert e5 > 1.5 * e4  # one mantissa bit fewer


def test_nvfp4_te_values_scales_and_2d_tiles() -> None:
    w = spread(40, 64, seed=2)  # 40 rows: the last tile has 8 rows (TE pads it with zeros)
    values, s8, g_dec = nvfp4_te_quantize(w, tile_rows=16)
    assert torch.isin(values.abs(), E2M1).all() and s8.dtype == torch.float8_e4m3fn and s8.shape == (40, 4)
    assert g_dec.item() == pytest.approx(w.abs().max().item() / (448 * 6), rel=1e-6)
    for r0 in (0, 16, 32):  # one scale per 16x16 tile, repeated on its rows
        tile = s8[r0:r0 + 16].float()
        assert torch.equal(tile, tile[:1].expand_as(tile))
        amax = w[r0:r0 + 16].reshape(-1, 4, 16).abs().amax(dim=(0, 2))
        assert torch.allclose(tile[0] * g_dec, amax / 6, rtol=2 ** -3)  # E4M3 rounding of amax / 6
    dq = NVFP4TEEmuLinear(w).dequantized_weight()
    assert torch.equal(dq, (values.reshape(40, 4, 16) * (g_dec * s8.float()).unsqueeze(-1)).reshape(40, 64))
    # error bound: the E2M1 step at the top of a block is 2 units of amax / 6, so at most 1/6 of the tile's
    # amax, plus the E4M3 rounding of the scale
    tile_amax = torch.nn.functional.pad(w, (0, 0, 0, 8)).reshape(3, 16, 4, 16).abs().amax(dim=(1, 3))
    per_elem = tile_amax.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)
    assert bool(((dq - w).abs() <= per_elem * (1 / 6) * (1 + 2 ** -3) + 1e-12).all())
    # packed: two values per byte, one E4M3 scale per 16 values of a row, one FP32 global scale
    assert NVFP4TEEmuLinear(w).packed_weight_bytes() == 40 * 64 // 2 + 40 * 4 + 4


def test_nvfp4_te_2d_tiles_cost_small_rows_precision() -> None:
    """A row of small values inside a tile of large ones loses precision with 16x16 tiles and keeps it with
    1x16 blocks (the price of the recipe's weight layout); activations always use 1x16."""
    w = spread(16, 32, seed=3)
    w[3] *= 1e-2
    err = {rows: (NVFP4EmuLinear.fake_quantize(w) if rows == 0 else
                  _dq(*nvfp4_te_quantize(w, rows)) - w)[3].abs().sum() for rows in (1, 16)}
    assert err[16] > 10 * err[1]
    x = spread(5, 32, seed=4)
    assert torch.equal(NVFP4TEEmuLinear.fake_quantize(x), _dq(*nvfp4_te_quantize(x, 1)))


def _dq(values, s8, g_dec):
    m, k = values.shape
    return (values.reshape(m, k // 16, 16) * (g_dec * s8.float()).unsqueeze(-1)).reshape(m, k)


def test_nvfp4_te_zeroes_a_block_whose_scale_underflows_where_torchao_keeps_it() -> None:
    x = torch.ones(2, 32)
    x[0, :16] = 1e3          # sets the global amax
    # block scale 448 * 2e-3 / 1e3 = 9.0e-4: under half E4M3's smallest subnormal (2^-9), so 0 in TE; torchao
    # raises it to E4M3's smallest normal (2^-6), where 2e-3 still rounds to a nonzero E2M1 value
    x[1, :16] = 2e-3
    te = NVFP4TEEmuLinear.fake_quantize(x)
    assert not te[1, :16].any() and te[0, :16].eq(1e3).all()
    assert NVFP4EmuLinear.fake_quantize(x)[1, :16].abs().min() > 0  # torchao keeps the block
    zeros = NVFP4TEEmuLinear.fake_quantize(torch.zeros(3, 16))
    assert not zeros.any() and not zeros.isnan().any()
    with pytest.raises(ValueError, match="tile_rows"):
        nvfp4_te_quantize(x, 8)


@pytest.mark.parametrize("backend, cls", [("fp8-e4m3-emu", FP8E4M3EmuLinear), ("fp8-e5m2-emu", FP8E5M2EmuLinear),
                                          ("nvfp4-te-emu", NVFP4TEEmuLinear)])
def test_backends_replace_the_selected_linears(backend, cls) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 8))
    ref = torch.nn.Sequential(*[m for m in model])  # same modules before preparation
    x = torch.randn(6, 32)
    exact = ref(x).detach()
    be = build_backend(PrecisionConfig(backend=backend, skip=("2",)))
    be.prepare(model)
    assert isinstance(model[0], cls) and not isinstance(model[2], cls) and be.quantized_names == ("0",)
    err = (model(x) - exact).abs().max().item()
    assert 0 < err < 0.5 * exact.abs().max().item()
    w = be.weight_bytes(model)
    assert w["quantized"] == (48 * 32 + 4 if "fp8" in backend else 48 * 32 // 2 + 48 * 2 + 4)
