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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from draftwise.config import GenerationConfig
from draftwise.drafters import Proposal
from draftwise.errors import ContextLengthError
from draftwise.grammar import Grammars
from draftwise.lm import Passes
from draftwise.remote.protocol import (
    OpenSession,
    ProtocolError,
    decode_verify_response,
    tokenizer_fingerprint,
)
from draftwise.remote.settings import ClientSettings

# RemoteVerifierError is this module's error too: importers of RemoteTarget find it here.
from draftwise.remote.transport import RemoteVerifierError, VerifierConnection, VerifierSession
from draftwise.target import Verification
from draftwise.verify import Verdict

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer


class RemoteTarget:
    """A ``Target`` whose model runs behind a verifier: a session per generation
    (``VerifierSession``) over one persistent connection (``VerifierConnection``)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        settings: ClientSettings | None = None,
        connection: VerifierConnection | None = None,
        session: VerifierSession | None = None,
    ) -> None:
        self.connection = connection or VerifierConnection(url, api_key, timeout, settings)
        self.session = session or VerifierSession(self.connection)
        self.eos_token_ids = tuple(self.info.eos_token_ids)

    # What callers and tests read of the connection and session, under their old names.
    url = property(lambda self: self.connection.url)
    settings = property(lambda self: self.connection.settings)
    info = property(lambda self: self.connection.info)
    retries = property(lambda self: self.connection.retries)
    reconnects = property(lambda self: self.connection.reconnects)
    routing_retries = property(lambda self: self.connection.routing_retries)
    reopens = property(lambda self: self.session.reopens)

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> Passes[None]:
        # The passes run on the verifier: one HTTP request each, made here (no local pass).
        yield from ()
        # The prefill is one request to the server.
        # The server seeds its own target stream from config.sampling.seed exactly as the
        # local engine seeds the generator it passes here, so that object is not needed.
        # The grammar travels with the session (opened again with it, mid-answer, if need be).
        self.session.sampling = config.sampling
        self.session.grammar, self.session.answer_start = config.grammar, len(prompt)
        self.session.open(OpenSession(prompt=list(prompt), sampling=config.sampling, grammar=config.grammar))

    def _sparse_q(self, proposal: Proposal) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The non-zero entries of q per position ([k, n] ids and probs; [k + 1, n] with the row
        of a token the grammar refused after the block), or (None, None)."""
        if self.session.sampling.greedy or proposal.probs is None:
            return None, None
        probs = proposal.probs if proposal.refused is None else torch.cat([proposal.probs, proposal.refused[None]])
        if not len(probs):
            return None, None
        # Like the local rule, ids past the target's vocabulary (padding rows) carry no mass.
        probs = probs[:, : self.info.vocab_size]
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

    def verify(
        self, context: Sequence[int], proposal: Proposal, mask: torch.Tensor | None = None
    ) -> Passes[Verification]:
        yield from ()  # one request to the verifier (see start)
        # ``mask`` is the run's grammar's: the session holds the same grammar, compiled for the
        # same vocabulary (the fingerprint says so) and walked through the same tokens, and the
        # verifier masks the rows itself, so it is not sent.
        if mask is not None and self.session.grammar is None:
            raise RemoteVerifierError("a mask needs the run's grammar on the verifier: start the run with it")
        if self.session.id is None:
            raise RemoteVerifierError("verify called before start")
        proposal = self._fit(context, proposal)
        tokens = proposal.tokens.tolist()
        q_ids, q_probs = self._sparse_q(proposal)
        response, body, round_trip, reopened = self.session.verify(
            context, tokens, None if q_ids is None else q_ids.numpy(), None if q_probs is None else q_probs.numpy()
        )
        try:
            answer = decode_verify_response(response.content, len(tokens))
        except ProtocolError as exc:
            raise RemoteVerifierError(f"verifier at {self.url} sent a malformed answer: {exc}") from exc
        verdict = Verdict(n_accepted=answer.n_accepted, next_token=answer.next_token, n_proposed=len(tokens))
        self.session.server_context = list(context) + tokens[: answer.n_accepted] + [answer.next_token]
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

    def finish(self) -> None:
        """The run is over: close its session now rather than leave its KV cache on the server
        until the idle timeout. The connection stays open for the next run."""
        self.session.close()

    def grammars(self, tokenizer: Tokenizer) -> Grammars:
        """Grammars compiled here for the verifier's vocabulary, read from ``tokenizer`` (which
        must map tokens as the verifier's does): the engine drafts a grammar's forced text and
        cuts other drafts with them; the verifier masks with its own copy."""
        return Grammars(tokenizer, self.info.vocab_size, self.info.eos_token_ids)

    def speaks(self, tokenizer: Tokenizer | None) -> bool:
        """Whether the verifier's target maps tokens to the same ids as ``tokenizer``."""
        return tokenizer_fingerprint(tokenizer) == self.info.tokenizer_fingerprint

    def check_tokenizer(self, tokenizer: Tokenizer | None, whose: str = "the draft's") -> None:
        """Refuse a verifier whose tokenizer maps tokens to other ids than ``tokenizer`` does."""
        if not self.speaks(tokenizer):
            raise RemoteVerifierError(
                f"the verifier at {self.url} serves {self.info.model!r}, whose tokenizer differs from {whose} "
                f"(fingerprint {self.info.tokenizer_fingerprint} vs {tokenizer_fingerprint(tokenizer)}); drafter "
                "and target must share one tokenizer"
            )

    def close(self) -> None:
        self.session.close()
        self.connection.close()

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
