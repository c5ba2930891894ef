"""``draftwise serve-verifier --ray``: the verifier as a Ray Serve deployment, sessions routed by ID.

A session holds a KV cache on one replica, so its requests must reach that replica. Each
session a replica opens becomes one of its Serve "multiplexed model IDs"; ``/info`` tells
clients to send the session ID in Serve's routing header, and Serve's router prefers the
replica that announced the ID. That preference is best effort (the router learns of a new ID a
moment after it is announced, and routes elsewhere when the holder is saturated or gone), so a
request can reach a replica that does not hold its session: that replica answers 404 and the
client re-opens the session there with the same context, which leaves the output unchanged.
``/health`` counts those hits and misses for the whole fleet; the client's events count its
re-opens (``extra["reopened"]``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from draftwise.cluster.fleet import FleetReplica, Report, deployment_options, replica_log, serve_fleet
from draftwise.cluster.serve_app import OVERFLOW
from draftwise.lm import LanguageModel
from draftwise.remote.protocol import Affinity, Health, OpenSession, ServerInfo, SessionOpened
from draftwise.remote.sessions import VerifierService
from draftwise.remote.settings import VerifierSettings
from draftwise.scale import ServeScale

APP = "draftwise-verifier"
# Serve's router reads the multiplexed model ID from this header.
ROUTING_HEADER = "serve_multiplexed_model_id"


class RoutedVerifierService(VerifierService):
    """The sessions of one replica of a fleet: each session it opens or serves is announced to
    Serve (``announce(session_id)``) so that requests carrying its ID come here."""

    def __init__(self, settings: VerifierSettings, lm: LanguageModel, announce: Callable[[str], None]) -> None:
        super().__init__(settings, lm)
        self.announce = announce

    def info(self) -> ServerInfo:
        return super().info().model_copy(update={"routing_header": ROUTING_HEADER})

    def open(self, request: OpenSession) -> SessionOpened:
        opened = super().open(request)
        self.announce(opened.session_id)
        return opened

    def verify(self, session_id: str, body: bytes) -> bytes:
        answer = super().verify(session_id, body)
        # Keeps Serve's list of this replica's IDs (least recently used goes first) in step
        # with the sessions the service keeps.
        self.announce(session_id)
        return answer


def fleet_health(reports: dict[str, dict[str, Any]]) -> Health:
    """One ``Health`` for the fleet: sums over the replicas, and each replica's own."""
    replicas = {replica: Health.model_validate(report) for replica, report in sorted(reports.items())}
    return Health(
        status="ok",
        sessions=sum(h.sessions for h in replicas.values()),
        affinity=Affinity(
            hits=sum(h.affinity.hits for h in replicas.values()),
            misses=sum(h.affinity.misses for h in replicas.values()),
        ),
        replicas=replicas,
    )


class VerifierReplica(FleetReplica):
    """One replica: the target loaded once, then the app of a plain ``serve-verifier``."""

    app_name = APP
    fleet_path = "/health"

    def __init__(self, settings: VerifierSettings) -> None:
        from ray import serve

        from draftwise.prepare import prepare_pair

        super().__init__()
        self.settings = settings
        # As a plain serve-verifier prepares it: a slot for each session held at once.
        pair = prepare_pair(settings.target, None, settings.models, None, slots=settings.slots, log=replica_log)
        self.lm = pair.target

        async def hold(session_id: str) -> str:
            return session_id  # the session lives in the service; Serve only keeps its ID

        # Serve forgets the least recently used ID beyond this, as the service drops sessions.
        self._hold = serve.multiplexed(max_num_models_per_replica=settings.max_sessions)(hold)
        self.service: RoutedVerifierService | None = None

    def build(self) -> Any:
        from draftwise.remote.server import create_app

        loop = asyncio.get_running_loop()  # Serve calls build on the replica's event loop

        def announce(session_id: str) -> None:
            # Called from the service's worker threads; Serve's bookkeeping lives on that loop.
            asyncio.run_coroutine_threadsafe(self._hold(session_id), loop)

        self.service = RoutedVerifierService(self.settings, self.lm, announce)
        return create_app(self.settings, service=self.service)

    def report(self) -> Report:
        if self.service is None:
            raise RuntimeError("the replica reports before its app was built")
        return self.service.health().model_dump(mode="json")

    def fleet_response(self, reports: dict[str, Report]) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(fleet_health(reports).model_dump(mode="json", exclude_none=True))


def verifier_options(settings: VerifierSettings, scale: ServeScale) -> dict[str, Any]:
    # Every open session may have a request in flight; a replica that refused more would push
    # requests to replicas without their session. Autoscaling: a couple of verifies in flight each.
    return deployment_options(scale, settings.max_sessions + OVERFLOW, 2)


def serve_verifier_on_ray(settings: VerifierSettings, log: Callable[[str], None]) -> None:
    """``draftwise serve-verifier --ray``: deploy, say where, serve until Ctrl-C or SIGTERM."""
    if settings.ray is None:
        raise ValueError("serve_verifier_on_ray needs settings.ray")
    serve_fleet(
        VerifierReplica,
        settings,
        verifier_options(settings, settings.ray),
        f"the verifier of {settings.target}",
        lambda url: (
            f"draftwise verifier: {settings.target} on {url} (sessions routed by {ROUTING_HEADER}; "
            "API docs at /docs, fleet health at /health)"
        ),
        log,
    )
