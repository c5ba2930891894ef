"""How an answer goes out: each endpoint's shape (``CompletionShape``, ``ChatShape``: the
response a finished ``Transcript`` becomes, and the chunks of a stream), and the
server-sent events that carry a stream's chunks (``sse``, ``JobStream``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from draftwise.api import responses as r
from draftwise.api.pool import Job
from draftwise.api.transcript import Transcript


class Shape:
    """How one endpoint dresses the same generation: ids, response and chunk objects, each
    with the server's ``system_fingerprint``."""

    id_prefix = ""
    response_type: type[BaseModel] = BaseModel  # the endpoint's whole response

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    def response(self, rid: str, created: int, model: str, t: Transcript) -> BaseModel:
        return self.response_type(
            id=rid,
            created=created,
            model=model,
            system_fingerprint=self.fingerprint,
            choices=[self.choice(t)],
            usage=t.usage(),
            speculative=t.stats(),
            provenance=t.provenance if t.plan.provenance else None,
        )

    def choice(self, t: Transcript) -> BaseModel:
        """The one choice of a finished answer, as this endpoint writes it."""
        raise NotImplementedError

    def opening(self, rid: str, created: int, model: str) -> Any:
        """The chunk a stream starts with, before any text; None: the text's own chunks start it."""
        return None

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> Any:
        raise NotImplementedError

    def tool_chunk(self, rid: str, created: int, model: str, calls: list[r.ToolCallDelta]) -> Any:
        raise NotImplementedError  # only chat answers call tools


class CompletionShape(Shape):
    id_prefix = "cmpl"
    response_type = r.CompletionResponse

    def choice(self, t: Transcript) -> BaseModel:
        return r.CompletionChoice(text="".join(t.text), finish_reason=t.finish_reason)

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> r.CompletionChunk:
        choices = [] if text is None else [r.CompletionChoice(text=text, finish_reason=finish)]
        return r.CompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=self.fingerprint, choices=choices
        )


class ChatShape(Shape):
    id_prefix = "chatcmpl"
    response_type = r.ChatCompletionResponse

    def choice(self, t: Transcript) -> BaseModel:
        return r.ChatChoice(message=_message(t), finish_reason=t.finish_reason)

    def opening(self, rid: str, created: int, model: str) -> r.ChatCompletionChunk:
        # As OpenAI and llama-server open a chat stream: the role alone, the text from the next chunk.
        return self._chunk(rid, created, model, [r.ChatChunkChoice(delta=r.ChatDelta(role="assistant", content=""))])

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> r.ChatCompletionChunk:
        if text is None:
            return self._chunk(rid, created, model, [])
        # A chunk without text (the last one) has an empty delta, as at OpenAI.
        delta = r.ChatDelta(content=text or None)
        return self._chunk(rid, created, model, [r.ChatChunkChoice(delta=delta, finish_reason=finish)])

    def tool_chunk(self, rid: str, created: int, model: str, calls: list[r.ToolCallDelta]) -> r.ChatCompletionChunk:
        return self._chunk(rid, created, model, [r.ChatChunkChoice(delta=r.ChatDelta(tool_calls=calls))])

    def _chunk(self, rid: str, created: int, model: str, choices: list[r.ChatChunkChoice]) -> r.ChatCompletionChunk:
        return r.ChatCompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=self.fingerprint, choices=choices
        )


def _message(t: Transcript) -> r.AssistantMessage:
    content, calls = t.tool_calls()
    if not calls:
        return r.AssistantMessage(content=content)
    return r.AssistantMessage(content=content.strip() or None, tool_calls=calls)


def sse(data: BaseModel | dict[str, Any]) -> str:
    """One server-sent event whose ``data`` is ``data`` as JSON."""
    payload = data.model_dump() if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class JobStream(StreamingResponse):
    """An SSE response that hands its job back however the stream ends (finished, client
    gone, server stopping), even if the body was never started."""

    def __init__(self, content: AsyncIterator[str], job: Job) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close("disconnect")
