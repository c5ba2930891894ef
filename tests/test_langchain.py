"""LangChain (``langchain-openai``) against ``draftwise serve``, as an agent framework uses it:
``with_structured_output`` by all three methods, ``bind_tools`` with a tool round trip, and
streamed tool calls. Tiny in-process models on 127.0.0.1. The schemas bound every string and
are strict (no other keys), so even a random model's answers end within ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import pydantic
import pytest

pytest.importorskip("fastapi")
langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402

from server_support import serve_in_background  # noqa: E402

MODEL = "tiny:0"


class Record(pydantic.BaseModel):
    """A record."""

    name: str = pydantic.Field(max_length=6)
    tag: Literal["red", "green", "blue"]


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)


@tool(args_schema=City)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def llm(tiny_target, tiny_near_draft) -> Iterator[object]:
    settings = ServerSettings(target=MODEL, max_context=2048)
    with serve_in_background(create_app(settings, Pair(tiny_target, tiny_near_draft).fork())) as base:
        yield langchain_openai.ChatOpenAI(
            base_url=f"{base}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=200, max_retries=0
        )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_gives_the_model(llm, method):
    record = llm.with_structured_output(Record, method=method, strict=True).invoke("a record")
    assert isinstance(record, Record) and record.tag in ("red", "green", "blue")


def test_json_mode_gives_a_json_object(llm):
    # No schema reaches the server in json_mode: any object will do, parsed by LangChain.
    schema = {"title": "anything", "type": "object"}
    answer = llm.with_structured_output(schema, method="json_mode").invoke("record")
    assert isinstance(answer, dict)


def test_bind_tools_round_trip(llm):
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    question = HumanMessage("What is the weather in Paris?")
    call = bound.invoke([question])
    (request,) = call.tool_calls
    assert request["name"] == "get_weather" and set(request["args"]) == {"city"}
    result = ToolMessage(get_weather.invoke(request["args"]), tool_call_id=request["id"])
    reply = llm.bind_tools([get_weather], strict=True).invoke([question, call, result])
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def test_streamed_tool_calls_add_up_to_the_call(llm):
    bound = llm.bind_tools([get_weather], tool_choice="required", strict=True)
    chunks = list(bound.stream([HumanMessage("Weather in Oslo?")]))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    (call,) = whole.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert all(part["index"] is not None for chunk in chunks for part in chunk.tool_call_chunks)
