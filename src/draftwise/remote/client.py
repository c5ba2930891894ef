"""The client side: ``RemoteTarget``, a ``Target`` whose model runs behind a verifier server.

It plugs into ``SpeculativeEngine`` like ``LocalTarget``, so events and metrics are the same;
each event's ``extra`` adds the round trip's split: ``server_seconds`` (the server's own
work) and ``network_seconds`` (everything else: transport, HTTP, framing).

    >>> target = connect("http://127.0.0.1:8765", tokenizer=draft_lm.tokenizer)  # doctest: +SKIP
    >>> engine = SpeculativeEngine(target, ModelDrafter(draft_lm), tokenizer=draft_lm.tokenizer)  # doctest: +SKIP

A session lasts one run: the engine closes it when the run ends, however it ends. A verifier
that goes away mid-run (restarted, say) is tried again for ``ClientSettings.reconnect_s``; when
it is back, the run carries on in a new session holding the whole context, losslessly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import torch

from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.drafters import Proposal
from draftwise.errors import ContextLengthError, TargetError
from draftwise.remote.protocol import (
    PROTOCOL_VERSION,
    OpenSession,
    ProtocolError,
    ServerInfo,
    SessionOpened,
    decode_verify_response,
    encode_verify_request,
    tokenizer_fingerprint,
)
from draftwise.remote.settings import API_KEY_ENV, ClientSettings
from draftwise.target import Verification
from draftwise.verify import Verdict

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer

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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])


class RemoteTarget:
    """A verifier session per generation, over one persistent HTTP connection."""

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
        self.info = self._server_info()
        if self.info.protocol_version != PROTOCOL_VERSION:
            raise RemoteVerifierError(
                f"verifier at {self.url} speaks protocol {self.info.protocol_version}, this client {PROTOCOL_VERSION}"
            )
        self.eos_token_ids = tuple(self.info.eos_token_ids)
        self.reopens = 0  # sessions opened again because the server no longer (or never) held them
        self.routing_retries = 0  # a fleet's 404s retried while its router caught up with a session
        self.retries = 0  # requests tried again because the verifier was unreachable
        self.reconnects = 0  # retries that found the verifier answering again (and serving the same model)
        self._session: str | None = None
        self._server_context: list[int] = []  # what the server's session holds, mirrored
        self._sampling = SamplingConfig()  # of the current generation

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise RemoteVerifierError(
                f"cannot reach the verifier at {self.url}: {exc}", unavailable=isinstance(exc, _DROPPED)
            ) from exc
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except (ValueError, AttributeError):  # not JSON, or JSON but not an object (a proxy's page)
                detail = response.text
            status = response.status_code
            raise RemoteVerifierError(
                f"verifier at {self.url} answered {status}: {detail}",
                reply_status=status,
                unavailable=status in UNAVAILABLE_STATUSES,
            )
        return response

    def _patient_call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """``_call`` through an outage: while the verifier is unreachable (or a proxy says it is
        down), tried again with doubling pauses for ``settings.reconnect_s``, checking first each
        time that the verifier answering serves the same model; after that, the last error."""
        deadline: float | None = None  # set by the first failure
        pause = RECONNECT_FIRST_PAUSE_S
        while True:
            try:
                if deadline is not None:
                    self._check_same_verifier()
                    self.reconnects += 1
                return self._call(method, path, **kwargs)
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

    def _server_info(self) -> ServerInfo:
        try:
            return ServerInfo.model_validate(self._call("GET", "/info").json())
        except ValueError as exc:  # not JSON, or not a verifier's /info
            raise RemoteVerifierError(f"{self.url} does not answer /info like a draftwise verifier") from exc

    def _check_same_verifier(self) -> None:
        """After an outage: the verifier that answers must still serve the same model with the
        same tokenizer, or the rest of the run would be some other model's output."""
        info = self._server_info()
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

    def _route(self, session: str) -> dict[str, str]:
        """The header that routes a request to the replica holding ``session`` (a fleet only)."""
        header = self.info.routing_header
        return {header: session} if header else {}

    def _open(self, request: OpenSession) -> None:
        self._close_session()
        opened = SessionOpened.model_validate(
            self._patient_call("POST", "/v1/sessions", json=request.model_dump(mode="json")).json()
        )
        self._session = opened.session_id
        self._server_context = list(request.prompt)

    def start(
        self,
        prompt: Sequence[int],
        config: GenerationConfig,
        generator: torch.Generator | None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        # The prefill is one request to the server: ``cancelled`` is asked after it, by the engine.
        # The server seeds its own target stream from config.sampling.seed exactly as the
        # local engine seeds the generator it passes here, so that object is not needed.
        self._sampling = config.sampling
        self._open(OpenSession(prompt=list(prompt), sampling=config.sampling))

    def _sparse_q(self, proposal: Proposal) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The non-zero entries of q per position ([k, n] ids and probs), or (None, None)."""
        if self._sampling.greedy or proposal.probs is None or not len(proposal):
            return None, None
        # Like the local rule, ids past the target's vocabulary (padding rows) carry no mass.
        probs = proposal.probs[:, : self.info.vocab_size]
        width = int((probs > 0).sum(-1).max())
        limit = self.info.limits.max_q_entries
        if width > limit:
            raise RemoteVerifierError(
                f"the draft distribution has {width} non-zero entries per token, over the verifier's limit of "
                f"{limit}: sample the draft from fewer tokens (DraftConfig.proposal_top, e.g. 64, or top_k)"
            )
        values, ids = torch.topk(probs, width, dim=-1)
        return ids, values

    def _fit(self, context: Sequence[int], proposal: Proposal) -> Proposal:
        """``proposal``, cut to what the session has room for; ``ContextLengthError`` when the
        session is full. A session holds the context, the block and the token a verify adds."""
        limit = self.info.limits.max_context
        room = limit - len(context) - 1
        if room < 0:
            raise ContextLengthError(
                f"the verifier at {self.url} holds at most {limit} tokens per session "
                f"(its max_context), and the context has {len(context)}"
            )
        if len(proposal) <= room:
            return proposal
        # Verifying fewer draft tokens is always valid: the rest are simply not offered.
        return Proposal(proposal.tokens[:room], None if proposal.probs is None else proposal.probs[:room])

    def _session_call(self, method: str, path: str, patient: bool = True, **kwargs: Any) -> httpx.Response:
        """A request to the current session (``patient``: through an outage, ``_patient_call``).
        A fleet (``routing_header``) may answer 404 while its router has not yet learnt which
        replica holds a new session: retried for ``ROUTING_PATIENCE_S`` before the 404 is believed."""
        session = self._session or ""
        headers = {**kwargs.pop("headers", {}), **self._route(session)}
        send = self._patient_call if patient else self._call
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

    def _post_verify(
        self, context: Sequence[int], tokens: list[int], q_ids: Any, q_probs: Any
    ) -> tuple[httpx.Response, bytes, float]:
        """One verify on the current session: (response, body sent, round-trip seconds)."""
        keep = _common_prefix(self._server_context, context)
        body = encode_verify_request(keep, list(context[keep:]), tokens, q_ids, q_probs)
        sent = time.perf_counter()
        response = self._session_call(
            "POST",
            f"/v1/sessions/{self._session}/verify",
            content=body,
            headers={"content-type": "application/octet-stream"},
        )
        return response, body, time.perf_counter() - sent

    def _verify_anywhere(
        self, context: Sequence[int], tokens: list[int], q_ids: Any, q_probs: Any
    ) -> tuple[httpx.Response, bytes, float, int]:
        """``_post_verify``; when the server no longer holds the session (expired, evicted, its
        replica gone, the server restarted), the session is opened again holding the context,
        once, and the last item is 1. A fresh random stream (no seed) keeps the draws independent of the ones already
        made, so the output stays lossless (not reproducible under sampling; greedy is unchanged).
        """
        try:
            return (*self._post_verify(context, tokens, q_ids, q_probs), 0)
        except RemoteVerifierError as exc:
            if exc.reply_status != 404:
                raise
        self._session = None  # gone: nothing to close
        self._open(OpenSession(prompt=list(context), sampling=self._sampling.model_copy(update={"seed": None})))
        self.reopens += 1
        return (*self._post_verify(context, tokens, q_ids, q_probs), 1)

    def verify(self, context: Sequence[int], proposal: Proposal) -> Verification:
        if self._session is None:
            raise RemoteVerifierError("verify called before start")
        proposal = self._fit(context, proposal)
        tokens = proposal.tokens.tolist()
        q_ids, q_probs = self._sparse_q(proposal)
        response, body, round_trip, reopened = self._verify_anywhere(
            context, tokens, None if q_ids is None else q_ids.numpy(), None if q_probs is None else q_probs.numpy()
        )
        try:
            answer = decode_verify_response(response.content, len(tokens))
        except ProtocolError as exc:
            raise RemoteVerifierError(f"verifier at {self.url} sent a malformed answer: {exc}") from exc
        verdict = Verdict(n_accepted=answer.n_accepted, next_token=answer.next_token, n_proposed=len(tokens))
        self._server_context = list(context) + tokens[: answer.n_accepted] + [answer.next_token]
        return Verification(
            verdict=verdict,
            target_token_probs=answer.target_probs,
            extra={
                "server_seconds": answer.server_seconds,
                "network_seconds": max(0.0, round_trip - answer.server_seconds),
                "request_bytes": len(body),
                "response_bytes": len(response.content),
                "reopened": reopened,  # 1: the session was opened again before this verify
            },
        )

    def _close_session(self) -> None:
        if self._session is not None:
            try:
                self._session_call("DELETE", f"/v1/sessions/{self._session}", patient=False, timeout=CLOSE_TIMEOUT_S)
            except RemoteVerifierError:
                pass  # already gone (expired, evicted, server restarted): nothing to free
            finally:
                self._session = None

    def finish(self) -> None:
        """The run is over: close its session now rather than leave its KV cache on the server
        until the idle timeout. The connection stays open for the next run."""
        self._close_session()

    def check_tokenizer(self, tokenizer: Tokenizer | None, whose: str = "the draft's") -> None:
        """Refuse a verifier whose tokenizer maps tokens to other ids than ``tokenizer`` does."""
        mine, theirs = tokenizer_fingerprint(tokenizer), self.info.tokenizer_fingerprint
        if mine != theirs:
            raise RemoteVerifierError(
                f"the verifier at {self.url} serves {self.info.model!r}, whose tokenizer differs from {whose} "
                f"(fingerprint {theirs} vs {mine}); drafter and target must share one tokenizer"
            )

    def close(self) -> None:
        self._close_session()
        self._http.close()

    def __enter__(self) -> RemoteTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    url: str,
    api_key: str | None = None,
    tokenizer: Tokenizer | None = None,
    timeout: float = 600.0,
    settings: ClientSettings | None = None,
) -> RemoteTarget:
    """Open a ``RemoteTarget`` and check the handshake: with ``tokenizer`` (the draft's),
    refuse a verifier whose tokenizer maps tokens to different ids. A verifier that cannot be
    reached here is an error at once (a wrong URL, most likely); ``settings.reconnect_s`` is
    for one that goes away later.
    """
    if not url.startswith(("http://", "https://")):
        raise RemoteVerifierError(f"verifier URL must start with http:// or https://, got {url!r}")
    target = RemoteTarget(url, api_key=api_key, timeout=timeout, settings=settings)
    if tokenizer is not None:
        try:
            target.check_tokenizer(tokenizer)
        except RemoteVerifierError:
            target.close()
            raise
    return target
