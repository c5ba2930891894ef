"""Run the bench: every method on the same prompts, interleaved, results saved as they come.

For prompt i the methods run in the configured order rotated by i, so slow drift in the
machine's speed (thermal, other processes) hits every method alike. Multi-turn prompts feed
each method its own earlier answers, as Spec-Bench does.
"""

from __future__ import annotations

import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean
from typing import Any

from draftwise.bench.analysis import decode_rate, percentile, summarize, token_latencies
from draftwise.bench.audit import score_output
from draftwise.bench.config import REFERENCE, BenchConfig, BenchError
from draftwise.bench.dataset import Prompt, load_prompts
from draftwise.bench.methods import build_methods
from draftwise.bench.report import node_info
from draftwise.bench.store import Record, ResultStore, record_key
from draftwise.bench.trace import Method, Trace
from draftwise.chat import encode_messages, encode_raw
from draftwise.config import GenerationConfig
from draftwise.lm import LanguageModel, Tokenizer
from draftwise.loading import load_draft
from draftwise.prepare import Pair, prepare, prepare_pair

RESULTS = "results.jsonl"
WARMUP_TOKENS = 8
# Runs a bench's pending units elsewhere (on Ray workers), handing each record to the
# recorder; returns how many units ran again after their worker died.
Measure = Callable[["Bench", "Recorder"], int]


class PromptBuilder:
    """Turns a conversation so far into prompt token ids.

    With a chat template (and ``use_chat``), the turns and the model's answers become user
    and assistant messages; without one the texts are joined by blank lines.
    """

    def __init__(self, tokenizer: Tokenizer, use_chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = bool(use_chat and getattr(tokenizer, "chat_template", None))

    def ids(self, turns: Sequence[str], answers: Sequence[str]) -> list[int]:
        if self.chat:
            messages = []
            for i, turn in enumerate(turns):
                messages.append({"role": "user", "content": turn})
                if i < len(answers):
                    messages.append({"role": "assistant", "content": answers[i]})
            return encode_messages(self.tokenizer, messages)
        parts = [x for pair in zip(turns, [*answers, ""]) for x in pair if x]
        return encode_raw(self.tokenizer, "\n\n".join(parts), parse_special=False)  # prompts are text


def sampling_seed(base: int | None, prompt_id: str, turn: int) -> int | None:
    """A per-prompt seed derived from the configured one, so results do not depend on which
    other prompts were selected; every method gets the same seed on the same prompt."""
    return None if base is None else base + zlib.crc32(f"{prompt_id}/{turn}".encode())


def interleave_subtasks(prompts: Sequence[Prompt]) -> list[Prompt]:
    """The prompts in run order: one of each subtask in turn, so that a run stopped early
    (it resumes later) already covers every subtask.

    >>> [p.id for p in interleave_subtasks([Prompt("a1", "a", "", ("x",)), Prompt("a2", "a", "", ("x",)),
    ...                                      Prompt("b1", "b", "", ("x",))])]
    ['a1', 'b1', 'a2']
    """
    by_subtask: dict[str, list[Prompt]] = defaultdict(list)
    for prompt in prompts:
        by_subtask[prompt.subtask].append(prompt)
    rounds = max((len(group) for group in by_subtask.values()), default=0)
    return [group[i] for i in range(rounds) for group in by_subtask.values() if i < len(group)]


@dataclass
class _Live:
    """Running tokens/s per method, for the progress bar."""

    rates: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, record: Record) -> None:
        self.rates[record["method"]].append(record["tokens_per_second"])

    def describe(self, methods: Sequence[str]) -> str:
        ref = mean(self.rates[REFERENCE]) if self.rates.get(REFERENCE) else 0.0
        parts = [
            f"{m} {mean(self.rates[m]) / ref:.2f}x" for m in methods if m != REFERENCE and self.rates.get(m) and ref > 0
        ]
        return " | ".join(parts)


def _record(
    trace: Trace,
    prompt: Prompt,
    turn: int,
    method: str,
    position: int,
    config_hash: str,
    prompt_ids: Sequence[int],
    text: str,
    perplexity: float | None,
    gaps: list[float],
) -> Record:
    record: Record = {
        "key": record_key(prompt.id, turn, method, config_hash),
        "config_hash": config_hash,
        "prompt_id": prompt.id,
        "subtask": prompt.subtask,
        "category": prompt.category,
        "turn": turn,
        "method": method,
        "run_position": position,
        "finished_at": time.time(),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": len(trace.tokens),
        "tokens": trace.tokens,
        "text": text,
        "finish_reason": trace.finish_reason,
        "wall_seconds": trace.wall_seconds,
        "tokens_per_second": len(trace.tokens) / trace.wall_seconds if trace.wall_seconds > 0 else 0.0,
        "ttft_seconds": trace.arrivals[0] if trace.arrivals and trace.timed_deliveries else None,
        "timed_deliveries": trace.timed_deliveries,
        "arrivals": trace.arrivals,
        "step_tokens": trace.step_tokens,
        "steps": trace.steps,
        "metrics": trace.metrics,
        "rollback_seconds": trace.rollback_seconds,
        "perplexity": perplexity,
        # Only the reference's gaps are needed: the audit looks them up at the first mismatch.
        "top2_logit_gaps": [round(g, 5) for g in gaps] if method == REFERENCE else None,
    }
    latencies = token_latencies(record)
    record["latency_p50_s"] = percentile(latencies, 50)
    record["latency_p95_s"] = percentile(latencies, 95)
    record["decode_tokens_per_second"] = decode_rate(record)
    return record


def load_models(config: BenchConfig) -> Pair:
    """The bench's pair, prepared as every entry point prepares it (warmed up, its costs
    measured for the cost policy); the draft model only where a method needs it."""
    draft = config.draft if config.needs_draft_model else None
    return prepare_pair(config.target, draft, config.models, config.generation.draft)


def load_other_drafts(config: BenchConfig, target: LanguageModel) -> dict[str, Pair]:
    """Each of ``config.other_drafts`` loaded for the bench's ``target`` and prepared (warmed
    up, its costs measured), as ``load_models`` prepares the pair."""
    return {
        name: prepare(target, load_draft(target, config.target, name, config.models), config.generation.draft)
        for name in config.other_drafts
    }


def generation_for(
    config: BenchConfig, prompt: Prompt, turn: int, max_new_tokens: int | None = None
) -> GenerationConfig:
    """The generation settings of one turn: the configured ones, seeded for this prompt and turn."""
    g = config.generation
    sampling = g.sampling.model_copy(update={"seed": sampling_seed(g.sampling.seed, prompt.id, turn)})
    return g.model_copy(update={"sampling": sampling, "max_new_tokens": max_new_tokens or g.max_new_tokens})


def shown_runs(config: BenchConfig) -> list[str]:
    """The runs the progress bar and the plots show: all but a sweep's fixed-length runs, which
    would crowd them (a dozen more bars per subtask); the report's regret section covers those."""
    return [m for m in config.runs if m not in config.sweep_runs]


def unit_keys(prompt: Prompt, config: BenchConfig, config_hash: str) -> list[str]:
    """The record keys of one unit: every turn of ``prompt`` by every method."""
    return [record_key(prompt.id, t, m, config_hash) for t in range(len(prompt.turns)) for m in config.runs]


class UnitRunner:
    """Runs units of work on one process's models: a unit is one prompt, every method on it,
    interleaved, so every speedup is a ratio measured on one machine. The local bench runs its
    units one after another; ``draftwise bench --ray`` gives each Ray worker a ``UnitRunner``."""

    def __init__(self, config: BenchConfig, pair: Pair, node: dict[str, Any] | None = None) -> None:
        self.config = config
        self.config_hash = config.results_hash()
        self.target = pair.target
        others = load_other_drafts(config, pair.target)
        self.methods, self._timers = build_methods(config, pair.target, pair.draft, pair.profile, others)
        if pair.target.tokenizer is None:
            raise BenchError(f"the target model {config.target!r} has no tokenizer; the bench needs one")
        self.builder = PromptBuilder(pair.target.tokenizer, config.chat_template)
        self.node = node or node_info()  # which machine ran each record, and its CPU
        self._scores: dict[int, tuple[float | None, list[float]]] = {}

    def warm_up(self, prompt: Prompt) -> None:
        """Run every method once on ``prompt``'s first turn, untimed."""
        warm_ids = self.builder.ids(prompt.turns[:1], [])
        warm = generation_for(self.config, prompt, 0, min(WARMUP_TOKENS, self.config.generation.max_new_tokens))
        for method in self.methods.values():
            method.run(warm_ids, warm)

    def run(
        self,
        index: int,
        prompt: Prompt,
        stored: Callable[[str], Record | None],
        emit: Callable[[Record], None],
        describe: Callable[[str], None] | None = None,
    ) -> None:
        """Run the records of ``prompt`` not yet ``stored`` (key -> record), ``index``-th in the run
        order (the methods' order rotates by it); ``emit`` each new record as it finishes."""
        names = list(self.methods)
        order = names[index % len(names) :] + names[: index % len(names)]
        answers: dict[str, list[str]] = {name: [] for name in names}
        for turn in range(len(prompt.turns)):
            for position, name in enumerate(order):
                record = stored(record_key(prompt.id, turn, name, self.config_hash))
                if record is None:
                    if describe is not None:
                        describe(f"{prompt.subtask} {prompt.id}.{turn + 1} {name}")
                    record = self._run_one(self.methods[name], prompt, turn, position, answers[name])
                    emit(record)
                answers[name].append(record["text"])

    def _run_one(self, method: Method, prompt: Prompt, turn: int, position: int, answers: Sequence[str]) -> Record:
        prompt_ids = self.builder.ids(prompt.turns[: turn + 1], answers)
        trace = method.run(prompt_ids, generation_for(self.config, prompt, turn))
        # Scoring is outside the timed region; identical outputs (the usual case) are scored once.
        memo = hash((tuple(prompt_ids), tuple(trace.tokens)))
        if memo not in self._scores:
            self._scores[memo] = score_output(self.target, prompt_ids, trace.tokens)
        perplexity, gaps = self._scores[memo]
        tokenizer = self.target.tokenizer
        assert tokenizer is not None  # the prompts were built with it
        text = tokenizer.decode(trace.tokens, skip_special_tokens=True)
        record = _record(
            trace, prompt, turn, method.name, position, self.config_hash, prompt_ids, text, perplexity, gaps
        )
        record["chat_template"] = self.builder.chat
        record["node"] = self.node
        return record

    def close(self) -> None:
        for timer in self._timers:
            timer.close()


class Recorder:
    """Where finished records go: the results file, the progress bar and ``on_record``."""

    def __init__(
        self,
        store: ResultStore,
        done: Sequence[Record],
        todo: int,
        progress: Any,
        on_record: Callable[[Record], None] | None,
        methods: Sequence[str],
    ) -> None:
        self.store = store
        self.progress = progress
        self.on_record = on_record
        self.methods = list(methods)
        self.live = _Live()
        for record in done:
            self.live.add(record)
        self.task = (
            progress.add_task("bench", total=todo, speedup=self.live.describe(self.methods)) if progress else None
        )

    def describe(self, text: str) -> None:
        if self.progress:
            self.progress.update(self.task, description=text)

    def add(self, record: Record) -> None:
        if self.store.get(record["key"]) is not None:
            return  # a unit run twice (its first worker died after answering) counts once
        self.store.append(record)
        self.live.add(record)
        if self.progress:
            self.progress.update(self.task, advance=1, speedup=self.live.describe(self.methods))
        if self.on_record is not None:
            self.on_record(record)


class Bench:
    """One bench run over a configuration; ``run`` measures, ``summary`` analyses."""

    def __init__(self, config: BenchConfig) -> None:
        if config.generation.stop or config.generation.ignore_eos:
            raise BenchError(
                "the bench runs every method, its anchors included (llama.cpp's and transformers' own "
                "decoding loops), to the model's EOS or the token limit; stop strings and ignore_eos have no "
                "equivalent there: leave them unset"
            )
        self.config = config
        self.prompts = load_prompts(config.data, config.subtasks, config.limit)
        self.config_hash = config.results_hash()
        self.store = ResultStore(config.out / RESULTS)
        self.retried_units = 0  # --ray: units run again because their worker died

    def pending(self) -> int:
        """Units (prompt, turn, method) not yet in the results file."""
        return sum(
            self.store.get(key) is None for p in self.prompts for key in unit_keys(p, self.config, self.config_hash)
        )

    def pending_units(self) -> list[tuple[int, Prompt]]:
        """(position in the run order, prompt) of every prompt with a record still to run."""
        return [
            (index, prompt)
            for index, prompt in enumerate(interleave_subtasks(self.prompts))
            if any(self.store.get(key) is None for key in unit_keys(prompt, self.config, self.config_hash))
        ]

    def load_models(self) -> Pair:
        return load_models(self.config)

    def run(
        self,
        progress: Any = None,
        on_record: Callable[[Record], None] | None = None,
        models: Pair | None = None,
        measure: Measure | None = None,
    ) -> list[Record]:
        """Run every pending unit; return the records of this configuration and selection.

        ``progress`` is a rich ``Progress`` (or None); ``on_record`` sees each new record. The
        units run here on ``models`` (prepared here unless given), or, given ``measure``, by it
        (``draftwise bench --ray`` passes ``draftwise.cluster.bench.measure_on_ray``): the
        caller chooses, so the bench never imports the Ray code above it.
        """
        if self.config.ray is not None and measure is None:
            raise BenchError("this bench runs on Ray workers (config.ray): pass the measure that runs them")
        self.config.out.mkdir(parents=True, exist_ok=True)
        (self.config.out / "config.json").write_text(self.config.model_dump_json(indent=2) + "\n")
        todo = self.pending()
        if todo:
            recorder = Recorder(self.store, self.records(), todo, progress, on_record, shown_runs(self.config))
            if measure is not None:
                self.retried_units += measure(self, recorder)
            else:
                self._measure(models or self.load_models(), recorder)
        return self.records()

    def records(self) -> list[Record]:
        wanted = {p.id for p in self.prompts}
        return [
            r
            for r in self.store.records(self.config_hash)
            if r["prompt_id"] in wanted and r["method"] in self.config.runs
        ]

    def _measure(self, pair: Pair, recorder: Recorder) -> None:
        runner = UnitRunner(self.config, pair)
        try:
            if self.config.warmup:
                runner.warm_up(self.prompts[0])
            for index, prompt in enumerate(interleave_subtasks(self.prompts)):
                runner.run(index, prompt, self.store.get, recorder.add, recorder.describe)
        finally:
            runner.close()

    def summary(self) -> dict[str, Any]:
        greedy = self.config.generation.sampling.greedy
        return summarize(self.records(), self.prompts, self.config.runs, greedy)


def run_bench(
    config: BenchConfig,
    *,
    command: str | None = None,
    progress: Any = None,
    on_record: Callable[[Record], None] | None = None,
    models: Pair | None = None,
    measure: Measure | None = None,
) -> Path:
    """Measure what is pending (see ``Bench.run``), then write summary.json, the plots and
    report.md; return the report's path."""
    from draftwise.bench.plots import write_plots
    from draftwise.bench.report import write_report

    bench = Bench(config)
    records = bench.run(progress=progress, on_record=on_record, models=models, measure=measure)
    summary = bench.summary()
    plots = write_plots(config.out, summary, records, shown_runs(config))
    return write_report(config.out, summary, config, bench.prompts, records, command, [str(p) for p in plots])
