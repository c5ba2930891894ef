"""Schemas and tool lists llguidance cannot follow, through the OpenAI-compatible server and
``draftwise generate``: a one-line 400 at admission where the check can see it coming, a
one-line 400 too (or, streaming, an error event and no normal stop) where the answer runs into
it, and each bad schema compiled once however often it is sent."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.constraint import REASON_CHARS  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402
from grammar_support import LATE_DEAD_END, UNFINISHABLE, count_compiles, optional_properties  # noqa: E402

from cli_support import run_cli_here  # noqa: E402
from server_support import serve_in_background  # noqa: E402

MODEL = "tiny:0"


@pytest.fixture(scope="module")
def url(tiny_target) -> Iterator[str]:
    app = create_app(ServerSettings(target=MODEL), Pair(tiny_target).fork())
    with serve_in_background(app) as base:
        yield base


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}


def _chat(url: str, **body) -> httpx.Response:
    messages = [{"role": "user", "content": "A record, please."}]
    return httpx.post(
        f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 60, **body}, timeout=60
    )


def _error(response: httpx.Response, status: int, param: str, code: str = "invalid_schema") -> str:
    """The message of an error answer with this status, param and code: one short line."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code)
    message = error["message"]
    assert "\n" not in message and len(message) < 150 + REASON_CHARS, message
    assert "<state>" not in message and "panic" not in message and "backtrace" not in message
    return str(message)


def test_a_schema_over_llguidances_row_limit_is_a_400_at_admission(url):
    message = _error(_chat(url, response_format=_format(optional_properties(3000))), 400, "response_format")
    assert "too many alternatives" in message


@pytest.mark.parametrize("name", sorted(UNFINISHABLE))
def test_a_schema_no_answer_can_finish_is_a_400_not_a_stop(url, name):
    for stream in (False, True):
        response = _chat(url, response_format=_format(UNFINISHABLE[name]), stream=stream)
        assert "cannot be followed" in _error(response, 400, "response_format")


def test_a_tool_whose_arguments_llguidance_cannot_follow_is_a_400_naming_it(url):
    def tool(name: str, parameters: dict) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    # Several tools: the whole grammar's check stops at the choice of name, so each
    # function's arguments are checked alone.
    tools = [
        tool("small", {"type": "object", "properties": {"x": {"type": "integer"}}}),
        tool("huge", optional_properties(3000)),
    ]
    for choice in ("auto", "required"):
        message = _error(_chat(url, tools=tools, tool_choice=choice), 400, "tools")
        assert message.startswith("function 'huge': the JSON schema cannot be followed: too many alternatives")


def test_a_dead_end_mid_answer_is_a_400_and_never_a_stop(url):
    response = _chat(url, response_format=_format(LATE_DEAD_END))
    message = _error(response, 400, "response_format", "grammar_dead_end")
    assert message.startswith("the output reached a point the JSON schema cannot go past: too many alternatives")


def test_a_streamed_dead_end_ends_with_an_error_event_and_no_finish_reason(url):
    response = _chat(url, response_format=_format(LATE_DEAD_END), stream=True)
    assert response.status_code == 200  # the answer had begun: the stream says what went wrong
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks, error = [json.loads(e) for e in events[:-2]], json.loads(events[-2])["error"]
    assert error["code"] == "grammar_dead_end" and error["param"] == "response_format"
    assert "\n" not in error["message"] and len(error["message"]) < 150 + REASON_CHARS
    assert chunks and all(choice["finish_reason"] is None for c in chunks for choice in c["choices"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).startswith('{"k": "')


def test_the_same_bad_schema_is_compiled_once(url, monkeypatch):
    built = count_compiles(monkeypatch)
    bad = _format(optional_properties(3001))  # a schema no other test sends: not yet kept
    first = _error(_chat(url, response_format=bad), 400, "response_format")
    second = _error(_chat(url, response_format=bad), 400, "response_format")
    assert first == second and len(built) == 1


def test_generate_says_a_grammar_failure_in_one_short_line(tmp_path):
    for schema, fragment in ((UNFINISHABLE["$ref cycle"], "cannot be followed"), (LATE_DEAD_END, "cannot go past")):
        path = tmp_path / "schema.json"
        path.write_text(json.dumps(schema))
        done = run_cli_here(
            "generate",
            "A record: ",
            "--target",
            MODEL,
            "--json-schema",
            str(path),
            "--max-new-tokens",
            "60",
            env={"DRAFTWISE_HOME": str(tmp_path / "home")},
        )
        # Above it, what generate says as it starts (the timing of the passes, the colours' legend).
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error: ")]
        assert done.returncode == 2 and errors == lines[-1:], done.stderr[:2000]
        assert fragment in errors[0] and len(errors[0]) < 150 + REASON_CHARS
        assert "Traceback" not in done.stderr and "<state>" not in done.stderr
