"""``draftwise serve --ray``: the OpenAI-compatible app as a Ray Serve deployment.

Each replica prepares the pair once, as a plain ``draftwise serve`` does (``prepare_pair``:
loaded, warmed up, the cost policy calibrated), and serves the very app it does
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
from draftwise.cluster.fleet import FleetReplica, Report, deployment_options, replica_log, serve_fleet
from draftwise.scale import ServeScale

APP = "draftwise"
# A replica is sent this many requests beyond its slots and queue, so that an overfull replica
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
                    out = merged.setdefault(
                        family.name, Metric(family.name, family.documentation, family.type, family.unit)
                    )
                    for sample in family.samples:
                        out.add_sample(
                            sample.name,
                            {**sample.labels, "replica": replica},
                            sample.value,
                            sample.timestamp,
                            sample.exemplar,
                        )
            yield from merged.values()
            yield GaugeMetricFamily(
                "draftwise_fleet_replicas", "replicas whose metrics are in this view", value=len(texts)
            )

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fleet())
    return generate_latest(registry)


class ApiReplica(FleetReplica):
    """One replica: the pair loaded once, then the app of a plain ``draftwise serve``."""

    app_name = APP
    fleet_path = "/metrics"

    def __init__(self, settings: ServerSettings) -> None:
        from draftwise.prepare import prepare_pair

        super().__init__()
        self.settings = settings
        # Prepared as a plain `serve` prepares it (warmed up, the cost policy calibrated) and
        # handed to the app once it is built: a slot for each of its workers.
        self.pair = prepare_pair(
            settings.target,
            settings.draft,
            settings.models,
            settings.generation.draft,
            slots=settings.slots,
            log=replica_log,
        )
        self.registry: Any = None

    def build(self) -> Any:
        from draftwise.api.app import create_app

        app = create_app(self.settings, self.pair)
        self.registry = app.state.metrics.registry
        return app

    def report(self) -> Report:
        from prometheus_client import generate_latest

        return {"metrics": generate_latest(self.registry).decode()}

    def fleet_response(self, reports: dict[str, Report]) -> Any:
        from fastapi.responses import Response
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(
            merge_metrics({r: report["metrics"] for r, report in reports.items()}), media_type=CONTENT_TYPE_LATEST
        )


def api_options(settings: ServerSettings, scale: ServeScale) -> dict[str, Any]:
    # Autoscaling aims at every worker busy and nothing queued.
    return deployment_options(scale, settings.slots + settings.queue_size + OVERFLOW, settings.slots)


def serve_on_ray(settings: ServerSettings, log: Callable[[str], None]) -> None:
    """``draftwise serve --ray``: deploy, say where, serve until Ctrl-C or SIGTERM, clean up."""
    if settings.ray is None:
        raise ValueError("serve_on_ray needs settings.ray")
    serve_fleet(
        ApiReplica,
        settings,
        api_options(settings, settings.ray),
        settings.served_model,
        lambda url: (
            f"serving {settings.served_model} (drafter: {settings.default_drafter}) on {url}  "
            "(docs: /docs, metrics of every replica: /metrics)"
        ),
        log,
    )
