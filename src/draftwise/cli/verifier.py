"""``draftwise serve-verifier``: serve a target model to remote drafters.

Every flag comes from ``VerifierSettings`` (default and help text), so the CLI and the
library cannot drift apart.
"""

from __future__ import annotations

from typing import Optional

import typer

from draftwise.cli.options import field_option, warn_if_exposed
from draftwise.remote.settings import API_KEY_ENV, VerifierSettings


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join(f"--{'.'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}" for e in exc.errors())
    return str(exc)


def register(app: typer.Typer) -> None:
    @app.command("serve-verifier")
    def serve_verifier(
        target: str = field_option(VerifierSettings, "target"),
        dtype: str = field_option(VerifierSettings, "dtype"),
        threads: Optional[int] = field_option(VerifierSettings, "threads"),  # noqa: UP045 (typer needs Optional on 3.10)
        host: str = field_option(VerifierSettings, "host"),
        port: int = field_option(VerifierSettings, "port"),
        api_key: Optional[str] = field_option(VerifierSettings, "api_key", envvar=API_KEY_ENV, show_default=False),  # noqa: UP045
        max_sessions: int = field_option(VerifierSettings, "max_sessions"),
        idle_timeout_s: float = field_option(VerifierSettings, "idle_timeout_s", "--idle-timeout"),
        max_context: int = field_option(VerifierSettings, "max_context"),
        max_block: int = field_option(VerifierSettings, "max_block"),
        max_q_entries: int = field_option(VerifierSettings, "max_q_entries"),
        max_body_bytes: int = field_option(VerifierSettings, "max_body_bytes"),
    ) -> None:
        """Serve a target model as a remote verifier: drafters elsewhere send one request per block."""
        from pydantic import ValidationError

        from draftwise.loading import ModelLoadError

        values = dict(
            target=target, dtype=dtype, threads=threads, host=host, port=port, api_key=api_key,
            max_sessions=max_sessions, idle_timeout_s=idle_timeout_s, max_context=max_context,
            max_block=max_block, max_q_entries=max_q_entries, max_body_bytes=max_body_bytes,
        )
        try:
            settings = VerifierSettings(**values)
        except ValidationError as exc:
            typer.echo(f"error: {_one_line(exc)}", err=True)
            raise typer.Exit(2) from None

        import uvicorn

        from draftwise.remote.server import create_app

        try:
            verifier = create_app(settings)
        except ModelLoadError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        warn_if_exposed(settings.host, settings.api_key)
        typer.echo(f"draftwise verifier: {target} on http://{settings.host}:{settings.port} (API docs at /docs)",
                   err=True)
        # uvicorn stops cleanly on Ctrl-C / SIGTERM (the lifespan closes every session) and
        # reports a port it cannot bind in one line.
        uvicorn.run(
            verifier, host=settings.host, port=settings.port, log_level="warning", timeout_graceful_shutdown=5,
            server_header=False, date_header=False,  # fewer bytes on every round trip
        )
