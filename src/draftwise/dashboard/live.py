"""One streamed generation as the dashboard sees it: tokens with their provenance, and steps.

The API streams one chunk per target pass when provenance is on. Each chunk carries the
step's tokens (``provenance``: accepted draft tokens, then the target's correction or bonus)
and, from servers that send it, the step itself (``step``: the draft length asked for, every
proposed token with its probabilities, timings). Without ``step`` the model falls back to
what the tokens alone tell (k unknown, only the first rejected proposal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACCEPTED, CORRECTED, BONUS = "accepted", "corrected", "bonus"
PREDICTED = "predicted"  # an accepted token that a request's prediction drafted (shown apart)
PREDICTION_SOURCE = "prediction"  # the drafter source that drafts from a prediction
RECALLED = "recalled"  # an accepted token drafted from the server's earlier answers (shown apart)
SUFFIX_SOURCE = "suffix"  # the drafter source that drafts from earlier answers


@dataclass(frozen=True)
class DraftToken:
    """A token the drafter proposed and the target did not keep."""

    id: int
    text: str | None  # None when the server did not send it
    draft_prob: float | None
    target_prob: float | None
    checked: bool  # False: proposed after the first rejection, so thrown away unjudged


@dataclass
class TokenView:
    id: int
    text: str
    source: str  # accepted | corrected | bonus
    step: int
    drafted_by: str | None = None  # the drafter's source of an accepted token, where the server says
    draft_prob: float | None = None  # q(token): accepted draft tokens only
    target_prob: float | None = None  # p(token): accepted draft tokens only
    rejected: list[DraftToken] = field(default_factory=list)  # what a correction replaced, in order


@dataclass(frozen=True)
class StepView:
    index: int
    k: int | None  # draft length the policy asked for; None when the server does not report it
    proposed: int
    accepted: int
    emitted: int
    arrived: float  # seconds from sending the request to receiving this step
    engine_seconds: float | None  # the engine's own time for the step (prefill included on the first)
    expected: float | None = None  # tokens/s the policy expected of the arm it took
    expected_plain: float | None = None  # tokens/s it expected of plain decoding


def _draft_tokens(step: dict[str, Any], n_accepted: int) -> list[DraftToken]:
    return [
        DraftToken(
            id=p["id"],
            text=p.get("text"),
            draft_prob=p.get("draft_prob"),
            target_prob=p.get("target_prob"),
            checked=i == 0,
        )
        for i, p in enumerate(step.get("proposed", [])[n_accepted:])
    ]


def _expected(step: dict[str, Any] | None) -> dict[str, float | None]:
    """What the policy expected of the arm it took and of plain decoding (the step's ``arms``:
    the one taken first), where the server says."""
    arms = (step or {}).get("arms") or []
    plain = next((a["tokens_per_second"] for a in arms if a["source"] == "plain"), None)
    return {"expected": arms[0]["tokens_per_second"] if arms else None, "expected_plain": plain}


@dataclass
class LiveRun:
    """Everything received so far for one generation."""

    drafter: str
    tokens: list[TokenView] = field(default_factory=list)
    steps: list[StepView] = field(default_factory=list)
    text: str = ""
    stats: dict[str, Any] | None = None  # the server's speculation statistics (last chunk)
    finish_reason: str | None = None
    error: str | None = None

    def add_chunk(self, chunk: dict[str, Any], at: float) -> None:
        """Take in one SSE chunk received ``at`` seconds after the request was sent."""
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.text += choice.get("text") or delta.get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("speculative") is not None:
            self.stats = chunk["speculative"]
        provenance, step = chunk.get("provenance"), chunk.get("step")
        if provenance is None and step is None:
            return
        self._add_step(provenance or [], step, at)

    def _add_step(self, provenance: list[dict[str, Any]], step: dict[str, Any] | None, at: float) -> None:
        index = step["index"] if step else len(self.steps)
        n_accepted = step["n_accepted"] if step else sum(p["source"] == ACCEPTED for p in provenance)
        for item in provenance:
            token = TokenView(
                id=item["id"],
                text=item.get("text", ""),
                source=item["source"],
                step=index,
                draft_prob=item.get("draft_prob"),
                target_prob=item.get("target_prob"),
                drafted_by=step.get("source") if step and item["source"] == ACCEPTED else None,
            )
            if token.source == CORRECTED:
                if step is not None:
                    token.rejected = _draft_tokens(step, n_accepted)
                elif item.get("rejected"):
                    r = item["rejected"]
                    token.rejected = [
                        DraftToken(
                            id=r["id"],
                            text=r.get("text"),
                            draft_prob=r.get("draft_prob"),
                            target_prob=r.get("target_prob"),
                            checked=True,
                        )
                    ]
            self.tokens.append(token)
        if step is not None:
            proposed = len(step.get("proposed", []))
            seconds = (step.get("prefill_seconds") or 0.0) + (step.get("step_seconds") or 0.0)
            engine_seconds: float | None = seconds
        else:  # a lower bound: proposals after a rejection are not reported without ``step``
            proposed = n_accepted + any(p["source"] == CORRECTED for p in provenance)
            engine_seconds = None
        self.steps.append(
            StepView(
                index=index,
                k=step.get("k") if step else None,
                proposed=proposed,
                accepted=n_accepted,
                emitted=len(provenance),
                arrived=at,
                engine_seconds=engine_seconds,
                **_expected(step),
            )
        )

    # ---- what the page reports -----------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def passes(self) -> int:
        return len(self.steps)

    @property
    def proposed(self) -> int:
        return sum(s.proposed for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def count(self, source: str) -> int:
        return sum(t.source == source for t in self.tokens)

    @property
    def wall_rate(self) -> float:
        """Tokens per second as the client saw them arrive (HTTP and queueing included)."""
        last = self.steps[-1].arrived if self.steps else 0.0
        return len(self.tokens) / last if last > 0 else 0.0

    @property
    def engine_seconds(self) -> float | None:
        """The engine's own time so far (prefill and steps); None when the server does not report it."""
        times = [s.engine_seconds for s in self.steps]
        return sum(times) if times and None not in times else None  # type: ignore[arg-type]

    @property
    def tokens_per_second(self) -> float:
        """The engine's own rate (the fair number to compare runs by: no HTTP, no page drawing),
        from the server's final statistics or the steps so far; else the rate seen by the client."""
        if self.stats and self.stats.get("tokens_per_second"):
            return float(self.stats["tokens_per_second"])
        seconds = self.engine_seconds
        if seconds:
            return len(self.tokens) / seconds
        return self.wall_rate


@dataclass(frozen=True)
class Comparison:
    speculative_rate: float
    plain_rate: float
    speedup: float | None
    identical: bool
    first_difference: int | None  # index of the first differing token; None when identical


def compare(speculative: LiveRun, plain: LiveRun) -> Comparison:
    """The same prompt with and without speculation: rates, speedup, same tokens or not."""
    a, b = speculative.token_ids, plain.token_ids
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    spec_rate, plain_rate = speculative.tokens_per_second, plain.tokens_per_second
    return Comparison(
        speculative_rate=spec_rate,
        plain_rate=plain_rate,
        speedup=spec_rate / plain_rate if plain_rate > 0 else None,
        identical=first is None,
        first_difference=first,
    )
