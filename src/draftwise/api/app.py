"""The OpenAI-compatible HTTP app: ``create_app(settings, pair)`` builds it over a prepared pair
(``draftwise.prepare.prepare_pair``), uvicorn serves it.

Both endpoints, streaming or not, consume the same async stream of engine step events
(``WorkerPool.run`` over ``SpeculativeEngine.stream``); streaming writes each step as an
SSE chunk, non-streaming collects the steps into one response.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.routing import Match

from draftwise.api import schemas as s
from draftwise.api.errors import APIError, install_handlers, invalid
from draftwise.api.monitoring import ServerMetrics
from draftwise.api.openapi import GUARDED, UNKNOWN_MODEL, complete, generation_responses
from draftwise.api.pool import GenerationTimeout, Job, QueueFull, WorkerPool, build_workers
from draftwise.api.settings import ServerSettings
from draftwise.api.tools import CallStream, parse_tool_calls
from draftwise.api.translate import (
    Plan,
    check_grammar,
    check_prediction,
    context_exceeded,
    encode_chat,
    encode_completion,
    grammar_failed,
    grammar_param,
    plan,
    prompt_bytes,
)
from draftwise.chat import PromptTooLong
from draftwise.errors import ModelLoadError
from draftwise.events import StepEvent
from draftwise.grammar import GrammarError, Grammars
from draftwise.lm import LanguageModel, Tokenizer, longest_token
from draftwise.metrics import GenerationMetrics
from draftwise.prediction import PREDICTION
from draftwise.prepare import Pair
from draftwise.verify import TokenSource
from draftwise.web import BodyLimit, JsonBodyError, bearer_guard, error_responses, read_json_body

# The engine says why it stopped; OpenAI has two words for it.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _provenance(event: StepEvent, tokenizer: Tokenizer) -> list[s.TokenProvenance]:
    """Where each token of a step came from, with the probabilities that decided it."""
    out = []
    for i, (token, source) in enumerate(zip(event.tokens, event.sources)):
        item = s.TokenProvenance(id=token, text=tokenizer.decode([token]), source=source.value)
        if source is TokenSource.ACCEPTED:
            item.draft_prob, item.target_prob = event.draft_probs[i], event.target_probs[i]
        elif source is TokenSource.CORRECTED and i < len(event.proposed):
            item.rejected = s.RejectedDraft(
                id=event.proposed[i], draft_prob=event.draft_probs[i], target_prob=event.target_probs[i]
            )
        out.append(item)
    return out


def _step(event: StepEvent, tokenizer: Tokenizer) -> s.StepInfo:
    """The target pass behind a chunk: every proposal (kept or not) and the step's timings."""
    proposed = [
        s.DraftedToken(
            id=token,
            text=tokenizer.decode([token]),
            draft_prob=event.draft_probs[i],
            target_prob=event.target_probs[i] if i < len(event.target_probs) else None,
        )
        for i, token in enumerate(event.proposed)
    ]
    return s.StepInfo(
        index=event.step,
        k=event.k,
        source=event.source,
        proposed=proposed,
        n_accepted=event.n_accepted,
        prefill_seconds=event.prefill_seconds,
        draft_seconds=event.draft_seconds,
        verify_seconds=event.verify_seconds,
        step_seconds=event.step_seconds,
        arms=[s.WeighedArm(source=source, k=k, tokens_per_second=rate) for source, k, rate in event.arms],
    )


class Transcript:
    """What a generation produced so far: text, statistics and (if asked) provenance."""

    def __init__(self, request_plan: Plan, tokenizer: Tokenizer, job: Job) -> None:
        self.plan = request_plan
        self.tokenizer = tokenizer
        self.job = job
        self.metrics = GenerationMetrics()
        self.text: list[str] = []
        self.provenance: list[s.TokenProvenance] = []
        self.calls = CallStream()  # a stream's reading of the tool calls in its text

    def add(self, event: StepEvent) -> list[s.TokenProvenance] | None:
        """Take in a step; return its provenance when the request asked for it."""
        self.metrics.add(event)
        self.text.append(event.text)
        if not self.plan.provenance:
            return None
        step = _provenance(event, self.tokenizer)
        self.provenance.extend(step)
        return step

    def stream_pieces(self, new: str) -> tuple[str, list[s.ToolCallDelta]]:
        """What a stream sends for a step's ``new`` text: content, and where the answer may
        call tools, the calls as they go (``CallStream``: nothing of a call goes as content)."""
        if not self.plan.tools:
            return new, []
        return self._pieces(self.calls.push(new))

    def stream_rest(self) -> tuple[str, list[s.ToolCallDelta]]:
        """What a stream still holds back once the answer has ended."""
        return self._pieces(self.calls.flush()) if self.plan.tools else ("", [])

    def _pieces(self, pieces: list[tuple[str, str]]) -> tuple[str, list[s.ToolCallDelta]]:
        content, deltas = "", []
        # The reader has counted every call these pieces open: number them from the first.
        index = self.calls.calls - sum(kind == "call" for kind, _ in pieces) - 1
        for kind, value in pieces:
            if kind == "content":
                content += value
            elif kind == "call":
                index += 1
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                function = s.FunctionCallDelta(name=value)
                deltas.append(s.ToolCallDelta(index=index, id=call_id, type="function", function=function))
            elif deltas and deltas[-1].index == index:
                # One entry a call in a chunk: clients merge entries across chunks, not within one.
                deltas[-1].function.arguments += value
            else:
                deltas.append(s.ToolCallDelta(index=index, function=s.FunctionCallDelta(arguments=value)))
        return content, deltas

    def tool_calls(self) -> tuple[str, list[s.ToolCall]]:
        """(the content, the tool calls) of a finished answer; without calls, all is content."""
        text = "".join(self.text)
        if not self.plan.tools:
            return text, []
        content, calls = parse_tool_calls(text)
        return content, [
            s.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=s.FunctionCall(name=name, arguments=arguments))
            for name, arguments in calls
        ]

    @property
    def finish_reason(self) -> str | None:
        reason = _FINISH.get(self.metrics.finish_reason or "")
        if reason == "stop" and self.plan.tools and parse_tool_calls("".join(self.text))[1]:
            return "tool_calls"
        return reason

    def usage(self) -> s.Usage:
        prompt = len(self.plan.prompt)
        return s.Usage(
            prompt_tokens=prompt,
            completion_tokens=self.metrics.new_tokens,
            total_tokens=prompt + self.metrics.new_tokens,
            prompt_tokens_details=s.PromptTokensDetails(cached_tokens=self.job.cached_tokens),
            completion_tokens_details=self._prediction_details(),
        )

    def _prediction_details(self) -> s.CompletionTokensDetails | None:
        if self.plan.config.prediction is None:
            return None
        accepted, rejected = self.metrics.prediction_tokens(PREDICTION)
        return s.CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)

    def stats(self) -> dict[str, Any]:
        return {"drafter": self.plan.drafter, **self.metrics.to_dict()}


class _Shape:
    """How one endpoint dresses the same generation: ids, response and chunk objects, each
    with the server's ``system_fingerprint``."""

    id_prefix = ""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint

    def response(self, rid: str, created: int, model: str, t: Transcript) -> BaseModel:
        raise NotImplementedError

    def opening(self, rid: str, created: int, model: str) -> Any:
        """The chunk a stream starts with, before any text; None: the text's own chunks start it."""
        return None

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> Any:
        raise NotImplementedError

    def tool_chunk(self, rid: str, created: int, model: str, calls: list[s.ToolCallDelta]) -> Any:
        raise NotImplementedError  # only chat answers call tools


class _CompletionShape(_Shape):
    id_prefix = "cmpl"

    def response(self, rid: str, created: int, model: str, t: Transcript) -> BaseModel:
        return s.CompletionResponse(
            id=rid,
            created=created,
            model=model,
            system_fingerprint=self.fingerprint,
            choices=[s.CompletionChoice(text="".join(t.text), finish_reason=t.finish_reason)],
            usage=t.usage(),
            speculative=t.stats(),
            provenance=t.provenance if t.plan.provenance else None,
        )

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> s.CompletionChunk:
        choices = [] if text is None else [s.CompletionChoice(text=text, finish_reason=finish)]
        return s.CompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=self.fingerprint, choices=choices
        )


class _ChatShape(_Shape):
    id_prefix = "chatcmpl"

    def response(self, rid: str, created: int, model: str, t: Transcript) -> BaseModel:
        return s.ChatCompletionResponse(
            id=rid,
            created=created,
            model=model,
            system_fingerprint=self.fingerprint,
            choices=[s.ChatChoice(message=_message(t), finish_reason=t.finish_reason)],
            usage=t.usage(),
            speculative=t.stats(),
            provenance=t.provenance if t.plan.provenance else None,
        )

    def opening(self, rid: str, created: int, model: str) -> s.ChatCompletionChunk:
        # As OpenAI and llama-server open a chat stream: the role alone, the text from the next chunk.
        return self._chunk(rid, created, model, [s.ChatChunkChoice(delta=s.ChatDelta(role="assistant", content=""))])

    def chunk(self, rid: str, created: int, model: str, text: str | None, finish: str | None) -> s.ChatCompletionChunk:
        if text is None:
            return self._chunk(rid, created, model, [])
        # A chunk without text (the last one) has an empty delta, as at OpenAI.
        delta = s.ChatDelta(content=text or None)
        return self._chunk(rid, created, model, [s.ChatChunkChoice(delta=delta, finish_reason=finish)])

    def tool_chunk(self, rid: str, created: int, model: str, calls: list[s.ToolCallDelta]) -> s.ChatCompletionChunk:
        return self._chunk(rid, created, model, [s.ChatChunkChoice(delta=s.ChatDelta(tool_calls=calls))])

    def _chunk(self, rid: str, created: int, model: str, choices: list[s.ChatChunkChoice]) -> s.ChatCompletionChunk:
        return s.ChatCompletionChunk(
            id=rid, created=created, model=model, system_fingerprint=self.fingerprint, choices=choices
        )


def _message(t: Transcript) -> s.AssistantMessage:
    content, calls = t.tool_calls()
    if not calls:
        return s.AssistantMessage(content=content)
    return s.AssistantMessage(content=content.strip() or None, tool_calls=calls)


def _sse(data: BaseModel | dict[str, Any]) -> str:
    payload = data.model_dump() if isinstance(data, BaseModel) else data
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _JobStream(StreamingResponse):
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


class _CountRequests:
    """ASGI middleware counting requests by endpoint and status (streams included). The
    endpoint is the path template of the route that takes the request (``/v1/models/{model}``
    whatever the id), ``other`` where none does."""

    def __init__(self, app: Any, metrics: ServerMetrics, routes: Callable[[], Sequence[Any]]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(self._endpoint(scope), str(status)).inc()

    def _endpoint(self, scope: Any) -> str:
        # Matched here rather than read from scope["route"]: a request refused before routing
        # (an oversize body) still counts for its route. As the router does: a full match
        # first, else the route that only lacks the method (a 405).
        partial = None
        for route in self.routes():
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return str(route.path_format)
            if match is Match.PARTIAL and partial is None:
                partial = str(route.path_format)
        return partial or "other"


class _Service:
    """The request-handling logic behind the routes."""

    def __init__(
        self,
        settings: ServerSettings,
        target: LanguageModel,
        has_draft: bool,
        pool: WorkerPool,
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

    async def encode(self, request: s.GenerationRequest, work: Callable[[int | None], list[int]]) -> list[int]:
        """``work(limit)``'s prompt ids, off the event loop. A prompt that cannot fit the
        context is refused before the tokenizer's work: here when its text is longer than the
        context could hold even in the vocabulary's longest tokens, in ``work`` when it holds
        more markup and text pieces than the context has positions."""
        limit = self.context_limit
        size = prompt_bytes(request)
        if limit is not None and size > limit * self.token_bytes_max:
            raise context_exceeded(
                request,
                f"this model's maximum context length is {limit} tokens, and a prompt of {size} "
                f"bytes holds more (no token of this model is longer than {self.token_bytes_max} bytes)",
            )

        def prompt_and_prediction(limit: int | None) -> list[int]:
            prompt = work(limit)
            check_prediction(request, self.tokenizer, len(prompt), limit, self.token_bytes_max)
            check_grammar(request, self.grammars)
            return prompt

        try:
            return await asyncio.get_running_loop().run_in_executor(self.text_work, prompt_and_prediction, limit)
        except PromptTooLong as exc:
            message = f"this model's maximum context length is {limit} tokens, and {exc}"
            raise context_exceeded(request, message) from exc

    def check_model(self, name: str) -> None:
        if name != self.settings.served_model:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.settings.served_model!r}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    async def generate(self, request: s.GenerationRequest, prompt: list[int], shape: _Shape, http: Request) -> Any:
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
            job, request_plan.prompt, request_plan.config, request_plan.drafter, request_plan.cache_prompt
        )
        transcript = Transcript(request_plan, self.tokenizer, job)
        rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.settings.served_model
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return _JobStream(self._stream(events, transcript, shape, rid, created, model, include_usage), job)
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
        shape: _Shape,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        opening = shape.opening(rid, created, model)
        if opening is not None:
            yield _sse(opening)
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
                        chunk.step = _step(event, self.tokenizer)
                    yield _sse(chunk)
                if calls:
                    yield _sse(shape.tool_chunk(rid, created, model, calls))
                first = False
            text, calls = t.stream_rest()
            if text:
                yield _sse(shape.chunk(rid, created, model, text, None))
            if calls:
                yield _sse(shape.tool_chunk(rid, created, model, calls))
            last = shape.chunk(rid, created, model, "", t.finish_reason)
            last.speculative = t.stats()
            yield _sse(last)
            if include_usage:
                usage = shape.chunk(rid, created, model, None, None)
                usage.usage = t.usage()
                yield _sse(usage)
        except GenerationTimeout as exc:
            yield _sse(_timed_out(exc).payload())
        except GrammarError as exc:  # an error event in place of the last chunk: no normal stop
            yield _sse(_grammar_failed(exc, t).payload())
        except Exception as exc:  # a fault in generation: say so in the stream rather than cut it short
            yield _sse(_internal(exc).payload())
        yield "data: [DONE]\n\n"


class _JsonRequest(Request):
    """A request whose body is read by ``read_json_body``, once; FastAPI takes it from here."""

    _checked: dict[str, Any] | None = None

    async def json(self) -> Any:
        if self._checked is None:
            self._checked = read_json_body(await self.body(), self.headers.get("content-type"))
        return self._checked


class _JsonBodyRoute(APIRoute):
    """A route whose body must be a JSON object. One that is not (another content type, not
    UTF-8, malformed, nested too deep) is a 400 that says which and names the member where
    there is one; FastAPI alone answers "There was an error parsing the body", or takes a
    text/plain body for a missing object."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle

        async def read_then_handle(request: Request) -> Response:
            strict = _JsonRequest(request.scope, request.receive)
            try:
                await strict.json()
            except JsonBodyError as exc:
                raise invalid(str(exc), param=exc.field) from None
            return await handle(strict)

        return read_then_handle


_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def _openai_route(app: FastAPI, method: str, path: str, **options: Any) -> Callable[[_Handler], _Handler]:
    """Register a handler at ``/v1{path}`` and at ``path``, as llama-server serves OpenAI's
    routes: the same handler under both, documented once (under /v1)."""

    def register(handler: _Handler) -> _Handler:
        for route, documented in ((f"/v1{path}", True), (path, False)):
            app.router.add_api_route(
                route,
                handler,
                methods=[method],
                route_class_override=_JsonBodyRoute,
                include_in_schema=documented,
                **options,
            )
        return handler

    return register


def _add_v1_routes(app: FastAPI, service: _Service, guarded: list[Any], fingerprint: str) -> None:
    """OpenAI's routes: completions, chat completions and models, each also without ``/v1``.
    (Added to ``app`` itself, not through a router: request counting names endpoints by
    ``app.routes``.)"""
    completion_shape, chat_shape = _CompletionShape(fingerprint), _ChatShape(fingerprint)

    @_openai_route(
        app,
        "POST",
        "/completions",
        dependencies=guarded,
        response_model=s.CompletionResponse,
        responses=generation_responses(s.CompletionChunk),
    )
    async def completions(body: s.CompletionRequest, http: Request) -> Any:
        """Complete a prompt (OpenAI `completions`); `stream: true` answers with SSE chunks."""
        service.check_model(body.model)
        parse_special = service.settings.parse_special
        prompt = await service.encode(
            body, lambda limit: encode_completion(body, service.tokenizer, service.vocab_size, parse_special, limit)
        )
        return await service.generate(body, prompt, completion_shape, http)

    @_openai_route(
        app,
        "POST",
        "/chat/completions",
        dependencies=guarded,
        response_model=s.ChatCompletionResponse,
        responses=generation_responses(s.ChatCompletionChunk),
    )
    async def chat_completions(body: s.ChatCompletionRequest, http: Request) -> Any:
        """Answer a conversation with the target's chat template (OpenAI `chat.completions`)."""
        service.check_model(body.model)
        prompt = await service.encode(body, lambda limit: encode_chat(body, service.tokenizer, limit))
        return await service.generate(body, prompt, chat_shape, http)

    _add_model_routes(app, service, guarded)


def _add_model_routes(app: FastAPI, service: _Service, guarded: list[Any]) -> None:
    """OpenAI's model listing, also without ``/v1``."""

    def card() -> s.ModelCard:
        return s.ModelCard(id=service.settings.served_model, created=service.created)

    @_openai_route(
        app,
        "GET",
        "/models",
        dependencies=guarded,
        response_model=s.ModelList,
        responses=error_responses(s.ErrorResponse, GUARDED),
    )
    async def models() -> s.ModelList:
        """The served model."""
        return s.ModelList(data=[card()])

    @_openai_route(
        app,
        "GET",
        "/models/{model:path}",
        dependencies=guarded,
        response_model=s.ModelCard,
        responses=error_responses(s.ErrorResponse, {**GUARDED, **UNKNOWN_MODEL}),
    )
    async def model_info(model: str) -> s.ModelCard:
        service.check_model(model)
        return card()


def _add_status_routes(app: FastAPI, service: _Service) -> None:
    """Liveness and Prometheus metrics, open without a key for probes and scrapers."""
    settings, pool = service.settings, service.pool

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness and load: slots busy, requests waiting."""
        return {
            "status": "ok",
            "model": settings.served_model,
            "draft": settings.draft,
            "drafter": settings.default_drafter,
            "slots": pool.size,
            "active": pool.running,
            "queued": pool.waiting,
            "queue_size": pool.queue_size,
            **service.metrics.means(),
        }

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: ServerSettings, pair: Pair) -> FastAPI:
    """Build the server's web parts over a pair prepared for it (``draftwise.prepare``: loaded
    with ``settings.slots`` slots, warmed up, its costs measured for the cost policy); nothing
    is loaded here. The app takes the pair's models: the first of the ``settings.slots``
    workers runs on them, each other one on forks of them (shared weights, KV caches of their
    own). A caller that goes on using its models hands over ``pair.fork()``."""
    from draftwise import __version__

    if pair.target.tokenizer is None:
        raise ModelLoadError(f"the target model {settings.target!r} has no tokenizer; the server needs one")
    metrics = ServerMetrics()
    workers = build_workers(pair.target, pair.draft, settings.slots, pair.profile)
    pool = WorkerPool(workers, settings.queue_size, settings.request_timeout, metrics)
    service = _Service(settings, pair.target, pair.draft is not None, pool, metrics, workers[0].grammars)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.close()
        service.text_work.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="draftwise",
        version=__version__,
        description="OpenAI-compatible text generation with lossless speculative decoding. "
        "The `speculative` request field picks the drafter and its settings per request.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.metrics = metrics
    install_handlers(app)
    guarded = _install_middleware(app, settings, metrics)
    _add_v1_routes(app, service, guarded, _system_fingerprint(settings, pair))
    _add_status_routes(app, service)
    complete(app, settings.served_model)  # the rest of /openapi.json
    return app


def _system_fingerprint(settings: ServerSettings, pair: Pair) -> str:
    """``draftwise-<version>-<hash>``, the hash of what decides the answers: the loaded models'
    fingerprints (weights, format, threads) and the default drafter. Stable across restarts
    of the same server; it changes when they do, as OpenAI's changes with its backend."""
    from draftwise import __version__

    draft = "no draft" if pair.draft is None else pair.draft.fingerprint
    parts = [__version__, pair.target.fingerprint, draft, settings.default_drafter]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"draftwise-{__version__}-{digest[:10]}"


def _install_middleware(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> list[Any]:
    """The body limit and request counting; returns the dependencies of the key-guarded routes."""
    app.add_middleware(
        BodyLimit, limit=settings.max_body_bytes, error=lambda status, message: APIError(status, message).response()
    )
    authorize = bearer_guard(
        settings.api_key,
        lambda message, headers: APIError(
            401, message, type="authentication_error", code="invalid_api_key", headers=headers
        ),
    )
    app.add_middleware(_CountRequests, metrics=metrics, routes=lambda: app.routes)
    # Open without a key: /health and /metrics (probes, scrapers) and the API's description
    # (/docs, /redoc, /openapi.json), which holds nothing the source does not.
    return [Depends(authorize)]
