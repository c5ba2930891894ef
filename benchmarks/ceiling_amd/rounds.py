"""The ceiling of `ceiling.py` with C streams that share their passes, as a server's rounds batch
them: how much drafting the known tokens (forced, or copied after a 3-token match) could raise
decode at C clients over C streams that decode one token a round each, as llama-server does.

Per task it decodes the answer with the target alone under the grammar (as `ceiling.py`), marks
the known runs, then replays the answers in rounds, C at a time, a new task taking a stream's
place when its answer ends (as `draftwise load`'s clients do). In each round every stream puts
in its last token and, in the oracle, the whole known run after it (every block accepted); a
round costs T(all its rows) on the pass curve timed here, and each stream gains its rows in
tokens. Prefill is left out on both sides (the same work for both servers).

    python benchmarks/ceiling_amd/rounds.py benchmarks/data/tool_calls.jsonl --clients 4 --out run4/tool_calls_c4.json
"""

from __future__ import annotations

import json
from typing import Any

from ceiling import MAX_ROWS, copy_lengths, curve, forced_flags, known_runs, read_tasks, request_of, task_arguments

from draftwise.config import ModelOptions
from draftwise.engine import SpeculativeEngine
from draftwise.loading import load_lm


def price(times: dict[int, float], rows: int) -> float:
    """T(rows) on the timed curve, extended past its end (MAX_ROWS) on the line through its last two."""
    if rows <= MAX_ROWS:
        return times[rows]
    slope = times[MAX_ROWS] - times[MAX_ROWS - 1]
    return times[MAX_ROWS] + slope * (rows - MAX_ROWS)


def replay(answers: list[list[int]], clients: int, times: dict[int, float]) -> dict[str, float]:
    """Replay the answers in rounds of ``clients`` streams; ``answers[t][i]`` is how many known
    tokens follow position i of task t (all zeros: one token a round). Returns the total tokens,
    seconds and rounds, and the mean of each answer's tokens over the time it was in rounds."""
    queue = list(range(len(answers)))
    active: dict[int, tuple[int, float]] = {}  # task -> (position, seconds it has been in rounds)
    seconds = rounds = 0.0
    rates = []
    while queue or active:
        while queue and len(active) < clients:
            active[queue.pop(0)] = (0, 0.0)
        rows = {t: 1 + min(answers[t][i], len(answers[t]) - i - 1) for t, (i, _) in active.items()}
        cost = price(times, sum(rows.values()))
        seconds, rounds = seconds + cost, rounds + 1
        for t, n in rows.items():
            i, spent = active.pop(t)
            if i + n < len(answers[t]):
                active[t] = (i + n, spent + cost)
            else:
                rates.append(len(answers[t]) / (spent + cost))
    tokens = sum(len(a) for a in answers)
    return {"tokens": tokens, "seconds": round(seconds, 3), "rounds": rounds, "tok_s": round(tokens / seconds, 2)} | {
        "mean_answer_tok_s": round(sum(rates) / len(rates), 2)
    }


def main() -> None:
    parser = task_arguments()
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()
    rows = read_tasks(args.tasks, args.limit)
    lm = load_lm(args.target, ModelOptions(threads=2, context=4096))
    plain = SpeculativeEngine.from_models(lm)
    runs: dict[str, list[list[int]]] = {"one token a round": [], "forced": [], "forced and copies after 3": []}
    for row in rows:
        prompt, config = request_of(row, lm)
        answer = plain.generate(prompt, config).tokens
        forced = forced_flags(plain, config, answer)
        runs["one token a round"].append([0] * len(answer))
        runs["forced"].append(known_runs(forced, [0] * len(answer)))
        runs["forced and copies after 3"].append(known_runs(forced, copy_lengths(prompt, answer, 3)))
    context, _ = request_of(rows[0], lm)
    times = curve(lm, context)
    result: dict[str, Any] = {"clients": args.clients, "tasks": len(rows)}
    for name, answers in runs.items():
        result[name] = replay(answers, args.clients, times)
    base = result["one token a round"]
    for name in runs:
        result[name]["over_one_token_a_round"] = round(result[name]["tok_s"] / base["tok_s"], 3)
    result["pass_ms"] = {n: round(1000 * t, 1) for n, t in times.items()}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "pass_ms"}))


if __name__ == "__main__":
    main()
