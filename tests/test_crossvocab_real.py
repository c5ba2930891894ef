"""Drafting with another vocabulary on real models (CI pulls both): Gemma 3 270M as the
target and SmolLM2-135M, whose tokenizer is another, as its draft, both on llama.cpp.

The output must be the plain target's, greedy, on text in several scripts and on code; the
draft must have proposed and had some of it accepted; the draft's context is capped at the
target's.
"""

from __future__ import annotations

import json

import pytest

from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.drafters import CrossVocabDrafter, HybridDrafter, build_drafter, text_bridge
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.loading import load_pair

from cli_support import run_cli
from real_support import GEMMA, SMOL, needs_two_vocabularies

pytestmark = [pytest.mark.slow, needs_two_vocabularies]
OPTIONS = ModelOptions(threads=2, context=2048)
PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Größe, café, naïve: 日本語のテキスト。 The word for 'thank you' in Japanese is",
]
GREEDY = GenerationConfig(
    max_new_tokens=32,
    ignore_eos=True,
    sampling=SamplingConfig(temperature=0),
    draft=DraftConfig(k_policy="fixed", k=4, confidence_threshold=0.0),
)


@pytest.fixture(scope="module")
def pair():
    said: list[str] = []
    target, draft = load_pair(GEMMA, SMOL, OPTIONS, log=said.append)
    assert any("speaks another vocabulary" in line for line in said)
    return target, draft


@pytest.mark.parametrize("kind", ["model", "hybrid"])
def test_greedy_output_is_the_targets_and_the_draft_is_accepted(pair, kind):
    target, draft = pair
    proposed = accepted = 0
    for prompt in PROMPTS:
        plain = autoregressive(target).generate(prompt, GREEDY)
        drafter = build_drafter(kind, draft, text_bridge(target.tokenizer, draft))
        assert isinstance(drafter, CrossVocabDrafter | HybridDrafter)
        spec = SpeculativeEngine.from_models(target, drafter).generate(prompt, GREEDY)
        assert spec.tokens == plain.tokens, prompt
        proposed += spec.metrics.proposed
        accepted += spec.metrics.accepted
    assert proposed > 0 and accepted > 0


def test_a_draft_gets_no_longer_context_than_the_target():
    target, draft = load_pair(SMOL, GEMMA, ModelOptions(threads=2))
    assert draft is not None
    assert draft.max_context == target.max_context == 8192  # Gemma's own is 32768


def test_generate_through_the_cli_gives_the_plain_text():
    done = run_cli(
        "generate", PROMPTS[0], "--target", GEMMA, "--draft", SMOL, "--drafter", "hybrid", "--context", "2048",
        "--max-new-tokens", "24", "--temperature", "0", "--compare", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["compare"]["identical"] is True
    assert "drafts through text" in " ".join(done.stderr.split())
