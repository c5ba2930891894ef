"""``draftwise serve-verifier``: serve a target model to remote drafters.

Every flag comes from ``VerifierSettings`` (default and help text) through
``draftwise.cli.options.with_flags``, so the CLI and the library cannot drift apart; the one
shorter name is ``--idle-timeout`` (``idle_timeout_s``).
"""

from __future__ import annotations

from typing import Any

import typer

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
from draftwise.config import ModelOptions
from draftwise.remote.settings import API_KEY_ENV, VerifierSettings
from draftwise.scale import ServeScale

FLAGS = (
    Flags(
        VerifierSettings,
        include=(
            "target",
            "host",
            "port",
            "api_key",
            "max_sessions",
            "slots",
            "idle_timeout_s",
            "max_context",
            "max_block",
            "max_q_entries",
            "max_body_bytes",
        ),
        aliases={"idle_timeout_s": "idle_timeout"},
        options={"api_key": {"envvar": API_KEY_ENV}},
    ),
)
ALIASES = aliases_of(*FLAGS)
_ON_RAY = (
    "run on Ray Serve: replicas behind one endpoint, each session routed to the replica holding it, on a local "
    "Ray (127.0.0.1) or --ray-address (needs draftwise[ray])"
)


def register(app: typer.Typer) -> None:
    @app.command("serve-verifier")
    @with_model_options(skip=("draft_quant",))
    @with_cluster_options(ServeScale, _ON_RAY)
    @with_flags(*FLAGS)
    def serve_verifier(
        given: dict[Any, dict[str, Any]],
        models: ModelOptions = ModelOptions(),
        models_given: dict | None = None,
        ray: ServeScale | None = None,
    ) -> None:
        """Serve a target model as a remote verifier: drafters elsewhere send one request per block."""
        settings = built(VerifierSettings, aliases=ALIASES, **given[VerifierSettings], models=models, ray=ray)
        if settings.ray is not None:
            from draftwise.cluster.verifier import serve_verifier_on_ray

            warn_if_exposed(settings.host, settings.api_key)
            serve_verifier_on_ray(settings, log=note)
        else:
            _serve_here(settings)


def _serve_here(settings: VerifierSettings) -> None:
    """This process, on uvicorn."""
    import uvicorn

    from draftwise.prepare import prepare_pair
    from draftwise.remote.server import create_app

    # A slot for each session held at once. Nothing drafts here: with several slots only the
    # target's passes are timed, to size a long prompt's pieces beside other sessions' verifies.
    pair = prepare_pair(settings.target, None, settings.models, None, slots=settings.slots, log=note, pace=True)
    verifier = create_app(settings, pair.target, profile=pair.profile)
    warn_if_exposed(settings.host, settings.api_key)
    note(f"draftwise verifier: {settings.target} on http://{settings.host}:{settings.port} (API docs at /docs)")
    # uvicorn stops cleanly on Ctrl-C / SIGTERM (the lifespan closes every session) and
    # reports a port it cannot bind in one line.
    uvicorn.run(
        verifier,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        server_header=False,
        date_header=False,  # fewer bytes on every round trip
    )
