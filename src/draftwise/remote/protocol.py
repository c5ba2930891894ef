"""The verifier wire format, shared by the server and the client.

Session set-up is JSON (it happens once). The verify round trip, which happens once per
drafted block, is a small binary body, little-endian throughout:

Request (``POST /v1/sessions/{id}/verify``, ``application/octet-stream``)::

    int32 keep, int32 n_append, int32 k, int32 n_top, int32 refused   # 20-byte header
    int32[n_append]  append     # committed tokens the server has not seen (normally none)
    int32[k]         tokens     # the proposed block
    int32[(k + refused) * n_top] q_ids      # sampling only: the non-zero entries of q per position
    float32[(k + refused) * n_top] q_probs

The server's context becomes ``context[:keep] + append``; it already appends the accepted
tokens and the correction or bonus itself, so in a normal step ``keep`` is its whole
context and ``append`` is empty. ``n_top == 0`` means no draft distribution (greedy, or a
deterministic drafter whose q is a point mass on each token). ``refused == 1`` (with
``n_top > 0``): the draft drew one more token after the block, which the session's grammar
refuses, and q holds that position's row too (``draftwise.verify.verify_sampling``).

Response (``application/octet-stream``)::

    int32 n_accepted, int32 next_token, float32 server_seconds   # 12-byte header
    float32[k] target_probs     # p(x_i) of each proposed token

Errors are JSON ``{"detail": "what is wrong"}`` with a 4xx status; one the client acts on
also has a ``code``: ``grammar_dead_end`` (a 422), the answer reached a point the session's
grammar allows no way on from (the client raises ``draftwise.constraint.GrammarDeadEnd``).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from draftwise.config import GrammarSpec, SamplingConfig
from draftwise.errors import DraftwiseError

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer

PROTOCOL_VERSION = 2  # 2: the refused row of a draft cut by a grammar

# The ``code`` of an error answer saying the answer's grammar reached a dead end.
GRAMMAR_DEAD_END = "grammar_dead_end"

_REQUEST_HEADER = struct.Struct("<iiiii")
_RESPONSE_HEADER = struct.Struct("<iif")
_INT = np.dtype("<i4")
_FLOAT = np.dtype("<f4")


class ProtocolError(DraftwiseError, ValueError):
    """A verify body (or answer) that does not follow the wire format; the message says how."""

    exit_code = 1  # on the client's side: the server answered something else than the protocol
    status = 422


@dataclass(frozen=True)
class VerifyRequest:
    keep: int
    append: np.ndarray  # [n_append] int32
    tokens: np.ndarray  # [k] int32
    q_ids: np.ndarray  # [k + refused, n_top] int32
    q_probs: np.ndarray  # [k + refused, n_top] float32

    @property
    def n_top(self) -> int:
        return int(self.q_ids.shape[1])

    @property
    def refused(self) -> bool:
        """Whether q holds the row of a token drawn after the block that the grammar refused."""
        return self.n_top > 0 and self.q_ids.shape[0] > len(self.tokens)


@dataclass(frozen=True)
class VerifyResponse:
    n_accepted: int
    next_token: int
    server_seconds: float
    target_probs: list[float]  # [k]


def encode_verify_request(
    keep: int,
    append: list[int],
    tokens: list[int],
    q_ids: np.ndarray | None = None,  # [k + refused, n_top] integer
    q_probs: np.ndarray | None = None,  # [k + refused, n_top] float32
) -> bytes:
    k = len(tokens)
    n_top = 0 if q_ids is None else int(q_ids.shape[1])
    refused = int(q_ids.shape[0]) - k if q_ids is not None and n_top else 0
    parts = [
        _REQUEST_HEADER.pack(keep, len(append), k, n_top, refused),
        np.asarray(append, dtype=_INT).tobytes(),
        np.asarray(tokens, dtype=_INT).tobytes(),
    ]
    if n_top:
        parts.append(np.ascontiguousarray(q_ids, dtype=_INT).tobytes())
        parts.append(np.ascontiguousarray(q_probs, dtype=_FLOAT).tobytes())
    return b"".join(parts)


def decode_verify_request(body: bytes) -> VerifyRequest:
    """Parse a verify body; checks the framing only (the server checks values and limits)."""
    if len(body) < _REQUEST_HEADER.size:
        raise ProtocolError(
            f"verify body is {len(body)} bytes, shorter than its {_REQUEST_HEADER.size}-byte header "
            "(int32 keep, n_append, k, n_top, refused)"
        )
    keep, n_append, k, n_top, refused = _REQUEST_HEADER.unpack_from(body)
    for name, value in (("keep", keep), ("n_append", n_append), ("k", k), ("n_top", n_top)):
        if value < 0:
            raise ProtocolError(f"{name} must be >= 0, got {value}")
    if refused not in (0, 1) or (refused and not n_top):
        raise ProtocolError(f"refused must be 0, or 1 with a q (n_top > 0), got {refused} with n_top={n_top}")
    rows = k + refused
    expected = _REQUEST_HEADER.size + 4 * (n_append + k + 2 * rows * n_top)
    if len(body) != expected:
        raise ProtocolError(
            f"verify body is {len(body)} bytes but its header (n_append={n_append}, k={k}, n_top={n_top}, "
            f"refused={refused}) announces {expected}"
        )
    offset = _REQUEST_HEADER.size
    arrays = []
    for count, dtype in ((n_append, _INT), (k, _INT), (rows * n_top, _INT), (rows * n_top, _FLOAT)):
        arrays.append(np.frombuffer(body, dtype=dtype, count=count, offset=offset))
        offset += 4 * count
    append, tokens, q_ids, q_probs = arrays
    return VerifyRequest(keep, append, tokens, q_ids.reshape(rows, n_top), q_probs.reshape(rows, n_top))


def encode_verify_response(n_accepted: int, next_token: int, server_seconds: float, target_probs: list[float]) -> bytes:
    return (
        _RESPONSE_HEADER.pack(n_accepted, next_token, server_seconds) + np.asarray(target_probs, dtype=_FLOAT).tobytes()
    )


def decode_verify_response(body: bytes, k: int) -> VerifyResponse:
    expected = _RESPONSE_HEADER.size + 4 * k
    if len(body) != expected:
        raise ProtocolError(f"verify answer is {len(body)} bytes, expected {expected} for a block of {k}")
    n_accepted, next_token, server_seconds = _RESPONSE_HEADER.unpack_from(body)
    probs = np.frombuffer(body, dtype=_FLOAT, count=k, offset=_RESPONSE_HEADER.size).tolist()
    return VerifyResponse(n_accepted, next_token, server_seconds, probs)


def tokenizer_fingerprint(tokenizer: Tokenizer | None) -> str | None:
    """A short hash of the token <-> id mapping (added tokens included): two tokenizers with
    the same fingerprint give every token the same id, which is what drafter and target
    must agree on. ``None`` without a tokenizer.
    """
    if tokenizer is None:
        return None
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:16]


# JSON bodies, strict like every config: unknown keys are rejected.


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OpenSession(_Strict):
    prompt: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(
        ..., min_length=1, description="prompt token ids; the server prefills all but the last"
    )
    sampling: SamplingConfig = Field(
        SamplingConfig(), description="the acceptance rule's distribution and seed (same meaning as locally)"
    )
    grammar: GrammarSpec | None = Field(
        None,
        description="a grammar the answer follows (structured output): the session masks every verified row to "
        "what it allows, as a local run does; None = no constraint",
    )
    answer_start: int | None = Field(
        None,
        ge=1,
        description="where the answer begins in prompt, for a session opened again mid-answer: the grammar "
        "follows prompt[answer_start:]; None = the answer starts after the prompt",
    )


class SessionOpened(_Strict):
    session_id: str
    context_length: int
    prefill_seconds: float


class Limits(_Strict):
    max_sessions: int
    idle_timeout_s: float
    max_context: int = Field(..., description="tokens a session may hold: the setting, capped at the model's own")
    max_block: int
    max_q_entries: int
    max_body_bytes: int


class ServerInfo(_Strict):
    protocol_version: int
    model: str
    tokenizer_fingerprint: str | None
    vocab_size: int = Field(..., description="rows of the target's output layer: token ids must be below this")
    eos_token_ids: list[int]
    limits: Limits
    routing_header: str | None = Field(
        None,
        description="a fleet of replicas (draftwise serve-verifier --ray): the header that carries the session "
        "ID on every request to a session, so it is routed to the replica holding it; None = one server",
    )


class Affinity(_Strict):
    hits: int = Field(..., description="verifies that found their session on the server that answered")
    misses: int = Field(
        ...,
        description="verifies for a session the server did not hold (expired, evicted, or in a fleet held by "
        "another replica); the client re-opens the session there, losslessly",
    )


class Health(_Strict):
    status: str
    sessions: int
    affinity: Affinity
    replicas: dict[str, Health] | None = Field(
        None, description="a fleet: each replica's own view, by replica ID (the fields above are their sums)"
    )


class ErrorDetail(_Strict):
    """Every error the verifier answers (4xx, and 500 for a fault of its own)."""

    detail: str = Field(..., description="what is wrong, in one line")
    code: str | None = Field(
        None,
        description=f"set where the client acts on the kind of failure: {GRAMMAR_DEAD_END!r} (a 422), the "
        "answer reached a point its grammar allows no way on from, so it cannot be completed",
    )
