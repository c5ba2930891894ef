"""Integration on a real model: SmolLM2-135M-Instruct from its GGUF file (CI pulls it first).

Speculation must reproduce the plain target's greedy output exactly, with the n-gram drafter
and with the model drafter; with the target as its own draft every proposal is accepted.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from draftwise.config import DraftConfig, GenerationConfig
from draftwise.drafters import NGramDrafter
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.lm import LanguageModel
from draftwise.registry import REGISTRY, model_path

from hf_support import load_hf_model
from real_support import PROMPT, SMOL, needs_smol

pytestmark = [pytest.mark.slow, pytest.mark.one_core, needs_smol]
ENTRY = REGISTRY[SMOL]


@pytest.fixture(scope="module")
def smol() -> LanguageModel:
    return load_hf_model(SMOL)


def test_pulled_file_matches_the_registry_checksum():
    digest = hashlib.sha256()
    with open(model_path(ENTRY), "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    assert digest.hexdigest() == ENTRY.sha256


def test_gguf_conversion_cache_reloads_identical_weights(smol):
    # The fixture's load wrote (or read) the converted folder; a second load reads it.
    again = load_hf_model(SMOL)
    ids = smol.tokenizer.encode(PROMPT)
    smol.reset()
    assert torch.equal(smol.forward(ids), again.forward(ids))
    assert smol.tokenizer.get_vocab() == again.tokenizer.get_vocab()
    assert smol.tokenizer.chat_template == again.tokenizer.chat_template


def _config(**draft) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=32, ignore_eos=True, draft=DraftConfig(**draft))


def test_ngram_speculation_equals_plain_greedy(smol):
    plain = autoregressive(smol).generate(PROMPT, _config())
    spec = SpeculativeEngine.from_models(smol, NGramDrafter()).generate(PROMPT, _config(k_policy="fixed", k=4))
    assert spec.tokens == plain.tokens
    assert spec.metrics.proposed > 0  # the repeated phrase gives the n-gram drafter something to propose
    assert spec.metrics.target_passes < plain.metrics.target_passes


def test_self_draft_accepts_everything_and_equals_plain_greedy(smol):
    draft = smol.fork()  # same weights, its own cache
    config = _config(k_policy="fixed", k=4, confidence_threshold=0.0)
    plain = autoregressive(smol).generate(PROMPT, config)
    spec = SpeculativeEngine.from_models(smol, draft).generate(PROMPT, config)
    assert spec.tokens == plain.tokens
    assert spec.metrics.acceptance_rate == 1.0
    assert spec.metrics.mean_accepted_length > 4.0  # 5 per pass, except a shorter last one
