"""Running the load benchmark: every server at every concurrency, then the report.

A run is one (server, C): the server started with C slots, one warm-up request, every prompt
sent once by C clients (an edit task with its prediction where ``sends_prediction``). Its
records (one per request, then one for the run) are written to ``results.jsonl`` when it ends,
so an interrupted benchmark keeps its finished runs and the same command later runs only the
missing ones (a run cut short leaves requests without a run record, which are ignored).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftwise.bench.store import ResultStore
from draftwise.loadbench.client import Answer, Endpoint, page, run_level
from draftwise.loadbench.config import DRAFTWISE_SERVERS, LLAMA_SERVERS, LoadConfig, LoadError, sends_prediction
from draftwise.loadbench.drafted import Drafted, from_llama_log, from_metrics
from draftwise.loadbench.prompts import LoadPrompt, load_prompts
from draftwise.loadbench.servers import (
    Server,
    draftwise_settings,
    llama_server_version,
    running,
    served_model,
    server_for,
)
from draftwise.loadbench.stats import (
    Run,
    RunKey,
    against_llama,
    alone_texts,
    by_turn,
    last_runs,
    mismatches,
    run_by_run,
    runs_by_key,
    summarize,
)

RESULTS = "results.jsonl"
LOGS = "logs"
WARMUP_TOKENS = 8
Log = Callable[[str], None]


def request_record(answer: Answer, run: dict[str, Any]) -> dict[str, Any]:
    p = answer.prompt
    return {
        "key": f"{run['key']}/{p.id}",
        "kind": "request",
        **{k: run[k] for k in ("config_hash", "run_id", "server", "concurrency")},
        "prompt_id": p.id,
        "subtask": p.subtask,
        "chat": p.chat,
        "edit": p.prediction is not None,
        "structured": p.structured is not None,
        "predicted": p.prediction is not None and sends_prediction(run["server"]),  # sent with its prediction
        "start_s": answer.start_s,
        "status": answer.status,
        "ok": answer.ok,
        "error": answer.error,
        "ttft_s": answer.ttft_s,
        "first_chunk_chars": answer.first_chunk_chars,
        "latency_s": answer.latency_s,
        "completion_tokens": answer.completion_tokens,
        "accepted_prediction_tokens": answer.accepted_prediction_tokens,
        "rejected_prediction_tokens": answer.rejected_prediction_tokens,
        "finish_reason": answer.finish_reason,
        "text": answer.text,
    }


class LoadBench:
    """One benchmark over a configuration; ``run`` measures, ``summary`` sums up."""

    def __init__(self, config: LoadConfig, log: Log = lambda line: None) -> None:
        self.config = config
        self.log = log
        self.prompts: list[LoadPrompt] = load_prompts(config)
        self.config_hash = config.results_hash()
        self.store = ResultStore(config.out / RESULTS)

    def all_runs(self) -> dict[RunKey, list[Run]]:
        """Every finished run this configuration asks for, by key, in the order they ran."""
        runs = runs_by_key(self.store.records(), self.config_hash)
        wanted = {(s, c) for s in self.config.servers for c in self.config.concurrency}
        return {key: found for key, found in runs.items() if key in wanted}

    def pending(self) -> list[RunKey]:
        """The runs still to do, in order: each server at each concurrency ``repeat`` times,
        the servers' order reversed on every other pass over them (A B, then B A), so that a
        server measured first on a fresh machine is measured last too."""
        done = {key: len(runs) for key, runs in self.all_runs().items()}
        servers = self.config.servers
        todo: list[RunKey] = []
        for turn in range(self.config.repeat):
            for name in servers if turn % 2 == 0 else servers[::-1]:
                todo += [(name, level) for level in self.config.concurrency if done.get((name, level), 0) <= turn]
        return todo

    def check(self) -> None:
        """Fail before anything starts: models not pulled, binaries or files missing."""
        from draftwise.loading import resolve

        if self.config.url is not None:
            if self.config.audit:
                resolve(self.config.target)  # loaded here at the end, to score differing answers
            return
        resolve(self.config.target)
        if self.config.draft_model is not None:
            resolve(self.config.draft_model)
        for name in dict.fromkeys(s for s, _ in self.pending()):
            server_for(name, self.config, 1)

    @contextmanager
    def _serving(self, name: str, level: int) -> Iterator[tuple[Endpoint, str]]:
        """(where to send requests, the command that serves them) of ``name`` with ``level``
        slots, for as long as needed: a running server, one started here as a program, or with
        ``in_process`` draftwise's app in this process."""
        if self.config.url is not None:
            base = self.config.url.rstrip("/")
            yield Endpoint(base, served_model(base)), f"running server at {base}"
            return
        server: Server = server_for(name, self.config, level)
        if self.config.in_process and name in DRAFTWISE_SERVERS:
            from draftwise.loadbench.inprocess import IN_PROCESS, in_process

            self.log(f"loading {name} with {level} slot(s) in this process")
            with in_process(draftwise_settings(self.config, level, name)) as transport:
                yield Endpoint(IN_PROCESS, server.model, transport), f"{server.shown} (in process, without HTTP)"
            return
        log = self._log_of(name, level)
        self.log(f"starting {name} with {level} slot(s) (log: {log})")
        with running(server, log, self.config.startup_timeout) as base:
            yield Endpoint(base, server.model), server.shown

    def _log_of(self, name: str, level: int) -> Path:
        return self.config.out / LOGS / f"{name}-c{level}.log"

    def _drafted(self, name: str, level: int, counted: Drafted | None) -> Drafted | None:
        """What the run drafted: draftwise's counts (``counted``, from ``/metrics``), else a
        llama-server's started here, from its log; None where neither says."""
        log = self._log_of(name, level)
        if counted is not None or self.config.url is not None or name not in LLAMA_SERVERS or not log.exists():
            return counted
        return from_llama_log(log.read_text(errors="replace"), skip_first=self.config.warmup)

    def _warm_up(self, endpoint: Endpoint, name: str) -> None:
        """One short untimed request; a server that cannot answer it stops the benchmark."""
        tokens = min(WARMUP_TOKENS, self.config.max_tokens)
        timeout, predict = self.config.request_timeout, sends_prediction(name)
        answers, _ = run_level(endpoint, self.prompts[:1], 1, tokens, timeout, predict=predict)
        if not answers[0].ok:
            raise LoadError(f"{name} failed the warm-up request: {answers[0].error}")

    def run_one(self, name: str, level: int, advance: Callable[[], None]) -> dict[str, Any]:
        """Measure ``name`` at concurrency ``level``; its records are stored when it ends."""
        config = self.config
        with self._serving(name, level) as (endpoint, command):
            if config.warmup:
                self._warm_up(endpoint, name)
            before = from_metrics(page(endpoint, "/metrics") or "")
            answers, wall = run_level(
                endpoint,
                self.prompts,
                level,
                config.max_tokens,
                config.request_timeout,
                lambda a: advance(),
                predict=sends_prediction(name),
            )
            after = from_metrics(page(endpoint, "/metrics") or "")
        drafted = self._drafted(name, level, after - before if after is not None and before is not None else None)
        failed = [a for a in answers if not a.ok]
        if len(failed) == len(answers):  # nothing measured: say why rather than store it
            raise LoadError(f"{name} C={level}: every request failed, the first with {failed[0].error}")
        run_id = uuid.uuid4().hex[:12]
        run = {
            "key": f"{self.config_hash}/{name}/{level}/{run_id}",
            "kind": "run",
            "config_hash": self.config_hash,
            "run_id": run_id,
            "server": name,
            "concurrency": level,
            "wall_s": wall,
            "requests": len(answers),
            "command": command,
            "drafted": drafted.record() if drafted is not None else None,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        for answer in answers:
            self.store.append(request_record(answer, run))
        self.store.append(run)
        if failed:
            self.log(f"{name} C={level}: {len(failed)} request(s) failed, the first: {failed[0].error}")
        return run

    def summary(self) -> dict[str, Any]:
        """Rows per (server, C), draftwise against llama-server, and the audited mismatches."""
        every = self.all_runs()
        runs = last_runs(every)  # the tables hold each key's last run; "Run by run", all of them
        rank: dict[str, int] = {name: i for i, name in enumerate(self.config.servers)}
        ordered = sorted(runs, key=lambda k: (rank[k[0]], k[1]))
        needs_count = any(r["ok"] and r["completion_tokens"] is None for run in runs.values() for r in run.requests)
        found = mismatches(runs)
        lm = self._target() if self.config.audit and found else None
        tokenizer = lm.tokenizer if lm is not None else self._tokenizer(needs_count)
        count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer is not None else None
        rows = [summarize(runs[key], alone_texts(runs, key[0]), count) for key in ordered]
        audits = None
        if self.config.audit:
            from draftwise.loadbench.audit import audit

            audits = audit(lm, self.prompts, found) if found else []
        commands = [(key[0], key[1], runs[key].record["command"]) for key in ordered]
        turns = by_turn({key: runs[key] for key in ordered}, turns_of(self.prompts), count)
        repeated = run_by_run(every, self.config.servers, count) if any(len(r) > 1 for r in every.values()) else []
        return {
            "rows": rows,
            "against_llama": against_llama(rows),
            "by_turn": turns,
            "run_by_run": repeated,
            "mismatches": audits,
            "commands": commands,
        }

    def _tokenizer(self, needed: bool) -> Any:
        """The target's tokenizer (its vocabulary only), to count the text of answers: always
        when the servers ran here, since the target is pulled; against ``--url`` only where a
        server did not count its tokens (the model may not be here)."""
        if not needed and self.config.url is not None:
            return None
        from draftwise.loading import load_tokenizer

        return load_tokenizer(self.config.target, self.config.models)

    def _target(self) -> Any:
        from draftwise.loading import load_lm

        self.log(f"loading {self.config.target} here to score the answers that differ from alone")
        options = self.config.models.model_copy(update={"threads": self.config.threads, "context": self.config.context})
        return load_lm(self.config.target, options)


def turns_of(prompts: Sequence[LoadPrompt]) -> dict[str, int]:
    """Each prompt's place (1-based) among its subtask's, in the order they are sent."""
    seen: dict[str, int] = {}
    found = {}
    for prompt in prompts:
        seen[prompt.subtask] = seen.get(prompt.subtask, 0) + 1
        found[prompt.id] = seen[prompt.subtask]
    return found


def run_load(config: LoadConfig, command: str, progress: Any = None, log: Log = lambda line: None) -> Path:
    """The whole benchmark: the runs still missing, then ``report.md``; returns its path."""
    from draftwise.loadbench.report import write_config, write_report

    bench = LoadBench(config, log)
    bench.check()
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    wants_llama = config.url is None and bool(LLAMA_SERVERS & set(config.servers))
    llama = llama_server_version(config) if wants_llama else None
    write_config(config, command, date, bench.prompts, llama)
    pending = bench.pending()
    levels = ",".join(map(str, config.concurrency))
    log(
        f"load: {len(pending)} run(s) to do ({', '.join(config.servers)} at C={levels}; "
        f"{len(bench.prompts)} prompts, {config.max_tokens} tokens) -> {config.out}"
    )
    task = progress.add_task("load", total=len(pending) * len(bench.prompts)) if progress is not None else None
    for name, level in pending:
        if progress is not None:
            progress.update(task, description=f"{name} C={level}")
        bench.run_one(name, level, lambda: progress.advance(task) if progress is not None else None)
    from draftwise.loadbench.report import machine, versions

    info = {"command": command, "date": date, "machine": machine(), "versions": versions(llama)}
    return write_report(config, info, bench.prompts, bench.summary())
