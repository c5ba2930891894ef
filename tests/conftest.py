"""Shared fixtures: tiny fp32 random models built in-process (no downloads).

Models are cached per session because building one costs ~0.1 s; every engine resets a
model's cache when a generation starts, so sharing them between tests is safe.

Also the hooks of ``real_support``'s gates (the ``needs`` mark): a test is skipped where a
requirement is missing, failed instead under ``DRAFTWISE_STRICT_TESTS=1``, as is any skipped
slow test.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch

from draftwise.backends.tiny import tiny_lm
from draftwise.lm import LanguageModel

from real_support import enforce_gates, fail_strict_skip


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # tryfirst: a missing model must stop the test before its fixtures try to load it.
    enforce_gates(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    fail_strict_skip(item, report)
    return report


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
