"""The model seam: the one protocol the decode loop, targets, drafters, servers and bench see.

A ``LanguageModel`` is one sequence of tokens with its KV cache over a set of weights. It
feeds tokens and returns float32 scores, forgets its tail, and forks a new sequence over the
same weights. Backends live behind it (``draftwise.backends.hf`` for transformers models,
``draftwise.backends.llamacpp`` for GGUF files on llama.cpp's kernels); nothing above this
seam imports a backend's libraries or reaches into a backend's objects.

``prefill`` and ``sync`` are written once here, over the protocol.

Passes are values. Code that needs a model's scores (a prefill, a draft, a verification)
is a generator that yields a ``Forward`` and receives its scores: ``scores = yield
Forward(lm, tokens, last)``. One stream alone runs its passes as they come (``drive``); a
server's ``draftwise.scheduler.Scheduler`` gathers every stream's pending pass in rounds and
runs those over one model's sequences as one batched pass (``Batch``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids, as every backend provides it (transformers' tokenizers through
    ``draftwise.backends.hf.HFTokenizer``).

    ``encode`` recognises control tokens written in the text (``<|im_start|>``) unless told
    not to (``parse_special=False``: every character is text, so user text can never pass for
    markup), and, with ``add_special_tokens``, adds what the model adds on its own (a BOS
    token, for some). Its cost is linear in the text.
    """

    @property
    def chat_template(self) -> str | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def control_tokens(self) -> Mapping[str, int]:
        """The markup strings ``encode`` turns into control tokens, with their ids."""

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...

    def token_bytes(self) -> list[bytes]:
        """The bytes each token stands for, by id (a control token: its markup's text)."""


@dataclass(frozen=True)
class PassInfo:
    """The target pass behind a forward's scores: its rows, over every sequence it served,
    and how long it took. A backend that batches sequences (llama.cpp) reports it; where a
    forward runs alone, its rows are the tokens fed and its time the call's. ``sequences``:
    how many sequences the pass served (a stream decoding emits a token a pass; a prompt fed
    in pieces puts many rows in and emits none)."""

    rows: int
    seconds: float
    sequences: int = 1


@dataclass(eq=False)
class Forward:
    """A pass a stream asks for: append ``tokens`` to ``lm``'s sequence and return the scores
    ``[last or n, V]`` of its final positions (see ``LanguageModel.forward``).

    A backend that batches may take several passes to feed it (a long prompt goes in pieces
    beside the other streams' steps): ``scores`` is set once it is fed whole; ``state`` is
    the backend's bookkeeping meanwhile. ``after`` counts the tokens the stream feeds right
    after this pass, before it needs anyone's attention (the rest of a prompt fed in pieces):
    a backend that serves the least work first counts them too.
    """

    lm: LanguageModel
    tokens: Sequence[int]
    last: int | None = None
    after: int = 0
    scores: torch.Tensor | None = None  # [last or n, V] float32, once done
    error: BaseException | None = None  # why it cannot be done (a full context, a failed pass)
    state: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.scores is not None or self.error is not None

    def run(self) -> torch.Tensor:  # [last or n, V]
        """Run this pass alone, now."""
        return self.lm.forward(self.tokens, self.last)


T = TypeVar("T")
# A computation that needs passes: it yields each ``Forward`` and is sent back its scores
# ``[last or n, V]``; what it returns is its result.
Passes = Generator[Forward, torch.Tensor, T]


def ready(value: T) -> Passes[T]:
    """``value``, as a computation that needs no pass."""
    yield from ()
    return value


def drive(passes: Passes[T]) -> T:
    """Run ``passes`` alone: each pass as it is asked for (a pass that fails raises inside
    ``passes``, where the code that asked may handle it); return its result."""
    try:
        request = next(passes)
        while True:
            request = _answer(passes, request)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def _answer(stream: Generator[Any, torch.Tensor, Any], request: Forward) -> Any:
    """Run ``request`` alone and send ``stream`` its scores, or throw in why it failed;
    what ``stream`` yields next."""
    try:
        scores = request.run()
    except Exception as exc:
        return stream.throw(exc)
    return stream.send(scores)


E = TypeVar("E")


def run_alone(
    stream: Generator[Forward | E, torch.Tensor, None], cancelled: Callable[[], bool] | None = None
) -> Generator[E, None, None]:
    """Run a stream of passes and events alone: its passes as they come (as ``drive``), its
    events yielded. Once ``cancelled()`` is true before a pass (a long prefill goes in
    several), the stream ends there; so it does once the consumer stops reading."""
    try:
        item = next(stream)
        while True:
            if not isinstance(item, Forward):
                yield item
                item = next(stream)
            elif cancelled is not None and cancelled():
                return
            else:
                item = _answer(stream, item)
    except StopIteration:
        return
    finally:
        stream.close()


class Batch(Protocol):
    """Sequences over one model whose passes can share a pass (a llama.cpp context of several
    slots): the scheduler hands it every pending ``Forward`` of its sequences in a round."""

    def step(self, forwards: Sequence[Forward], rows: int | None = None) -> int:
        """One pass over ``forwards`` (as many of their tokens as its row budget takes, and
        at most ``rows``: the scheduler's bound on a pass that feeds a long prompt beside
        other streams); each one fed whole gets its ``scores``. Returns the rows it fed."""

    def apart_from(self) -> int:
        """The fewest rows of prompt pieces that run on faster kernels in a pass of their own
        than beside other streams' steps (0: the same kernels either way). The scheduler feeds
        pieces that large in a pass of their own, and the steps in another."""


class KernelTiming(Protocol):
    """Kernels for prompt pieces that a backend leaves to timing (llama.cpp's repacked matrices,
    docs/speed.md#kernels-chosen-by-timing): what the choice depends on, and where it goes.
    ``draftwise.costs.choose_kernels`` times the pieces both ways and sets it."""

    @property
    def key(self) -> str:
        """What decides the choice: the weights file, the threads, the device."""

    def set_stock_rows(self, rows: int) -> None:
        """Passes of prompt pieces of at least ``rows`` rows run the stock kernels (0: none)."""

    def set_apart_rows(self, rows: int) -> None:
        """Prompt pieces of at least ``rows`` rows beside other streams' steps go in a pass of
        their own (``Batch.apart_from``; 0: never)."""


@runtime_checkable
class LanguageModel(Protocol):
    """One sequence and its KV cache over a model's weights (batch size 1).

    ``tokens`` mirrors what the cache holds, so callers can tell what still has to be fed.
    """

    name: str
    backend: str  # "hf" or "llamacpp"
    tokens: list[int]

    @property
    def tokenizer(self) -> Tokenizer | None:
        """Text <-> ids for this model (shared by its forks); None for a model without one."""

    @property
    def vocab_size(self) -> int:
        """Width of every score row ``forward`` returns (may exceed the tokenizer's vocabulary)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Tokens that end a generation."""

    @property
    def max_context(self) -> int | None:
        """Most positions one sequence may hold (prompt + generated), if known."""

    @property
    def dtype(self) -> str:
        """The weights' format, for the user: ``float32``, ``bfloat16``, ``Q4_K_M``..."""

    @property
    def fingerprint(self) -> str:
        """What makes this model as fast as it is (weights, format, threads...), as a key for
        measured costs (``draftwise.costs``)."""

    @property
    def batch(self) -> Batch | None:
        """What batches this sequence's passes with its forks'; None where each runs alone."""

    @property
    def kernel_timing(self) -> KernelTiming | None:
        """The choice of kernels for prompt pieces left to timing and not yet made; None where
        there is none to make (another backend, ``--exact``, the GPU, the user's own)."""

    @property
    def last_pass(self) -> PassInfo | None:
        """The pass that produced the last ``forward``'s scores, where it may have served
        other sequences too; None where every forward runs alone."""

    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``tokens`` to the cache and return float32 scores ``[last or n, V]`` for the
        final positions.

        The result may be a view of the backend's own buffer: it is valid until the next
        ``forward``, ``rollback`` or ``reset`` of this sequence. Copy what must outlive that.
        """

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on."""

    def reset(self) -> None:
        """Forget everything (an empty sequence)."""

    def fork(self) -> LanguageModel:
        """A new, empty sequence with a KV cache of its own over the same weights (no second
        load); its tokenizer may be used from another thread."""


# Prompt tokens fed per forward while prefilling: a stream run alone stops between chunks
# once cancelled (in rounds, a batched backend feeds fewer a pass anyway). The llamacpp
# backend decodes in pieces of this size anyway (its BATCH), so chunking there changes no
# number.
PREFILL_CHUNK = 512


def common_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading tokens ``cached`` and ``tokens`` share."""
    n = min(len(cached), len(tokens))
    if list(cached[:n]) == list(tokens[:n]):
        return n
    return next(i for i, (a, b) in enumerate(zip(cached, tokens)) if a != b)


def cached_start(lm: LanguageModel, prompt: Sequence[int]) -> int:
    """How many of ``prompt``'s tokens ``prefill`` keeps from what ``lm`` holds: their common
    start, short of the prompt's last token (which is always fed)."""
    return common_prefix(lm.tokens, prompt[:-1])


def prefill(lm: LanguageModel, prompt: Sequence[int]) -> Passes[None]:
    """Start a new sequence: cache everything but the prompt's last token, which is fed with
    the first block (its scores are what the first step needs).

    What the cache already holds of the prompt's start is kept, not fed again: a server's
    slot keeps its last request's tokens, so a shared system prompt or the earlier turns of
    a chat cost nothing the second time. Call ``lm.reset()`` first for a prefill from
    scratch. The rest is fed in chunks of ``PREFILL_CHUNK``: whoever runs the passes may stop
    between two (a cancelled request).

    Example: cached ``[5 8 2 9 4]``, prompt ``[5 8 2 7 1]``: keep ``[5 8 2]``, feed ``[7]``.
    """
    body = list(prompt[:-1])
    keep = cached_start(lm, prompt)
    if keep < len(lm.tokens):
        lm.rollback(keep)
    for start in range(keep, len(body), PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, len(body))
        yield Forward(lm, body[start:end], last=1, after=len(body) - end)


def sync(lm: LanguageModel, context: Sequence[int]) -> list[int]:
    """Roll ``lm`` back to the longest cached prefix of ``context`` that leaves its last token
    out, and return the tokens still to feed (never empty: the scores after the last token
    are what every caller wants next).

    Example: cached ``[5 8 2 9]``, context ``[5 8 3 1]``: roll back to ``[5 8]``, feed ``[3 1]``.
    """
    keep = min(common_prefix(lm.tokens, context), len(context) - 1)
    if keep < len(lm.tokens):
        lm.rollback(keep)
    return list(context[keep:])


def longest_token(tokenizer: Tokenizer) -> int:
    """The most bytes of text one token stands for (at least 1): a text of n bytes holds at
    least n / this many tokens, so a text too long for a context is refused by its size,
    unread. Counted on ``token_bytes``, not on the vocabulary's spelling, which writes each
    byte of a byte-level vocabulary as a character of up to two UTF-8 bytes (``Ġ`` for a
    space) and so doubles the bound: a text twice the size it need be was tokenized, whole,
    before its refusal."""
    return max(1, max((len(piece) for piece in tokenizer.token_bytes()), default=1))
