"""LoRA adapters on tiny seeded diffusers transformers (CPU, fp32)."""

from __future__ import annotations

import hashlib
import json

import pytest
import safetensors.torch
import torch
from diffusers import PixArtTransformer2DModel, SanaTransformer2DModel
from diffusers.loaders import PeftAdapterMixin
from peft.tuners.tuners_utils import BaseTunerLayer

from solrl.adapters import (
    LoraAdapters,
    LoraSpec,
    apply_merged,
    decode_adapter,
    encode_adapter,
    make_inference_copy,
    sha256_hex,
)

PIXART = dict(
    sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2,
    caption_channels=16, in_channels=3, out_channels=3, cross_attention_dim=16, attention_bias=True,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6,
)  # fmt: skip
SANA = dict(
    patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=2,
    num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
    sample_size=8,
)  # fmt: skip
# alpha != rank: diffusers' loader only gets scale 2 (not its default 1) by reading our metadata.
SPEC = LoraSpec(rank=4, alpha=8.0)


class PixArtWithPeft(PixArtTransformer2DModel, PeftAdapterMixin):
    """PixArt lacks diffusers' PeftAdapterMixin (SANA/SD3/FLUX have it); add it to reach load_lora_adapter."""


def make_model(kind: str = "pixart", cls: type | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    config, default_cls = (PIXART, PixArtTransformer2DModel) if kind == "pixart" else (SANA, SanaTransformer2DModel)
    return (cls or default_cls)(**config).eval()


def run(model: torch.nn.Module, kind: str = "pixart") -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    if kind == "pixart":
        x, enc = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 5, 16, generator=g)
        extra = {"added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    else:
        x, enc = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 8, generator=g)
        extra = {}
    t = torch.tensor([500.0, 20.0])
    return model(hidden_states=x, encoder_hidden_states=enc, timestep=t, return_dict=False, **extra)[0]


@torch.no_grad()
def perturb(adapters: LoraAdapters, name: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in adapters.parameters(name):
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0)
    with pytest.raises(ValueError, match="alpha"):
        LoraSpec(alpha=float("nan"))
    with pytest.raises(ValueError, match="init"):
        LoraSpec(init="orthogonal")
    with pytest.raises(ValueError, match="target_modules"):
        LoraSpec(target_modules=())


def test_init_is_seeded_gaussian_with_zero_b() -> None:
    a1 = LoraAdapters(make_model(), SPEC, seed=0)
    a2 = LoraAdapters(make_model(), SPEC, seed=0)
    a3 = LoraAdapters(make_model(), SPEC, seed=1)
    s1, s2, s3 = a1.state_dict("default"), a2.state_dict("default"), a3.state_dict("default")
    assert s1.keys() == s2.keys() == s3.keys()
    a_keys = [k for k in s1 if k.endswith("lora_A.weight")]
    b_keys = [k for k in s1 if k.endswith("lora_B.weight")]
    assert len(a_keys) == len(b_keys) == 8  # attn1 + attn2, each to_q/to_k/to_v/to_out.0
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert all(not torch.equal(s1[k], s3[k]) for k in a_keys)
    assert all(torch.count_nonzero(s1[k]) == 0 for k in b_keys)
    std = torch.cat([s1[k].flatten() for k in a_keys]).std().item()
    assert 0.8 / SPEC.rank < std < 1.2 / SPEC.rank  # peft "gaussian": A ~ N(0, 1/r)
    for name in ("old", "ema"):
        other = a1.state_dict(name)
        assert all(torch.equal(s1[k], other[k]) for k in s1)
    with a1.disabled():
        base = run(a1.model)
    with a1.use("default"):
        assert torch.equal(run(a1.model), base)  # B = 0 -> exactly the base model


def test_init_leaves_global_rng_alone() -> None:
    model = make_model()
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    LoraAdapters(model, SPEC, seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_use_and_disabled_switch_adapters() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    with adapters.disabled():
        base = run(adapters.model)
    perturb(adapters, "default", seed=1)
    with adapters.use("default"):
        out_default = run(adapters.model)
    with adapters.use("old"):
        out_old = run(adapters.model)
        with adapters.disabled():
            assert torch.equal(run(adapters.model), base)
        assert torch.equal(run(adapters.model), out_old)  # inner context restored "old"
    assert not torch.allclose(out_default, base, atol=1e-4)
    assert torch.equal(out_old, base)  # "old" is still the initial (B = 0) copy
    assert torch.equal(run(adapters.model), out_default)  # outside any context: "default"
    adapters.copy_("old", "default")
    with adapters.use("old"):
        assert torch.equal(run(adapters.model), out_default)
    with pytest.raises(ValueError, match="adapter name"):
        adapters.use("new")


def test_only_default_requires_and_receives_grad() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    perturb(adapters, "old", seed=2)
    default_ids = {id(p) for p in adapters.trainable_parameters()}
    assert default_ids == {id(p) for p in adapters.parameters("default")}

    def requiring_grad() -> set[int]:
        return {id(p) for p in adapters.model.parameters() if p.requires_grad}

    # The DiffusionNFT pattern: v (default), v_old (old), v_ref (disabled), no torch.no_grad anywhere;
    # the flags hold inside every context, and a backward run inside disabled() still reaches default.
    with adapters.use("default"):
        v = run(adapters.model)
    with adapters.use("old"):
        v_old = run(adapters.model)
        assert requiring_grad() == default_ids
    with adapters.disabled():
        v_ref = run(adapters.model)
        assert requiring_grad() == default_ids
        ((v - v_old) ** 2 + (v - v_ref) ** 2 + v_old + v_ref).mean().backward()
    assert requiring_grad() == default_ids
    for p in adapters.parameters("default"):
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0
    for p in adapters.model.parameters():
        if id(p) not in default_ids:
            assert p.grad is None


def test_state_dict_layout_and_strict_load() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    state = adapters.state_dict("default")
    layout = adapters.layout()
    assert list(state) == list(layout)
    assert {k: tuple(v.shape) for k, v in state.items()} == layout
    # inner dim = 2 heads x 8 = 16; cross-attention k/v read the 16-dim caption projection
    assert layout["transformer.transformer_blocks.0.attn1.to_q.lora_A.weight"] == (4, 16)
    assert layout["transformer.transformer_blocks.0.attn1.to_out.0.lora_B.weight"] == (16, 4)
    adapters.load_state_dict("ema", state)
    for p_ema, p_def in zip(adapters.parameters("ema"), adapters.parameters("default"), strict=True):
        assert torch.equal(p_ema, p_def)
    key = next(iter(state))
    with pytest.raises(ValueError, match="missing"):
        adapters.load_state_dict("old", {k: v for k, v in state.items() if k != key})
    with pytest.raises(ValueError, match="unexpected"):
        adapters.load_state_dict("old", {**state, "transformer.x.lora_A.weight": torch.zeros(4, 16)})
    with pytest.raises(ValueError, match="expected shape"):
        adapters.load_state_dict("old", {**state, key: torch.zeros(5, 16)})
    with pytest.raises(ValueError, match="dtype"):
        adapters.load_state_dict("old", {**state, key: torch.zeros(state[key].shape, dtype=torch.int32)})


def test_base_state_dict_loads_into_fresh_model() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    base = adapters.base_state_dict()
    assert not any("base_layer" in k or "lora_" in k for k in base)
    torch.manual_seed(7)  # a differently initialised fresh model
    fresh = PixArtTransformer2DModel(**PIXART).eval()
    fresh.load_state_dict(base, strict=True)
    with adapters.disabled():
        assert torch.equal(run(fresh), run(adapters.model))


def test_wire_round_trip_is_bit_exact() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    state = adapters.state_dict("default")
    state = {k: (v.to(torch.bfloat16) if i % 2 else v) for i, (k, v) in enumerate(state.items())}  # mixed dtypes
    data = encode_adapter(state, 7, SPEC, extra={"run": "r1"})
    assert encode_adapter(state, 7, SPEC, extra={"run": "r1"}) == data  # canonical bytes
    payload = decode_adapter(data, expected_layout=adapters.layout(), max_bytes=len(data))
    assert payload.state.keys() == state.keys()
    for k, v in state.items():
        assert payload.state[k].dtype == v.dtype
        assert torch.equal(payload.state[k].view(torch.uint8), v.view(torch.uint8))
    assert payload.version == 7 and payload.spec == SPEC
    assert payload.sha256 == hashlib.sha256(data).hexdigest() == sha256_hex(data)
    assert payload.metadata["run"] == "r1"
    assert json.loads(payload.metadata["lora_adapter_metadata"])["transformer.lora_alpha"] == 8.0
    assert encode_adapter(state, 8, SPEC) != data
    with pytest.raises(ValueError, match="reserved"):
        encode_adapter(state, 7, SPEC, extra={"solrl.version": "9"})
    with pytest.raises(ValueError, match="version"):
        encode_adapter(state, -1, SPEC)


@pytest.mark.parametrize("kind", ["pixart", "sana"])
def test_bytes_load_with_diffusers_own_loader(kind: str, tmp_path) -> None:
    adapters = LoraAdapters(make_model(kind), SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    with adapters.use("default"):
        expected = run(adapters.model, kind)
    with adapters.disabled():
        base = run(adapters.model, kind)
    (tmp_path / "pytorch_lora_weights.safetensors").write_bytes(encode_adapter(adapters.state_dict("default"), 3, SPEC))
    fresh = make_model(kind, PixArtWithPeft if kind == "pixart" else SanaTransformer2DModel)
    fresh.load_state_dict(adapters.base_state_dict(), strict=True)
    fresh.load_lora_adapter(
        str(tmp_path), weight_name="pytorch_lora_weights.safetensors", prefix="transformer", adapter_name="pushed"
    )
    assert fresh.peft_config["pushed"].lora_alpha == 8.0
    got = run(fresh, kind)
    assert not torch.allclose(got, base, atol=1e-4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_merged_weights_into_inference_copy() -> None:
    model = make_model()
    adapters = LoraAdapters(model, SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    perturb(adapters, "old", seed=2)
    with adapters.disabled():
        base = run(model)
    copy = make_inference_copy(adapters, PixArtTransformer2DModel, model.config)
    assert not any(isinstance(m, BaseTunerLayer) for m in copy.modules())
    assert torch.equal(run(copy), base)

    merged = adapters.merged_weights("default")
    lora_q = model.get_submodule("transformer_blocks.0.attn1.to_q")
    w, a, b = lora_q.base_layer.weight, lora_q.lora_A["default"].weight, lora_q.lora_B["default"].weight
    by_hand = w + (SPEC.alpha / SPEC.rank) * b @ a
    assert len(merged) == 8 and all(v.dtype == torch.float32 and not v.requires_grad for v in merged.values())
    torch.testing.assert_close(merged["transformer_blocks.0.attn1.to_q"], by_hand.detach())

    for name in ("default", "old"):
        apply_merged(copy, adapters.merged_weights(name))
        with adapters.use(name):
            torch.testing.assert_close(run(copy), run(model), rtol=1e-5, atol=1e-5)
    apply_merged(copy, adapters.merged_weights(None))
    assert torch.equal(run(copy), base)
    with adapters.disabled():
        assert torch.equal(run(model), base)  # merging into the copy left the trainer's base alone


def test_bf16_base_keeps_fp32_lora_and_copy_dtype() -> None:
    # No forward pass: this CPU has no native bf16 matmul.
    model = make_model().to(torch.bfloat16)
    adapters = LoraAdapters(model, SPEC, seed=0)
    assert all(p.dtype == torch.float32 for name in adapters.ADAPTERS for p in adapters.parameters(name))
    base = adapters.base_state_dict()
    assert all(v.dtype == torch.bfloat16 for v in base.values() if v.is_floating_point())
    perturb(adapters, "default", seed=1)
    merged = adapters.merged_weights("default")
    lora_q = model.get_submodule("transformer_blocks.0.attn1.to_q")
    w, a, b = lora_q.base_layer.weight, lora_q.lora_A["default"].weight, lora_q.lora_B["default"].weight
    by_hand = w.float() + 2.0 * b.detach() @ a.detach()
    assert merged["transformer_blocks.0.attn1.to_q"].dtype == torch.float32
    torch.testing.assert_close(merged["transformer_blocks.0.attn1.to_q"], by_hand)
    copy = make_inference_copy(adapters, PixArtTransformer2DModel, model.config)
    assert all(v.dtype == torch.bfloat16 for v in copy.state_dict().values() if v.is_floating_point())
    assert all(torch.equal(copy.state_dict()[k], v) for k, v in base.items())


def test_apply_merged_errors() -> None:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    copy = make_inference_copy(adapters, PixArtTransformer2DModel, adapters.model.config)
    merged = adapters.merged_weights(None)
    key = next(iter(merged))
    with pytest.raises(ValueError, match="no module"):
        apply_merged(copy, {"transformer_blocks.9.attn1.to_q": merged[key]})
    with pytest.raises(ValueError, match="expected shape"):
        apply_merged(copy, {key: merged[key][:, :3]})
    with pytest.raises(TypeError, match=r"nn\.Linear"):
        apply_merged(adapters.model, {key: merged[key]})  # peft-wrapped module, not a plain copy
    with pytest.raises(ValueError, match="do not match"):
        make_inference_copy(adapters, PixArtTransformer2DModel, {**PIXART, "num_layers": 2})


@pytest.fixture(scope="module")
def wire() -> tuple[LoraAdapters, dict[str, torch.Tensor], bytes]:
    adapters = LoraAdapters(make_model(), SPEC, seed=0)
    perturb(adapters, "default", seed=1)
    state = adapters.state_dict("default")
    return adapters, state, encode_adapter(state, 1, SPEC)


def _forge(state: dict[str, torch.Tensor], like: bytes) -> bytes:
    """Bytes a faulty or hostile sender could produce: valid metadata, bad tensors (bypasses encode's checks)."""
    return safetensors.torch.save(state, metadata=decode_adapter(like).metadata)


def test_decode_rejects_bad_payloads(wire) -> None:
    adapters, state, data = wire
    layout = adapters.layout()
    key_a = "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight"
    key_b = key_a.replace("lora_A", "lora_B")
    with pytest.raises(ValueError, match="too short"):
        decode_adapter(b"abc")
    with pytest.raises(ValueError, match="header length"):
        decode_adapter(b"definitely not a safetensors payload")
    with pytest.raises(ValueError, match="truncated"):
        decode_adapter(data[:-16])
    with pytest.raises(ValueError, match="exceeds max_bytes"):
        decode_adapter(data, max_bytes=len(data) - 1)
    with pytest.raises(ValueError, match="__metadata__"):
        decode_adapter(safetensors.torch.save(state))
    with pytest.raises(ValueError, match=r"solrl\.format"):
        decode_adapter(safetensors.torch.save(state, metadata={"format": "pt"}))
    extra = {
        **state,
        "transformer.extra.lora_A.weight": torch.zeros(4, 16),
        "transformer.extra.lora_B.weight": torch.zeros(16, 4),
    }
    with pytest.raises(ValueError, match="unexpected"):
        decode_adapter(_forge(extra, data), expected_layout=layout)
    missing = {k: v for k, v in state.items() if k not in (key_a, key_b)}
    with pytest.raises(ValueError, match="missing"):
        decode_adapter(_forge(missing, data), expected_layout=layout)
    with pytest.raises(ValueError, match="expected shape"):
        decode_adapter(_forge({**state, key_a: torch.zeros(4, 17)}, data), expected_layout=layout)
    with pytest.raises(ValueError, match="rank 4"):
        decode_adapter(_forge({**state, key_a: torch.zeros(3, 16)}, data))
    with pytest.raises(ValueError, match="without both"):
        decode_adapter(_forge({k: v for k, v in state.items() if k != key_b}, data))
    nan = state[key_a].clone()
    nan[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        decode_adapter(_forge({**state, key_a: nan}, data), expected_layout=layout)
    with pytest.raises(ValueError, match="NaN"):
        encode_adapter({**state, key_a: nan}, 1, SPEC)
    with pytest.raises(ValueError, match="float"):
        decode_adapter(_forge({**state, key_a: torch.zeros(4, 16, dtype=torch.int8)}, data), expected_layout=layout)
    with pytest.raises(TypeError, match="data"):
        decode_adapter("not bytes")  # type: ignore[arg-type]


def test_conv_lora_merges_into_a_unet_copy_and_a_quantized_explorer() -> None:
    """LoRA on a UNet's ResNet convolutions (conv1/conv2): the merged kernel W + s * B(1x1) o A(kxk) gives the
    peft model's output in a plain copy, and a quantized explorer takes it (convs stay in high precision)."""
    from diffusers import UNet2DConditionModel

    from solrl.precision import PrecisionConfig, build_backend

    cfg = dict(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
               down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
               up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16, attention_head_dim=8,
               norm_num_groups=8)
    torch.manual_seed(0)
    model = UNet2DConditionModel(**cfg).eval()
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"))
    adapters = LoraAdapters(model, spec, seed=0)
    perturb(adapters, "default", seed=1)
    g = torch.Generator().manual_seed(5)
    x, enc, t = torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 4, 16, generator=g), torch.tensor([500.0, 20.0])

    def unet(m: torch.nn.Module) -> torch.Tensor:
        return m(x, t, encoder_hidden_states=enc, return_dict=False)[0]

    merged = adapters.merged_weights("default")
    convs = [k for k in merged if k.endswith(("conv1", "conv2"))]
    assert convs and all(merged[k].dim() == 4 for k in convs)
    copy = make_inference_copy(adapters, UNet2DConditionModel, model.config)
    apply_merged(copy, merged)
    with adapters.use("default"):
        want = unet(model)
    torch.testing.assert_close(unet(copy), want, rtol=1e-5, atol=1e-5)
    with adapters.disabled():
        assert not torch.allclose(unet(model), want, atol=1e-3)  # the conv deltas change the output

    # a serving process merges the pushed tensors into its plain copy the same way (peft's conv layout)
    from solrl.adapters.merge import lora_layout, merge_lora, target_weights
    state = adapters.state_dict("default")
    assert lora_layout(copy, spec) == adapters.layout()
    fresh = make_inference_copy(adapters, UNet2DConditionModel, model.config)  # `copy` now holds merged weights
    by_state = merge_lora(target_weights(fresh, spec), state, spec)
    assert sorted(by_state) == sorted(merged)
    for k in merged:
        torch.testing.assert_close(by_state[k], merged[k], rtol=1e-6, atol=1e-6)

    backend = build_backend(PrecisionConfig(backend="nvfp4-emu"))
    explorer = backend.prepare(make_inference_copy(adapters, UNet2DConditionModel, model.config))
    backend.requantize(explorer, merged)
    conv = convs[0]
    # copied in with the backend's BF16 rounding, as its other high-precision weights
    assert torch.equal(explorer.get_submodule(conv).weight, merged[conv].to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="expected"):
        backend.requantize(explorer, {conv: merged[conv][:, :1]})
