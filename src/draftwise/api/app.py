"""The OpenAI-compatible HTTP app: ``create_app(settings, pair)`` builds it over a prepared pair
(``draftwise.prepare.prepare_pair``), uvicorn serves it. Here: the factory and the routes it
adds (OpenAI's under ``/v1`` and without it, and the open ``/health`` and ``/metrics``).

The parts it puts together: ``service`` (the request handling behind the generation routes,
over ``pool``'s slots), ``middleware`` (body limit, key guard, request counting, the JSON body
check), ``openapi`` (what ``/openapi.json`` says beyond the routes).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from draftwise.api import responses as r, schemas as s
from draftwise.api.errors import install_handlers
from draftwise.api.middleware import JsonBodyRoute, install_middleware
from draftwise.api.monitoring import ServerMetrics
from draftwise.api.openapi import GUARDED, UNKNOWN_MODEL, complete, generation_responses
from draftwise.api.pool import SlotPool, build_slots
from draftwise.api.service import Service
from draftwise.api.settings import ServerSettings
from draftwise.api.shapes import ChatShape, CompletionShape
from draftwise.api.translate import encode_chat, encode_completion
from draftwise.errors import ModelLoadError
from draftwise.prepare import Pair
from draftwise.suffix import SuffixStore, vocabulary_digest
from draftwise.web import error_responses


def create_app(settings: ServerSettings, pair: Pair, log: Callable[[str], None] = lambda line: None) -> FastAPI:
    """Build the server's web parts over a pair prepared for it (``draftwise.prepare``: loaded
    with ``settings.slots`` slots, warmed up, its costs measured for the cost policy); nothing
    is loaded here. The app takes the pair's models: the first of the ``settings.slots``
    slots runs on them, each other one on forks of them (shared weights, KV caches of their
    own). A caller that goes on using its models hands over ``pair.fork()``. ``log`` hears
    what the server's start and end say in a line (a suffix cache it could not read)."""
    from draftwise import __version__

    if pair.target.tokenizer is None:
        raise ModelLoadError(f"the target model {settings.target!r} has no tokenizer; the server needs one")
    metrics = ServerMetrics()
    # A ``Pair`` does not say how many slots its models were loaded for, so the count is the
    # settings' own, the one ``prepare_pair`` was given.
    suffix, cache = SuffixStore(settings.suffix), settings.suffix.cache
    # Names the target's vocabulary in the cache file: read only where there is one.
    vocabulary = vocabulary_digest(pair.target.tokenizer) if cache is not None else ""
    if cache is not None:
        problem = suffix.load(cache, vocabulary)
        if problem is not None:
            log(problem)
    slots = build_slots(pair.target, pair.draft, settings.slots, pair.profile, suffix)
    pool = SlotPool(slots, settings.queue_size, settings.request_timeout, metrics, settings.pacing)
    metrics.watch_rounds(pool.scheduler.stats)
    metrics.watch_suffix(suffix)
    service = Service(settings, pair.target, pair.draft is not None, pool, metrics, slots[0].grammars)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.close()
        service.text_work.shutdown(wait=False, cancel_futures=True)
        if cache is not None:
            try:
                suffix.save(cache, vocabulary)
            except OSError as exc:
                log(f"suffix cache {cache} not written: {exc}")

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
    guarded = install_middleware(app, settings, metrics)
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
                route_class_override=JsonBodyRoute,
                include_in_schema=documented,
                **options,
            )
        return handler

    return register


def _add_v1_routes(app: FastAPI, service: Service, guarded: list[Any], fingerprint: str) -> None:
    """OpenAI's routes: completions, chat completions and models, each also without ``/v1``.
    (Added to ``app`` itself, not through a router: request counting names endpoints by
    ``app.routes``.)"""
    completion_shape, chat_shape = CompletionShape(fingerprint), ChatShape(fingerprint)

    @_openai_route(
        app,
        "POST",
        "/completions",
        dependencies=guarded,
        response_model=r.CompletionResponse,
        responses=generation_responses(r.CompletionChunk),
    )
    async def completions(body: s.CompletionRequest, http: Request) -> Any:
        """Complete a prompt (OpenAI `completions`); `stream: true` answers with SSE chunks."""
        service.check_model(body.model)
        parse_special = service.settings.parse_special
        encoded = await service.encode(
            body, lambda limit: encode_completion(body, service.tokenizer, service.vocab_size, parse_special, limit)
        )
        return await service.generate(body, encoded, completion_shape, http)

    @_openai_route(
        app,
        "POST",
        "/chat/completions",
        dependencies=guarded,
        response_model=r.ChatCompletionResponse,
        responses=generation_responses(r.ChatCompletionChunk),
    )
    async def chat_completions(body: s.ChatCompletionRequest, http: Request) -> Any:
        """Answer a conversation with the target's chat template (OpenAI `chat.completions`)."""
        service.check_model(body.model)
        encoded = await service.encode(body, lambda limit: encode_chat(body, service.tokenizer, limit))
        return await service.generate(body, encoded, chat_shape, http)

    _add_model_routes(app, service, guarded)


def _add_model_routes(app: FastAPI, service: Service, guarded: list[Any]) -> None:
    """OpenAI's model listing, also without ``/v1``."""

    def card() -> r.ModelCard:
        return r.ModelCard(id=service.settings.served_model, created=service.created)

    @_openai_route(
        app,
        "GET",
        "/models",
        dependencies=guarded,
        response_model=r.ModelList,
        responses=error_responses(r.ErrorResponse, GUARDED),
    )
    async def models() -> r.ModelList:
        """The served model."""
        return r.ModelList(data=[card()])

    @_openai_route(
        app,
        "GET",
        "/models/{model:path}",
        dependencies=guarded,
        response_model=r.ModelCard,
        responses=error_responses(r.ErrorResponse, {**GUARDED, **UNKNOWN_MODEL}),
    )
    async def model_info(model: str) -> r.ModelCard:
        service.check_model(model)
        return card()


def _add_status_routes(app: FastAPI, service: Service) -> None:
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
