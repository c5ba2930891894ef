"""The Streamlit page through Streamlit's own test driver (``AppTest``), against live tiny API servers."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("fastapi")
from streamlit.testing.v1 import AppTest

from draftwise.dashboard.client import API_URL_ENV
from draftwise.dashboard.page import BENCH_DIR_ENV

from dashboard_support import FIXED, live_api, tiny_bench

APP = Path(__file__).resolve().parent.parent / "src" / "draftwise" / "dashboard" / "app.py"
TIMEOUT = 120  # seconds per script run: the first one imports torch and streams generations


def _page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    return at.run()


def _token_box(at: AppTest, index: int = 0) -> str:
    boxes = [m.value for m in at.markdown if 'class="dw-box"' in m.value]
    return boxes[index]


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.fixture(scope="module")
def api(tiny_target, tiny_near_draft):
    with live_api(tiny_target, tiny_near_draft) as url:
        yield url


def test_live_run_with_plain_twin(api, monkeypatch) -> None:
    monkeypatch.setenv(API_URL_ENV, api)
    at = _page()
    assert not at.exception and not at.error
    assert "serving **tiny:0**, draft **tiny-draft**" in at.sidebar.caption[0].value
    assert at.selectbox(key="drafter").options == ["model", "ngram", "hybrid", "off"]
    assert at.selectbox(key="drafter").value == "hybrid"  # the server's default drafter
    assert "press Generate" in _token_box(at)
    at.selectbox(key="drafter").set_value("model")  # every step drafts k with the model
    at.selectbox(key="k_policy").set_value(FIXED["k_policy"])
    at.number_input(key="k").set_value(FIXED["k"])
    at.slider(key="threshold").set_value(FIXED["confidence_threshold"])
    at.number_input(key="max_tokens").set_value(32)
    at.radio(key="format").set_value("completion")
    at.button(key="generate").click().run()
    assert not at.exception and not at.error

    spec, plain, greedy = at.session_state["runs"]
    assert greedy and len(spec.tokens) == len(plain.tokens) == 32
    assert {t.source for t in plain.tokens} == {"bonus"}  # the plain twin never drafts
    assert {"accepted", "corrected"} <= {t.source for t in spec.tokens}
    done = 0
    for step in spec.steps:  # fixed k, except where the token budget leaves less room
        assert step.k == min(FIXED["k"], 32 - done - 1)
        done += step.emitted
    spec_box, plain_box = _token_box(at, 0), _token_box(at, 1)
    for source in ("accepted", "corrected", "bonus"):
        assert f'class="dw-tok dw-{source}"' in spec_box
    assert 'class="dw-rejected"' in spec_box
    assert plain_box.count('class="dw-tok dw-') == plain_box.count('class="dw-tok dw-bonus"') == 32
    # Greedy speculation is lossless: the same tokens as the plain target.
    assert _metric(at, "outputs identical") == "yes"
    assert spec.token_ids == plain.token_ids
    assert _metric(at, "speedup").endswith("x")
    assert _metric(at, "target passes") == str(spec.passes)

    # Changing a widget reruns the script: the finished run is drawn again, not lost.
    at.slider(key="temperature").set_value(0.5).run()
    assert _token_box(at, 0) == spec_box and not at.exception


def test_unreachable_server_shows_a_message(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(API_URL_ENV, f"http://127.0.0.1:{port}")
    at = _page()
    assert not at.exception
    assert "cannot reach the draftwise API" in at.error[0].value
    assert at.button(key="generate").disabled


def test_server_without_draft_model_offers_no_model_drafter(tiny_target, monkeypatch) -> None:
    with live_api(tiny_target) as url:
        monkeypatch.setenv(API_URL_ENV, url)
        at = _page()
        assert at.selectbox(key="drafter").options == ["ngram", "off"]
        at.number_input(key="k").set_value(9)
        at.number_input(key="k_max").set_value(4)
        at.selectbox(key="k_policy").set_value("heuristic")
        at.button(key="generate").click().run()
        assert not at.exception
        assert "invalid drafting settings: k (9) must not exceed k_max (4)" in at.error[0].value


def test_report_view(tmp_path_factory, tiny_target, tiny_random_draft, monkeypatch) -> None:
    out = tiny_bench(tmp_path_factory.mktemp("bench"), tiny_target, tiny_random_draft)
    monkeypatch.setenv(BENCH_DIR_ENV, str(out))
    at = _page()
    at.radio(key="view").set_value("Bench report").run()
    assert not at.exception
    assert at.selectbox(key="bench_group").options == ["overall", "alpha", "beta"]
    methods = at.dataframe[0].value
    assert list(methods.index) == ["baseline", "model", "ngram"]
    at.selectbox(key="bench_group").set_value("beta")
    at.selectbox(key="bench_method").set_value("ngram").run()
    records = at.dataframe[1].value
    assert list(records["prompt"]) == ["p2"]
    at.text_input(key="bench_path").set_value(str(tmp_path_factory.mktemp("empty"))).run()
    assert "holds no results.jsonl" in at.info[0].value
