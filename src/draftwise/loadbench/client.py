"""The clients: C streaming requests at a time, sharing one list of prompts until it is done.

Each answer records what a user of the stream sees: time to the first chunk with text, the
whole latency, the text, and the completion tokens the server counted (``usage``, which
both draftwise and llama-server send at the end of a stream when asked), with the prediction
tokens it accepted and rejected where it reports them (``usage.completion_tokens_details``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.loadbench.prompts import LoadPrompt


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: a server's base URL and the model id they name; ``transport``, when
    set, carries them instead of the network (``draftwise.loadbench.inprocess``)."""

    base: str
    model: str
    transport: Any = None


MAX_BUSY_RETRIES = 100  # a 429 (the server's queue is full) is retried this often at most
BUSY_WAIT_CAP_S = 5.0  # the longest Retry-After honoured


@dataclass
class Answer:
    """One request's outcome, as the client saw it."""

    prompt: LoadPrompt
    start_s: float  # when it was sent, from the start of the run
    status: int | None = None  # the HTTP status; None: no answer
    text: str = ""
    ttft_s: float | None = None  # to the first chunk that carries text
    first_chunk_chars: int | None = None  # len(text) once that chunk is read: what came with it
    latency_s: float = 0.0  # to the end of the stream
    completion_tokens: int | None = None  # the server's own count (usage)
    accepted_prediction_tokens: int | None = None  # usage.completion_tokens_details, where reported
    rejected_prediction_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None  # why it failed; None for a complete stream

    @property
    def ok(self) -> bool:
        return self.error is None


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a stream chunk adds: a completion's ``text`` or a chat ``delta.content``, and
    the arguments of a tool call (a server may send them whole or in pieces)."""
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice["text"] or ""
            continue
        delta = choice.get("delta") or {}
        text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            text += (call.get("function") or {}).get("arguments") or ""
    return text


def read_event(answer: Answer, data: str, elapsed: float) -> bool:
    """Take one ``data:`` payload into ``answer``; True once the stream is over."""
    if data == "[DONE]":
        return True
    chunk = json.loads(data)
    if "error" in chunk:
        answer.error = f"error event: {json.dumps(chunk['error'])[:300]}"
        return True
    text = chunk_text(chunk)
    answer.text += text
    if text and answer.ttft_s is None:
        answer.ttft_s, answer.first_chunk_chars = elapsed, len(answer.text)
    for choice in chunk.get("choices") or []:
        answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    read_usage(answer, chunk.get("usage"))
    return False


def read_usage(answer: Answer, usage: dict[str, Any] | None) -> None:
    """The completion tokens of a ``usage`` object, and the prediction tokens where it has them."""
    if not usage:
        return
    if usage.get("completion_tokens") is not None:
        answer.completion_tokens = int(usage["completion_tokens"])
    details = usage.get("completion_tokens_details") or {}
    if details.get("accepted_prediction_tokens") is not None:
        answer.accepted_prediction_tokens = int(details["accepted_prediction_tokens"])
    if details.get("rejected_prediction_tokens") is not None:
        answer.rejected_prediction_tokens = int(details["rejected_prediction_tokens"])


async def _stream(http: Any, url: str, body: dict[str, Any], answer: Answer, started: float) -> float:
    """One attempt; returns the seconds to wait before trying again (a 429), else 0."""
    async with http.stream("POST", url, json=body) as response:
        answer.status = response.status_code
        if response.status_code == 429:
            await response.aread()
            return min(float(response.headers.get("retry-after") or 1), BUSY_WAIT_CAP_S)
        if response.status_code != 200:
            answer.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
            return 0.0
        done = False
        async for line in response.aiter_lines():
            if line.startswith("data:") and read_event(answer, line[5:].strip(), time.perf_counter() - started):
                done = True
                break
        if not done and answer.error is None:
            answer.error = "the stream ended without [DONE]"
    return 0.0


async def send(
    http: Any, endpoint: Endpoint, prompt: LoadPrompt, max_tokens: int, t0: float, predict: bool = False
) -> Answer:
    """Send ``prompt`` (again after a 429, as told) and read its stream to the end; with
    ``predict``, an edit task's prediction goes with it."""
    import httpx

    answer = Answer(prompt, start_s=time.perf_counter() - t0)
    body = prompt.body(endpoint.model, max_tokens, predict)
    for _ in range(MAX_BUSY_RETRIES):
        started = time.perf_counter()
        try:
            wait = await _stream(http, endpoint.base + prompt.path, body, answer, started)
        except httpx.HTTPError as exc:
            answer.error = f"{type(exc).__name__}: {exc}"
            wait = 0.0
        answer.latency_s = time.perf_counter() - started
        if not wait:
            return answer
        await asyncio.sleep(wait)
    answer.error = f"still busy (429) after {MAX_BUSY_RETRIES} tries"
    return answer


async def _level(
    endpoint: Endpoint,
    prompts: Sequence[LoadPrompt],
    clients: int,
    max_tokens: int,
    timeout: float,
    on_answer: Any,
    predict: bool,
) -> tuple[list[Answer], float]:
    import httpx

    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    queue = iter(prompts)  # shared: each prompt goes to whichever client is free first
    answers: list[Answer] = []
    transport = endpoint.transport
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False, transport=transport) as http:
        t0 = time.perf_counter()

        async def client() -> None:
            for prompt in queue:
                answer = await send(http, endpoint, prompt, max_tokens, t0, predict)
                answers.append(answer)
                on_answer(answer)

        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return answers, wall


def run_level(
    endpoint: Endpoint,
    prompts: Sequence[LoadPrompt],
    clients: int,
    max_tokens: int,
    timeout: float,
    on_answer: Callable[[Answer], None] = lambda answer: None,
    predict: bool = False,
) -> tuple[list[Answer], float]:
    """Every prompt once, ``clients`` at a time; the answers (in the order they finished) and
    the wall time from the first request sent to the last stream ended. With ``predict``, the
    edit tasks' requests carry their predictions."""
    return asyncio.run(_level(endpoint, prompts, clients, max_tokens, timeout, on_answer, predict))


def page(endpoint: Endpoint, path: str, timeout: float = 30.0) -> str | None:
    """The text a GET of ``path`` answers with, or None where the server has no such page (or
    did not answer)."""
    import httpx

    async def get() -> str | None:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False, transport=endpoint.transport) as http:
            answer = await http.get(endpoint.base + path)
            return answer.text if answer.status_code == 200 else None

    try:
        return asyncio.run(get())
    except httpx.HTTPError:
        return None
