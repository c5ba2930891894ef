"""From the records of finished runs to the numbers of the report.

Per (server, C): aggregate tokens/s (every completion token of the run over the run's wall
time, from the first request sent to the last stream ended), the median of each request's own
tokens/s (its completion tokens over its latency), decode-phase tokens/s (the tokens after each
request's first over the time after its first token, summed over the requests: prefill and
queueing left out; and, with a tokenizer, the text after the first chunk), time to first token
and latency at p50 and p95, the prediction tokens the server accepted and rejected (summed from
each answer's usage, where it reports them), and how many answers are identical to the same
request run alone (C = 1 on the same server). Percentiles interpolate linearly between the
nearest ranks.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from draftwise.loadbench.config import LLAMA_SERVERS

Record = dict[str, Any]
RunKey = tuple[str, int]  # (server, concurrency)
Count = Callable[[str], int]  # tokens of a text, where a server did not count them


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linear between ranks; None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = q / 100 * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Run:
    """A finished run: its own record and its requests' records."""

    record: Record
    requests: list[Record]

    @property
    def key(self) -> RunKey:
        return self.record["server"], self.record["concurrency"]


def runs_by_key(records: Iterable[Record], config_hash: str) -> dict[RunKey, list[Run]]:
    """The runs of this configuration that ended, each with its requests, by (server, C) in
    the order they ended; a run interrupted before its end left requests without a run record,
    which are left out."""
    runs: dict[str, Record] = {}
    requests: dict[str, list[Record]] = {}
    for record in records:
        if record.get("config_hash") != config_hash:
            continue
        if record["kind"] == "run":
            runs[record["run_id"]] = record
        elif record["kind"] == "request":
            requests.setdefault(record["run_id"], []).append(record)
    found: dict[RunKey, list[Run]] = {}
    for run_id, run in runs.items():  # the file's order
        found.setdefault((run["server"], run["concurrency"]), []).append(Run(run, requests.get(run_id, [])))
    return found


def last_runs(found: dict[RunKey, list[Run]]) -> dict[RunKey, Run]:
    """The last of each key's runs (``runs_by_key``): a later run of the same key wins."""
    return {key: runs[-1] for key, runs in found.items()}


def run_by_run(
    runs: dict[RunKey, list[Run]], servers: Sequence[str], count: Count | None = None
) -> list[dict[str, Any]]:
    """Per concurrency and server, the tok/s of each of its runs in the order they ran, and
    its ratio to the first of ``servers`` run for run (the n-th run of one against the n-th
    of the other, which ran next to it), each with its median.

    Example: servers A and B at C=4, runs A 10.0, B 11.0, then B 9.0, A 9.9 (the second pass
    reversed): B's tok/s [11.0, 9.0], median 10.0; B / A [1.1, 0.91], median 1.0.
    """
    rows = []
    for level in sorted({level for _, level in runs}):
        rates = {s: [summarize(run, None, count)["tok_s"] for run in runs.get((s, level), [])] for s in servers}
        base = rates[servers[0]]
        for server in servers:
            mine = rates[server]
            ratios = [r / b for r, b in zip(mine, base) if r is not None and b] if server != servers[0] else []
            rows.append(
                {
                    "server": server,
                    "concurrency": level,
                    "tok_s": mine,
                    "median_tok_s": statistics.median(mine) if None not in mine and mine else None,
                    "ratio_to": servers[0],
                    "ratios": ratios,
                    "median_ratio": statistics.median(ratios) if ratios else None,
                }
            )
    return rows


def tokens_of(request: Record, count: Count | None) -> int:
    if request.get("completion_tokens") is not None:
        return int(request["completion_tokens"])
    if count is None:
        raise ValueError(f"request {request['key']} has no token count and there is no tokenizer to count")
    return count(request["text"])


def alone_texts(runs: dict[RunKey, Run], server: str) -> dict[str, str] | None:
    """Each prompt's answer on ``server`` at C = 1 (the reference); None without that run."""
    alone = runs.get((server, 1))
    if alone is None:
        return None
    return {r["prompt_id"]: r["text"] for r in alone.requests if r["ok"]}


def decode_tok_s(requests: Sequence[Record], tokens: Sequence[int]) -> float | None:
    """``sum(tokens - 1) / sum(latency - ttft)`` over the requests that streamed a token
    (``tokens[i]``: request i's completion tokens); None where that time is 0."""
    phases = [(n - 1, r["latency_s"] - r["ttft_s"]) for n, r in zip(tokens, requests) if r["ttft_s"] is not None and n]
    seconds = sum(s for _, s in phases)
    return sum(n for n, _ in phases) / seconds if seconds > 0 else None


def decode_after_first_chunk(requests: Sequence[Record], count: Count | None) -> float | None:
    """The text after each request's first chunk, tokenized by ``count``, over the time after
    that chunk, summed over the requests; None without a tokenizer or such time.

    ``decode_tok_s`` counts every token of an answer but its first as decoded after the first
    chunk. Where a server streams a token a chunk, the two agree. Where a chunk carries a block
    (a pass's accepted tokens), or tokens without text came before it (a tool call's wrapper and
    name, before its first ``arguments`` text), that counts tokens made before the clock starts.
    Worked example: a tool call of 30 tokens whose first ``arguments`` chunk ends a 14-token
    opening, 1.0 s later the end: ``decode_tok_s`` reads 29 tok/s; if the text after that chunk
    is 16 tokens, this reads 16. It reads low where text was decoded in more tokens than the
    tokenizer cuts it into (newlines written one at a time), and by the tokens never streamed as
    text (markup, the end of turn).
    """
    if count is None:
        return None
    phases = [
        (count(r["text"][r["first_chunk_chars"] :]), r["latency_s"] - r["ttft_s"])
        for r in requests
        if r.get("first_chunk_chars") is not None and r["ttft_s"] is not None
    ]
    seconds = sum(s for _, s in phases)
    return sum(n for n, _ in phases) / seconds if seconds > 0 else None


def prediction_tokens(requests: Iterable[Record], field: str) -> int | None:
    """The sum of a usage count of the prediction (``accepted_prediction_tokens`` or
    ``rejected_prediction_tokens``) over the requests; None where no answer reported it."""
    counts = [int(r[field]) for r in requests if r.get(field) is not None]
    return sum(counts) if counts else None


def parsed_json(requests: Iterable[Record]) -> tuple[int, int] | None:
    """(answers that parse as one JSON value, answers) of the structured-output requests;
    None where there were none."""
    answers = [r["text"] for r in requests if r.get("structured")]
    if not answers:
        return None
    valid = 0
    for text in answers:
        try:
            json.loads(text)
        except ValueError:
            continue
        valid += 1
    return valid, len(answers)


def summarize(run: Run, alone: dict[str, str] | None, count: Count | None = None) -> dict[str, Any]:
    """One row of the report: the numbers of one (server, C)."""
    ok = [r for r in run.requests if r["ok"]]
    tokens = [tokens_of(r, count) for r in ok]
    wall = run.record["wall_s"]
    rates = [n / r["latency_s"] for n, r in zip(tokens, ok) if r["latency_s"] > 0]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    latency = [r["latency_s"] for r in ok]
    compared = identical = None
    if alone is not None and run.key[1] != 1:
        pairs = [(r["text"], alone[r["prompt_id"]]) for r in ok if r["prompt_id"] in alone]
        compared, identical = len(pairs), sum(a == b for a, b in pairs)
    return {
        "server": run.key[0],
        "concurrency": run.key[1],
        "requests": len(run.requests),
        "errors": len(run.requests) - len(ok),
        "completion_tokens": sum(tokens),
        "wall_s": wall,
        "tok_s": sum(tokens) / wall if wall > 0 else None,
        "request_tok_s_p50": percentile(rates, 50),
        "decode_tok_s": decode_tok_s(ok, tokens),
        "decode_after_first_chunk_tok_s": decode_after_first_chunk(ok, count),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "latency_p50_s": percentile(latency, 50),
        "latency_p95_s": percentile(latency, 95),
        "accepted_prediction_tokens": prediction_tokens(ok, "accepted_prediction_tokens"),
        "rejected_prediction_tokens": prediction_tokens(ok, "rejected_prediction_tokens"),
        "parsed_json": parsed_json(ok),
        "compared_to_alone": compared,
        "identical_to_alone": identical,
        "drafted": run.record.get("drafted"),  # {"proposed", "kept"}: what the server says it drafted
    }


@dataclass(frozen=True)
class Mismatch:
    """A loaded answer that differs from the same request's answer alone."""

    server: str
    concurrency: int
    prompt_id: str
    alone: str
    loaded: str


def mismatches(runs: dict[RunKey, Run]) -> list[Mismatch]:
    """Every answer at C > 1 that differs from its server's answer at C = 1."""
    found = []
    for (server, level), run in sorted(runs.items()):
        alone = alone_texts(runs, server)
        if alone is None or level == 1:
            continue
        for r in run.requests:
            if r["ok"] and r["prompt_id"] in alone and r["text"] != alone[r["prompt_id"]]:
                found.append(Mismatch(server, level, r["prompt_id"], alone[r["prompt_id"]], r["text"]))
    return found


def against_llama(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: draftwise's aggregate tokens/s over the best llama-server
    configuration's (None where either is missing)."""
    out = []
    for level in sorted({row["concurrency"] for row in rows}):
        at = {row["server"]: row for row in rows if row["concurrency"] == level}
        mine = at.get("draftwise", {}).get("tok_s")
        theirs = [(row["tok_s"], name) for name, row in at.items() if name in LLAMA_SERVERS and row["tok_s"]]
        best_tok_s, best = max(theirs) if theirs else (None, None)
        ratio = mine / best_tok_s if mine is not None and best_tok_s else None
        drafted = at[best].get("drafted") if best is not None else None
        out.append(
            {
                "concurrency": level,
                "draftwise_tok_s": mine,
                "best": best,
                "best_tok_s": best_tok_s,
                "ratio": ratio,
                "best_drafted": drafted,
            }
        )
    return out


# Requests by their place among their subtask's, in the order sent: the first of a sequence
# cannot draft from earlier answers, later ones can (``draftwise.suffix``).
TURNS = ("1", "2", "3+")


def turn_bucket(turn: int) -> str:
    return str(turn) if turn < len(TURNS) else TURNS[-1]


def by_turn(runs: dict[RunKey, Run], turns: dict[str, int], count: Count | None = None) -> list[dict[str, Any]]:
    """Per (server, C, subtask, turn bucket): the requests, their tokens over their summed
    latency (prefill included), and decode tokens/s; ``turns``: each prompt's place (1-based)
    among its subtask's."""
    rows = []
    for (server, level), run in sorted(runs.items()):
        ok = [r for r in run.requests if r["ok"]]
        for subtask in sorted({r["subtask"] for r in ok}):
            for bucket in TURNS:
                chosen = [
                    r for r in ok if r["subtask"] == subtask and turn_bucket(turns.get(r["prompt_id"], 1)) == bucket
                ]
                if not chosen:
                    continue
                tokens = [tokens_of(r, count) for r in chosen]
                latency = sum(r["latency_s"] for r in chosen)
                rows.append(
                    {
                        "server": server,
                        "concurrency": level,
                        "subtask": subtask,
                        "turn": bucket,
                        "requests": len(chosen),
                        "tok_s": sum(tokens) / latency if latency > 0 else None,
                        "decode_tok_s": decode_tok_s(chosen, tokens),
                    }
                )
    return rows
