"""``draftwise generate``: run speculation on a prompt and show what it did."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def generate(
        prompt: str = typer.Argument(..., help="the prompt text"),
        target: str = typer.Option("tiny:0", help="target model source"),
        draft: str = typer.Option("tiny:0", help="draft model source"),
        max_new_tokens: int = typer.Option(64, help="tokens to generate at most"),
    ) -> None:
        """Generate text with speculative decoding (placeholder until the CLI issue lands)."""
        from draftwise.config import GenerationConfig
        from draftwise.engine import SpeculativeEngine
        from draftwise.loading import load_lm

        engine = SpeculativeEngine.from_models(load_lm(target), load_lm(draft))
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens))
        typer.echo(result.text)
