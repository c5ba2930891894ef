"""A real browser on the real thing: ``draftwise dashboard`` (which starts ``draftwise serve`` on tiny
models and ``streamlit run``), driven by headless Chromium through Playwright.

Chromium is Debian's package (``apt-get install chromium``; Playwright's own browser downloads
do not work offline). Screenshots are saved as artifacts under ``$DRAFTWISE_ARTIFACTS`` (default:
the test's temporary folder) and are not committed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
playwright_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STARTUP_S = 300  # the API server and the page both import torch; on a busy 2-core machine that takes a while
RUN_S = 180
MAX_TOKENS = 48

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="no Chromium found (apt-get install chromium); .ci/run installs it")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[str]:
    """`draftwise dashboard` on tiny models: target tiny:0, draft tiny:0 (the same weights, not
    quantized: a draft that is always right)."""
    import httpx

    port = _free_port()
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    command = [sys.executable, "-c", "from draftwise.cli import main; main()", "dashboard", "--target", "tiny:0",
               "--draft", "tiny:0", "--draft-quant", "none", "--threads", "1", "--port", str(port)]
    with log.open("wb") as sink:
        # Its own session, so teardown stops the command and both of its children together.
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"draftwise dashboard exited ({process.returncode}):\n{log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/_stcore/health", timeout=2.0, trust_env=False).text == "ok":
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the dashboard did not come up in {STARTUP_S} s:\n{log.read_text()[-2000:]}")
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


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
    return {c: box.locator(f".dw-{c}").count() for c in ("accepted", "corrected", "bonus", "rejected")}


def test_tokens_of_every_provenance_class_show_up(dashboard: str, artifacts: Path) -> None:
    with playwright_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 2300})
            page.goto(dashboard)
            page.get_by_role("button", name="Generate").wait_for(timeout=STARTUP_S * 1000)
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
            ngram = _generate(page, "ngram")
            page.screenshot(path=str(artifacts / "dashboard-ngram-drafter.png"), full_page=True)
            assert ngram["corrected"] > 0 and ngram["rejected"] >= ngram["corrected"]
            assert sum(ngram[c] for c in ("accepted", "corrected", "bonus")) == MAX_TOKENS
            rejected = page.locator(".dw-box").first.locator(".dw-rejected").first
            assert "line-through" in rejected.evaluate("e => getComputedStyle(e).textDecorationLine")
        finally:
            browser.close()
        print(f"screenshots: {artifacts}")
