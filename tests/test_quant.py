"""Weight formats: int4 drafts are close to the dense layer and never change output; packed
float32 layers compute what the dense ones do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from draftwise import DraftConfig, GenerationConfig, SpeculativeEngine, autoregressive
from draftwise.backends.quant import (
    DENSE_ROWS,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    can_pack,
    pack_linears,
    quantize_weights,
)
from draftwise.backends.tiny import tiny_lm

from hf_support import load_hf_model


def test_int4_linear_matches_its_dequantized_weights_and_approximates_the_dense_layer():
    torch.manual_seed(0)
    dense = nn.Linear(128, 48, bias=True)
    quantized = Int4Linear(dense, group_size=64)
    x = torch.randn(3, 5, 128)
    out = quantized(x)
    assert out.shape == (3, 5, 48) and out.dtype == x.dtype
    reference = dense(x)
    error = (out - reference).norm() / reference.norm()
    assert error < 0.1  # 4-bit weights: close, not equal
    assert error > 0  # and really quantized


def test_quantize_int4_skips_layers_the_kernel_cannot_take():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16), nn.Linear(64, 20))
    assert quantize_weights(model, bits=4, group_size=64) == 1  # 32 inputs < group; 20 outputs not a multiple of 16
    assert isinstance(model[0], Int4Linear)
    assert isinstance(model[1], nn.Linear) and isinstance(model[2], nn.Linear)


def test_an_int4_draft_leaves_greedy_output_unchanged():
    target, draft = tiny_lm(0), tiny_lm(0)
    assert quantize_weights(draft.model, bits=4) > 0
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4, confidence_threshold=0)
    )
    plain = autoregressive(target).generate("Hello world", config)
    spec = SpeculativeEngine.from_models(target, draft).generate("Hello world", config)
    assert spec.tokens == plain.tokens
    assert spec.metrics.proposed > 0


needs_onednn = pytest.mark.skipif(not can_pack(), reason="this torch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_the_dense_layer(bias):
    torch.manual_seed(0)
    dense = nn.Linear(96, 40, bias=bias)
    for rows in [(1,), (1, 8), (8, 2)]:
        packed = PackedLinear(dense, rows)
        for shape in [(1, 96), (3, 96), (9, 96), (2, 7, 96)]:
            x = torch.randn(*shape)
            out = packed(x)
            assert out.shape == (*shape[:-1], 40) and out.dtype == torch.float32
            torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-5)
        assert not any(k.startswith("packed") for k in packed.state_dict())  # opaque oneDNN copies: never saved


@needs_onednn
def test_packed_linear_uses_the_layout_made_for_the_nearest_row_count_above():
    packed = PackedLinear(nn.Linear(32, 16), rows=(8, 1))
    assert packed.rows == (1, 8)
    for m, count in [(1, 1), (2, 8), (7, 8), (8, 8), (600, 8)]:
        assert packed._packed_for(m) is getattr(packed, f"packed_{count}")
    only_steps = PackedLinear(nn.Linear(32, 16), rows=(1,))
    assert only_steps._packed_for(9) is only_steps.packed_1  # above every count: the largest
    with pytest.raises(ValueError, match="positive row counts"):
        PackedLinear(nn.Linear(32, 16), rows=(0,))


@needs_onednn
def test_pack_linears_leaves_layers_that_are_not_float32():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16).to(torch.bfloat16))
    assert pack_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)


@needs_onednn
def test_a_packed_target_keeps_its_logits_and_speculation_stays_exact():
    dense, packed = load_hf_model("tiny:0"), load_hf_model("tiny:0", pack=True)
    assert not any(isinstance(m, PackedLinear) for m in dense.model.modules())  # tiny models: off by default
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    ids = list(range(5, 25))
    torch.testing.assert_close(
        packed.forward(ids, last=len(ids)), dense.forward(ids, last=len(ids)), rtol=1e-4, atol=1e-4
    )

    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4, confidence_threshold=0)
    )
    plain = autoregressive(packed).generate("Hello world", config)
    spec = SpeculativeEngine.from_models(packed, load_hf_model("tiny:0", pack=True)).generate("Hello world", config)
    assert spec.tokens == plain.tokens
    assert spec.metrics.mean_accepted_length == 5.0  # draft == target: every block accepted whole


@pytest.mark.parametrize("make", [lambda dense: Int4Linear(dense, group_size=64), Int8Linear])
def test_long_prefills_use_the_same_quantized_weights_as_the_kernel(make):
    # Above DENSE_ROWS rows the layer multiplies by its dequantized weights in float32; a
    # few rows go through torch's weight-only kernel (bfloat16 activations). Same weights,
    # so the two agree to bfloat16 precision, and both differ from the dense original.
    torch.manual_seed(0)
    dense = nn.Linear(128, 48, bias=True)
    layer = make(dense)
    x = torch.randn(DENSE_ROWS + 8, 128)
    many = layer(x)
    few = torch.cat([layer(x[i : i + 4]) for i in range(0, len(x), 4)])
    torch.testing.assert_close(many, few, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(many, x @ layer.dense_weight().T + layer.bias.float(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer.dense_weight(), dense.weight.detach())


@pytest.mark.parametrize(
    ("quantize", "pack_rows"),
    [("none", None), ("none", (1,)), ("none", (1, 8)), ("int8", (1,)), ("int4", (1,)), ("int8", None)],
)
def test_every_model_property_reads_the_same_after_packing_and_quantization(quantize, pack_rows):
    # Issue 13: servers read vocab_size from a packed output layer, which has no .weight.
    dense = load_hf_model("tiny:0", pack=False)
    lm = load_hf_model("tiny:0", quantize=quantize, pack=pack_rows is not None, pack_rows=pack_rows or (1,))
    head = type(lm.model.get_output_embeddings()).__name__
    if pack_rows is not None or quantize == "int8":
        assert head != "Linear"  # the layout under test really replaced the output layer
    assert lm.vocab_size == dense.vocab_size == 257
    assert lm.forward([1, 2, 3]).shape == (3, lm.vocab_size)
    assert lm.eos_token_ids == dense.eos_token_ids == (256,)
    assert lm.max_context == dense.max_context == 4096
    assert lm.dtype == dense.dtype == "float32"
