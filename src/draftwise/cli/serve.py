"""``draftwise serve``: the OpenAI-compatible server (FastAPI on uvicorn).

Flags derive from ``ServerSettings`` (and its ``GenerationConfig`` of request defaults) through
``draftwise.cli.options.with_flags``; their help texts are those fields' descriptions. Shorter
names: ``--timeout`` (``request_timeout``), ``--max-tokens`` (``max_new_tokens``).
"""

from __future__ import annotations

from typing import Any

import typer

from draftwise.api.settings import ServerSettings
from draftwise.cli.options import (
    Flags,
    aliases_of,
    built,
    note,
    warn_if_exposed,
    with_cluster_options,
    with_flags,
    with_model_options,
)
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, PacingConfig, SuffixConfig
from draftwise.prepare import choose_drafter
from draftwise.registry import DEFAULT_TARGET
from draftwise.scale import API_KEY_ENV, ServeScale

_ON_RAY = (
    "run on Ray Serve: replicas behind one endpoint, on a local Ray (127.0.0.1) or --ray-address (needs draftwise[ray])"
)
FLAGS = (
    Flags(
        ServerSettings,
        include=(
            "target",
            "draft",
            "drafter",
            "host",
            "port",
            "slots",
            "queue_size",
            "request_timeout",
            "max_context",
            "model_name",
            "api_key",
            "max_body_bytes",
            "parse_special",
        ),
        aliases={"request_timeout": "timeout"},
        also={"slots": ("--workers",)},  # the old name of --slots
        defaults={"target": DEFAULT_TARGET},
        help={
            "drafter": "default drafter of requests: model, ngram, hybrid or off; default: the registry's "
            "recommendation for the target (hybrid with --draft); model or hybrid without --draft take the "
            "registry's draft, as generate does",
        },
        options={"api_key": {"envvar": API_KEY_ENV}},
    ),
    Flags(
        GenerationConfig,
        include=("max_new_tokens",),
        aliases={"max_new_tokens": "max_tokens"},
        help={"max_new_tokens": f"default max_tokens of a request; default: {GenerationConfig().max_new_tokens}"},
    ),
    Flags(DraftConfig, include=("k_policy", "k")),
    Flags(PacingConfig, include=("piece_seconds",)),
    Flags(
        SuffixConfig,
        include=("scope", "cap_tokens", "cache"),
        aliases={"scope": "suffix_scope", "cap_tokens": "suffix_cap", "cache": "suffix_cache"},
    ),
)
ALIASES = aliases_of(*FLAGS)


@with_model_options()
@with_cluster_options(ServeScale, _ON_RAY)
@with_flags(*FLAGS)
def serve(
    given: dict[Any, dict[str, Any]],
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
    ray: ServeScale | None = None,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with speculation,
    plus /metrics (Prometheus), /health and /docs; with --ray, as replicas on Ray Serve."""
    server = dict(given[ServerSettings])
    server["draft"], server["drafter"] = choose_drafter(server["target"], server.get("draft"), server.get("drafter"))
    draft = built(DraftConfig, aliases=ALIASES, **given[DraftConfig])
    generation = built(GenerationConfig, aliases=ALIASES, **given[GenerationConfig], draft=draft)
    pacing = built(PacingConfig, aliases=ALIASES, **given[PacingConfig])
    suffix = built(SuffixConfig, aliases=ALIASES, **given[SuffixConfig])
    settings = built(
        ServerSettings,
        aliases=ALIASES,
        **server,
        models=models,
        ray=ray,
        generation=generation,
        pacing=pacing,
        suffix=suffix,
    )
    warn_if_exposed(settings.host, settings.api_key)
    if settings.ray is not None:
        from draftwise.cluster.serve_app import serve_on_ray

        serve_on_ray(settings, log=note)
    else:
        _serve_here(settings)


def register(app: typer.Typer) -> None:
    app.command()(serve)


def _serve_here(settings: ServerSettings) -> None:
    """This process, on uvicorn."""
    import uvicorn

    from draftwise.api.app import create_app
    from draftwise.prepare import prepare_pair

    note(f"loading {settings.target}" + (f" and draft {settings.draft}" if settings.draft else "") + " ...")
    # Loaded with the app's slots and handed over: each request in flight takes one of them.
    pair = prepare_pair(
        settings.target, settings.draft, settings.models, settings.generation.draft, slots=settings.slots, log=note
    )
    server = create_app(settings, pair, log=note)
    note(
        f"serving {settings.served_model} (drafter: {settings.default_drafter}) on "
        f"http://{settings.host}:{settings.port}  (docs: /docs, metrics: /metrics)"
    )
    uvicorn.run(server, host=settings.host, port=settings.port, log_level="info")
