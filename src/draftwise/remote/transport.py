"""The transport under ``RemoteTarget``: ``VerifierConnection`` (one verifier over one keep-alive
HTTP connection: errors, retries through an outage, a fleet's routing) and ``VerifierSession``
(the session of one run on it: opened, reopened holding the context when the server lost it,
closed). ``draftwise.remote.client.RemoteTarget`` adds the ``Target`` logic on top.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import httpx

from draftwise.config import GrammarSpec, SamplingConfig
from draftwise.constraint import GrammarDeadEnd
from draftwise.errors import DraftwiseError, TargetError
from draftwise.lm import common_prefix
from draftwise.remote.protocol import (
    GRAMMAR_DEAD_END,
    PROTOCOL_VERSION,
    OpenSession,
    ServerInfo,
    SessionOpened,
    encode_verify_request,
)
from draftwise.remote.settings import API_KEY_ENV, ClientSettings

# A fleet (``ServerInfo.routing_header``): how long a verify whose session the answering replica
# does not hold keeps being retried, for the router to reach the replica that holds it (the
# router learns of a new session within a few hundred milliseconds), before the session is
# opened again; and the pause between those retries.
ROUTING_PATIENCE_S = 2.0
ROUTING_RETRY_S = 0.05
# A verifier that went away is tried again after pauses that double from the first to the
# last: quick to notice a fast restart, without hammering one that takes a while.
RECONNECT_FIRST_PAUSE_S = 0.1
RECONNECT_LAST_PAUSE_S = 2.0
# What a proxy or load balancer answers while the verifier behind it is down or restarting.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
# No answer because the connection failed or dropped (refused, reset, closed mid-request). A
# timeout on a connection that was made is not one: that server is there, only slow.
_DROPPED = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
# Closing a session is a courtesy (the server's idle timeout reclaims it anyway): a run that is
# over, by Ctrl-C say, should not wait long for it.
CLOSE_TIMEOUT_S = 5.0


class RemoteVerifierError(TargetError, RuntimeError):
    """The verifier cannot be used (unreachable, refused, incompatible); the message says why.

    ``reply_status`` is the HTTP status of the verifier's refusal, ``None`` when there was no
    answer; ``unavailable``: the verifier is down or restarting (worth trying again). Mid-run,
    the engine ends the generation with what it has (finish reason "error").
    """

    def __init__(self, message: str, reply_status: int | None = None, unavailable: bool = False) -> None:
        super().__init__(message)
        self.reply_status = reply_status
        self.unavailable = unavailable


class VerifierConnection:
    """One verifier over one persistent HTTP connection, checked to speak this protocol."""

    def __init__(
        self, url: str, api_key: str | None = None, timeout: float = 600.0, settings: ClientSettings | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.settings = settings or ClientSettings()
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        # One client = one keep-alive connection reused by every round trip. Long read
        # timeout: a CPU server may take a while to prefill a long prompt.
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0))
        # Headers the server ignores would only add bytes to every round trip.
        for name in ("accept", "accept-encoding", "user-agent"):
            self._http.headers.pop(name, None)
        self.routing_retries = 0  # a fleet's 404s retried while its router caught up with a session
        self.retries = 0  # requests tried again because the verifier was unreachable
        self.reconnects = 0  # retries that found the verifier answering again (and serving the same model)
        self.info = self.server_info()
        if self.info.protocol_version != PROTOCOL_VERSION:
            raise RemoteVerifierError(
                f"verifier at {self.url} speaks protocol {self.info.protocol_version}, this client {PROTOCOL_VERSION}"
            )

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteVerifierError(
                f"cannot reach the verifier at {self.url}: {exc}", unavailable=isinstance(exc, _DROPPED)
            ) from exc
        if response.status_code >= 400:
            raise self._refusal(response)
        return response

    def _refusal(self, response: httpx.Response) -> DraftwiseError:
        """The error an error answer stands for: ``GrammarDeadEnd`` where the verifier says the
        answer's grammar reached a dead end (its code), as a local run raises it, so the run
        ends with that error and never as a normal stop; else a ``RemoteVerifierError``."""
        try:
            body = response.json()
            detail, code = body.get("detail", response.text), body.get("code")
        except (ValueError, AttributeError):  # not JSON, or JSON but not an object (a proxy's page)
            detail, code = response.text, None
        status = response.status_code
        if code == GRAMMAR_DEAD_END and status < 500:
            # The verifier's message is the local one (``Constraint``'s); one line.
            return GrammarDeadEnd(" ".join(str(detail).split()))
        return RemoteVerifierError(
            f"verifier at {self.url} answered {status}: {detail}",
            reply_status=status,
            unavailable=status in UNAVAILABLE_STATUSES,
        )

    def patient_call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``call`` through an outage: while the verifier is unreachable (or a proxy says it is
        down), tried again with doubling pauses for ``settings.reconnect_s``, checking first each
        time that the verifier answering serves the same model; after that, the last error."""
        deadline: float | None = None  # set by the first failure
        pause = RECONNECT_FIRST_PAUSE_S
        while True:
            try:
                if deadline is not None:
                    self._check_same_verifier()
                    self.reconnects += 1
                return self.call(method, path, **kwargs)
            except RemoteVerifierError as exc:
                if not exc.unavailable or self.settings.reconnect_s <= 0:
                    raise
                self.retries += 1
                now = time.monotonic()
                deadline = now + self.settings.reconnect_s if deadline is None else deadline
                if now >= deadline:
                    raise RemoteVerifierError(
                        f"{exc}; gave up after retrying for {self.settings.reconnect_s:g} s (reconnect_s)",
                        exc.reply_status,
                    ) from exc
            time.sleep(min(pause, deadline - now))
            pause = min(2 * pause, RECONNECT_LAST_PAUSE_S)

    def server_info(self) -> ServerInfo:
        try:
            return ServerInfo.model_validate(self.call("GET", "/info").json())
        except ValueError as exc:  # not JSON, or not a verifier's /info
            raise RemoteVerifierError(f"{self.url} does not answer /info like a draftwise verifier") from exc

    def _check_same_verifier(self) -> None:
        """After an outage: the verifier that answers must still serve the same model with the
        same tokenizer, or the rest of the run would be some other model's output."""
        info = self.server_info()
        old = self.info
        if (info.protocol_version, info.model, info.tokenizer_fingerprint, info.vocab_size) != (
            old.protocol_version,
            old.model,
            old.tokenizer_fingerprint,
            old.vocab_size,
        ):
            raise RemoteVerifierError(
                f"the verifier at {self.url} came back serving {info.model!r} (tokenizer {info.tokenizer_fingerprint}, "
                f"protocol {info.protocol_version}) instead of {old.model!r} (tokenizer {old.tokenizer_fingerprint}, "
                f"protocol {old.protocol_version}): the run cannot go on with another target"
            )
        self.info = info  # a restart may have changed its limits

    def route(self, session: str) -> dict[str, str]:
        """The header that routes a request to the replica holding ``session`` (a fleet only)."""
        header = self.info.routing_header
        return {header: session} if header else {}

    def session_call(self, session: str, method: str, path: str, patient: bool = True, **kwargs: Any) -> httpx.Response:
        """A request to ``session`` (``patient``: through an outage, ``patient_call``).
        A fleet (``routing_header``) may answer 404 while its router has not yet learnt which
        replica holds a new session: retried for ``ROUTING_PATIENCE_S`` before the 404 is believed."""
        headers = {**kwargs.pop("headers", {}), **self.route(session)}
        send = self.patient_call if patient else self.call
        missed_at = None
        while True:
            try:
                return send(method, path, headers=headers, **kwargs)
            except RemoteVerifierError as exc:
                if exc.reply_status != 404 or not self.info.routing_header:
                    raise
                missed_at = missed_at or time.monotonic()
                if time.monotonic() - missed_at >= ROUTING_PATIENCE_S:
                    raise
            self.routing_retries += 1
            time.sleep(ROUTING_RETRY_S)

    def close(self) -> None:
        self._http.close()


class VerifierSession:
    """The verifier session of one run, and a mirror of the context the server's session holds."""

    def __init__(self, connection: VerifierConnection) -> None:
        self.connection = connection
        self.id: str | None = None
        self.server_context: list[int] = []  # what the server's session holds, mirrored
        self.sampling = SamplingConfig()  # of the current generation
        self.grammar: GrammarSpec | None = None  # the answer's grammar, opened with the session
        self.answer_start = 0  # where the answer begins in the context: the grammar follows it from there
        self.reopens = 0  # sessions opened again because the server no longer (or never) held them

    def open(self, request: OpenSession) -> None:
        """A new session holding ``request.prompt`` (the previous one closed first)."""
        self.close()
        opened = SessionOpened.model_validate(
            self.connection.patient_call("POST", "/v1/sessions", json=request.model_dump(mode="json")).json()
        )
        self.id = opened.session_id
        self.server_context = list(request.prompt)

    def _post_verify(
        self, context: Sequence[int], tokens: list[int], q_ids: Any, q_probs: Any
    ) -> tuple[httpx.Response, bytes, float]:
        """One verify on the current session: (response, body sent, round-trip seconds)."""
        keep = common_prefix(self.server_context, context)
        body = encode_verify_request(keep, list(context[keep:]), tokens, q_ids, q_probs)
        sent = time.perf_counter()
        response = self.connection.session_call(
            self.id or "",
            "POST",
            f"/v1/sessions/{self.id}/verify",
            content=body,
            headers={"content-type": "application/octet-stream"},
        )
        return response, body, time.perf_counter() - sent

    def verify(
        self, context: Sequence[int], tokens: list[int], q_ids: Any, q_probs: Any
    ) -> tuple[httpx.Response, bytes, float, int]:
        """One verify on the session: (response, body sent, round-trip seconds, reopened).

        When the server no longer holds the session (expired, evicted, its replica gone, the
        server restarted), the session is opened again holding the context, once, and the last
        item is 1. A fresh random stream (no seed) keeps the draws independent of the ones
        already made, so the output stays lossless (not reproducible under sampling; greedy is
        unchanged).
        """
        try:
            return (*self._post_verify(context, tokens, q_ids, q_probs), 0)
        except RemoteVerifierError as exc:
            if exc.reply_status != 404:
                raise
        self.id = None  # gone: nothing to close
        self.open(
            OpenSession(
                prompt=list(context),
                sampling=self.sampling.model_copy(update={"seed": None}),
                grammar=self.grammar,
                answer_start=self.answer_start if self.grammar is not None else None,
            )
        )
        self.reopens += 1
        return (*self._post_verify(context, tokens, q_ids, q_probs), 1)

    def close(self) -> None:
        """Closes the session, if one is open."""
        if self.id is not None:
            try:
                self.connection.session_call(
                    self.id, "DELETE", f"/v1/sessions/{self.id}", patient=False, timeout=CLOSE_TIMEOUT_S
                )
            except RemoteVerifierError:
                pass  # already gone (expired, evicted, server restarted): nothing to free
            finally:
                self.id = None
