"""Peft-free LoRA merge (solrl.adapters.merge) against the trainer's peft adapters on tiny seeded models."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import PixArtTransformer2DModel, SanaTransformer2DModel
from torch import nn

from solrl.adapters import LoraAdapters, LoraSpec, decode_adapter, encode_adapter
from solrl.adapters.merge import lora_layout, lora_targets, merge_lora, target_weights

PIXART = dict(
    sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2,
    caption_channels=16, in_channels=3, out_channels=3, cross_attention_dim=16, attention_bias=True,
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False,
)  # fmt: skip
SANA = dict(
    patch_size=1, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=4, num_attention_heads=2,
    num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
    sample_size=8,
)  # fmt: skip
SPEC = LoraSpec(rank=4, alpha=6.0)  # scale 1.5: a wrong scale would show


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return (PixArtTransformer2DModel(**PIXART) if kind == "pixart" else SanaTransformer2DModel(**SANA)).eval()


def trained_adapters(base: nn.Module, spec: LoraSpec = SPEC) -> LoraAdapters:
    """peft adapters on a copy of `base`, with "default" moved away from its init (B = 0)."""
    adapters = LoraAdapters(copy.deepcopy(base), spec, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in adapters.parameters("default"):
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return adapters


@pytest.mark.parametrize("kind", ["pixart", "sana"])
def test_layout_equals_peft_layout(kind):
    base = make(kind)
    adapters = LoraAdapters(copy.deepcopy(base), SPEC, seed=0)
    layout = lora_layout(base, SPEC)
    assert layout == adapters.layout()
    assert list(layout) == list(adapters.layout())  # same order too
    assert not any("base_layer" in k for k in layout)


@pytest.mark.parametrize("kind", ["pixart", "sana"])
def test_merge_equals_peft_merge(kind):
    base = make(kind)
    adapters = trained_adapters(base)
    state = adapters.state_dict("default")
    merged = merge_lora(target_weights(base, SPEC), state, SPEC)
    expected = adapters.merged_weights("default")
    assert list(merged) == list(expected)
    for name, w in merged.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, expected[name], rtol=0, atol=1e-6)
    # the base model is untouched
    fresh = make(kind)
    for (n, p), (_, q) in zip(base.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n


def test_merge_is_w_plus_scaled_b_at_a_by_hand():
    base = make("pixart")
    adapters = trained_adapters(base)
    # a pushed adapter goes through the wire format first
    payload = decode_adapter(encode_adapter(adapters.state_dict("default"), 5, SPEC), lora_layout(base, SPEC))
    merged = merge_lora(target_weights(base, SPEC), payload.state, SPEC)
    name = "transformer_blocks.0.attn1.to_q"
    w = base.get_submodule(name).weight.detach().double()
    a = payload.state[f"transformer.{name}.lora_A.weight"].double()
    b = payload.state[f"transformer.{name}.lora_B.weight"].double()
    by_hand = w + (6.0 / 4) * torch.einsum("or,ri->oi", b, a)
    torch.testing.assert_close(merged[name].double(), by_hand, rtol=0, atol=1e-5)
    assert (merged[name].double() - w).abs().max() > 0.1  # the adapter really moves the weight


def test_zero_b_merges_to_the_base():
    base = make("pixart")
    state = LoraAdapters(copy.deepcopy(base), SPEC, seed=0).state_dict("default")  # B = 0 at init
    merged = merge_lora(target_weights(base, SPEC), state, SPEC)
    for name, w in merged.items():
        assert torch.equal(w, base.get_submodule(name).weight)


def test_targets_follow_peft_matching():
    base = make("pixart")
    spec = LoraSpec(rank=2, alpha=2.0, target_modules=("to_out.0",))
    names = list(lora_targets(base, spec))
    assert names == [n for n, _ in base.named_modules() if n.endswith(".to_out.0")]
    assert names and all(isinstance(base.get_submodule(n), nn.Linear) for n in names)


def test_merge_rejects_bad_state():
    base = make("pixart")
    weights = target_weights(base, SPEC)
    state = trained_adapters(base).state_dict("default")
    key = next(iter(state))
    with pytest.raises(ValueError, match="missing key"):
        merge_lora(weights, {k: v for k, v in state.items() if k != key}, SPEC)
    with pytest.raises(ValueError, match="unexpected key"):
        merge_lora(weights, {**state, "transformer.nope.lora_A.weight": torch.zeros(4, 8)}, SPEC)
    with pytest.raises(ValueError, match="expected shape"):
        merge_lora(weights, {**state, key: torch.zeros(3, 3)}, SPEC)
    with pytest.raises(ValueError, match="NaN or Inf"):
        merge_lora(weights, {**state, key: torch.full_like(state[key], float("nan"))}, SPEC)
    with pytest.raises(ValueError, match="shape"):  # the state of a rank-2 adapter for a rank-4 spec
        small = LoraSpec(rank=2, alpha=6.0)
        merge_lora(weights, LoraAdapters(copy.deepcopy(base), small, seed=0).state_dict("default"), SPEC)
    with pytest.raises(TypeError, match="spec"):
        merge_lora(weights, state, {"rank": 4})
    with pytest.raises(ValueError, match="base_weights"):
        merge_lora({}, state, SPEC)


def test_layout_errors_name_the_problem():
    base = make("pixart")
    with pytest.raises(ValueError, match="match no module"):
        lora_layout(base, LoraSpec(rank=2, alpha=2.0, target_modules=("no_such_layer",)))
    with pytest.raises(TypeError, match="only nn.Linear"):
        lora_layout(base, LoraSpec(rank=2, alpha=2.0, target_modules=("attn1",)))
    with pytest.raises(TypeError, match="model"):
        lora_layout("not a model", SPEC)
