"""Per-layer precision policies: skip patterns, the size threshold, first / last blocks kept, and the report of
what each quantizes."""

from __future__ import annotations

import pytest
import torch

from solrl.cli.app import main
from solrl.config import apply_overrides, get_preset
from solrl.models import load_model
from solrl.precision import PrecisionConfig, build_backend
from solrl.precision.base import denoiser_blocks, quantized_mac_share, with_model_skips
from solrl.precision.policy import POLICIES, policy_config, share_report


@pytest.fixture(scope="module")
def shapes():
    return load_model("shapes")


def test_blocks_and_kept_blocks_on_the_bundled_unet(shapes) -> None:
    tr = shapes.transformer
    assert denoiser_blocks(tr) == [f"down_blocks.{i}" for i in range(3)] + [f"up_blocks.{i}" for i in range(3)]
    spec = shapes.spec
    ref = set(build_backend(policy_config("nvfp4-emu", "reference", spec)).selected_layers(tr))
    both = set(build_backend(policy_config("nvfp4-emu", "keep-first-and-last", spec)).selected_layers(tr))
    dropped = ref - both
    assert dropped and both < ref
    assert all(n.startswith(("down_blocks.0.", "up_blocks.2.")) for n in dropped)
    assert not any(n.startswith(("down_blocks.0.", "up_blocks.2.")) for n in both)


def test_policy_errors_name_the_field(shapes) -> None:
    tr = shapes.transformer
    with pytest.raises(ValueError, match=r"skip pattern 'attn9\*' matches no Linear layer of UNet2DConditionModel"):
        build_backend(PrecisionConfig(backend="nvfp4-emu", skip=("attn9*",))).selected_layers(tr)
    with pytest.raises(ValueError, match="keep_first_blocks=4 \\+ keep_last_blocks=3 exceed the 6 blocks"):
        build_backend(PrecisionConfig(backend="nvfp4-emu", keep_first_blocks=4, keep_last_blocks=3)).selected_layers(tr)
    with pytest.raises(ValueError, match="keep_last_blocks must be >= 0"):
        PrecisionConfig(keep_last_blocks=-1)
    with pytest.raises(TypeError, match="keep_first_blocks must be an int"):
        PrecisionConfig(keep_first_blocks="1")
    # the model's own patterns (one list for a whole family) are not required to match
    cfg = with_model_skips(PrecisionConfig(backend="nvfp4-emu"), ("no_such_layer*",), 0)
    assert build_backend(cfg).selected_layers(tr)
    with pytest.raises(ValueError, match="unknown precision policy"):
        policy_config("nvfp4-emu", "keep-everything", shapes.spec)


def test_a_run_with_a_bad_skip_pattern_fails_before_any_work(tmp_path) -> None:
    from solrl.engine.loop import train

    cfg = apply_overrides(get_preset("shapes-sol-rl"), ['rollout.explore_precision.skip=["mid_blok.*"]']).validate()
    with pytest.raises(ValueError, match="mid_blok"):
        train(cfg, tmp_path / "run", progress=False, log=lambda *_: None)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_share_report_matches_the_measured_share(shapes, capsys) -> None:
    r = share_report(shapes, "nvfp4-emu")
    rows = {p["policy"]: p for p in r["policies"]}
    assert list(rows) == list(POLICIES) and r["blocks"] == 6
    spec = shapes.spec
    selected = build_backend(with_model_skips(PrecisionConfig(backend="nvfp4-emu"), spec.quant_skip,
                                              spec.quant_min_features)).selected_layers(shapes.transformer)
    x, cond = torch.zeros(1, *spec.latent_shape), shapes.encode(["a red circle"])
    run = lambda: shapes.velocity(shapes.transformer, x, torch.tensor([0.5]), cond)  # noqa: E731
    assert rows["reference"]["all_share"] == pytest.approx(quantized_mac_share(shapes.transformer, selected, run))
    assert 0.2 < rows["reference"]["all_share"] < 0.3 < rows["reference"]["linear_share"] <= 1.0  # convs stay BF16
    assert rows["keep-first-and-last"]["layers"] < rows["reference"]["layers"]
    assert rows["keep-first-and-last"]["all_share"] < rows["reference"]["all_share"]
    assert main(["models", "quantized", "--backend", "fp8-e4m3-emu", "--policy", "reference",
                 "--policy", "keep-last-block"]) == 0
    out = capsys.readouterr().out
    assert "backend fp8-e4m3-emu" in out and "keep-last-block" in out and "keep-first-block " not in out


def test_real_architectures_on_the_meta_device() -> None:
    """The published configs build the published sizes (no weights: meta device), and the report says what
    the reference's rule leaves in high precision: SANA's Mix-FFN convolutions and its self-attention q/k/v
    (about three quarters of its forward), almost nothing of SD3.5-Large and FLUX.1-dev."""
    from solrl.models.architectures import meta_denoiser
    from solrl.precision.policy import architecture_share_report

    sizes = {"sana1.5-1.6b": (1.60e9, 20), "sd3.5-large": (8.06e9, 38), "flux1-dev": (11.9e9, 57)}
    for name, (params, blocks) in sizes.items():
        module, _ = meta_denoiser(name)
        assert sum(p.numel() for p in module.parameters()) == pytest.approx(params, rel=0.01)
        assert len(denoiser_blocks(module)) == blocks
    sana = {p["policy"]: p for p in architecture_share_report("sana1.5-1.6b", "nvfp4-emu")["policies"]}
    assert 0.45 < sana["reference"]["linear_share"] < 0.6 and 0.2 < sana["reference"]["all_share"] < 0.3
    assert sana["keep-first-and-last"]["all_share"] < sana["keep-first-block"]["all_share"] < sana["reference"]["all_share"]
    sd = architecture_share_report("sd3.5-large", "fp8-e4m3-emu", ("reference",))
    assert sd["policies"][0]["all_share"] > 0.99 and sd["resolution"] == 1024
    with pytest.raises(ValueError, match="no architecture"):
        meta_denoiser("sd1.5")
