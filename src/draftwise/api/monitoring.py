"""Prometheus metrics of one server, in a registry of its own (never the global one), so
two apps in one process (tests, embedding) never share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from draftwise.events import StepEvent
from draftwise.scheduler import RoundStats
from draftwise.suffix import SuffixStore

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "draftwise_requests", "HTTP requests by endpoint and status code", ["endpoint", "code"], registry=r
        )
        self.generations = Counter(
            "draftwise_generations",
            "finished generations by finish reason (eos, stop, length, disconnect, timeout, error)",
            ["finish_reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "draftwise_generations_cancelled",
            "generations stopped early, by reason (disconnect, timeout)",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter("draftwise_requests_rejected", "requests refused with 429 (queue full)", registry=r)
        self.prompt_tokens = Counter("draftwise_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "draftwise_prompt_tokens_cached",
            "prompt tokens a slot's cache held from its last request, not prefilled again",
            registry=r,
        )
        self.tokens = Counter(
            "draftwise_generated_tokens",
            "tokens generated (including work a disconnected client never read)",
            registry=r,
        )
        self.target_passes = Counter(
            "draftwise_target_passes", "target model forward passes (one per step)", registry=r
        )
        self.proposed = Counter("draftwise_draft_tokens_proposed", "draft tokens proposed", registry=r)
        self.accepted = Counter("draftwise_draft_tokens_accepted", "draft tokens the target accepted", registry=r)
        self.proposed_at = Counter(
            "draftwise_draft_position_proposed", "proposals reaching block position", ["position"], registry=r
        )
        self.accepted_at = Counter(
            "draftwise_draft_position_accepted",
            "draft tokens accepted at block position (acceptance by position = accepted / proposed)",
            ["position"],
            registry=r,
        )
        self.queue_depth = Gauge("draftwise_queue_depth", "admitted requests waiting for a slot", registry=r)
        self.active = Gauge("draftwise_active_generations", "generations running on a slot", registry=r)
        self.round_seconds = Gauge(
            "draftwise_round_thread_seconds",
            "the round thread's seconds since start: in passes (passes), or between them in the streams' own "
            "work, admissions included (between); the rest it waited for work",
            ["part"],
            registry=r,
        )
        self.rounds = Gauge("draftwise_rounds", "rounds run since start", registry=r)
        self.drafted = Counter(
            "draftwise_draft_tokens_by_source",
            "draft tokens by source (model, ngram, suffix, prediction, grammar) and whether the target kept them",
            ["source", "kept"],
            registry=r,
        )
        self.suffix_tokens = Gauge(
            "draftwise_suffix_tokens", "tokens kept of earlier outputs to draft from (draftwise.suffix)", registry=r
        )
        self.suffix_outputs = Gauge("draftwise_suffix_outputs", "earlier outputs kept to draft from", registry=r)
        self.suffix_cap = Gauge("draftwise_suffix_cap_tokens", "most tokens of earlier outputs kept", registry=r)
        self._add_histograms(r)

    def watch_suffix(self, store: SuffixStore) -> None:
        """Read the suffix store's size at each scrape."""
        self.suffix_tokens.set_function(lambda: store.size)
        self.suffix_outputs.set_function(lambda: store.documents)
        self.suffix_cap.set(store.config.cap_tokens)

    def watch_rounds(self, stats: RoundStats) -> None:
        """Read the scheduler's ``stats`` at each scrape: where the round thread's time went."""
        self.round_seconds.labels("passes").set_function(lambda: stats.passing)
        self.round_seconds.labels("between").set_function(lambda: stats.advancing)
        self.rounds.set_function(lambda: stats.rounds)

    def _add_histograms(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "draftwise_time_to_first_token_seconds",
            "request arrival to first generated token (queueing and prefill included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "draftwise_queue_wait_seconds",
            "request arrival to the start of its generation on a free slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pass_rows = Histogram(
            "draftwise_pass_rows",
            "rows of the target pass behind each step, other streams' rows included (slots share passes)",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
            registry=r,
        )
        self.token_latency = Histogram(
            "draftwise_time_per_output_token_seconds",
            "step time divided by the tokens the step emitted, once per token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def means(self) -> dict[str, float | None]:
        """Rows per target pass and seconds of queue wait, averaged since the start (/health)."""
        return {"rows_per_pass": _mean(self.pass_rows), "queue_wait_seconds": _mean(self.queue_wait)}

    def observe_step(self, event: StepEvent, since_arrival: float | None) -> None:
        """Record one engine step; ``since_arrival`` is set on a request's first step (its TTFT)."""
        if not event.target_pass:  # the closing event of a run the target could not take further
            return
        self.target_passes.inc()
        self.tokens.inc(len(event.tokens))
        self.proposed.inc(len(event.proposed))
        self.accepted.inc(event.n_accepted)
        for source, proposed, kept in event.drafted_by():
            self.drafted.labels(source, "yes").inc(kept)
            self.drafted.labels(source, "no").inc(proposed - kept)
        for i in range(len(event.proposed)):
            self.proposed_at.labels(str(i)).inc()
            if i < event.n_accepted:
                self.accepted_at.labels(str(i)).inc()
        if since_arrival is not None:
            self.ttft.observe(since_arrival)
        rows = event.extra.get("pass_rows")
        if isinstance(rows, int):
            self.pass_rows.observe(rows)
        if event.tokens:
            per_token = event.step_seconds / len(event.tokens)
            for _ in event.tokens:
                self.token_latency.observe(per_token)


def _mean(histogram: Histogram) -> float | None:
    """The mean of what ``histogram`` observed (None before the first observation)."""
    samples = {sample.name: sample.value for metric in histogram.collect() for sample in metric.samples}
    count = next((v for name, v in samples.items() if name.endswith("_count")), 0.0)
    total = next((v for name, v in samples.items() if name.endswith("_sum")), 0.0)
    return round(total / count, 4) if count else None
