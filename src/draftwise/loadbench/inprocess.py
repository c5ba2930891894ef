"""draftwise's server in the load bench's own process, driven without HTTP.

``in_process(settings)`` loads the pair and builds the app with ``create_app``, exactly as
``draftwise serve`` does, and runs it on an event loop of its own thread, as uvicorn runs it
on its own. The load clients reach it through ``AppTransport``, an httpx transport that hands
each request to the app's ASGI entry and streams back every body chunk the moment the app
sends it. What is left out is the socket, HTTP parsing and a second process: a run in process
against a run over HTTP says what those cost, and a run in process at 1 and 2 clients says
what the server itself does with a second stream.

httpx's own ``ASGITransport`` is no use here: it gathers the whole body before it returns, so
every chunk would seem to arrive at the end and the time to first token would be the latency.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import httpx

from draftwise.api.settings import ServerSettings

IN_PROCESS = "http://in-process"  # the base URL requests name; it never reaches a socket
_END = None  # the mark after a response's last chunk


class _Chunks(httpx.AsyncByteStream):
    """A response body as the app sends it; closing it tells the app the client is gone."""

    def __init__(self, chunks: asyncio.Queue[bytes | None], gone: asyncio.Event, app_loop: asyncio.AbstractEventLoop):
        self._chunks, self._gone, self._app_loop = chunks, gone, app_loop

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not _END:
            yield chunk

    async def aclose(self) -> None:
        self._app_loop.call_soon_threadsafe(self._gone.set)


def _scope(request: httpx.Request) -> dict[str, Any]:
    """The ASGI scope of ``request``, as a server on 127.0.0.1 would build it."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.url.path,
        "raw_path": request.url.raw_path.split(b"?")[0],
        "query_string": request.url.query,
        "root_path": "",
        "headers": [(key.lower(), value) for key, value in request.headers.raw],
        "server": ("127.0.0.1", 0),
        "client": ("127.0.0.1", 0),
    }


class AppTransport(httpx.AsyncBaseTransport):
    """Requests of any client event loop, served by ``app`` on ``app_loop`` (another thread).

    Messages cross between the two loops only through ``call_soon_threadsafe``: the app's
    ``send`` puts the response start into a future and each body chunk into a queue of the
    client's loop; closing the response sets the app's disconnect event on the app's loop.
    """

    def __init__(self, app: Any, app_loop: asyncio.AbstractEventLoop) -> None:
        self.app, self.app_loop = app, app_loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        client_loop = asyncio.get_running_loop()
        body = await request.aread()
        start: asyncio.Future[dict[str, Any]] = client_loop.create_future()
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        gone = asyncio.Event()  # bound to the app's loop when the app first waits on it

        def to_client(call: Any, *args: Any) -> None:
            client_loop.call_soon_threadsafe(call, *args)

        unread = [body]  # the request's body, until the app has read it

        async def receive() -> dict[str, Any]:
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            await gone.wait()  # then the app hears of a client only once it has gone
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                to_client(_settle, start, message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    to_client(chunks.put_nowait, bytes(message["body"]))
                if not message.get("more_body", False):
                    to_client(chunks.put_nowait, _END)

        async def serve() -> None:
            try:
                await self.app(_scope(request), receive, send)
            finally:  # an app that failed or never answered still ends the client's wait
                to_client(_settle, start, None)
                to_client(chunks.put_nowait, _END)

        asyncio.run_coroutine_threadsafe(serve(), self.app_loop)
        head = await start
        if head is None:
            raise httpx.RemoteProtocolError("the app ended without a response", request=request)
        headers = [(bytes(key), bytes(value)) for key, value in head.get("headers", [])]
        return httpx.Response(head["status"], headers=headers, stream=_Chunks(chunks, gone, self.app_loop))


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


@contextmanager
def running_app(app: Any) -> Iterator[AppTransport]:
    """``app`` started (its lifespan entered) on an event loop of its own thread, for as long as
    the block runs; then shut down as uvicorn would shut it down."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="draftwise-in-process", daemon=True)
    thread.start()
    lifespan = app.router.lifespan_context(app)

    def on_app_loop(coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, loop)
        return future.result()

    try:
        on_app_loop(lifespan.__aenter__())
        try:
            yield AppTransport(app, loop)
        finally:
            on_app_loop(lifespan.__aexit__(None, None, None))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@contextmanager
def in_process(settings: ServerSettings) -> Iterator[AppTransport]:
    """``draftwise serve`` with ``settings``, in this process: the pair loaded as serve loads it,
    the app ``create_app`` builds, served through ``AppTransport`` until the block ends."""
    from draftwise.api.app import create_app
    from draftwise.prepare import prepare_pair

    models, draft = settings.models, settings.generation.draft
    pair = prepare_pair(settings.target, settings.draft, models, draft, slots=settings.slots)
    with running_app(create_app(settings, pair)) as transport:
        yield transport
