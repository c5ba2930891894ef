"""``draftwise serve --ray``: the OpenAI-compatible app as a Ray Serve deployment.

Each replica loads the pair once and serves the very app a plain ``draftwise serve`` does
(``create_app``): same routes, errors, auth, limits, per-request ``speculative`` settings and
streaming, through Serve's proxy. A client that disconnects still cancels its generation: the
proxy cancels the request on the replica, which closes its job as it would under uvicorn.

``/metrics`` is the whole fleet: every replica's own metrics with a ``replica`` label (sum them
in PromQL for totals), and ``draftwise_fleet_replicas``. ``/health`` stays per replica (liveness
of the one that answered).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from draftwise.api.settings import ServerSettings
from draftwise.cluster.fleet import (
    FleetPath,
    Reporter,
    deployment_options,
    keep_replica_grpc_on_loopback,
    replica_log,
    serve_until_stopped,
)
from draftwise.cluster.settings import ServeScale

APP = "draftwise"
# A replica is sent this many requests beyond its workers and queue, so that an overfull replica
# answers with its own 429 (and Retry-After) rather than Ray queueing the request unseen; it also
# leaves room for /health and /metrics.
OVERFLOW = 4


def merge_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text of every replica (replica ID -> its exposition) as one exposition: each
    sample gains a ``replica`` label, and ``draftwise_fleet_replicas`` counts the replicas."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families

    class Fleet:
        def collect(self) -> Iterable[Metric]:
            merged: dict[str, Metric] = {}
            for replica, text in sorted(texts.items()):
                for family in text_string_to_metric_families(text):
                    out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                family.unit))
                    for sample in family.samples:
                        out.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value,
                                       sample.timestamp, sample.exemplar)
            yield from merged.values()
            yield GaugeMetricFamily("draftwise_fleet_replicas", "replicas whose metrics are in this view",
                                    value=len(texts))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fleet())  # type: ignore[arg-type]
    return generate_latest(registry)


class ApiReplica:
    """One replica: the pair loaded once, then the app of a plain ``draftwise serve``."""

    def __init__(self, settings: ServerSettings) -> None:
        from draftwise.loading import load_pair

        keep_replica_grpc_on_loopback()
        self.settings = settings
        self.target, self.draft = load_pair(settings.target, settings.draft, settings.models, log=replica_log)
        self.reporter: Reporter | None = None

    async def __serve_build_asgi_app__(self) -> Any:
        from prometheus_client import generate_latest

        from draftwise.api.app import create_app

        app = create_app(self.settings, target=self.target, draft=self.draft)
        registry = app.state.metrics.registry
        self.reporter = Reporter(APP, lambda: {"metrics": generate_latest(registry).decode()})
        app.add_middleware(FleetPath, path="/metrics", answer=self._fleet_metrics)
        return app

    async def _fleet_metrics(self) -> Any:
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        if self.reporter is None:
            raise RuntimeError("the fleet view is asked for before the replica's app was built")
        reports = await self.reporter.fleet()
        return Response(merge_metrics({r: report["metrics"] for r, report in reports.items()}),
                        media_type=CONTENT_TYPE_LATEST)

    async def __del__(self) -> None:
        if self.reporter is not None:
            await self.reporter.close()


def api_options(settings: ServerSettings, scale: ServeScale) -> dict[str, Any]:
    # Autoscaling aims at every worker busy and nothing queued.
    return deployment_options(scale, settings.workers + settings.queue_size + OVERFLOW, settings.workers)


def describe(scale: ServeScale) -> str:
    if scale.autoscaling:
        return f"{scale.min_replicas} to {scale.max_replicas} replicas (autoscaling)"
    return f"{scale.replicas} replica{'s' if scale.replicas > 1 else ''}"


def serve_on_ray(settings: ServerSettings, log: Callable[[str], None]) -> None:
    """``draftwise serve --ray``: deploy, say where, serve until Ctrl-C or SIGTERM, clean up."""
    scale = settings.ray
    if scale is None:
        raise ValueError("serve_on_ray needs settings.ray")

    def ready(url: str) -> None:
        log(f"serving {settings.served_model} (drafter: {settings.default_drafter}, {describe(scale)}) on "
            f"{url}  (docs: /docs, metrics of every replica: /metrics); Ctrl-C stops")

    log(f"starting {describe(scale)} of {settings.served_model} on Ray Serve ...")
    serve_until_stopped(ApiReplica, (settings,), APP, settings.host, settings.port, api_options(settings, scale),
                        scale, ready)
    log("stopped")
