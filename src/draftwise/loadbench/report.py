"""The load benchmark's files: ``config.json`` (what ran where), ``report.md`` (the tables) and
``summary.json`` (the same numbers for programs)."""

from __future__ import annotations

import json
import platform
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftwise.bench.audit import NEAR_TIE
from draftwise.cpu import kernel_flags
from draftwise.loadbench.config import DRAFTWISE_SERVERS, LLAMA_SERVERS, LoadConfig, sends_prediction
from draftwise.loadbench.prompts import LoadPrompt

CONFIG = "config.json"
REPORT = "report.md"
SUMMARY = "summary.json"


def machine() -> dict[str, Any]:
    from draftwise.bench.report import node_info

    info = node_info()
    return {"cpu": info["cpu"], "cores": info["cores"], "cpu_flags": kernel_flags(), "platform": platform.platform()}


def versions(llama_server: str | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    from draftwise import __version__

    found: dict[str, Any] = {"draftwise": __version__, "python": platform.python_version()}
    for package in ("llama_cpp_python", "torch", "transformers", "httpx"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    found["llama-server"] = llama_server
    return found


def subtask_counts(prompts: Sequence[LoadPrompt]) -> dict[str, int]:
    return dict(Counter(p.subtask for p in prompts))


def write_config(config: LoadConfig, command: str, date: str, prompts: Sequence[LoadPrompt], llama: str | None) -> Path:
    """``config.json``: the command, the settings, the prompts, the machine and the versions."""
    path = config.out / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "command": command,
        "date": date,
        "config": config.model_dump(mode="json"),
        "config_hash": config.results_hash(),
        "draft_model": config.draft_model,
        "threads": config.threads,
        "prompts": {"count": len(prompts), "by_subtask": subtask_counts(prompts)},
        "machine": machine(),
        "versions": versions(llama),
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def _identical(row: dict[str, Any]) -> str:
    if row["concurrency"] == 1:
        return "(reference)"
    if row["compared_to_alone"] is None:
        return "n/a (no C=1 run)"
    return f"{row['identical_to_alone']}/{row['compared_to_alone']}"


def _parsed(value: Sequence[int] | None) -> str:
    return "" if value is None else f"{value[0]}/{value[1]}"  # blank: no structured-output task


def _count(value: int | None) -> str:
    return "" if value is None else str(value)  # blank: the server reported no such count


def _drafted(value: dict[str, int] | None) -> str:
    """Draft tokens and the share kept; blank where the server did not say."""
    if value is None:
        return ""
    proposed, kept = value["proposed"], value["kept"]
    return f"{proposed} ({kept / proposed:.0%} kept)" if proposed else "0"


def rows_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| server | C | requests | errors | tokens | wall s | tok/s | request tok/s p50 | decode tok/s "
        "| decode tok/s after the 1st chunk | TTFT p50 s "
        "| TTFT p95 s | latency p50 s | latency p95 s | prediction accepted | prediction rejected "
        "| JSON answers | identical to alone | drafted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['errors']} | {r['completion_tokens']} "
            f"| {_fmt(r['wall_s'], '.1f')} | {_fmt(r['tok_s'], '.1f')} | {_fmt(r['request_tok_s_p50'], '.1f')} "
            f"| {_fmt(r['decode_tok_s'], '.1f')} | {_fmt(r['decode_after_first_chunk_tok_s'], '.1f')} "
            f"| {_fmt(r['ttft_p50_s'], '.3f')} | {_fmt(r['ttft_p95_s'], '.3f')} "
            f"| {_fmt(r['latency_p50_s'], '.2f')} | {_fmt(r['latency_p95_s'], '.2f')} "
            f"| {_count(r['accepted_prediction_tokens'])} | {_count(r['rejected_prediction_tokens'])} "
            f"| {_parsed(r.get('parsed_json'))} | {_identical(r)} | {_drafted(r.get('drafted'))} |"
        )
    return lines


def ratio_table(ratios: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| C | draftwise tok/s | best llama-server | its tok/s | its drafts | draftwise / best |",
        "|---|---|---|---|---|---|",
    ]
    for r in ratios:
        lines.append(
            f"| {r['concurrency']} | {_fmt(r['draftwise_tok_s'], '.1f')} | {r['best'] or 'n/a'} "
            f"| {_fmt(r['best_tok_s'], '.1f')} | {_drafted(r.get('best_drafted'))} "
            f"| {_fmt(r['ratio'], '.2f')}{'x' if r['ratio'] is not None else ''} |"
        )
    return lines


def repeat_section(rows: Sequence[dict[str, Any]]) -> list[str]:
    """With ``--repeat``: each server's tok/s run by run, and its ratio to the first server
    listed, run for run (the tables above hold each key's last run)."""
    if not rows:
        return []
    lines = [
        "## Run by run (`--repeat`: the servers' order reversed on every other pass)",
        "",
        f"Ratios are to {rows[0]['ratio_to']}, the n-th run of each against the n-th of the other.",
        "",
        "| server | C | tok/s, run by run | median | ratio, run by run | median ratio |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rates = ", ".join(_fmt(v, ".1f") for v in r["tok_s"])
        ratios = ", ".join(f"{v:.2f}x" for v in r["ratios"])
        median = f"{r['median_ratio']:.2f}x" if r["median_ratio"] is not None else ""
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {rates} | {_fmt(r['median_tok_s'], '.1f')} | {ratios} | {median} |"
        )
    return [*lines, ""]


def turn_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each server's requests by subtask and by their place in the subtask's sequence, and
    draftwise's over draftwise-off and over the best llama-server at the same place."""
    if not rows:
        return []
    at = {(r["concurrency"], r["subtask"], r["turn"], r["server"]): r for r in rows}
    lines = [
        "| subtask | turn | server | C | requests | tok/s (latency) | decode tok/s | / draftwise-off "
        "| / best llama-server |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["subtask"], r["concurrency"], r["turn"])):
        place = (r["concurrency"], r["subtask"], r["turn"])
        off = at.get((*place, "draftwise-off"), {}).get("tok_s")
        llama = [v["tok_s"] for key, v in at.items() if key[:3] == place and key[3] in LLAMA_SERVERS and v["tok_s"]]
        mine = r["tok_s"]
        over_off = f"{mine / off:.2f}x" if mine and off and r["server"] != "draftwise-off" else ""
        over_llama = f"{mine / max(llama):.2f}x" if mine and llama and r["server"] in DRAFTWISE_SERVERS else ""
        lines.append(
            f"| {r['subtask']} | {r['turn']} | {r['server']} | {r['concurrency']} | {r['requests']} "
            f"| {_fmt(r['tok_s'], '.1f')} | {_fmt(r['decode_tok_s'], '.1f')} | {over_off} | {over_llama} |"
        )
    return lines


def mismatch_section(audits: Sequence[dict[str, Any]] | None, compared: int) -> list[str]:
    if compared == 0:
        return ["None compared: that needs a run at C = 1 and one above it of the same server."]
    if audits is None:
        return ["Not audited (--no-audit): see the table above for how many answers differ."]
    if not audits:
        return [f"None: every one of the {compared} answers compared is identical to its answer alone."]
    ties = sum(a["near_tie"] for a in audits)
    lines = [
        f"{len(audits)} of {compared} answers differ from their answer alone; {ties} of them first differ at a "
        f"near tie (top-2 logit gap < {NEAR_TIE}), where batched kernels may round either way.",
        "",
        "| server | C | prompt | token | alone | loaded | top-2 gap | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in audits:
        verdict = "near tie" if a["near_tie"] else ("unknown" if a["top2_gap"] is None else "CLEAR PREFERENCE")
        lines.append(
            f"| {a['server']} | {a['concurrency']} | {a['prompt_id']} | {_fmt(a['position'], 'd')} "
            f"| {json.dumps(a['alone_token'])} | {json.dumps(a['loaded_token'])} | {_fmt(a['top2_gap'], '.3f')} "
            f"| {verdict} |"
        )
    return lines


METHOD = """Each server runs as a child process on 127.0.0.1 (one start per server and concurrency C,
with C slots), gets one untimed warm-up request, then C streaming clients share the prompt list:
each client sends the next unsent prompt as soon as its previous answer has ended, until every
prompt was sent once. Code prompts go raw to `/v1/completions`; chat prompts, code-edit tasks and
structured-output tasks go as one user message to `/v1/chat/completions`; greedy (temperature 0),
the same `max_tokens`, no `ignore_eos` (draftwise's API has none), so an answer may end early at
the model's end of turn. A code-edit task's request carries its predicted answer (OpenAI's
`prediction`: the file unchanged) to `draftwise` only; `draftwise-noprediction` is the same server
asked without it, and llama-server gets none. A structured-output task's request carries its
`response_format` (a JSON schema), or its tools and `tool_choice`, to every server (llama-server
then runs with `--jinja`).

- tok/s: the run's completion tokens (the servers' own `usage` counts) over its wall time, from the
  first request sent to the last stream ended.
- request tok/s: one request's completion tokens over its latency (prefill included).
- decode tok/s: the tokens after each request's first over the time after its first token, summed
  over the run's requests (sum(tokens - 1) / sum(latency - TTFT)): the generation speed a stream
  sees once it has started, prefill and queueing left out.
- decode tok/s after the 1st chunk: the text streamed after each request's first chunk, tokenized
  with the target's tokenizer, over the same time. Where a chunk carries several tokens (a block
  of accepted tokens, a tool call's forced opening before its first argument) the column before
  counts them as decoded after the first token; this one does not. It reads low where the text
  was not decoded as the tokenizer would cut it (a run of newlines written a token at a time
  becomes one or two tokens) and leaves out tokens with no text (markup, the end of turn).
- TTFT: to the first chunk that carries text; latency: to the end of the stream.
- prediction accepted / rejected: the summed `usage.completion_tokens_details` counts of the answers
  (blank where the server reported none).
- JSON answers: the structured-output answers that parse as JSON (a tool call's: its arguments),
  of those answered (blank without such tasks).
- drafted: the draft tokens the server proposed over the run's requests (the warm-up left out)
  and the share its target kept, as the server says: draftwise's `/metrics` counters, read before
  and after; llama-server's log line as each request ends. `0`: a speculative configuration that
  drafted nothing decoded plainly, and what sets it apart from plain decoding is not speculation.
- identical to alone: the answer's text equals the same prompt's answer on the same server at C = 1.
  Where it differs, both texts are tokenized with the target's tokenizer and the target (loaded in
  the benchmark's process) gives its top-2 logit gap before the first differing token."""


def _header(config: LoadConfig, info: dict[str, Any], prompts: Sequence[LoadPrompt]) -> list[str]:
    m, v = info["machine"], info["versions"]
    by_subtask = ", ".join(f"{k} {n}" for k, n in subtask_counts(prompts).items())
    edits = sum(p.prediction is not None for p in prompts)
    predicted = [s for s in config.servers if sends_prediction(s)]
    edit_line = f"- code edits: {edits} from {config.edit}, with their prediction to {', '.join(predicted) or 'none'}"
    structured = sum(p.structured is not None for p in prompts)
    structured_line = f"- structured output: {structured} from {config.structured}, with their schema or tools"
    return [
        f"# draftwise load: {config.target} (draft: {config.draft_model or 'none'})",
        "",
        f"- draftwise's drafter: {config.drafter or 'what draftwise serve picks for these models'}",
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, flags {' '.join(m['cpu_flags']) or 'none'}",
        f"- versions: draftwise {v['draftwise']}, llama-cpp-python {v['llama_cpp_python']}, "
        f"llama-server {v['llama-server'] or 'n/a'}",
        f"- threads {config.threads}, context {config.context} per slot, max_tokens {config.max_tokens}, greedy",
        f"- prompts: {len(prompts)} ({by_subtask}), each sent once per server and concurrency",
        *([edit_line] if edits else []),
        *([structured_line] if structured else []),
    ]


def write_report(
    config: LoadConfig,
    info: dict[str, Any],
    prompts: Sequence[LoadPrompt],
    summary: dict[str, Any],
) -> Path:
    """``report.md`` and ``summary.json`` from the summary of the finished runs."""
    rows, audits = summary["rows"], summary["mismatches"]
    compared = sum(r["compared_to_alone"] or 0 for r in rows)
    commands = [f"  - {name} (C={level}): `{command}`" for name, level, command in summary["commands"]]
    lines = [
        *_header(config, info, prompts),
        "- server commands:",
        *commands,
        "",
        "## Throughput and latency per server and concurrency",
        "",
        *rows_table(rows),
        "",
        "## draftwise against the best llama-server configuration",
        "",
        *ratio_table(summary["against_llama"]),
        "",
        *repeat_section(summary.get("run_by_run", [])),
        "## By turn: each request's place among its subtask's, in the order sent (1 client)",
        "",
        *turn_table(summary.get("by_turn", [])),
        "",
        "## Answers that differ from the same request alone",
        "",
        *mismatch_section(audits, compared),
        "",
        "## How it was measured",
        "",
        METHOD,
        "",
    ]
    path = config.out / REPORT
    path.write_text("\n".join(lines))
    (config.out / SUMMARY).write_text(json.dumps({**info, **summary}, indent=2) + "\n")
    return path
