"""Structured output end to end on a real model (SmolLM2-135M on llama.cpp) through the
server: a schema llguidance could not follow is refused at admission on the real vocabulary
(whose ``{"`` token hides the forced ``{`` from llguidance's forced tokens); with several
tools and one thing to do, the answer holds one call and ends there (``parallel_tool_calls``
is false by default), and under ``tool_choice: "auto"`` it is text or a call, never text that
holds a call half-way or a second call."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from draftwise.api.tools import TOOL_OPEN
from draftwise.config import ModelOptions
from draftwise.loading import load_lm
from grammar_support import UNFINISHABLE, optional_properties

from real_support import SMOL, needs_smol_on_llama_cpp, require_module
from server_support import serve_in_background

pytestmark = [pytest.mark.slow, needs_smol_on_llama_cpp]


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TEXT = {"type": "string", "maxLength": 24}
TOOLS = [
    _tool("get_weather", "The current weather in a city.", {"city": TEXT}, ["city"]),
    _tool("get_time", "The current time in a time zone.", {"zone": {"enum": ["utc", "cet", "pst"]}}, ["zone"]),
    _tool("send_email", "Send an email.", {"to": TEXT, "subject": TEXT}, ["to", "subject"]),
    _tool("search_web", "Search the web.", {"query": TEXT}, ["query"]),
]
# SmolLM2's chat template leaves tools out: the system message teaches the format instead.
SYSTEM = (
    "You can call these tools: "
    + json.dumps([tool["function"] for tool in TOOLS])
    + '. To call one, answer with <tool_call>\n{"name": "...", "arguments": {...}}\n</tool_call>'
)
ASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris right now?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
# Asked to copy two calls: without a grammar SmolLM2 writes both (the control below), so a
# second call would show here if the grammar let one through.
TWO_CALLS = [ASK[0], {"role": "user", "content": f"Repeat exactly this text and nothing else: {CALL}\n{SECOND}"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    require_module("fastapi")
    require_module("httpx")
    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings
    from draftwise.prepare import Pair

    lm = load_lm(SMOL, ModelOptions(backend="llamacpp", threads=2, context=2048))
    with serve_in_background(create_app(ServerSettings(target=SMOL), Pair(lm))) as base:
        yield base


def _answer(url: str, stream: bool = False, messages: list[dict] | None = None, **body) -> dict:
    import httpx

    request = {"model": SMOL, "messages": messages or ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json={**request, **body, "stream": stream}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json() if not stream else _collected(response.text)


def _collected(sse: str) -> dict:
    """A streamed answer put together as a non-streamed one reads: content, calls, finish reason."""
    chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
    assert all("error" not in chunk for chunk in chunks), chunks[-1]
    content, calls, finish = "", {}, None
    for choice in (c["choices"][0] for c in chunks if c["choices"]):
        content += choice["delta"].get("content") or ""
        for delta in choice["delta"].get("tool_calls") or []:
            call = calls.setdefault(delta["index"], {"function": {"name": None, "arguments": ""}})
            call["function"]["name"] = delta["function"].get("name") or call["function"]["name"]
            call["function"]["arguments"] += delta["function"].get("arguments") or ""
        finish = choice["finish_reason"] or finish
    message = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None}
    return {"choices": [{"message": message, "finish_reason": finish}]}


def _one_call(answer: dict) -> dict:
    """The answer's one call, checked against its tool's schema; fails on a second call."""
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert len(calls) == 1, calls
    assert choice["finish_reason"] == "tool_calls"
    name, arguments = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
    (tool,) = [t["function"] for t in TOOLS if t["function"]["name"] == name]
    assert set(arguments) == set(tool["parameters"]["required"])
    assert TOOL_OPEN not in (choice["message"].get("content") or "")
    return {"name": name, "arguments": arguments}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("messages", [ASK, TWO_CALLS], ids=["question", "two calls asked"])
def test_one_intended_action_is_one_call_among_several_tools(url, stream, messages):
    call = _one_call(_answer(url, stream, messages, tool_choice="required"))
    assert call["name"] in {t["function"]["name"] for t in TOOLS}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("messages", "expected"), [(ASK, "text"), (TWO_CALLS, "call")], ids=["question", "two calls asked"]
)
def test_auto_answers_in_text_or_one_call_never_both_half_way(url, stream, messages, expected):
    """SmolLM2 answers the question in text and copies the calls: each answer is checked
    against what it is, and must be that (one model, greedy: the same answer every run)."""
    choice = _answer(url, stream, messages)["choices"][0]
    if choice["message"].get("tool_calls"):
        assert expected == "call"
        assert _one_call({"choices": [choice]}) == {"name": "get_weather", "arguments": {"city": "Paris"}}
    else:
        # Text only: no call opened in it, broken or whole, and an ordinary end.
        assert expected == "text"
        assert TOOL_OPEN not in (choice["message"].get("content") or "")
        assert choice["finish_reason"] in ("stop", "length")


def test_without_the_grammar_the_model_writes_the_second_call(url):
    """The control of the two tests above: with tools taken away (``tool_choice: "none"``) the
    model copies both calls, so the grammar is what stops the second."""
    content = _answer(url, messages=TWO_CALLS, tool_choice="none")["choices"][0]["message"]["content"]
    assert content.count(TOOL_OPEN) == 2, content


@pytest.mark.parametrize(
    "schema", [optional_properties(3000), *UNFINISHABLE.values()], ids=["3000 properties", *UNFINISHABLE]
)
def test_a_schema_llguidance_cannot_follow_is_a_400_at_admission(url, schema):
    import httpx

    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}
    body = {"model": SMOL, "messages": ASK[1:], "max_tokens": 40, "response_format": response_format}
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["param"] == "response_format" and "cannot be followed" in error["message"]
    assert "\n" not in error["message"] and len(error["message"]) < 300
