"""Replays a load run's answers through a suffix source, priced on host profiles.

Takes the answers one server gave in a ``draftwise load`` run (``results.jsonl``), in the order
sent, and drafts each from the answers before it, as the server's store of earlier answers
would (``draftwise.suffix``): at every step it proposes up to ``k`` tokens whenever the source
offers any (no policy), keeps the longest right prefix plus the target's token, and prices each
pass on a host profile's curve (``draftwise curve --out``, ``tests/data/hosts/``). It prints,
per host and ``k``, the speed-up over one-row steps on the requests from ``--from-turn`` on,
and the mean time of one lookup (the draft call alone). With ``--arctic``, ArcticInference's suffix tree
(``arctic_inference.suffix_decoding``, built from its sdist) drafts the same answers beside it:
its tree of earlier answers alone, and with its tree of the prompt.

    .venv/bin/python scripts/suffix_replay.py benchmarks/suffix_amd/agentic/results.jsonl \\
        --data benchmarks/data/agentic.jsonl --subtask tool_schemas --arctic
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

HOSTS = ("tests/data/hosts/amd-epyc.json", "tests/data/hosts/intel-xeon.json")


class Source(Protocol):
    """A suffix source as a server would run it: each request started with its prompt,
    drafted from, fed what the target kept, and finished with its answer."""

    def start(self, request: int, prompt: list[int]) -> None: ...
    def draft(self, request: int, context: list[int], k: int) -> list[int]: ...
    def grow(self, request: int, tokens: list[int]) -> None: ...
    def finish(self, request: int, prompt: list[int], answer: list[int]) -> None: ...


def curve(path: str) -> Callable[[int], float]:
    """A pass's time by rows, linear between the profile's points."""
    points = sorted((int(rows), ms) for rows, ms in json.loads(Path(path).read_text())["pass_ms"].items())

    def at(rows: int) -> float:
        for (r0, t0), (r1, t1) in zip(points, points[1:]):
            if r0 <= rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        return points[-1][1] * rows / points[-1][0]

    return at


def answers(args: argparse.Namespace) -> list[tuple[list[int], list[int], bool]]:
    """(prompt ids, answer ids, counted) of the chosen server's answers, in the order sent."""
    from draftwise.config import ModelOptions
    from draftwise.loading import load_tokenizer

    tokenizer = load_tokenizer(args.target, ModelOptions())
    prompts = {row["id"]: row["turns"][0] for row in map(json.loads, Path(args.data).read_text().splitlines())}
    records = [json.loads(line) for line in Path(args.results).read_text().splitlines()]
    found, turns = [], {}
    for r in records:
        if r["kind"] != "request" or r["server"] != args.server:
            continue
        turns[r["subtask"]] = turns.get(r["subtask"], 0) + 1
        message = [{"role": "user", "content": prompts[r["prompt_id"]]}]
        chat = tokenizer.apply_chat_template(message, add_generation_prompt=True)
        ids = tokenizer.encode(chat, add_special_tokens=False)
        out = tokenizer.encode(r["text"], add_special_tokens=False, parse_special=False)
        counted = turns[r["subtask"]] >= args.from_turn and r["subtask"] in (args.subtask or r["subtask"])
        found.append((ids, out, counted))
    return found


def replay(runs: Sequence[tuple[list[int], list[int], bool]], source: Source, k: int, hosts: Sequence[str]) -> str:
    """The speed-up on each host and the mean lookup, drafting from ``source``."""
    prices = [curve(h) for h in hosts]
    plain, cost = [0.0] * len(hosts), [0.0] * len(hosts)
    spent, lookups = 0.0, 0
    for request, (prompt, out, counted) in enumerate(runs):
        context, pos = list(prompt), 0
        source.start(request, prompt)
        while pos < len(out):
            started = time.perf_counter()
            block = source.draft(request, context, k)[:k]
            spent, lookups = spent + time.perf_counter() - started, lookups + 1
            kept = next((i for i, t in enumerate(block) if pos + i >= len(out) or t != out[pos + i]), len(block))
            take = min(kept + 1, len(out) - pos)
            for i, price in enumerate(prices):
                if counted:
                    plain[i], cost[i] = plain[i] + take * price(1), cost[i] + price(len(block) + 1)
            source.grow(request, out[pos : pos + take])
            context += out[pos : pos + take]
            pos += take
        source.finish(request, prompt, out)
    ratios = ", ".join(f"{Path(h).stem} {p / c:.2f}x" for h, p, c in zip(hosts, plain, cost))
    return f"{ratios}; {1e6 * spent / lookups:.0f} us a lookup"


class Ours:
    """This project's source: a store of earlier answers (``draftwise.suffix``)."""

    def __init__(self) -> None:
        from draftwise.config import SuffixConfig
        from draftwise.suffix import SuffixStore

        self.store = SuffixStore(SuffixConfig())

    def start(self, request: int, prompt: list[int]) -> None:
        pass

    def draft(self, request: int, context: list[int], k: int) -> list[int]:
        return self.store.draft("", context, k)[1]

    def grow(self, request: int, tokens: list[int]) -> None:
        pass

    def finish(self, request: int, prompt: list[int], answer: list[int]) -> None:
        self.store.add("", prompt, answer)


class Arctic:
    """ArcticInference's: its tree of earlier answers, and with ``with_prompt`` its tree of
    the request's prompt and answer so far too."""

    def __init__(self, with_prompt: bool) -> None:
        from arctic_inference.suffix_decoding.cache import SuffixDecodingCache

        self.cache, self.with_prompt = SuffixDecodingCache(64), with_prompt

    def start(self, request: int, prompt: list[int]) -> None:
        self.cache.start_request(request, prompt)

    def draft(self, request: int, context: list[int], k: int) -> list[int]:
        from arctic_inference.suffix_decoding._C import SuffixTree

        if self.with_prompt:
            return list(self.cache.speculate(request, context[-64:], k).token_ids)
        tree = self.cache._global_tree
        return list(SuffixTree.speculate(tree, context[-64:], k, 1.0, 0.0, 0.1, False).token_ids)

    def grow(self, request: int, tokens: list[int]) -> None:
        self.cache.add_active_response(request, tokens)

    def finish(self, request: int, prompt: list[int], answer: list[int]) -> None:
        self.cache.stop_request(request)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a draftwise load run's results.jsonl")
    parser.add_argument("--data", required=True, help="the JSONL of its prompts (--data of the run)")
    parser.add_argument("--server", default="draftwise-off", help="whose answers to replay")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the target, for its tokenizer")
    parser.add_argument("--subtask", action="append", help="count only these subtasks (default: all)")
    parser.add_argument("--from-turn", type=int, default=3, help="count requests from this place in their subtask")
    parser.add_argument("--k", default="3,8,16", help="largest blocks to draft")
    parser.add_argument("--hosts", default=",".join(HOSTS), help="host profiles to price passes on")
    parser.add_argument("--arctic", action="store_true", help="also ArcticInference's suffix trees")
    args = parser.parse_args()
    runs, hosts = answers(args), args.hosts.split(",")
    for k in (int(value) for value in args.k.split(",")):
        print(f"k {k}, draftwise: {replay(runs, Ours(), k, hosts)}")
        if args.arctic:
            print(f"k {k}, arctic, earlier answers: {replay(runs, Arctic(False), k, hosts)}")
            print(f"k {k}, arctic, and the prompt: {replay(runs, Arctic(True), k, hosts)}")


if __name__ == "__main__":
    main()
