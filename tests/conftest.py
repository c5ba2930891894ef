"""Shared fixtures: tiny fp32 random models built in-process (no downloads).

Models are cached per session because building one costs ~0.1 s; every engine resets a
model's cache when a generation starts, so sharing them between tests is safe.

Also the hooks of ``real_support``'s gates (the ``needs`` mark): a test is skipped where a
requirement is missing, failed instead under ``DRAFTWISE_STRICT_TESTS=1``, as is any skipped
slow test.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

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


# The files that start a local Ray: one Ray at a time on this machine, so one worker takes both.
RAY_FILES = ("tests/test_ray.py", "tests/test_ray_cli.py")


def pytest_configure(config: pytest.Config) -> None:
    # Under pytest-xdist (``make test``'s run of the tests on tiny models), torch's operations
    # keep to one thread a worker: two workers of two threads each on two cores wait on each
    # other's threads. The commands a test starts keep their own settings.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each file whole on one worker, so that its module fixtures (a server, a model) are built
    once; the Ray files on the same one."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return RAY_FILES[0] if path in RAY_FILES else path

    return ByFile(config, log)


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
