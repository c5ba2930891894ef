"""How fast could any lossless method decode these answers on this host, drafting only what is
known before the target speaks? A bound from this host's pass costs, beside draftwise's own runs.

For each task (a JSON-schema extraction or a tool call, `benchmarks/data/*.jsonl`, or with
``load:SUBTASKS`` the prompts `draftwise load` sends) it
1. decodes the answer with the target alone (under the task's grammar, token by token: the
   output every lossless method must give), timed; then again with the grammar's forced text and
   n-gram lookup under the cost policy (`NGramDrafter`), timed, and compares the tokens;
2. marks what an oracle drafter could know at each position without the model: a token the
   grammar forces there (`compute_ff_tokens` in the state before it), or a token that continues
   a copy from the context (prompt and answer so far) after a match of the ``N`` tokens before
   it (``MATCHES``; the oracle picks the best occurrence, which no n-gram drafter knows);
3. cuts the answer into target passes as cheaply as the pass curve timed here allows: a pass
   feeds the last token and a block of known tokens and gains the target's token after them, so
   from position i a pass over b known tokens costs T(b + 1) and moves to i + b + 1 (a dynamic
   programme over the answer, every block accepted, drafting free).

Rates are every token of the answer over the time after the prompt's prefill; the oracle's
against the same tokens at T(1) each (one-token decoding on the same kernels), and end to end
with the plain run's prefill added to both sides.

    python benchmarks/ceiling_amd/ceiling.py benchmarks/data/extraction.jsonl --out extraction.json
    python benchmarks/ceiling_amd/ceiling.py load:rag --limit 8 --out rag.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple

from draftwise.api import schemas as s
from draftwise.api.translate import encode_chat, encode_completion, grammar_spec
from draftwise.cli.options import built
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions
from draftwise.costs import time_passes
from draftwise.drafters import NGramDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.lm import LanguageModel
from draftwise.loadbench.config import LoadConfig
from draftwise.loadbench.prompts import STRUCTURED_FIELDS, load_prompts
from draftwise.loading import load_lm
from draftwise.prepare import prepare

MAX_ROWS = 64  # the largest pass timed (the verifier's blocks stay below it)
REPEATS = 3  # each size's time is the fastest of this many passes


def curve(lm: LanguageModel, context: list[int]) -> dict[int, float]:
    """Seconds of a pass scoring all of its ``n`` rows after ``context`` (its first 1,024 tokens),
    n = 1 .. MAX_ROWS, the fastest of REPEATS."""
    return time_passes(lm, range(1, MAX_ROWS + 1), context[:1024], REPEATS)


# The copy oracles: 0 drafts forced tokens only; N also copies after a match of N tokens.
MATCHES = (0, 3, 1)


class Engines(NamedTuple):
    plain: SpeculativeEngine  # the target alone: token-by-token constrained decoding
    ngram: SpeculativeEngine  # the grammar's forced text and n-gram lookup, with the cost policy


def forced_flags(engine: SpeculativeEngine, config: GenerationConfig, answer: list[int]) -> list[bool]:
    """Whether the grammar forces each token of ``answer`` given the tokens before it."""
    if config.grammar is None:
        return [False] * len(answer)
    assert engine.grammars is not None
    constraint = engine.grammars.constraint(config.grammar)
    flags = []
    for token in answer:
        forced = constraint.forced()
        flags.append(bool(forced) and forced[0] == token)
        constraint.commit([token])
    return flags


def copy_lengths(prompt: list[int], answer: list[int], match: int) -> list[int]:
    """For each position j of ``answer``: the longest run answer[j:j+L] that follows, somewhere in
    the context before j, an occurrence of the ``match`` tokens just before j."""
    lengths = []
    for j in range(len(answer)):
        context = prompt + answer[:j]
        last, best = context[-match:], 0
        for p in range(match, len(context)):
            if context[p - match : p] != last:
                continue
            n = 0
            while j + n < len(answer) and p + n < len(context) and context[p + n] == answer[j + n]:
                n += 1
            best = max(best, n)
        lengths.append(best)
    return lengths


def known_runs(forced: list[bool], copies: list[int]) -> list[int]:
    """For each position, how many tokens from it on an oracle could draft (forced, or copied,
    in any chain of the two)."""
    n = len(forced)
    far = list(range(n + 1))  # far[i]: the furthest position reachable from i through known tokens
    for i in range(n - 1, -1, -1):
        reach = far[i + 1] if forced[i] else i
        for m in range(1, copies[i] + 1):
            reach = max(reach, far[i + m])
        far[i] = reach
    return [far[i] - i for i in range(n)]


def cheapest(runs: list[int], times: dict[int, float]) -> tuple[float, int]:
    """(seconds, passes) of the cheapest cut of the answer into passes (see the module)."""
    n = len(runs)
    cost: list[tuple[float, int]] = [(0.0, 0)] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = []
        for b in range(0, min(runs[i], n - 1 - i, MAX_ROWS - 1) + 1):
            rest, passes = cost[i + b + 1]
            options.append((times[b + 1] + rest, passes + 1))
        cost[i] = min(options)
    return cost[0]


def decode_seconds(
    engine: SpeculativeEngine, prompt: list[int], config: GenerationConfig
) -> tuple[list[int], float, float]:
    """(tokens, seconds after the prompt's prefill, the prefill's seconds) of one generation, from
    its metrics: every target pass that made tokens, the first included (a block of forced text
    can ride in it)."""
    result = engine.generate(prompt, config)
    metrics = result.metrics
    return result.tokens, metrics.total_seconds - metrics.prefill_seconds, metrics.prefill_seconds


def request_of(row: dict[str, Any], lm: LanguageModel) -> tuple[list[int], GenerationConfig]:
    """The prompt and config a server makes of the task's request (its chat template, its
    grammar); a row with a ``body`` is one of `draftwise load`'s prompts, sent as it sends it."""
    body = row.get("body") or {"model": "m", "messages": [{"role": "user", "content": row["turns"][0]}]}
    body = {"max_tokens": 256} | body | {k: row[k] for k in STRUCTURED_FIELDS if k in row}
    tokenizer = lm.tokenizer
    assert tokenizer is not None
    if "prompt" in body:
        completion = s.CompletionRequest.model_validate(body)
        ids = encode_completion(completion, tokenizer, lm.vocab_size, False, None)
        return ids, GenerationConfig(max_new_tokens=body["max_tokens"])
    request = s.ChatCompletionRequest.model_validate(body)
    config = GenerationConfig(max_new_tokens=body["max_tokens"], grammar=grammar_spec(request))
    return encode_chat(request, tokenizer, None), config


def read_tasks(source: str, limit: int) -> list[dict[str, Any]]:
    """The structured tasks of a JSONL file, or with ``load:SUBTASKS`` the prompts `draftwise load`
    sends for those subtasks (128 tokens each, as it asks)."""
    if not source.startswith("load:"):
        rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
        return rows[:limit]
    subtasks = tuple(source.removeprefix("load:").split(","))
    config = built(LoadConfig, servers=("draftwise",), limit=limit, subtasks=subtasks)
    bodies = [(p.id, p.body("m", 128)) for p in load_prompts(config)]
    return [{"id": id_, "body": {k: v for k, v in body.items() if not k.startswith("stream")}} for id_, body in bodies]


def one_task(engines: Engines, lm: LanguageModel, row: dict[str, Any], times: dict[int, float]) -> dict:
    prompt, config = request_of(row, lm)
    answer, plain, prefill = decode_seconds(engines.plain, prompt, config)
    drafted, seconds, _ = decode_seconds(engines.ngram, prompt, config)
    forced = forced_flags(engines.plain, config, answer)
    task: dict[str, Any] = {"id": row["id"], "tokens": len(answer), "forced": sum(forced)}
    task["forced_runs"] = [len(run) for run in "".join("F" if f else "." for f in forced).split(".") if run]
    task["one_row_seconds"] = round(len(answer) * times[1], 4)
    task["plain_prefill_seconds"] = round(prefill, 4)
    task["plain_decode_seconds"], task["ngram_decode_seconds"] = round(plain, 4), round(seconds, 4)
    task["ngram_identical"] = drafted == answer
    for match in MATCHES:
        copies = copy_lengths(prompt, answer, match) if match else [0] * len(answer)
        seconds, passes = cheapest(known_runs(forced, copies), times)
        task[f"copyable_{match}"] = sum(1 for f, c in zip(forced, copies) if not f and c > 0)
        task[f"oracle_seconds_{match}"], task[f"oracle_passes_{match}"] = round(seconds, 4), passes
    return task


def summarize(tasks: list[dict[str, Any]], times: dict[int, float], context: int) -> dict[str, Any]:
    """The run's totals: tokens, forced runs, measured and oracle decode rates, and the same
    end to end with the plain run's prefill (the same for every method)."""
    after, plain = sum(t["tokens"] for t in tasks), sum(t["one_row_seconds"] for t in tasks)
    prefill = sum(t["plain_prefill_seconds"] for t in tasks)
    summary: dict[str, Any] = {"tasks": len(tasks), "tokens": after, "forced": sum(t["forced"] for t in tasks)}
    summary["context_tokens_timed_after"] = context
    runs = sorted(n for t in tasks for n in t["forced_runs"]) or [0]
    summary["forced_runs"] = {"count": len(runs), "median": runs[len(runs) // 2], "longest": runs[-1]}
    summary["forced_runs"]["tokens_in_runs_of_15_or_more"] = sum(n for n in runs if n >= 15)
    summary["one_row_tok_s"], summary["prefill_seconds"] = round(after / plain, 2), round(prefill, 2)
    for name in ("plain", "ngram"):
        summary[f"{name}_decode_tok_s"] = round(after / sum(t[f"{name}_decode_seconds"] for t in tasks), 2)
    summary["ngram_identical"] = sum(t["ngram_identical"] for t in tasks)
    for match in MATCHES:
        oracle = sum(t[f"oracle_seconds_{match}"] for t in tasks)
        summary[f"oracle_{match}"] = {
            "copyable": sum(t[f"copyable_{match}"] for t in tasks),
            "passes": sum(t[f"oracle_passes_{match}"] for t in tasks),
            "tok_s": round(after / oracle, 2),
            "over_one_row": round(plain / oracle, 3),
            "end_to_end_over_one_row": round((prefill + plain) / (prefill + oracle), 3),
        }
    summary["pass_ms"] = {n: round(1000 * t, 1) for n, t in times.items()}
    return summary


def task_arguments() -> argparse.ArgumentParser:
    """The arguments this folder's scripts share: the tasks, the target, how many, where to write."""
    parser = argparse.ArgumentParser()
    parser.add_argument("tasks", help="a JSONL of structured tasks, or load:SUBTASK,... (`draftwise load`'s prompts)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main() -> None:
    args = task_arguments().parse_args()
    rows = read_tasks(args.tasks, args.limit)
    lm = load_lm(args.target, ModelOptions(threads=2, context=4096))
    pair = prepare(lm, None, DraftConfig())  # warmed up, the cost policy's pass times measured (cached)
    engines = Engines(
        SpeculativeEngine.from_models(lm), SpeculativeEngine.from_models(lm, NGramDrafter(), pair.profile)
    )
    context, config = request_of(rows[0], lm)
    for engine in engines:  # warm-up: the first task once each, not counted
        decode_seconds(engine, context, config)
    times = curve(lm, context)
    tasks = [one_task(engines, lm, row, times) for row in rows]
    summary = summarize(tasks, times, len(context[:1024]))
    args.out.write_text(json.dumps({"summary": summary, "tasks": tasks}, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
