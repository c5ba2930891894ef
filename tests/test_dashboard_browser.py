"""A real browser on the real thing: ``draftwise dashboard`` (which starts ``draftwise serve`` and
``streamlit run``), driven by headless Chromium through Playwright, on tiny models and on a real one.

Chromium is Debian's package (``apt-get install chromium``; Playwright's own browser downloads
do not work offline). Screenshots are saved as artifacts under ``$DRAFTWISE_ARTIFACTS`` (default:
the test's temporary folder) and are not committed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cli_support import cli_server
from real_support import CHROMIUM, SMOL, chromium_missing, needs, needs_smol, require_module

# CI installs the dashboard's extras and Chromium: under DRAFTWISE_STRICT_TESTS=1 a missing one fails.
require_module("streamlit")
playwright_api = require_module("playwright.sync_api")

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STARTUP_S = 300  # the API server and the page both import torch; on a busy 2-core machine that takes a while
RUN_S = 180
MAX_TOKENS = 48

# Every test here starts a browser and two servers: slow, whatever the model.
pytestmark = [pytest.mark.slow, needs(chromium_missing)]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[str]:
    """`draftwise dashboard` on tiny models: target tiny:0, draft tiny:0 (the same weights, not
    quantized: a draft that is always right)."""
    args = ["dashboard", "--target", "tiny:0", "--draft", "tiny:0", "--draft-quant", "none", "--threads", "1"]
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    with cli_server(args, "/_stcore/health", log, startup_s=STARTUP_S, env={"OMP_NUM_THREADS": "1"}) as (url, _):
        yield url


@pytest.fixture()
def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("DRAFTWISE_ARTIFACTS", tmp_path / "artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _choose(page, label: str, option: str) -> None:
    page.get_by_role("combobox", name=label).click()
    page.get_by_role("option", name=option, exact=True).click()


def _set_number(page, label: str, value: int) -> None:
    field = page.get_by_label(label, exact=True)
    field.fill(str(value))
    field.press("Enter")


def _generate(page, drafter: str) -> dict[str, int]:
    """Run one generation with ``drafter``; return how many tokens of each class it shows."""
    _choose(page, "Drafter", drafter)
    page.get_by_role("button", name="Generate").click()
    # The caption under the speculative run appears once that run (and its plain twin) finished.
    page.get_by_text(re.compile(rf"drafter {drafter}: .*finish: length")).wait_for(timeout=RUN_S * 1000)
    box = page.locator(".dw-box").first
    return {c: box.locator(f".dw-{c}").count() for c in ("accepted", "recalled", "corrected", "bonus", "rejected")}


@contextmanager
def open_page(url: str, height: int) -> Iterator:
    """The dashboard at ``url`` in headless Chromium, once its Generate button is there."""
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": height})
            page.goto(url)
            page.get_by_role("button", name="Generate").wait_for(timeout=STARTUP_S * 1000)
            yield page
        finally:
            browser.close()


@pytest.mark.one_core  # tiny models on one thread
def test_tokens_of_every_provenance_class_show_up(dashboard: str, artifacts: Path) -> None:
    with open_page(dashboard, height=2300) as page:
        assert page.get_by_text("serving tiny:0, draft tiny:0").is_visible()
        # Every step drafts 4 tokens and the model drafter never stops early.
        _choose(page, "k policy", "fixed")
        _set_number(page, "k (draft length; start for adaptive policies)", 4)
        page.get_by_role("slider", name="Confidence threshold").press("Home")
        _set_number(page, "Max tokens", MAX_TOKENS)
        page.get_by_text("completion", exact=True).click()

        # Draft == target, greedy: every proposal is accepted and each block ends with a bonus token.
        same = _generate(page, "model")
        page.screenshot(path=str(artifacts / "dashboard-model-drafter.png"), full_page=True)
        assert same["accepted"] > 0 and same["bonus"] > 0 and same["corrected"] == 0
        assert same["accepted"] + same["bonus"] == MAX_TOKENS
        title = page.locator(".dw-box").first.locator(".dw-accepted").first.get_attribute("title")
        assert re.search(r"draft q=\d\.\d{3}, target p=\d\.\d{3}", title)
        assert page.get_by_text("outputs identical").is_visible()

        # The n-gram drafter guesses from the text so far: on a random model it is often wrong.
        # Where it has no guess, the server's earlier answers to the same prompt (the run above
        # and its plain twin) are drafted: tokens recalled, in a colour of their own.
        ngram = _generate(page, "ngram")
        page.screenshot(path=str(artifacts / "dashboard-ngram-drafter.png"), full_page=True)
        assert ngram["corrected"] > 0 and ngram["rejected"] >= ngram["corrected"]
        assert ngram["recalled"] > 0
        assert sum(ngram[c] for c in ("accepted", "recalled", "corrected", "bonus")) == MAX_TOKENS
        rejected = page.locator(".dw-box").first.locator(".dw-rejected").first
        assert "line-through" in rejected.evaluate("e => getComputedStyle(e).textDecorationLine")
    print(f"screenshots: {artifacts}")


@needs_smol
def test_the_page_serves_a_real_model(tmp_path: Path, artifacts: Path) -> None:
    # The model as a user runs it: the default backend (llama.cpp where it is installed).
    args = ["dashboard", "--target", SMOL, "--threads", "2"]
    with cli_server(args, "/_stcore/health", tmp_path / "dashboard.log", startup_s=STARTUP_S) as (url, _):
        with open_page(url, height=1200) as page:
            assert page.get_by_text(f"serving {SMOL}").is_visible()
            _set_number(page, "Max tokens", 8)
            page.get_by_role("button", name="Generate").click()
            page.get_by_text(re.compile(r"drafter ngram: .*finish: (length|stop)")).wait_for(timeout=RUN_S * 1000)
            page.screenshot(path=str(artifacts / "dashboard-smollm2.png"), full_page=True)
