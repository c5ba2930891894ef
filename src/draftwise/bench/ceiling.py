"""The copy ceiling: the most that drafting from earlier text could give a workload on a host.

A drafter that copies (n-gram lookup in the prompt, the suffix store's earlier answers) can
propose, at a position of an answer, at most the run of the answer from there
that is already written somewhere, token for token: in the earlier requests' prompts and
answers, in its own prompt, or earlier in its own answer. Were it to propose exactly those
runs, each kept whole, in the blocks the host's pass curve makes fastest, it would decode the
answer at the ceiling computed here; no drafter of those sources does better on that host. Set
beside a speed goal, the ceiling says whether the goal can be met on the host at all, or only
by a better drafter (``draftwise replay --answers``; docs/speed.md).

Example: with passes of 1, 2, 3 and 4 rows at 1, 1.5, 1.8 and 2.4 units, and the answer
``a b c d`` whose runs found earlier are ``[3, 2, 1, 0]`` (``a b c`` was written before, ``d``
nowhere), the fastest is one block: ``a b c`` drafted and verified in a pass of 4 rows whose
last row gives ``d``, 2.4 units against 4 plain, 1.67x. Drafting ``a b`` first would cost 1.8
for 3 tokens and a step for ``d``: 2.8.

With a draft model that is always right (``Oracle``), a block may also go on past the run found
earlier, each of its further tokens at the model's price for a drafted token, its catch-up left
out. That bounds what copying and that draft model together could give on the host: a goal
above it needs a cheaper drafter than the model, or another host.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from draftwise.bench.replay import Recording, walk
from draftwise.config import GenerationConfig, SuffixConfig
from draftwise.drafters import LOOKUP_MIN_N, NGramDrafter, Sources
from draftwise.errors import ConfigError
from draftwise.suffix import SuffixStore

# The request of a sequence from which the ceiling is taken: the first has no earlier answer to
# copy, the second one, and from the third on a workload shows what repeating itself earns.
CEILING_FROM = 3


def copyable(answer: Sequence[int], earlier: Sequence[Sequence[int]], longest: int) -> list[int]:
    """At each position ``i`` of ``answer``, the length of the longest run ``answer[i:i + n]``
    (``n <= longest``) found whole in one of the ``earlier`` texts or in ``answer[:i]`` (a copy
    of the answer itself must be written before it is drafted)."""
    starts: dict[tuple[int, int], list[tuple[Sequence[int], int]]] = {}
    for text in earlier:
        for p in range(len(text) - 1):
            starts.setdefault((text[p], text[p + 1]), []).append((text, p))
    tokens = {t for text in earlier for t in text}
    runs = []
    for i, token in enumerate(answer):
        best = 1 if token in tokens or token in answer[:i] else 0
        pair = tuple(answer[i : i + 2])
        found = starts.get((pair[0], pair[1]), []) if len(pair) == 2 else []
        own = [(answer, p) for p in range(i - 1) if len(pair) == 2 and tuple(answer[p : p + 2]) == pair]
        for number, (text, p) in enumerate([*found, *own]):
            top = min(longest, len(answer) - i, len(text) - p, i - p if number >= len(found) else longest)
            n = 2
            while n < top and text[p + n] == answer[i + n]:
                n += 1
            best = max(best, min(n, top))
        runs.append(min(best, longest))
    return runs


@dataclass(frozen=True)
class Oracle:
    """A draft model that is always right: ``block`` tokens at most past a copied run, each at
    ``token_seconds`` (the host profile's price of a drafted token), in blocks of at most
    ``largest`` tokens in all (the longest a pass verifies)."""

    token_seconds: float
    block: int
    largest: int


def fastest(runs: Sequence[int], seconds: Callable[[int], float], oracle: Oracle | None = None) -> float:
    """The least time to decode an answer whose position ``i`` may start a block of up to
    ``runs[i]`` drafted tokens, all kept: one-row steps and blocks of ``k`` tokens verified in
    a pass of ``k + 1`` rows (``seconds(rows)``), chosen by a dynamic program over positions
    (the pass's last row is the target's own token, so a block ends before the answer does).
    With an ``oracle``, a block may hold up to ``oracle.block`` tokens more, at its price."""
    n = len(runs)
    price = 0.0 if oracle is None else oracle.token_seconds
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        best[i] = seconds(1) + best[i + 1]
        top = runs[i] if oracle is None else max(runs[i], min(runs[i] + oracle.block, oracle.largest))
        for k in range(1, min(top, n - i - 1) + 1):
            best[i] = min(best[i], seconds(k + 1) + max(0, k - runs[i]) * price + best[i + k + 1])
    return best[0]


@dataclass(frozen=True)
class Ceiling:
    """Answers' tokens, their plain decoding time and the copy ceiling's, on one host."""

    answers: int
    tokens: int
    plain_seconds: float
    seconds: float
    oracle_seconds: float | None = None  # with a draft model always right beside the copies

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds > 0 else 1.0

    @property
    def oracle_speedup(self) -> float | None:
        if self.oracle_seconds is None:
            return None
        return self.plain_seconds / self.oracle_seconds if self.oracle_seconds > 0 else 1.0


def copy_ceiling(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]],
    seconds: Callable[[int], float],
    longest: int,
    start: int,
    oracle: Oracle | None = None,
) -> Ceiling:
    """The ceiling of a sequence of requests, ``turns`` as (prompt, answer) in the order sent,
    over its answers from the ``start``-th (1-based) on: each may copy from every prompt and
    answer before it and from its own prompt; and, given an ``oracle``, the same with it."""
    earlier: list[Sequence[int]] = []
    answers = tokens = 0
    plain = fast = 0.0
    with_oracle = None if oracle is None else 0.0
    for turn, (prompt, answer) in enumerate(turns, 1):
        if turn >= start:
            runs = copyable(answer, [*earlier, prompt], longest)
            answers, tokens = answers + 1, tokens + len(answer)
            plain += len(answer) * seconds(1)
            fast += fastest(runs, seconds)
            if with_oracle is not None:
                with_oracle += fastest(runs, seconds, oracle)
        earlier += [prompt, answer]
    return Ceiling(answers, tokens, plain, fast, with_oracle)


def host_limit(seconds: Callable[[int], float], largest: int) -> float:
    """The most drafting can give on the host, were every drafted token kept: the best rows
    per plain step over passes of every size up to ``largest`` rows of a profile's curve
    (``draftwise.bench.curve.sure_limit`` picks the same among the sizes a curve timed)."""
    return max(rows * seconds(1) / seconds(rows) for rows in range(1, largest + 1))


def answered(results: Path, server: str) -> dict[str, str]:
    """The answers ``server`` gave at one client in a ``draftwise load`` run (its
    ``results.jsonl``), by prompt id: the last run's where it ran more than once."""
    try:
        lines = results.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--answers: cannot read {results}: {exc.strerror}") from None
    found: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line) if line.strip() else {}
        except json.JSONDecodeError:
            raise ConfigError(f"--answers: {results}:{number} is not JSON (a draftwise load results.jsonl?)") from None
        if record.get("kind") == "request" and record.get("server") == server and record.get("concurrency") == 1:
            if record.get("ok") and isinstance(record.get("text"), str):
                found[str(record["prompt_id"])] = record["text"]
    if not found:
        raise ConfigError(f"--answers: {results} holds no answer of {server} at one client (see --answers-of)")
    return found


def suffix_recordings(
    turns: Sequence[tuple[Sequence[int], Sequence[int]]], config: GenerationConfig, suffix: SuffixConfig
) -> list[Recording]:
    """What prompt lookup and the suffix source, over the answers before each, would draft along
    each answer of a sequence (``replay``'s recordings, without a model: a draft model's offers
    are left out), the answers added to one scope of a store in turn, as a server adds them."""
    store, scope = SuffixStore(suffix), "replay"
    recordings = []
    for n, (prompt, answer) in enumerate(turns, 1):
        drafter = Sources((NGramDrafter(min_n=LOOKUP_MIN_N), store.drafter(scope)))
        recordings.append(walk(drafter, prompt, answer, config, prompt_id=str(n)))
        store.add(scope, prompt, answer)
    return recordings
