"""A local Ray for tests, on 127.0.0.1 only, and proof that it leaves nothing behind.

``LocalRay`` starts Ray through draftwise's own ``ray_session`` (2 CPUs), remembers every
process Ray starts under this one, and on ``stop`` shuts Serve and Ray down and waits until
all of those processes are gone. Nothing here imports Ray at module level: Ray must be imported
only once the loopback environment is set (``draftwise.cluster.runtime``).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import time
from contextlib import ExitStack
from typing import Any

import psutil
import pytest

from draftwise.cluster.runtime import ray_session
from draftwise.scale import RayOptions

from cli_support import free_port

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'draftwise[ray]')"
)


def is_loopback(address: str) -> bool:
    host = address.removeprefix("::ffff:")
    return ipaddress.ip_address(host).is_loopback


def descendants(since: float) -> list[psutil.Process]:
    """This process's descendants started at or after ``since`` (epoch seconds)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.create_time() >= since:
                found.append(child)
        except psutil.NoSuchProcess:
            pass  # ended while we looked
    return found


def inet_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, str, str | None]]:
    """(process name, status, local address, remote address) of every TCP/UDP socket of ``processes``."""
    sockets = []
    for process in processes:
        try:
            name = process.name()
            for conn in process.net_connections(kind="inet"):
                remote = conn.raddr.ip if conn.raddr else None
                sockets.append((name, conn.status, conn.laddr.ip, remote))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended while we looked
    return sockets


class LocalRay:
    """A local Ray with 2 CPUs and Serve's proxy on ``port``; ``stop`` checks that it is all gone."""

    def __init__(self) -> None:
        self.port = free_port()
        self.started = time.time() - 1  # create_time has a coarse clock
        self._stack = ExitStack()
        self.ray: Any = self._stack.enter_context(ray_session(RayOptions(), num_cpus=2))
        self.processes: dict[int, psutil.Process] = {}
        self.track()

    def track(self) -> list[psutil.Process]:
        """Remember Ray's processes (workers come and go: call this while they run)."""
        for process in descendants(self.started):
            self.processes.setdefault(process.pid, process)
        return [p for p in self.processes.values() if p.is_running()]

    def replicas(self, app: str) -> list[str]:
        """Actor names of ``app``'s live Serve replicas."""
        return sorted(
            a["name"]
            for a in self.ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")
        )

    def kill(self, name: str, namespace: str) -> None:
        """``ray.kill`` the named actor, and wait until Ray reports it dead."""
        ray = self.ray
        handle = ray.get_actor(name, namespace=namespace)
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + 30
        while any(a["name"] == name for a in ray.util.list_named_actors(all_namespaces=True)):
            assert time.monotonic() < deadline, f"{name} is still alive 30 s after ray.kill"
            time.sleep(0.1)

    def stop(self) -> list[psutil.Process]:
        """Shut Serve and Ray down; return the processes still alive 30 s later (none, we hope)."""
        if self._stack is None:
            return []
        self.track()
        from ray import serve

        serve.shutdown()
        self._stack.close()
        self._stack = None  # type: ignore[assignment]
        deadline = time.monotonic() + 30
        while alive := [p for p in self.processes.values() if p.is_running() and p.status() != "zombie"]:
            if time.monotonic() > deadline:
                return alive
            time.sleep(0.2)
        return []
