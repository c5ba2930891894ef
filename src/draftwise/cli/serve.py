"""``draftwise serve``: the OpenAI-compatible server (FastAPI on uvicorn).

Flags map one to one onto ``ServerSettings`` (and its ``GenerationConfig`` of request
defaults); their help texts are those fields' descriptions.
"""

from __future__ import annotations

import typer

from draftwise.api.settings import ServerSettings
from draftwise.cli.options import field_option, note, warn_if_exposed, with_cluster_options, with_model_options
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions
from draftwise.errors import built
from draftwise.prepare import recommended
from draftwise.registry import DEFAULT_TARGET
from draftwise.serving import API_KEY_ENV, ServeScale

_ON_RAY = (
    "run on Ray Serve: replicas behind one endpoint, on a local Ray (127.0.0.1) or --ray-address (needs draftwise[ray])"
)
_DRAFTER = typer.Option(
    None,
    help="default drafter of requests: model, ngram, hybrid or off; default: the registry's recommendation for the "
    "target (model with --draft)",
)


@with_model_options()
@with_cluster_options(ServeScale, _ON_RAY)
def serve(
    target: str = typer.Option(DEFAULT_TARGET, help=ServerSettings.model_fields["target"].description),
    draft: str | None = field_option(ServerSettings, "draft"),
    drafter: str | None = _DRAFTER,
    host: str = field_option(ServerSettings, "host"),
    port: int = field_option(ServerSettings, "port"),
    slots: int = field_option(ServerSettings, "slots", "--slots", "--workers"),
    queue_size: int = field_option(ServerSettings, "queue_size"),
    request_timeout: float = field_option(ServerSettings, "request_timeout", "--timeout"),
    max_context: int | None = field_option(ServerSettings, "max_context"),
    max_tokens: int = field_option(
        GenerationConfig, "max_new_tokens", "--max-tokens", help="default max_tokens of a request"
    ),
    k_policy: str = field_option(DraftConfig, "k_policy"),
    k: int = field_option(DraftConfig, "k"),
    model_name: str | None = field_option(ServerSettings, "model_name"),
    api_key: str | None = field_option(ServerSettings, "api_key", envvar=API_KEY_ENV, show_default=False),
    max_body_bytes: int = field_option(ServerSettings, "max_body_bytes"),
    parse_special: bool = field_option(ServerSettings, "parse_special"),
    models: ModelOptions = ModelOptions(),
    models_given: dict | None = None,
    ray: ServeScale | None = None,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) with speculation,
    plus /metrics (Prometheus), /health and /docs; with --ray, as replicas on Ray Serve."""
    if draft is None and drafter is None:
        draft, drafter = recommended(target)
    generation = built(GenerationConfig, max_new_tokens=max_tokens, draft=built(DraftConfig, k_policy=k_policy, k=k))
    settings = built(
        ServerSettings,
        target=target,
        draft=draft,
        drafter=drafter,
        host=host,
        port=port,
        slots=slots,
        queue_size=queue_size,
        request_timeout=request_timeout,
        max_context=max_context,
        model_name=model_name,
        models=models,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        parse_special=parse_special,
        ray=ray,
        generation=generation,
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
    # Loaded with the app's slots and handed over (own): each worker takes one of them.
    pair = prepare_pair(
        settings.target, settings.draft, settings.models, settings.generation.draft, slots=settings.slots, log=note
    )
    server = create_app(settings, pair, own=True)
    note(
        f"serving {settings.served_model} (drafter: {settings.default_drafter}) on "
        f"http://{settings.host}:{settings.port}  (docs: /docs, metrics: /metrics)"
    )
    uvicorn.run(server, host=settings.host, port=settings.port, log_level="info")
