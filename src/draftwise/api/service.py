"""The request handling behind the generation routes (``Service``): check the model a
request names, encode its prompt off the event loop, admit it to the slot pool, and answer
with the whole response or a stream of chunks.

Both endpoints, streaming or not, consume the same async stream of step events:
``SlotPool.run`` waits for a slot and submits the request's generation
(``SpeculativeEngine.steps``) to the server's one ``Scheduler``, which runs it in rounds
beside every other slot's, its target passes batched with theirs. Streaming writes each
step as an SSE chunk; non-streaming collects the steps into one response.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from draftwise.api.errors import APIError
from draftwise.api.monitoring import ServerMetrics
from draftwise.api.pool import GenerationTimeout, Job, QueueFull, SlotPool
from draftwise.api.schemas import GenerationRequest
from draftwise.api.settings import ServerSettings
from draftwise.api.shapes import JobStream, Shape, sse
from draftwise.api.transcript import Transcript, step_info
from draftwise.api.translate import (
    check_grammar,
    check_prediction,
    context_exceeded,
    grammar_failed,
    grammar_param,
    plan,
    prompt_bytes,
)
from draftwise.chat import PromptTooLong
from draftwise.config import GenerationConfig
from draftwise.constraint import GrammarError
from draftwise.events import StepEvent
from draftwise.grammar import Grammars
from draftwise.lm import LanguageModel, Tokenizer, longest_token


def _timed_out(exc: GenerationTimeout) -> APIError:
    return APIError(exc.status, str(exc), type="timeout_error", code="request_timeout")


def _internal(exc: Exception) -> APIError:
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def _grammar_failed(exc: GrammarError, t: Transcript) -> APIError:
    # A grammar that reaches a dead end mid-answer is the request's own schema's failure
    # (GrammarDeadEnd: a 400, one line), not the server's: never a 500, never a normal stop.
    return grammar_failed(exc, grammar_param(t.plan.tools))


async def _close_on_disconnect(http: Request, job: Job) -> None:
    """Cancel a non-streaming job if its client goes away (streams notice through their response).

    The body has been read by then, so the next ASGI message can only be the disconnect.
    """
    while (await http.receive())["type"] != "http.disconnect":
        pass
    job.close("disconnect")


@dataclass(frozen=True)
class Encoded:
    """A request's prompt ids, and its prediction's where the admission check read them
    (``check_prediction``): the generation takes those rather than tokenizing it again."""

    prompt: list[int]
    prediction: list[int] | None = None


class Service:
    """The request-handling logic behind the routes."""

    def __init__(
        self,
        settings: ServerSettings,
        target: LanguageModel,
        has_draft: bool,
        pool: SlotPool,
        metrics: ServerMetrics,
        grammars: Grammars | None,
    ) -> None:
        assert target.tokenizer is not None  # create_app refuses a target without one first
        self.settings = settings
        self.tokenizer: Tokenizer = target.tokenizer
        self.vocab_size = target.vocab_size
        self.context_limit = settings.max_context or target.max_context
        self.has_draft = has_draft
        self.grammars = grammars
        self.pool = pool
        self.metrics = metrics
        self.created = int(time.time())
        # No token is longer than this, so a text of n bytes holds at least n / this tokens.
        self.token_bytes_max = longest_token(self.tokenizer)
        # Chat templates and tokenizers take time in proportion to the text, which may be
        # megabytes: they run here, never on the event loop, so /health and running streams
        # go on meanwhile. Two threads: one large prompt does not hold up every other.
        self.text_work = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draftwise-text")

    async def encode(self, request: GenerationRequest, work: Callable[[int | None], list[int]]) -> Encoded:
        """``work(limit)``'s prompt ids (and the prediction's, where its check read them), off
        the event loop. A prompt that cannot fit the context is refused before the tokenizer's
        work: here when its text is longer than the context could hold even in the
        vocabulary's longest tokens, in ``work`` when it holds more markup and text pieces
        than the context has positions."""
        limit = self.context_limit
        size = prompt_bytes(request)
        if limit is not None and size > limit * self.token_bytes_max:
            raise context_exceeded(
                request,
                f"this model's maximum context length is {limit} tokens, and a prompt of {size} "
                f"bytes holds more (no token of this model is longer than {self.token_bytes_max} bytes)",
            )

        def prompt_and_prediction(limit: int | None) -> Encoded:
            prompt = work(limit)
            prediction = check_prediction(request, self.tokenizer, len(prompt), limit, self.token_bytes_max)
            check_grammar(request, self.grammars)
            return Encoded(prompt, prediction)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.text_work, prompt_and_prediction, limit)
        except PromptTooLong as exc:
            message = f"this model's maximum context length is {limit} tokens, and {exc}"
            raise context_exceeded(request, message) from exc

    def suffix_scope(self, http: Request, config: GenerationConfig) -> str | None:
        """Whose earlier outputs a request drafts from (``--suffix-scope``): by the API key it
        sends as ``Authorization: Bearer KEY``, whether or not the server checks keys. A seeded
        sampled request drafts from none: which sample a seed draws depends on the drafts, so
        its answer would depend on what the server answered before."""
        store = self.pool.suffix
        if store is None or (config.sampling.seed is not None and config.sampling.temperature > 0):
            return None
        scheme, _, key = http.headers.get("authorization", "").partition(" ")
        return store.scope(key.strip() or None if scheme.lower() == "bearer" else None)

    def check_model(self, name: str) -> None:
        if name != self.settings.served_model:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.settings.served_model!r}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    async def generate(self, request: GenerationRequest, encoded: Encoded, shape: Shape, http: Request) -> Any:
        prompt = encoded.prompt
        request_plan = plan(request, prompt, self.settings, self.context_limit, self.has_draft)
        try:
            job = self.pool.admit()
        except QueueFull as exc:
            raise APIError(
                exc.status,
                f"the server is busy ({exc}); retry later",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.settings.retry_after)},
            ) from exc
        self.metrics.prompt_tokens.inc(len(prompt))
        events = self.pool.run(
            job,
            request_plan.prompt,
            request_plan.config,
            request_plan.drafter,
            request_plan.cache_prompt,
            prediction_ids=encoded.prediction,
            scope=self.suffix_scope(http, request_plan.config),
        )
        transcript = Transcript(request_plan, self.tokenizer, job)
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.settings.served_model
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return JobStream(self._stream(events, transcript, shape, rid, created, model, include_usage), job)
        watcher = asyncio.create_task(_close_on_disconnect(http, job))
        try:
            async for event in events:
                transcript.add(event)
        except GenerationTimeout as exc:
            raise _timed_out(exc) from exc
        except GrammarError as exc:
            raise _grammar_failed(exc, transcript) from exc
        except Exception as exc:  # a fault in generation: report it as OpenAI does
            raise _internal(exc) from exc
        finally:
            watcher.cancel()
            job.close("disconnect")
        return shape.response(rid, created, model, transcript)

    async def _stream(
        self,
        events: AsyncIterator[StepEvent],
        t: Transcript,
        shape: Shape,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        opening = shape.opening(rid, created, model)
        if opening is not None:
            yield sse(opening)
        # Until a chunk has gone out, the first step sends one even without text (a stop string
        # may hold its text back), so the client sees the answer has begun.
        first = opening is None
        try:
            async for event in events:
                provenance = t.add(event)
                text, calls = t.stream_pieces(event.text)
                # With provenance every target pass gets its chunk, even one whose tokens a stop cut away.
                if text or provenance is not None or (first and not calls):
                    chunk = shape.chunk(rid, created, model, text, None)
                    chunk.provenance = provenance
                    if provenance is not None:
                        chunk.step = step_info(event, self.tokenizer)
                    yield sse(chunk)
                if calls:
                    yield sse(shape.tool_chunk(rid, created, model, calls))
                first = False
            text, calls = t.stream_rest()
            if text:
                yield sse(shape.chunk(rid, created, model, text, None))
            if calls:
                yield sse(shape.tool_chunk(rid, created, model, calls))
            last = shape.chunk(rid, created, model, "", t.finish_reason)
            last.speculative = t.stats()
            yield sse(last)
            if include_usage:
                usage = shape.chunk(rid, created, model, None, None)
                usage.usage = t.usage()
                yield sse(usage)
        except GenerationTimeout as exc:
            yield sse(_timed_out(exc).payload())
        except GrammarError as exc:  # an error event in place of the last chunk: no normal stop
            yield sse(_grammar_failed(exc, t).payload())
        except Exception as exc:  # a fault in generation: say so in the stream rather than cut it short
            yield sse(_internal(exc).payload())
        yield "data: [DONE]\n\n"
