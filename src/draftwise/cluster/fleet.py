"""What the replicas of one Serve app share, and the Serve plumbing both servers use.

A replica only sees its own state, yet ``/metrics`` (the API) and ``/health`` (the verifier)
should describe the whole fleet, whichever replica answers. So each replica pushes a small report
to a board (a named Ray actor, one per app) every ``REPORT_EVERY_S`` seconds, and the replica that
answers merges the board's reports with its own live one. Reports of a replica that stopped
pushing (killed, its node gone) leave the view after ``STALE_AFTER_S``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from draftwise.cluster.runtime import LOOPBACK, NAMESPACE, ClusterError, ray_session, require_ray, require_serve
from draftwise.scale import ServeScale

REPORT_EVERY_S = 1.0
STALE_AFTER_S = 15.0
# Replicas' own log: Ray keeps it per replica and copies it to the driver's terminal.
log = logging.getLogger("draftwise.cluster")

Report = dict[str, Any]


def replica_log(note: str) -> None:
    """The model loader's notes, from inside a replica."""
    print(note, file=sys.stderr, flush=True)


def keep_replica_grpc_on_loopback() -> None:
    """In a Serve replica of a local Ray: bind its inter-deployment gRPC server to 127.0.0.1.

    Ray Serve 2.60 binds that server to every interface ("[::]:0", with no setting to change it),
    while a local Ray binds everything else to loopback and advertises 127.0.0.1 for it anyway.
    draftwise never calls it (the proxy reaches replicas as Ray actors); this keeps it off the
    network. Called from the replica's constructor, before Serve starts the server. On a real
    cluster (a node address that is not loopback) it changes nothing.
    """
    import ipaddress

    import ray
    from ray.serve._private import replica as serve_replica

    bind = getattr(serve_replica, "add_port_to_grpc_server", None)  # None: a Ray that binds it some other way
    if bind is None or getattr(bind, "loopback", False):
        return
    if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
        return

    def bind_loopback(server: Any, address: str) -> int:
        return bind(server, address.replace("[::]", LOOPBACK))

    bind_loopback.loopback = True  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = bind_loopback


class FleetBoard:
    """The latest report of each replica of one Serve app (a Ray actor that holds no CPU)."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S) -> None:
        self.stale_after_s = stale_after_s
        self._reports: dict[str, tuple[float, Report]] = {}

    def put(self, replica: str, report: Report) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def drop(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def reports(self) -> dict[str, Report]:
        oldest = time.monotonic() - self.stale_after_s
        return {replica: report for replica, (at, report) in self._reports.items() if at >= oldest}


def board_name(app: str) -> str:
    return f"draftwise-board-{app}"


def open_board(app: str) -> Any:
    """The board of ``app``, created if need be. Detached: it must outlive whichever replica or
    driver created it; ``served`` kills it when the app goes."""
    ray = require_ray()
    actor = ray.remote(FleetBoard).options(
        name=board_name(app), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote()


def replica_id() -> str:
    """This Serve replica's ID (the tail of its actor name ``SERVE_REPLICA::app#deployment#ID``)."""
    return str(require_serve().get_replica_context().replica_id.unique_id)


class Reporter:
    """Pushes this replica's report to the board of ``app``; must start on the replica's event loop."""

    def __init__(self, app: str, report: Callable[[], Report]) -> None:
        ray = require_ray()
        self._errors = ray.exceptions.RayError
        self.board = ray.get_actor(board_name(app), namespace=NAMESPACE)
        self.replica = replica_id()
        self.report = report
        self._task = asyncio.get_running_loop().create_task(self._push_forever())

    async def _push_forever(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.replica, self.report())
            except self._errors as exc:  # the board is gone (the app is being deleted): nothing to tell
                log.warning("draftwise: cannot report to the fleet board: %s", exc)
            await asyncio.sleep(REPORT_EVERY_S)

    async def fleet(self) -> dict[str, Report]:
        """Every replica's latest report, this one's fresh."""
        try:
            reports = dict(await self.board.reports.remote())
        except self._errors as exc:
            log.warning("draftwise: no fleet board, answering for this replica alone: %s", exc)
            reports = {}
        reports[self.replica] = self.report()
        return reports

    async def close(self) -> None:
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task
        with suppress(self._errors):
            await self.board.drop.remote(self.replica)


class FleetPath:
    """ASGI middleware: ``GET path`` answered by ``answer()`` (the fleet's view), everything else
    by the app (this replica)."""

    def __init__(self, app: Any, path: str, answer: Callable[[], Awaitable[Any]]) -> None:
        self.app = app
        self.path = path
        self.answer = answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == self.path:
            response = await self.answer()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def deployment_options(scale: ServeScale, max_ongoing: int, target_ongoing: int) -> dict[str, Any]:
    """``serve.deployment``'s options: a fixed number of replicas or an autoscaling range."""
    options: dict[str, Any] = {
        "max_ongoing_requests": max_ongoing,
        "ray_actor_options": {"num_cpus": scale.cpus_per_replica},
        # A replica whose constructor fails (a model that does not load) is retried a few times,
        # not Serve's default of many: the error reaches the user in seconds.
        "max_constructor_retry_count": 2,
    }
    if scale.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": scale.min_replicas,
            "max_replicas": scale.max_replicas,
            "target_ongoing_requests": target_ongoing,
        }
    else:
        options["num_replicas"] = scale.replicas
    return options


@contextmanager
def served(
    replica: type, args: tuple[Any, ...], app: str, host: str, port: int, options: dict[str, Any], delete: bool = True
) -> Iterator[str]:
    """Run ``replica`` (a class with ``__serve_build_asgi_app__``) as the Serve app ``app`` at
    ``/`` on ``host:port``; yield its base URL once every replica is up; on exit delete the app
    (unless ``delete`` is false: a local Ray about to shut down takes it along).

    Serve has one HTTP address per cluster: the first app started on a cluster fixes it.
    """
    ray, serve = require_ray(), require_serve()
    board = open_board(app)
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(serve.ingress()(replica), name=replica.__name__, **options)
    try:
        try:
            serve.run(deployment.bind(*args), name=app, route_prefix="/")
        except RuntimeError as exc:  # DEPLOY_FAILED: Serve's message ends with the replica's error
            raise ClusterError(
                f"the Ray Serve app {app!r} failed to start: {str(exc).strip().splitlines()[-1]}"
            ) from None
        yield f"http://{host}:{port}"
    finally:
        if delete:
            with suppress(ray.exceptions.RayError):
                serve.delete(app)
            with suppress(ray.exceptions.RayError):
                ray.kill(board)


def describe(scale: ServeScale) -> str:
    if scale.autoscaling:
        return f"{scale.min_replicas} to {scale.max_replicas} replicas (autoscaling)"
    return f"{scale.replicas} replica{'s' if scale.replicas > 1 else ''}"


def serve_fleet(
    replica: type[FleetReplica],
    settings: Any,
    options: dict[str, Any],
    what: str,
    banner: Callable[[str], str],
    log: Callable[[str], None],
) -> None:
    """The CLI's server on Ray (``settings``: a server's, with ``ray``, ``host`` and ``port``):
    deploy ``replica``, log ``banner(url)``, serve until Ctrl-C or SIGTERM (``kill``, a process
    manager), then delete the app (a joined cluster) or shut the local Ray down."""
    scale: ServeScale | None = settings.ray
    if scale is None:
        raise ValueError("serve_fleet needs settings with ray")
    log(f"starting {describe(scale)} of {what} on Ray Serve ...")
    local = scale.ray_address is None
    with ray_session(scale), suppress(KeyboardInterrupt):
        with served(
            replica, (settings,), replica.app_name, settings.host, settings.port, options, delete=not local
        ) as url:
            log(f"{banner(url)} ({describe(scale)}); Ctrl-C stops")
            while True:
                time.sleep(3600)
    log("stopped")


class FleetReplica:
    """A Serve replica whose ``fleet_path`` answers for the whole fleet: subclasses build the
    app (``build``, from the replica's loaded models), say what this replica reports
    (``report``) and how the reports of all answer (``fleet_response``)."""

    app_name = ""  # the Serve app (and its board)
    fleet_path = ""

    def __init__(self) -> None:
        keep_replica_grpc_on_loopback()
        self.reporter: Reporter | None = None

    def build(self) -> Any:
        raise NotImplementedError

    def report(self) -> Report:
        raise NotImplementedError

    def fleet_response(self, reports: dict[str, Report]) -> Any:
        raise NotImplementedError

    async def __serve_build_asgi_app__(self) -> Any:
        app = self.build()
        self.reporter = Reporter(self.app_name, self.report)
        app.add_middleware(FleetPath, path=self.fleet_path, answer=self._fleet)
        return app

    async def _fleet(self) -> Any:
        if self.reporter is None:
            raise RuntimeError("the fleet view is asked for before the replica's app was built")
        return self.fleet_response(await self.reporter.fleet())

    async def __del__(self) -> None:
        if self.reporter is not None:
            await self.reporter.close()
