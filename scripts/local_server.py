"""Serve an ASGI app in a background thread on a free loopback port (for the load and
benchmark scripts; the test suite has its own in tests/server_support.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def serve_in_background(app: Any) -> Iterator[str]:
    """``app`` on uvicorn in a thread, on a free loopback port; yields its URL."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for(url: str, process: Any, timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail if ``process`` exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")
