"""Weight-only int4 quantization of a draft: close to the dense layer, and never changes output."""

from __future__ import annotations

import torch
from torch import nn

from draftwise import DraftConfig, GenerationConfig, SpeculativeEngine, autoregressive
from draftwise.quant import Int4Linear, quantize_int4
from draftwise.tiny import tiny_lm


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
    assert quantize_int4(model, group_size=64) == 1  # 32 inputs < group; 20 outputs not a multiple of 16
    assert isinstance(model[0], Int4Linear)
    assert isinstance(model[1], nn.Linear) and isinstance(model[2], nn.Linear)


def test_an_int4_draft_leaves_greedy_output_unchanged():
    target, draft = tiny_lm(0), tiny_lm(0)
    assert quantize_int4(draft.model) > 0
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4, confidence_threshold=0)
    )
    plain = autoregressive(target).generate("Hello world", config)
    spec = SpeculativeEngine.from_models(target, draft).generate("Hello world", config)
    assert spec.tokens == plain.tokens
    assert spec.metrics.proposed > 0
