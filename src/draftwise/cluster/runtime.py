"""Ray itself: the install check, and a Ray to run on (a cluster joined, or a local one).

A local Ray binds 127.0.0.1 and nothing else. ``ray.init(_node_ip_address="127.0.0.1")`` is not
enough for that: Ray swaps a loopback node address for the machine's own and starts its gRPC
servers on every interface. Its single-machine mode (the one it uses on macOS and Windows) keeps
everything on loopback; it is chosen by an environment variable that must be set before Ray is
imported, and that Ray's own processes inherit.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from draftwise.errors import DraftwiseError
from draftwise.scale import RayOptions

RAY_INSTALL = "pip install 'draftwise[ray]'"
NAMESPACE = "draftwise"  # Ray namespace of draftwise's own named actors (Serve keeps its own, "serve")
LOOPBACK = "127.0.0.1"
# Ray's single-machine mode: every Ray process binds loopback. Usage statistics off: a local Ray
# that contacts no other address.
_LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
_NO_CRASH_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


class ClusterError(DraftwiseError):
    """Ray cannot do what was asked (a cluster unreachable, a deployment that failed to start, every
    bench worker gone); the message says why."""

    exit_code = 1
    status = 503


class RayMissingError(ClusterError):
    """``--ray`` without Ray installed."""

    exit_code = 2


def check_installed() -> None:
    """``RayMissingError`` unless Ray can be imported, without importing it (a local Ray must be set
    up before its first import, see ``ray_session``)."""
    if importlib.util.find_spec("ray") is None:
        raise RayMissingError(f"--ray needs Ray, which is not installed: {RAY_INSTALL}")


def require_ray() -> ModuleType:
    """The ``ray`` module, or ``RayMissingError`` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RayMissingError(f"--ray needs Ray, which is not installed: {RAY_INSTALL}") from None
    return ray


def require_serve() -> ModuleType:
    """The ``ray.serve`` module (Ray installed without its serve extra: the same one-line error)."""
    require_ray()
    try:
        from ray import serve
    except ImportError:
        raise RayMissingError(f"--ray needs Ray Serve, which is not installed: {RAY_INSTALL}") from None
    return serve


def _keep_local_ray_on_loopback() -> None:
    os.environ.update(_LOCAL_ENV)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        # Ray read the variable when it was imported: too late to keep a new local Ray on loopback.
        raise ClusterError(
            "Ray was imported before draftwise could keep a local Ray on 127.0.0.1: set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray, or give --ray-address"
        )


def _import_ray_for_driver() -> ModuleType:
    """``require_ray``, with Ray's crash handler left out of this process: it would also catch
    the SIGTERM that stops a server (``kill``, a process manager) and abort before draftwise
    deletes its app. Ray's own processes, started later, keep it (the variable is read at import,
    and is not left for them to inherit)."""
    if "ray" in sys.modules:
        return require_ray()
    os.environ[_NO_CRASH_HANDLER] = "1"
    try:
        return require_ray()
    finally:
        del os.environ[_NO_CRASH_HANDLER]


def init_args(options: RayOptions, num_cpus: int | None = None) -> dict[str, Any]:
    """``ray.init``'s arguments: join ``options.ray_address``, or start a local Ray on loopback."""
    if options.ray_address is not None:
        return {"address": options.ray_address, "namespace": NAMESPACE}
    # address="local": a new Ray of our own, never one that happens to run on this machine.
    return {
        "address": "local",
        "num_cpus": num_cpus,
        "include_dashboard": False,
        "_node_ip_address": LOOPBACK,
        "namespace": NAMESPACE,
    }


@contextmanager
def ray_session(options: RayOptions, num_cpus: int | None = None) -> Iterator[ModuleType]:
    """Yield ``ray`` connected: to the Ray this process already runs (tests, notebooks: left
    running), else to ``options.ray_address`` or a new local Ray (shut down on exit)."""
    running = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    if options.ray_address is None and not running:
        _keep_local_ray_on_loopback()  # before Ray is imported: it reads the variable then
    ray = _import_ray_for_driver()
    if running:
        yield ray
        return
    try:
        ray.init(**init_args(options, num_cpus))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(f"cannot start or join Ray ({options.ray_address or 'local'}): {exc}") from exc
    # ray.init makes SIGTERM exit at once; as KeyboardInterrupt it stops draftwise as Ctrl-C does
    # (a server deletes its app, the bench keeps its results).
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        yield ray
    finally:
        ray.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
