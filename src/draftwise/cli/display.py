"""What ``draftwise generate`` shows: each token coloured by where it came from, then the
metrics (a table, or with ``--json`` one machine-readable object).

``TokenColours`` colours the text as the run streams it; ``report`` prints what the run did
(and with ``--compare``, the plain target's run beside it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rich.console import Console

    from draftwise.config import GenerationConfig
    from draftwise.engine import GenerationResult
    from draftwise.lm import Tokenizer
    from draftwise.metrics import GenerationMetrics

STYLES = {"accepted": "green", "corrected": "red", "bonus": "cyan"}
LEGEND = "[green]accepted draft token[/] · [red]target correction[/] · [cyan]bonus token[/]"


class TokenColours:
    """Maps the text a step releases onto the tokens it came from, for colouring.

    The engine releases text per step (held back around stop strings and split characters),
    so each token's own piece is decoded here, in a short window of preceding tokens for
    tokenizers that render a leading space by context. Released characters take the colour
    of the token they came from; only colours depend on this, never the text itself.
    """

    WINDOW = 4  # tokens of context each piece is decoded in

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.styles: list[str] = []  # one style per decoded character not yet printed
        self._held: list[int] = []  # tokens ending in an incomplete character

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, tokens: list[int], sources: list[Any]) -> None:
        for token, source in zip(tokens, sources):
            context = self.tokens[-self.WINDOW :]
            piece = self._decode(context + self._held + [token])[len(self._decode(context)) :]
            if piece.endswith("\ufffd"):
                self._held.append(token)
                continue
            self.tokens += self._held + [token]
            self._held = []
            self.styles += [STYLES[source.value]] * len(piece)

    def render(self, text: str):
        """``text`` (the next released characters) as a rich Text, coloured per token."""
        from rich.text import Text

        out = Text()
        styles, self.styles = self.styles[: len(text)], self.styles[len(text) :]
        styles += [""] * (len(text) - len(styles))
        for char, style in zip(text, styles):
            out.append(char, style=style or None)
        return out


def stats_table(metrics: GenerationMetrics, title: str):
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    total = metrics.total_seconds or 1.0
    rows = [
        ("tokens", f"{metrics.new_tokens}"),
        ("tokens/s", f"{metrics.tokens_per_second:.2f}"),
        ("target passes", f"{metrics.target_passes}"),
        ("acceptance rate", f"{metrics.acceptance_rate:.1%} ({metrics.accepted}/{metrics.proposed})"),
        ("mean accepted length", f"{metrics.mean_accepted_length:.2f} tokens/pass"),
        ("total time", f"{metrics.total_seconds:.2f} s"),
    ]
    for name in ("prefill", "draft", "verify", "other"):
        seconds = getattr(metrics, f"{name}_seconds")
        rows.append((f"  {name}", f"{seconds:.2f} s ({seconds / total:.0%})"))
    for row in rows:
        table.add_row(*row)
    return table


def report(
    result: GenerationResult,
    baseline: GenerationResult | None,
    config: GenerationConfig,
    label: str,
    run: dict[str, Any],
    as_json: bool,
    out: Console,
) -> None:
    if as_json:
        payload = {
            **run,
            "config": config.model_dump(mode="json"),
            "prompt_tokens": len(result.prompt_ids),
            "text": result.text,
            "tokens": result.tokens,
            "metrics": result.metrics.to_dict(),
        }
        if baseline is not None:
            payload["compare"] = {
                "text": baseline.text,
                "tokens": baseline.tokens,
                "metrics": baseline.metrics.to_dict(),
                "speedup": speedup(result, baseline),
                "identical": baseline.tokens == result.tokens,
            }
        typer.echo(json.dumps(payload))
        return
    out.print()
    out.print(stats_table(result.metrics, f"speculative: {label}"))
    if baseline is not None:
        out.print(stats_table(baseline.metrics, f"plain target: {run['target']}"))
        same = "identical" if baseline.tokens == result.tokens else "different"
        note = "" if config.sampling.greedy or same == "identical" else " (expected when sampling)"
        out.print(
            f"[bold]speedup {speedup(result, baseline):.2f}x[/] (tokens/s, speculative vs plain); "
            f"outputs token-for-token {same}{note}"
        )


def speedup(result: GenerationResult, baseline: GenerationResult) -> float:
    base = baseline.metrics.tokens_per_second
    return result.metrics.tokens_per_second / base if base else 0.0
