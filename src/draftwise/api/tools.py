"""The tool-call format of Hermes-style chat templates (Qwen2.5's among them), as the API
speaks it: the grammar an answer that calls tools follows, the parser of a finished answer, and
the reader of one as it streams. The decode core knows none of it: it sees a ``GrammarSpec``
with a trigger. Another model family's format would be a module like this one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from draftwise.config import GrammarSpec
from draftwise.grammar import JSON_OPTIONS

# How Qwen2.5 (and other Hermes-style chat templates) write a tool call: the template lists the
# tools, and the model answers with one or more of these.
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CLOSE), re.DOTALL)


def tool_call_grammar(functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool, required: bool) -> GrammarSpec:
    """The grammar of an answer that calls tools: ``<tool_call>\n{"name": N, "arguments": A}\n
    </tool_call>``, one call or (``parallel``) several on their own lines, where N names one of
    ``functions`` (name, parameters schema) and A follows that function's schema. ``required``:
    the answer is calls from its first token; else (OpenAI's ``auto``) free text until the model
    opens a call. With the JSON layout above, everything up to the first argument's value is
    forced when there is one function: ``<tool_call>\n{"name": "get_weather", "arguments":
    {"city": "``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions
    ]
    schema = {"x-guidance": JSON_OPTIONS, "anyOf": calls}
    more = ' ("\\n" call)*' if parallel else ""
    text = f'start: call{more}\ncall: "{TOOL_OPEN}\\n" body "\\n{TOOL_CLOSE}"\nbody: %json {json.dumps(schema)}'
    return GrammarSpec(kind="lark", text=text, trigger=None if required else TOOL_OPEN, name="tool-call grammar")


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text before the first call, [(function name, arguments as a JSON string)]) of an
    answer in the format above; a call that does not parse stays in the text."""
    calls: list[tuple[str, str]] = []
    first = None
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        first = match.start() if first is None else first
    return (text if first is None else text[:first]), calls


def held_back(text: str) -> int:
    """Where streamed text must stop while an answer may still open a tool call: at the call's
    opening tag, or at an end of ``text`` that could be the start of one."""
    at = text.find(TOOL_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\}\s*" + re.escape(TOOL_CLOSE))


class CallStream:
    """Reads an answer in the tool-call format as it streams, and says what to send: the text
    before a call as content, then each call as it goes, its name once known and its arguments
    piece by piece (OpenAI's ``delta.tool_calls``).

    Example: pushed ``'Hi <tool_call>\n{"name": "f", "arguments": {"a": '`` then ``'1}}\n</tool_call>'``
    gives ``("content", "Hi ")``, ``("call", "f")``, ``("arguments", '{"a": ')``, then
    ``("arguments", "1}")``: the last ``}`` before the closing tag is the call's own.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "text"  # text -> head (after the opening tag) -> arguments -> text ...
        self.calls = 0  # calls opened so far

    def push(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes: (``content``, text), (``call``, name), (``arguments``, text)."""
        self.buffer += text
        pieces: list[tuple[str, str]] = []
        while True:
            piece = getattr(self, f"_{self.state}")()
            if piece is None:
                return pieces
            if piece[1] or piece[0] == "call":
                pieces.append(piece)

    def _text(self) -> tuple[str, str] | None:
        cut = held_back(self.buffer)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        if self.calls and not out.strip():
            out = ""  # the line break between two calls is not content
        if self.buffer.startswith(TOOL_OPEN):
            self.buffer, self.state = self.buffer[len(TOOL_OPEN) :], "head"
            return ("content", out)
        return ("content", out) if out else None

    def _head(self) -> tuple[str, str] | None:
        match = _HEAD.match(self.buffer)
        if match is None:
            return None
        self.buffer, self.state = self.buffer[match.end() :], "arguments"
        self.calls += 1
        return ("call", match.group(1))

    def _arguments(self) -> tuple[str, str] | None:
        match = _TAIL.search(self.buffer)
        if match is not None:
            out, self.buffer, self.state = self.buffer[: match.start()], self.buffer[match.end() :], "text"
            return ("arguments", out)
        keep = self.buffer.rfind("}")  # it may be the call's own closing brace: wait for what follows
        cut = len(self.buffer) if keep < 0 else keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return ("arguments", out) if out else None

    def flush(self) -> list[tuple[str, str]]:
        """What is left once the answer has ended (cut short, or a call that never opened)."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        if self.state == "arguments":
            return [("arguments", rest)]
        return [("content", (TOOL_OPEN if self.state == "head" else "") + rest)]
