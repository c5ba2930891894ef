"""A generation the target cannot take further ends with the text it has and a reason: its
context is full ("length"), or a remote verifier refused or went away ("error"). Nothing
already generated is raised away."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from draftwise import DraftConfig, GenerationConfig, ModelDrafter, SpeculativeEngine
from draftwise.backends.llamacpp import ContextOverflowError
from draftwise.errors import ContextLengthError, TargetError
from draftwise.target import LocalTarget

PROMPT = "The cat sat on the mat. The cat sat on the"
CONFIG = GenerationConfig(max_new_tokens=80, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4))


class Bounded:
    """A model whose sequence holds at most ``limit`` tokens and refuses more, as a llama.cpp
    context does (``LlamaCppModel.forward`` raises ``ContextOverflowError``)."""

    def __init__(self, lm, limit: int) -> None:
        self.lm = lm
        self.limit = limit

    def __getattr__(self, name: str):
        return getattr(self.lm, name)

    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        if len(self.lm.tokens) + len(tokens) > self.limit:
            raise ContextOverflowError(f"{len(self.lm.tokens) + len(tokens)} tokens do not fit in {self.limit}")
        return self.lm.forward(tokens, last)


class RefusesAfter:
    """A target that answers ``steps`` verifies, then refuses as a vanished verifier would."""

    def __init__(self, target: LocalTarget, steps: int) -> None:
        self.target = target
        self.steps = steps
        self.eos_token_ids = target.eos_token_ids

    def start(self, prompt, config, generator):
        return self.target.start(prompt, config, generator)

    def verify(self, context, proposal, mask=None):
        if self.steps == 0:
            raise TargetError("cannot reach the verifier at http://127.0.0.1:1: connection refused")
        self.steps -= 1
        return self.target.verify(context, proposal)

    def finish(self) -> None:
        self.target.finish()


@pytest.fixture(scope="module")
def expected(tiny_target, tiny_same_draft):
    return SpeculativeEngine.from_models(tiny_target, tiny_same_draft).generate(PROMPT, CONFIG)


def _check_kept(result, expected, tokenizer) -> None:
    """What was generated is a prefix of the full run, its text the decoded tokens."""
    assert 0 < len(result.tokens) < len(expected.tokens)
    assert result.tokens == expected.tokens[: len(result.tokens)]
    assert result.text == tokenizer.decode(result.tokens)
    # The closing event made no target pass: the metrics count only real ones.
    assert result.metrics.target_passes == len(result.events) - 1
    assert result.events[-1].tokens == [] and result.events[-1].finished


def test_a_full_target_context_ends_with_length(tiny_target, tiny_same_draft, expected):
    target = LocalTarget(Bounded(tiny_target.fork(), limit=60))
    engine = SpeculativeEngine(target, ModelDrafter(tiny_same_draft), tokenizer=tiny_target.tokenizer)
    result = engine.generate(PROMPT, CONFIG)
    assert result.metrics.finish_reason == "length"
    _check_kept(result, expected, tiny_target.tokenizer)
    assert len(result.prompt_ids) + len(result.tokens) > 60 - 5  # within one block of the limit
    assert "do not fit" in result.events[-1].extra["detail"]


def test_a_full_draft_context_ends_with_length(tiny_target, tiny_same_draft, expected):
    drafter = ModelDrafter(Bounded(tiny_same_draft.fork(), limit=60))
    result = SpeculativeEngine(LocalTarget(tiny_target), drafter, tokenizer=tiny_target.tokenizer).generate(
        PROMPT, CONFIG
    )
    assert result.metrics.finish_reason == "length"
    _check_kept(result, expected, tiny_target.tokenizer)


def test_a_target_that_goes_away_ends_with_error_and_keeps_the_text(tiny_target, tiny_same_draft, expected):
    target = RefusesAfter(LocalTarget(tiny_target), steps=3)
    result = SpeculativeEngine(target, ModelDrafter(tiny_same_draft), tokenizer=tiny_target.tokenizer).generate(
        PROMPT, CONFIG
    )
    assert result.metrics.finish_reason == "error"
    _check_kept(result, expected, tiny_target.tokenizer)
    assert "cannot reach the verifier" in result.events[-1].extra["detail"]


def test_context_overflow_is_a_context_length_error():
    assert issubclass(ContextOverflowError, ContextLengthError) and issubclass(ContextLengthError, TargetError)
