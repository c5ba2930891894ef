"""Test support: an ASGI app (either server) on uvicorn in a background thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def serve_in_background(app: Any, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` on uvicorn in a thread (port 0: a free one); yield its base URL, stop on exit.

    ``draftwise serve`` and ``draftwise serve-verifier`` run uvicorn in the foreground.
    """
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            server_header=False,
            date_header=False,
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_for(condition: Callable[[], Any], timeout: float = 20.0) -> None:
    """Return once ``condition()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def metric(url: str, name: str, **labels: str) -> float:
    """The value of one sample of a server's ``/metrics`` (0 where it has none yet)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


class HeldLM:
    """A model whose passes stop at a gate once ``hold_after(n)`` has let ``n`` more through,
    until ``release()``: a test acts on a generation still running, however slow its machine.
    The gate opens by itself after ``limit`` seconds, so a failing test cannot hang."""

    def __init__(self, lm: Any, limit: float = 60.0) -> None:
        self.lm = lm
        self.limit = limit
        self.passes = 0
        self.allowed: int | None = None
        self.gate = threading.Event()
        self.gate.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.lm, name)

    def hold_after(self, n: int) -> None:
        self.passes, self.allowed = 0, n
        self.gate.clear()

    def release(self) -> None:
        self.allowed = None
        self.gate.set()

    def forward(self, tokens: Any, last: int | None = None) -> Any:
        if self.allowed is not None and self.passes >= self.allowed:
            self.gate.wait(self.limit)
        self.passes += 1
        return self.lm.forward(tokens, last)
