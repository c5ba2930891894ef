"""``draftwise serve``: flags, defaults and one-line errors (no server is started)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytest.importorskip("fastapi")

from draftwise.cli import build_app
from draftwise.prepare import recommended


def test_serve_defaults_follow_the_registry():
    assert recommended("qwen2.5-coder-1.5b") == ("qwen2.5-coder-0.5b", "hybrid")
    assert recommended("smollm2-135m") == (None, "ngram")
    assert recommended("tiny:0") == (None, "ngram")


def test_serve_help_lists_the_settings():
    result = CliRunner().invoke(build_app(), ["serve", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--target",
        "--draft",
        "--drafter",
        "--slots",
        "--workers",
        "--queue-size",
        "--timeout",
        "--max-tokens",
    ):
        assert flag in result.output


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--target", "tiny:0", "--slots", "0"], 2, "slots"),
        (["--target", "tiny:0", "--workers", "0"], 2, "slots"),  # the old name of --slots
        (["--target", "tiny:0", "--drafter", "model"], 2, "--drafter model needs --draft: no draft model is known"),
        (["--target", "tiny:0", "--drafter", "magic"], 2, "drafter"),
        (["--target", "/nonexistent/model.gguf", "--drafter", "ngram"], 2, "no such file"),
    ],
)
def test_serve_mistakes_are_one_line_errors(args, code, says):
    result = CliRunner().invoke(build_app(), ["serve", *args])
    assert result.exit_code == code
    assert says in result.output
    assert "Traceback" not in result.output
