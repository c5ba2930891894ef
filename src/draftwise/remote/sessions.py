"""The verifier's sessions: each holds the target's context and KV cache.

Each session is a ``LocalTarget`` over the one loaded model (the weights are shared, each
session has its own cache), seeded exactly as the local engine seeds its target, so a
remote run makes the same decisions as a local one: the verification code is the local code.
On llama.cpp each session is a sequence (a slot) of one context loaded for ``slots``
sessions, and a session opened beyond them evicts one that is not verifying. Every session's
prefill and verify pass runs in the service's ``Scheduler``: the passes of sessions served at
the same time go into one ``llama_decode`` per round.

``VerifierService`` holds the session table; a refusal is a ``VerifierError`` (an HTTP status
and a message). The web app over it is ``draftwise.remote.server``.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from pydantic import ValidationError

from draftwise.config import GenerationConfig, GrammarSpec, SamplingConfig
from draftwise.constraint import Constraint, GrammarDeadEnd, GrammarError, Triggered
from draftwise.drafters import Proposal
from draftwise.engine import seeded_generators
from draftwise.errors import DraftwiseError, SlotsFullError, validation_message
from draftwise.grammar import grammars_of
from draftwise.lm import LanguageModel
from draftwise.profile import CostProfile
from draftwise.remote.protocol import (
    GRAMMAR_DEAD_END,
    PROTOCOL_VERSION,
    Affinity,
    Health,
    Limits,
    OpenSession,
    ProtocolError,
    ServerInfo,
    SessionOpened,
    VerifyRequest,
    decode_verify_request,
    encode_verify_response,
    tokenizer_fingerprint,
)
from draftwise.remote.settings import VerifierSettings
from draftwise.scheduler import Scheduler
from draftwise.target import LocalTarget
from draftwise.web import JsonBodyError, check_json_type, read_json_body

# q rows are probabilities computed in float32 by the drafter: their sum may exceed 1 by
# round-off, never by more than this.
_Q_SUM_SLACK = 1e-3


class VerifierError(DraftwiseError):
    """A request the server refuses: an HTTP status (``status``, this instance's own), a
    message for the client, and a ``code`` where the client acts on the kind of failure
    (``protocol.GRAMMAR_DEAD_END``)."""

    def __init__(
        self, status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.code = code


def dead_end(exc: GrammarDeadEnd) -> VerifierError:
    """The answer to a verify whose answer reached a point its grammar allows no way on from:
    a 422 with its own code, as a bad grammar is a 422 (the request's grammar fails, not the
    server), and never a normal verdict, which would pass text the grammar refuses off as
    valid. The code tells the client to raise ``GrammarDeadEnd``, as a local run does."""
    return VerifierError(422, str(exc), code=GRAMMAR_DEAD_END)


@dataclass
class _Session:
    target: LocalTarget
    sampling: SamplingConfig
    context: list[int]  # committed tokens, as the client's engine holds them
    last_used: float
    # When its last verify's pass ended (time.monotonic); None: none since it was opened.
    verified_at: float | None = None
    # The answer's grammar, if any: it follows context[answer_start:] and masks every verify.
    grammar: GrammarSpec | None = None
    constraint: Constraint | Triggered | None = None
    answer_start: int = 0
    # One verify at a time per session; sessions run theirs side by side (their passes share rounds).
    lock: threading.Lock = field(default_factory=threading.Lock)


class VerifierService:
    """Sessions over one loaded target model.

    One lock guards the session table, and each session has a lock of its own: a session is
    never verified twice at once, and different sessions verify concurrently, their passes
    batched in the scheduler's rounds (a CPU runs one pass over many rows well, not several
    passes).
    """

    def __init__(self, settings: VerifierSettings, lm: LanguageModel, profile: CostProfile | None = None) -> None:
        self.settings = settings
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.fingerprint = tokenizer_fingerprint(lm.tokenizer)
        # A session can hold no more than the model itself can, whatever the setting says.
        self.max_context = min(settings.max_context, lm.max_context or settings.max_context)
        self.grammars = grammars_of(lm)  # compiles the grammars sessions bring (structured output)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._held: weakref.ref[LocalTarget] | None = None  # the target on ``lm`` itself, while one lives
        self._lock = threading.Lock()
        self.hits = 0  # verifies that found their session here
        self.misses = 0  # verifies for a session not held here (its client re-opens it)
        self.scheduler = Scheduler(name="draftwise-verifier", pacing=settings.pacing)
        self.active_s = settings.active_s
        if profile is not None and lm.batch is not None:
            # A long prompt opening beside other sessions' verifies goes in pieces sized by
            # the target's pass times (as serve's streams do), not pieces of its row budget.
            # A session is in the rounds only during its verify: between two, while its client
            # drafts, it counts as waiting as long as it verified within ``settings.active_s``.
            times = profile.pass_times
            self.scheduler.pace(lm.batch, lambda rows: times.at(rows, rising=True), self._others_active)
        self.scheduler.start()
        weakref.finalize(self, self.scheduler.close)

    def _others_active(self) -> bool:
        """Whether a session has verified within ``active_s``: its client is drafting its next
        block and will want a pass soon. (Read from the round thread without the table's lock:
        the copy of the table is one step under the GIL.)"""
        now = time.monotonic()
        done = [s.verified_at for s in tuple(self._sessions.values()) if s.verified_at is not None]
        return any(now - at < self.active_s for at in done)

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def health(self) -> Health:
        return Health(status="ok", sessions=self.session_count, affinity=Affinity(hits=self.hits, misses=self.misses))

    def info(self) -> ServerInfo:
        s = self.settings
        return ServerInfo(
            protocol_version=PROTOCOL_VERSION,
            model=self.lm.name,
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.lm.eos_token_ids),
            limits=Limits(
                max_sessions=s.max_sessions,
                idle_timeout_s=s.idle_timeout_s,
                max_context=self.max_context,
                max_block=s.max_block,
                max_q_entries=s.max_q_entries,
                max_body_bytes=s.max_body_bytes,
            ),
        )

    def _check_ids(self, ids: np.ndarray, what: str) -> None:  # ids: [n] integer
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise VerifierError(
                422, f"{what} holds token id {int(bad[0])}, outside the target's vocabulary [0, {self.vocab_size})"
            )

    def open(self, request: OpenSession) -> SessionOpened:
        prompt = request.prompt
        if len(prompt) >= self.max_context:  # a session must also hold the token a verify adds
            raise VerifierError(
                422,
                f"prompt has {len(prompt)} tokens; this server's max_context of {self.max_context} leaves "
                f"room for prompts of at most {self.max_context - 1} (each verify adds a token)",
            )
        self._check_ids(np.asarray(prompt, dtype=np.int64), "prompt")
        answer_start = len(prompt) if request.answer_start is None else request.answer_start
        if answer_start > len(prompt):
            raise VerifierError(422, f"answer_start={answer_start} is past the prompt's {len(prompt)} tokens")
        constraint = self._follow(request.grammar, prompt, answer_start)
        with self._lock:
            self._expire_locked(time.monotonic())
            while len(self._sessions) >= self.settings.max_sessions:
                self._evict_locked()
            target = self._target_locked()
        # The prefill runs outside the table's lock: other sessions verify meanwhile.
        started = time.perf_counter()
        target_generator, _ = seeded_generators(request.sampling.seed)
        self.scheduler.run(target.start(prompt, GenerationConfig(sampling=request.sampling), target_generator))
        prefill_seconds = time.perf_counter() - started
        session_id = secrets.token_urlsafe(12)
        with self._lock:
            while len(self._sessions) >= self.settings.max_sessions:
                self._evict_locked()
            self._sessions[session_id] = _Session(
                target,
                request.sampling,
                list(prompt),
                time.monotonic(),
                grammar=request.grammar,
                constraint=constraint,
                answer_start=answer_start,
            )
        return SessionOpened(session_id=session_id, context_length=len(prompt), prefill_seconds=prefill_seconds)

    def _follow(
        self, grammar: GrammarSpec | None, context: list[int], answer_start: int
    ) -> Constraint | Triggered | None:
        """``grammar`` compiled (once per server, see ``Grammars``) and walked through the
        answer so far, ``context[answer_start:]``; None without a grammar."""
        if grammar is None:
            return None
        if self.grammars is None:
            raise VerifierError(
                422, f"this verifier's model {self.lm.name!r} has no tokenizer: it cannot follow a grammar"
            )
        try:
            constraint = self.grammars.constraint(grammar)
            constraint.commit(context[answer_start:])
        except GrammarDeadEnd as exc:  # a session opened again on an answer that has run into it
            raise dead_end(exc) from None
        except GrammarError as exc:
            raise VerifierError(422, str(exc)) from None
        return constraint

    def _target_locked(self) -> LocalTarget:
        """A target for a new session: on the loaded model itself while no session holds it,
        else on a fork of it. Where every slot holds a session (llama.cpp: the context was
        loaded for ``settings.slots``), sessions not verifying now are evicted, least recently
        used first, until one comes free; where each is verifying, a 503 the client retries.
        A session's slot goes back with its target (``LlamaCppModel.fork``)."""
        while True:
            if self._held is None or self._held() is None:
                self.lm.reset()
                target = LocalTarget(self.lm)
                self._held = weakref.ref(target)
                return target
            try:
                return LocalTarget(self.lm.fork())
            except SlotsFullError as exc:
                if not self._evict_locked(idle=True):
                    raise VerifierError(
                        503, f"{exc}, each in a verify now: retry shortly", {"Retry-After": "1"}
                    ) from None

    def _evict_locked(self, *, idle: bool = False) -> bool:
        """Drop the least recently used session that has served a verify, or else the least
        recently used one (``idle``: of those not verifying now); False when there is none.
        With more active clients than slots, plain LRU could evict a session before its first
        verify: its prefill wasted, its client (reopening after an eviction) failing again.
        Sparing those, every session opened gets to verify at least once."""
        candidates = [(sid, s) for sid, s in self._sessions.items() if not (idle and s.lock.locked())]
        if not candidates:
            return False
        victim = next((sid for sid, session in candidates if session.verified_at is not None), candidates[0][0])
        del self._sessions[victim]
        return True

    def close(self, session_id: str) -> None:
        with self._lock:
            if self._sessions.pop(session_id, None) is None:
                raise VerifierError(404, f"unknown session {session_id!r} (closed, expired or evicted)")

    def close_all(self) -> None:
        with self._lock:
            self._sessions.clear()

    def expire(self) -> None:
        with self._lock:
            self._expire_locked(time.monotonic())

    def _expire_locked(self, now: float) -> None:
        deadline = now - self.settings.idle_timeout_s
        while self._sessions:
            oldest_id, oldest = next(iter(self._sessions.items()))
            if oldest.last_used > deadline:
                break
            del self._sessions[oldest_id]

    def verify(self, session_id: str, body: bytes) -> bytes:
        started = time.perf_counter()
        try:
            request = decode_verify_request(body)
        except ProtocolError as exc:
            raise VerifierError(422, str(exc)) from exc
        limits = self.settings
        k = len(request.tokens)
        if k > limits.max_block:
            raise VerifierError(422, f"block of {k} tokens is over this server's max_block of {limits.max_block}")
        if request.n_top > limits.max_q_entries:
            raise VerifierError(
                422,
                f"{request.n_top} draft-distribution entries per token is over max_q_entries of "
                f"{limits.max_q_entries}; sample the draft from fewer tokens (draft.proposal_top)",
            )
        self._check_ids(request.append, "append")
        self._check_ids(request.tokens, "the proposed block")
        session = self._take(session_id)
        with session.lock:
            if request.keep > len(session.context):
                raise VerifierError(
                    409, f"keep={request.keep} but the session holds only {len(session.context)} tokens"
                )
            context = session.context[: request.keep] + request.append.tolist()
            if not context:
                raise VerifierError(422, "the context would be empty: keep or append at least one token")
            if len(context) + k + 1 > self.max_context:
                raise VerifierError(
                    422,
                    f"context of {len(context)} tokens plus a block of {k} and the token it adds is over "
                    f"max_context of {self.max_context}",
                )
            if request.refused and session.constraint is None:
                raise VerifierError(422, "refused=1 names a token the grammar refused, and this session has none")
            q = None if session.sampling.greedy else self._draft_probs(request)  # [k (+ 1), V]
            proposal = Proposal(
                tokens=torch.from_numpy(request.tokens.astype(np.int64)),
                probs=None if q is None else q[:k],
                refused=q[k] if q is not None and request.refused else None,
            )
            mask = self._mask(session, request, context)
            check = self.scheduler.run(session.target.verify(context, proposal, mask))
            verdict = check.verdict
            kept = request.tokens[: verdict.n_accepted].tolist() + [verdict.next_token]
            session.context = context + kept
            session.verified_at = time.monotonic()
            self._commit(session, kept)
        return encode_verify_response(
            verdict.n_accepted, verdict.next_token, time.perf_counter() - started, check.target_token_probs
        )

    def _mask(self, session: _Session, request: VerifyRequest, context: list[int]) -> torch.Tensor | None:  # [k + 1, W]
        """What the session's grammar allows at each row of the verify of ``request``'s block
        after ``context`` (None: no grammar). A context the client rewrote (``keep`` short of
        the session's, or ``append``) is walked again from the answer's start."""
        if session.constraint is None:
            return None
        if request.keep < len(session.context) or len(request.append):
            if (
                len(context) < session.answer_start
                or context[: session.answer_start] != session.context[: session.answer_start]
            ):
                raise VerifierError(
                    409, f"a session with a grammar keeps its prompt: keep must be at least {session.answer_start}"
                )
            session.constraint = self._follow(session.grammar, context, session.answer_start)
            assert session.constraint is not None
        try:
            return session.constraint.masks(request.tokens.tolist())
        except GrammarDeadEnd as exc:  # the answer so far, or the drafted block, ran into it
            raise dead_end(exc) from None

    @staticmethod
    def _commit(session: _Session, kept: list[int]) -> None:
        """Walk the session's grammar (if any) through the tokens a verify kept. Where the
        target's pick leads the grammar into a dead end the verify answers with it (a 422 with
        its code), not with the verdict: a local run raises there too, the token unshown."""
        if session.constraint is None:
            return
        try:
            session.constraint.commit(kept)
        except GrammarDeadEnd as exc:
            raise dead_end(exc) from None

    def _take(self, session_id: str) -> _Session:
        """The session to verify on, marked as just used; 404 when it is not held here."""
        with self._lock:
            self._expire_locked(time.monotonic())
            session = self._sessions.get(session_id)
            if session is None:
                self.misses += 1
                raise VerifierError(404, f"unknown session {session_id!r} (closed, expired or evicted)")
            self.hits += 1
            self._sessions.move_to_end(session_id)
            session.last_used = time.monotonic()
            return session

    def _draft_probs(self, request: VerifyRequest) -> torch.Tensor | None:  # [k (+ 1), V]; None = point masses
        """Rebuild the dense q the drafter sampled from out of its non-zero entries (with the
        row of the token the grammar refused after the block, where ``request.refused``)."""
        if request.n_top == 0:
            return None
        self._check_ids(request.q_ids.reshape(-1), "q_ids")
        probs = request.q_probs
        if not np.isfinite(probs).all() or (probs < 0).any():
            raise VerifierError(422, "q_probs must be finite and non-negative")
        ids = torch.from_numpy(request.q_ids.astype(np.int64))
        q = torch.zeros(len(ids), self.vocab_size, dtype=torch.float32)
        # scatter_add: padding entries (probability 0) may repeat an id without harm.
        q.scatter_add_(1, ids, torch.from_numpy(probs.copy()))
        sums = q.sum(-1)
        if (sums > 1 + _Q_SUM_SLACK).any():
            row = int((sums > 1 + _Q_SUM_SLACK).nonzero()[0])
            raise VerifierError(422, f"q row {row} sums to {float(sums[row]):.6f}, more than 1")
        tokens = torch.from_numpy(request.tokens.astype(np.int64))
        q_x = q[: len(tokens)].gather(1, tokens[:, None]).squeeze(1)
        if (q_x <= 0).any():
            row = int((q_x <= 0).nonzero()[0])
            raise VerifierError(
                422,
                f"proposed token {int(tokens[row])} at position {row} has draft probability 0 in q; "
                "a drafted token must come from its q",
            )
        return q


# Commas in a valid open-session body besides those between prompt tokens: the separators of
# its top-level keys and of the sampling settings, with room to spare.
_OPEN_COMMAS = 16
# JSON strings (a grammar's text), whose commas separate no values.
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def parse_open_session(body: bytes, max_context: int, content_type: str | None) -> OpenSession:
    """The body of ``POST /v1/sessions`` (sent as ``content_type``), parsed and checked; the
    route runs it in a worker thread.

    A thread alone does not keep a large body from holding up other requests: the parser keeps
    the GIL, and a body of ``max_body_bytes`` can hold a million numbers (most of a second's
    work). A prompt has fewer tokens than ``max_context``, so a body with more commas than that
    (and the sampling settings' few) outside its strings (a grammar's text has commas of its
    own) cannot be valid: it is refused before it is parsed, and what is parsed is at most
    about ``max_context`` numbers. A body that is no JSON object (another content type, not
    UTF-8, malformed, nested too deep) is a 400 saying which (``read_json_body``).
    """
    try:
        check_json_type(content_type)  # first: a body of another type is not counted either
        limit = max_context + _OPEN_COMMAS
        if _STRINGS.sub(b'""', body).count(b",") > limit:  # a quick scan, next to parsing
            raise VerifierError(
                422,
                f"the body holds over {limit} values, more than a session can: this server's max_context of "
                f"{max_context} leaves room for prompts of at most {max_context - 1} tokens",
            )
        value = read_json_body(body, content_type)
    except JsonBodyError as exc:
        raise VerifierError(400, str(exc)) from None
    try:
        return OpenSession.model_validate(value)
    except ValidationError as exc:
        raise VerifierError(422, validation_message(exc, every=True)) from None
