"""The bench's Markdown report and its machine-readable twin, ``summary.json``."""

from __future__ import annotations

import datetime as dt
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftwise.bench.analysis import OVERALL, WORST_PROMPT_MIN_TOKENS
from draftwise.bench.anchor_settings import describe
from draftwise.bench.audit import NEAR_TIE
from draftwise.bench.config import REFERENCE, BenchConfig
from draftwise.bench.dataset import Prompt, subtask_order
from draftwise.bench.store import Record
from draftwise.cpu import cpu_name, default_threads, kernel_flags

REPORT = "report.md"
SUMMARY = "summary.json"


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def node_info() -> dict[str, Any]:
    """The machine a record was measured on (every record carries it: a bench spread over a
    cluster says which node ran what, and the report says when nodes differ). "cores" are the
    ones this process may run on, not the machine's: those are the ones a measurement had."""
    return {"host": platform.node(), "cpu": cpu_name(), "cores": default_threads(), "cpu_flags": _cpu_flags()}


def machine_info() -> dict[str, Any]:
    import torch

    from draftwise import __version__

    return {
        "cpu": cpu_name(),
        "cores": default_threads(),  # usable by this process, as in node_info
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_flags": _cpu_flags(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "llama_cpp_python": _version("llama_cpp_python"),
        "draftwise": __version__,
    }


def _cpu_flags() -> str:
    """The vector extensions that decide CPU kernel speed (hosts of one kind differ)."""
    return " ".join(kernel_flags())


def _models_line(config: BenchConfig) -> str:
    m = config.models
    return (
        f"backend `{m.backend}`, threads {m.threads or 'all'}, context {m.context or 'default'}, "
        f"hf dtype `{m.dtype}`, hf draft quant `{m.draft_quant}`"
    )


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{spec}}{suffix}"


def _chat_line(records: Sequence[Record], config: BenchConfig) -> str:
    used = {r.get("chat_template") for r in records}
    if not config.chat_template:
        return "prompts as plain text (chat template disabled with --no-chat)"
    if used == {True}:
        return "every turn is wrapped in the target's chat template (user/assistant messages)"
    if used == {False}:
        return "prompts as plain text: the target has no chat template (turns joined by blank lines)"
    return "mixed (results from runs with and without the chat template)"


def _decoding_line(config: BenchConfig) -> str:
    s = config.generation.sampling
    if s.greedy:
        return "greedy"
    return f"sampling: temperature {s.temperature}, top-k {s.top_k}, top-p {s.top_p}, seed {s.seed} (per prompt)"


def _overall_table(stats: dict[str, dict[str, Any]], methods: Sequence[str], greedy: bool) -> list[str]:
    head = (
        "| method | prompts | tokens/s | speedup | decode tokens/s | decode speedup | predicted "
        "| measured/predicted | TTFT s | latency p50 ms | latency p95 ms | acceptance | draft cost "
        "| mean accepted length | passes/token | identical to baseline | PPL |"
    )
    columns = head.count("|") - 1
    lines = [head, "|" + "---|" * columns]
    for m in methods:
        s = stats[m]
        if not s.get("prompts"):
            lines.append(f"| {m} | 0 |" + " n/a |" * (columns - 2))
            continue
        identical = "n/a"
        if greedy and m != REFERENCE and s.get("compared"):
            identical = f"{s['identical']}/{s['compared']}"
        elif m == REFERENCE:
            identical = "(reference)"
        lines.append(
            f"| {m} | {s['prompts']} | {_fmt(s['tokens_per_second'], '.1f')} | {_fmt(s['speedup'], '.2f', 'x')} "
            f"| {_fmt(s.get('decode_tokens_per_second'), '.1f')} | {_fmt(s.get('decode_speedup'), '.2f', 'x')} "
            f"| {_fmt(s.get('predicted_speedup'), '.2f', 'x')} | {_fmt(s.get('efficiency'), '.2f')} "
            f"| {_fmt(s['ttft_seconds'], '.3f')} | {_fmt(s['latency_p50_ms'], '.1f')} "
            f"| {_fmt(s['latency_p95_ms'], '.1f')} | {_fmt(s.get('acceptance_rate'), '.2f')} "
            f"| {_fmt(s.get('cost_ratio'), '.2f')} "
            f"| {_fmt(s['mean_accepted_length'], '.2f')} | {_fmt(s['passes_per_token'], '.2f')} "
            f"| {identical} | {_fmt(s['perplexity'], '.2f')} |"
        )
    return lines


def _speedup_cell(stats: dict[str, Any], base: str) -> str:
    over = (stats.get("speedup_over") or {}).get(base) or {}
    return f"{_fmt(over.get('speedup'), '.2f', 'x')} / {_fmt(over.get('decode_speedup'), '.2f', 'x')}"


def _speedup_matrix(groups: dict[str, dict[str, dict[str, Any]]], methods: Sequence[str], base: str) -> list[str]:
    """Every method's speedup over ``base`` per subtask and overall, with prefill / decode phase."""
    names = [g for g in groups if g != OVERALL] + [OVERALL]
    lines = [
        f"## Speedup over `{base}` per subtask",
        "",
        "Each cell: with prefill / decode phase (after the first token).",
        "",
        "| method | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for m in methods:
        cells = [_speedup_cell(groups[g][m], base) for g in names]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


_REGRET_COLUMNS = (
    "subtask",
    "plain tokens/s",
    "method",
    "default / plain",
    "oracle",
    "oracle / plain",
    "default / oracle",
    "worst prompt",
)


def _worst_cell(worst: dict[str, Any] | None) -> str:
    if worst is None:
        return f"n/a (no prompt of {WORST_PROMPT_MIN_TOKENS}+ tokens)"
    return f"{worst['prompt_id']}: {_fmt(worst['speedup'], '.2f', 'x')}"


def _regret_section(regret: dict[str, dict[str, Any]], config: BenchConfig) -> list[str]:
    """Each swept drafter under the configured policy against its best fixed run in hindsight,
    per subtask and overall (summary.json's ``regret``)."""
    names = [g for g in regret if g != OVERALL] + [OVERALL]
    anchors = sorted({a for g in names for e in regret[g]["methods"].values() for a in e["over_anchors"]})
    lines = [
        "## Regret: the default against the best fixed configuration",
        "",
        f"Each drafter under the configured policy (`{config.generation.draft.k_policy}`) against the oracle: the "
        f"fastest of `baseline` and every fixed-length run (`METHOD/kK`, k in {', '.join(map(str, config.sweep))}), "
        "picked in hindsight per subtask. Ratios are the speedup tables' (tokens/s with prefill: the mean over "
        "prompts over the other run's mean on the same prompts). Worst prompt: the default's lowest speedup over "
        f"`baseline` on one prompt, among prompts where `baseline` produced {WORST_PROMPT_MIN_TOKENS}+ new tokens.",
        "",
        "| " + " | ".join([*_REGRET_COLUMNS, *(f"default / {a}" for a in anchors)]) + " |",
        "|" + "---|" * (len(_REGRET_COLUMNS) + len(anchors)),
    ]
    for g in names:
        plain = _fmt(regret[g]["baseline_tokens_per_second"], ".1f")
        for m, e in regret[g]["methods"].items():
            cells = [
                g,
                plain,
                m,
                _fmt(e["speedup"], ".2f", "x"),
                f"`{e['oracle']}`" if e["oracle"] else "n/a",
                _fmt(e["oracle_speedup"], ".2f", "x"),
                _fmt(e["over_oracle"], ".2f", "x"),
                _worst_cell(e["worst_prompt"]),
                *(_fmt(e["over_anchors"].get(a), ".2f", "x") for a in anchors),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _position_table(stats: dict[str, dict[str, Any]], methods: Sequence[str]) -> list[str]:
    rows = [(m, stats[m]["acceptance_by_position"]) for m in methods if stats[m].get("acceptance_by_position")]
    if not rows:
        return ["No draftwise drafter proposed any token."]
    width = max(len(r) for _, r in rows)
    lines = ["| method | " + " | ".join(str(i + 1) for i in range(width)) + " |", "|---|" + "---|" * width]
    for m, rates in rows:
        lines.append(f"| {m} | " + " | ".join(f"{x:.2f}" for x in rates) + " |" + " |" * (width - len(rates)))
    return lines


def _time_table(stats: dict[str, dict[str, Any]], methods: Sequence[str]) -> list[str]:
    lines = [
        "| method | wall s | prefill | draft | verify | of which cache rollback | loop overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        t = stats[m].get("time")
        if not t:
            continue
        if "verify" not in t:
            lines.append(f"| {m} | {t['wall']:.1f} | inside the anchor's own loop: not split | | | | |")
            continue
        wall = t["wall"] or 1.0
        cells = [f"{t[p]:.1f} ({100 * t[p] / wall:.0f}%)" for p in ("prefill", "draft", "verify", "rollback", "other")]
        lines.append(f"| {m} | {t['wall']:.1f} | " + " | ".join(cells) + " |")
    return lines


def _audit_section(summary: dict[str, Any], methods: Sequence[str], greedy: bool) -> list[str]:
    if not greedy:
        return ["Sampling run: outputs are not expected to be token-identical; see perplexity above."]
    overall = summary["groups"][OVERALL]
    lines = ["Share of prompts whose every turn is token-identical to `baseline` (greedy):", ""]
    for m in methods:
        if m == REFERENCE or not overall[m].get("compared"):
            continue
        s = overall[m]
        lines.append(f"- `{m}`: {s['identical']}/{s['compared']} ({100 * s['identical'] / s['compared']:.0f}%)")
    rows = [(m, x) for m in methods for x in summary["mismatches"].get(m, [])]
    lines.append("")
    if not rows:
        lines.append("No mismatches.")
        return lines
    lines += [
        f"Mismatches: first differing token, and the gap between the target's top two logits there "
        f"(computed by a fresh target pass on the baseline prefix). A gap below {NEAR_TIE} is a near-tie "
        "that float rounding in a different kernel or matmul shape can flip; a larger gap needs "
        "investigating.",
        "",
        "| method | prompt | subtask | turn | position | baseline token | method token | top-2 logit gap | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, x in rows:
        verdict = "near-tie" if x["near_tie"] else ("investigate" if x["top2_gap"] is not None else "length differs")
        lines.append(
            f"| {m} | {x['prompt_id']} | {x['subtask']} | {x['turn'] + 1} | {x['position']} "
            f"| {x['reference_token']} | {x['method_token']} | {_fmt(x['top2_gap'], '.3g')} | {verdict} |"
        )
    return lines


def nodes(records: Sequence[Record]) -> list[dict[str, Any]]:
    """Each machine that ran records (host, CPU, cores), with how many prompts and records it ran."""
    found: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in records:
        node = r.get("node") or {}
        key = (node.get("host"), node.get("cpu"), node.get("cores"), node.get("cpu_flags"))
        entry = found.setdefault(
            key, {**{k: node.get(k) for k in ("host", "cpu", "cores", "cpu_flags")}, "prompts": set(), "records": 0}
        )
        entry["prompts"].add(r["prompt_id"])
        entry["records"] += 1
    return [{**e, "prompts": len(e["prompts"])} for e in found.values()]


def _nodes_lines(machines: Sequence[dict[str, Any]]) -> list[str]:
    """A warning when the records come from more than one machine."""
    if len(machines) < 2:
        return []
    kinds = {(m["cpu"], m["cores"], m["cpu_flags"]) for m in machines}
    what = "machines that differ (CPU or cores)" if len(kinds) > 1 else "machines of one kind"
    listed = "; ".join(
        f"`{m['host']}`: {m['cpu']} ({m['cpu_flags'] or 'flags unknown'}), {m['cores']} cores, {m['prompts']} prompts"
        for m in machines
    )
    return [
        f"- **nodes differ**: {len(machines)} {what} ran these results ({listed}). Each prompt ran all its "
        "methods on one node, so every per-prompt speedup is a ratio measured on one machine; absolute "
        "tokens/s and latencies mix machines."
    ]


# The report's last section: what each number means.
_DEFINITIONS = [
    "## Definitions",
    "",
    "- tokens/s: a prompt's new tokens (all turns) over its wall time, prefill included; the mean over "
    "prompts. Speedup: that mean over `baseline`'s mean on the same prompts (Spec-Bench's definition).",
    "- decode tokens/s: the decode phase alone, everything after the first token: (new tokens - 1) / "
    "(wall time - TTFT), all turns together; the mean over prompts. Decode speedup: that mean over the "
    "base's on the same prompts. Speedup over an anchor: the same two ratios with the anchor as the base.",
    "- TTFT: time to the first delivered token (prefill + first step). Per-token latency: time between "
    "deliveries divided by the tokens delivered, pooled over all tokens after the first delivery.",
    "- acceptance: accepted / proposed draft tokens (draftwise methods only: the anchors do not "
    "report proposals). Draft cost: drafting time per proposed draft token, in plain target passes "
    "(`baseline`'s mean pass), the c below. Mean accepted length: tokens per target pass. passes/token: "
    "its inverse.",
    "- n/a where a method does not expose a number: `llamacpp-spec` (a separate process) reports only its "
    "total encode + decode time, so its TTFT, latency, tokens per pass and decode-phase rates are unknown.",
    "- predicted: Leviathan et al.'s expected speedup from alpha = accepted / (accepted + rejections) and "
    "c = drafting time per draft token / plain target pass time (baseline), summed over the draft lengths "
    "actually used; measured/predicted below 1 is the engine's own overhead.",
    "- PPL: perplexity of the method's output under the target (one fresh target pass, untimed).",
    "",
]


def _setup_lines(
    summary: dict[str, Any],
    config: BenchConfig,
    prompts: Sequence[Prompt],
    prompt_format: str,
    machine: dict[str, Any],
    command: str | None,
) -> list[str]:
    """The report's header: when, what command, which machine, models, settings, prompts and
    how they were formatted."""
    d = config.generation.draft
    counts = {s: sum(p.subtask == s for p in prompts) for s in subtask_order(prompts)}
    return [
        "# draftwise bench",
        "",
        f"- date: {summary['date']}",
        f"- command: `{command}`" if command else "- command: (library call)",
        f"- machine: {machine['cpu']} ({machine.get('cpu_flags') or 'flags unknown'}), {machine['cores']} cores, "
        f"torch threads {machine['torch_threads']}; {machine['platform']}; torch {machine['torch']}, "
        f"transformers {machine['transformers']}, llama-cpp-python {machine.get('llama_cpp_python')}, "
        f"draftwise {machine['draftwise']}",
        f"- target `{config.target}`, draft `{config.draft}`, models {_models_line(config)}, "
        f"max new tokens {config.generation.max_new_tokens}, {_decoding_line(config)}",
        *(
            [
                f"- other drafts: {', '.join(f'`{o}`' for o in config.other_drafts)}; `METHOD@DRAFT` is METHOD "
                "drafting with that model (through text where its tokenizer is not the target's)"
            ]
            if config.other_drafts
            else []
        ),
        *(
            [
                f"- sweep: `METHOD/kK` is METHOD with the fixed policy at k = K, for K in "
                f"{', '.join(map(str, config.sweep))}"
            ]
            if config.sweep
            else []
        ),
        f"- drafting: k policy `{d.k_policy}`, k {d.k}, k_max {d.k_max}, confidence threshold "
        f"{d.confidence_threshold}, n-gram {d.ngram_min}..{d.ngram_max}",
        *[f"- `{m}`: {note}" for m in config.runs if (note := describe(m, config.generation))],
        f"- prompts: {len(prompts)} ({sum(len(p.turns) for p in prompts)} turns) from `{config.data}`: "
        + ", ".join(f"{s} {n}" for s, n in counts.items()),
        f"- prompt format: {prompt_format}",
        f"- each prompt's methods run in one process, one after another, order rotated per prompt"
        f"{', after an untimed warm-up' if config.warmup else ''}; results hash `{summary['config_hash']}`",
        *_nodes_lines(summary.get("nodes") or []),
        "",
    ]


def render(
    summary: dict[str, Any],
    config: BenchConfig,
    prompts: Sequence[Prompt],
    records: Sequence[Record],
    machine: dict[str, Any],
    command: str | None,
    plots: Sequence[str],
) -> str:
    methods = list(config.runs)
    greedy = config.generation.sampling.greedy
    groups = summary["groups"]
    lines = _setup_lines(summary, config, prompts, _chat_line(records, config), machine, command)
    lines += ["## Overall", "", *_overall_table(groups[OVERALL], methods, greedy), ""]
    for base in summary.get("bases") or [REFERENCE]:
        lines += _speedup_matrix(groups, methods, base)
    if summary.get("regret"):  # only with a sweep
        lines += _regret_section(summary["regret"], config)
    for name, stats in groups.items():
        if name == OVERALL:
            continue
        lines += [f"## {name}", "", *_overall_table(stats, methods, greedy), ""]
    lines += [
        "## Acceptance by block position (overall)",
        "",
        *_position_table(groups[OVERALL], methods),
        "",
        "## Where the time goes (overall, seconds and share of wall time)",
        "",
        *_time_table(groups[OVERALL], methods),
        "",
        "Cache rollback is timed inside draft and verify; loop overhead is each step's time outside the "
        "two models (policy, bookkeeping, detokenising).",
        "",
        "## Losslessness audit",
        "",
        *_audit_section(summary, methods, greedy),
        "",
    ]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    return "\n".join(lines + _DEFINITIONS)


def write_report(
    out: Path,
    summary: dict[str, Any],
    config: BenchConfig,
    prompts: Sequence[Prompt],
    records: Sequence[Record],
    command: str | None,
    plots: Sequence[str],
) -> Path:
    machine = machine_info()
    summary = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "config_hash": config.results_hash(),
        "command": command,
        "machine": machine,
        "config": config.model_dump(mode="json"),
        "plots": [Path(p).name for p in plots],
        "nodes": nodes(records),
        **summary,
    }
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    path = out / REPORT
    path.write_text(render(summary, config, prompts, records, machine, command, plots), encoding="utf-8")
    return path
