"""Shared fixtures: tiny fp32 random models built in-process (no downloads).

Models are cached per session because building one costs ~0.1 s; every engine resets a
model's cache when a generation starts, so sharing them between tests is safe.
"""

from __future__ import annotations

import pytest
import torch

from draftwise.backends.tiny import tiny_lm
from draftwise.lm import LanguageModel


@pytest.fixture(scope="session")
def tiny_target() -> LanguageModel:
    """The target of most tests (seed 0)."""
    return tiny_lm(0)


@pytest.fixture(scope="session")
def tiny_same_draft() -> LanguageModel:
    """Same weights as ``tiny_target``, separate cache: a draft that is always right."""
    return tiny_lm(0)


@pytest.fixture(scope="session")
def tiny_random_draft() -> LanguageModel:
    """Unrelated weights (seed 1): a draft that is almost always wrong."""
    return tiny_lm(1)


@pytest.fixture(scope="session")
def tiny_near_draft() -> LanguageModel:
    """The target's weights with noise on the output layer: a draft that agrees only in
    part, so sampling tests exercise acceptances and rejections alike."""
    lm = tiny_lm(0)
    head = lm.model.get_output_embeddings().weight
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(123)
        head.add_(0.5 * head.std() * torch.randn_like(head))
    return lm
