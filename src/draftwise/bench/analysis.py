"""From per-prompt records to per-subtask and overall statistics: pure functions on data.

Definitions (the report repeats them):

* tokens/s of a prompt: its new tokens over its wall time, all turns together; a method's
  tokens/s is the mean over prompts, and its speedup is that mean over the baseline's mean
  on the same prompts (Spec-Bench's definition).
* decode-phase tokens/s of a prompt: everything after the first token, (new tokens - 1) /
  (wall time - time to first token), all turns together; its speedup is defined as above.
  It leaves prefill out, which is most of a short answer's time on a long prompt.
* speedup over an anchor: the same ratios with an anchor (another project's loop) in place
  of the baseline, with and without prefill.
* per-token latency: the time between two deliveries of tokens divided by the tokens
  delivered; the first delivery is the time to first token and is reported apart.
* mean accepted length: tokens per target pass (accepted draft tokens + the target's own).
* alpha: the per-token acceptance probability, estimated as accepted / (accepted +
  rejections), and c: the time of one drafted token over the time of one plain target pass
  (the baseline's), give Leviathan et al.'s predicted speedup for the draft lengths used.
* regret (with a sweep, ``--sweep``): per group, each drafter under the configured policy
  against the oracle, the fastest fixed configuration (the baseline, or any drafter's
  fixed-length run, ``model/k4``) by the speedup above, picked in hindsight; and its slowest
  prompt relative to the baseline.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from statistics import mean
from typing import Any

import numpy as np

from draftwise.bench.audit import audit_prompt
from draftwise.bench.config import ANCHORS, REFERENCE, parse_sweep_run
from draftwise.bench.dataset import Prompt, subtask_order
from draftwise.bench.store import Record

OVERALL = "overall"
# The worst-prompt pick of the regret counts a prompt only where the baseline produced at least
# this many new tokens: a shorter answer is mostly prefill and timer noise, not drafting.
WORST_PROMPT_MIN_TOKENS = 32
Complete = dict[tuple[str, str], list[Record]]  # (method, prompt id) -> records ordered by turn


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average when it drafts ``k`` and each draft token is accepted
    with probability ``alpha`` (until the first rejection), plus the target's own token."""
    if k == 0:
        return 1.0
    alpha = min(alpha, 0.999)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Expected tokens per unit of plain-decoding time for draft length ``k``.

    A step emits ``expected_tokens(alpha, k)`` tokens and costs ``1 + k c`` target passes'
    worth of time, where ``c`` is the cost of one draft token relative to one target pass
    (Leviathan et al. 2023).

    Example: alpha = 0.8, k = 4, c = 0.1 -> 3.36 tokens / 1.4 = 2.40x; with c = 0.43
    the same k gives only 1.21x.
    """
    if k == 0:
        return 1.0
    return expected_tokens(alpha, k) / (1.0 + k * cost_ratio)


def token_latencies(record: Record) -> list[float]:
    """Per-token latency of every token after the first delivery (seconds)."""
    latencies: list[float] = []
    arrivals = record["arrivals"]
    for i in range(1, len(arrivals)):
        n = record["step_tokens"][i]
        if n:
            latencies.extend([(arrivals[i] - arrivals[i - 1]) / n] * n)
    return latencies


def prompt_rate(turns: Sequence[Record]) -> float:
    """tokens/s of one prompt, all turns together."""
    seconds = sum(r["wall_seconds"] for r in turns)
    return sum(r["new_tokens"] for r in turns) / seconds if seconds > 0 else 0.0


def timed_deliveries(record: Record) -> bool:
    """Whether the record's arrivals were measured (False: one delivery at the end, see Trace)."""
    return record.get("timed_deliveries", True)


def decode_phase(record: Record) -> tuple[int, float] | None:
    """Tokens and seconds after the first token; None when the time to first token is unknown."""
    if record["ttft_seconds"] is None or not record["new_tokens"]:
        return None
    return record["new_tokens"] - 1, record["wall_seconds"] - record["ttft_seconds"]


def decode_rate(record: Record) -> float | None:
    """Decode-phase tokens/s of one record: (new tokens - 1) / (wall - time to first token)."""
    phase = decode_phase(record)
    return phase[0] / phase[1] if phase is not None and phase[1] > 0 else None


def prompt_decode_rate(turns: Sequence[Record]) -> float | None:
    """Decode-phase tokens/s of one prompt, all turns together; None when any turn's is unknown."""
    phases = [decode_phase(r) for r in turns]
    known = [p for p in phases if p is not None]
    if len(known) < len(phases):
        return None
    seconds = sum(p[1] for p in known)
    return sum(p[0] for p in known) / seconds if seconds > 0 else None


def relative_speed(
    method: str,
    base: str,
    prompt_ids: Sequence[str],
    complete: Complete,
    rate: Callable[[Sequence[Record]], float | None],
) -> float | None:
    """Mean ``rate`` of ``method`` over that of ``base``, on the prompts both finished and
    both have a rate for; None when there are none."""
    rates = [
        (rate(complete[(method, pid)]), rate(complete[(base, pid)]))
        for pid in prompt_ids
        if (method, pid) in complete and (base, pid) in complete
    ]
    pairs = [(own, ref) for own, ref in rates if own is not None and ref is not None]
    if not pairs:
        return None
    reference = mean(ref for _, ref in pairs)
    return mean(own for own, _ in pairs) / reference if reference > 0 else None


def speed_bases(methods: Sequence[str]) -> list[str]:
    """What speedups are given over: the reference, then every anchor in the run."""
    return [REFERENCE, *(m for m in methods if m in ANCHORS)]


def complete_prompts(records: Sequence[Record], prompts: Sequence[Prompt]) -> Complete:
    """Records of every (method, prompt) whose turns have all finished."""
    n_turns = {p.id: len(p.turns) for p in prompts}
    by: dict[tuple[str, str], dict[int, Record]] = defaultdict(dict)
    for r in records:
        if r["prompt_id"] in n_turns:
            by[(r["method"], r["prompt_id"])][r["turn"]] = r
    return {
        key: [turns[t] for t in range(n_turns[key[1]])]
        for key, turns in by.items()
        if all(t in turns for t in range(n_turns[key[1]]))
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _milliseconds(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _acceptance_by_position(records: Sequence[Record]) -> list[float]:
    proposed_at: Counter[int] = Counter()
    accepted_at: Counter[int] = Counter()
    for r in records:
        for p, a in zip(r["steps"]["proposed"], r["steps"]["accepted"]):
            proposed_at.update(range(int(p)))
            accepted_at.update(range(int(a)))
    return [accepted_at[i] / proposed_at[i] for i in range(len(proposed_at))]


def _target_pass_seconds(records: Sequence[Record]) -> float | None:
    """Mean time of one plain target pass, from baseline records."""
    passes = sum(len(r["steps"]["verify_s"]) for r in records)
    return sum(sum(r["steps"]["verify_s"]) for r in records) / passes if passes else None


def predicted_speedup(alpha: float, draft_lengths: Sequence[int], cost_ratio: float) -> float:
    """Leviathan et al.'s expected speedup, summed over the steps actually taken.

    A step that drafts k tokens is expected to emit ``expected_speedup(alpha, k, 0)`` tokens
    (with zero draft cost the formula is the expected token count) and to cost ``1 + k c``
    plain target passes; a step with k = 0 emits one token for one pass.
    """
    tokens = sum(expected_speedup(alpha, int(k), 0.0) for k in draft_lengths)
    cost = sum(1.0 + int(k) * cost_ratio for k in draft_lengths)
    return tokens / cost if cost else 1.0


def _speculation_stats(records: Sequence[Record], baseline: Sequence[Record]) -> dict[str, Any]:
    steps = [r["steps"] for r in records]
    proposed = sum(sum(s["proposed"]) for s in steps)
    accepted = sum(sum(s["accepted"]) for s in steps)
    rejections = sum(1 for s in steps for p, a in zip(s["proposed"], s["accepted"]) if a < p)
    stats: dict[str, Any] = {
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "acceptance_by_position": _acceptance_by_position(records),
        "alpha": accepted / (accepted + rejections) if accepted + rejections else None,
        "cost_ratio": None,
        "predicted_speedup": None,
    }
    pass_seconds = _target_pass_seconds(baseline)
    if proposed and pass_seconds:
        draft_seconds = sum(sum(s["draft_s"]) for s in steps)
        stats["cost_ratio"] = (draft_seconds / proposed) / pass_seconds
        lengths = [int(p) for s in steps for p in s["proposed"]]
        stats["predicted_speedup"] = predicted_speedup(stats["alpha"], lengths, stats["cost_ratio"])
    return stats


def _time_split(records: Sequence[Record]) -> dict[str, float]:
    split = {"wall": sum(r["wall_seconds"] for r in records)}
    if all(r.get("metrics") for r in records):
        for part in ("prefill", "draft", "verify", "other"):
            split[part] = sum(r["metrics"][f"{part}_seconds"] for r in records)
        split["rollback"] = sum(r["rollback_seconds"] or 0.0 for r in records)
    return split


def _speed_stats(method: str, prompt_ids: Sequence[str], complete: Complete, bases: Sequence[str]) -> dict[str, Any]:
    """tokens/s with and without prefill, and the speedups over each base (reference, anchors)."""
    mine = [pid for pid in prompt_ids if (method, pid) in complete]
    decode = [x for x in (prompt_decode_rate(complete[(method, pid)]) for pid in mine) if x is not None]
    over = {
        base: {
            "speedup": relative_speed(method, base, prompt_ids, complete, prompt_rate),
            "decode_speedup": relative_speed(method, base, prompt_ids, complete, prompt_decode_rate),
        }
        for base in bases
    }
    return {
        "tokens_per_second": mean(prompt_rate(complete[(method, pid)]) for pid in mine),
        "decode_tokens_per_second": mean(decode) if decode else None,
        "speedup": over[REFERENCE]["speedup"] if REFERENCE in over else None,
        "decode_speedup": over[REFERENCE]["decode_speedup"] if REFERENCE in over else None,
        "speedup_over": over,
    }


def _delivery_stats(records: Sequence[Record]) -> dict[str, Any]:
    """Latency and tokens per pass, from the records whose deliveries were timed."""
    timed = [r for r in records if timed_deliveries(r)]
    tokens = sum(r["new_tokens"] for r in timed)
    passes = sum(len(r["step_tokens"]) for r in timed)
    latencies = [x for r in timed for x in token_latencies(r)]
    ttfts = [r["ttft_seconds"] for r in timed if r["ttft_seconds"] is not None]
    return {
        "ttft_seconds": mean(ttfts) if ttfts else None,
        "latency_p50_ms": _milliseconds(percentile(latencies, 50)),
        "latency_p95_ms": _milliseconds(percentile(latencies, 95)),
        "target_passes": passes if timed else None,
        "mean_accepted_length": tokens / passes if passes else None,
        "passes_per_token": passes / tokens if tokens else None,
        "tokens_per_pass_histogram": dict(sorted(Counter(n for r in timed for n in r["step_tokens"]).items())),
    }


def method_stats(
    method: str, prompt_ids: Sequence[str], complete: Complete, greedy: bool, bases: Sequence[str] = (REFERENCE,)
) -> dict[str, Any]:
    mine = [pid for pid in prompt_ids if (method, pid) in complete]
    paired = [pid for pid in mine if (REFERENCE, pid) in complete]
    records = [r for pid in mine for r in complete[(method, pid)]]
    if not records:
        return {"prompts": 0}
    perplexities = [r["perplexity"] for r in records if r.get("perplexity") is not None]
    stats: dict[str, Any] = {
        "prompts": len(mine),
        "turns": len(records),
        "tokens": sum(r["new_tokens"] for r in records),
        **_speed_stats(method, prompt_ids, complete, bases),
        **_delivery_stats(records),
        "perplexity": mean(perplexities) if perplexities else None,
        "time": _time_split(records),
        "identical": None,
        "compared": None,
    }
    if paired and greedy:
        stats["compared"] = len(paired)
        stats["identical"] = sum(
            audit_prompt(complete[(REFERENCE, pid)], complete[(method, pid)]) is None for pid in paired
        )
    has_drafts = all(r.get("steps") for r in records) and any(sum(r["steps"]["proposed"]) for r in records)
    baseline = [r for pid in paired for r in complete[(REFERENCE, pid)]]
    if has_drafts:
        stats.update(_speculation_stats(records, baseline))
        if stats["speedup"] and stats["predicted_speedup"]:
            stats["efficiency"] = stats["speedup"] / stats["predicted_speedup"]
    return stats


def mismatches(method: str, prompt_ids: Sequence[str], complete: Complete) -> list[dict[str, Any]]:
    found = []
    for pid in prompt_ids:
        if (method, pid) in complete and (REFERENCE, pid) in complete:
            diff = audit_prompt(complete[(REFERENCE, pid)], complete[(method, pid)])
            if diff is not None:
                found.append(diff)
    return found


def fixed_runs(method: str, methods: Sequence[str]) -> list[str]:
    """``method``'s fixed-length runs (its sweep) among ``methods``: ``model/k1``, ``model/k2``..."""
    return [m for m in methods if (sweep := parse_sweep_run(m)) is not None and sweep[0] == method]


def _oracle(stats: dict[str, dict[str, Any]], methods: Sequence[str]) -> str | None:
    """The fastest fixed configuration, the baseline or any drafter's fixed-length run, by
    speedup over the baseline (the report's); None when none has one. A tie goes to the
    baseline, then to the first listed: the simpler configuration."""
    fixed = [m for m in methods if parse_sweep_run(m) is not None]
    speeds = {m: stats[m].get("speedup") for m in (REFERENCE, *fixed)}
    known = {m: s for m, s in speeds.items() if s is not None}
    return max(known, key=known.__getitem__) if known else None


def worst_prompt(method: str, prompt_ids: Sequence[str], complete: Complete) -> dict[str, Any] | None:
    """``method``'s prompt with the lowest speedup over the baseline, among those where the
    baseline produced at least ``WORST_PROMPT_MIN_TOKENS`` new tokens; None when there is none."""
    long_enough = [
        pid
        for pid in prompt_ids
        if (REFERENCE, pid) in complete
        and sum(r["new_tokens"] for r in complete[(REFERENCE, pid)]) >= WORST_PROMPT_MIN_TOKENS
    ]
    ratios = {pid: relative_speed(method, REFERENCE, [pid], complete, prompt_rate) for pid in long_enough}
    known = {pid: x for pid, x in ratios.items() if x is not None}
    if not known:
        return None
    pid = min(known, key=known.__getitem__)
    return {"prompt_id": pid, "speedup": known[pid]}


def regret(
    stats: dict[str, dict[str, Any]], prompt_ids: Sequence[str], complete: Complete, methods: Sequence[str]
) -> dict[str, Any]:
    """One group's regret: per drafter that was swept, its speedup under the configured policy
    (``stats``: the group's ``method_stats``), the oracle's, its ratio to the oracle and to each
    anchor, and its worst prompt."""
    swept = [m for m in methods if fixed_runs(m, methods)]
    anchors = [b for b in speed_bases(methods) if b != REFERENCE]
    oracle = _oracle(stats, methods)
    entries: dict[str, Any] = {}
    for method in swept:
        over = stats[method].get("speedup_over") or {}
        entries[method] = {
            "speedup": stats[method].get("speedup"),
            "oracle": oracle,
            "oracle_speedup": stats[oracle].get("speedup") if oracle else None,
            "over_oracle": relative_speed(method, oracle, prompt_ids, complete, prompt_rate) if oracle else None,
            "over_anchors": {a: (over.get(a) or {}).get("speedup") for a in anchors},
            "worst_prompt": worst_prompt(method, prompt_ids, complete),
        }
    return {"baseline_tokens_per_second": stats[REFERENCE].get("tokens_per_second"), "methods": entries}


def summarize(
    records: Sequence[Record], prompts: Sequence[Prompt], methods: Sequence[str], greedy: bool
) -> dict[str, Any]:
    """Statistics per subtask and overall, per method, plus the losslessness audit, and the
    regret per group when fixed-length runs (a sweep) are among ``methods``."""
    complete = complete_prompts(records, prompts)
    groups = {OVERALL: [p.id for p in prompts]}
    for subtask in subtask_order(prompts):
        groups[subtask] = [p.id for p in prompts if p.subtask == subtask]
    bases = speed_bases(methods)
    stats = {g: {m: method_stats(m, ids, complete, greedy, bases) for m in methods} for g, ids in groups.items()}
    summary: dict[str, Any] = {
        "bases": bases,
        "groups": stats,
        "mismatches": {m: mismatches(m, groups[OVERALL], complete) for m in methods if m != REFERENCE}
        if greedy
        else {},
    }
    if any(parse_sweep_run(m) is not None for m in methods):
        summary["regret"] = {g: regret(stats[g], ids, complete, methods) for g, ids in groups.items()}
    return summary
