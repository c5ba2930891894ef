"""Drafters: cheap proposers of the next few tokens.

Every drafter speaks the same protocol, so the decode loop never asks which one it has:
``start`` once per sequence, ``offers`` what each of its sources could propose now (a draft
policy picks one, see ``draftwise.policies``), ``propose`` a block from the chosen source,
``observe`` the verdict. A proposal may need passes of a draft model: ``propose`` returns
them as ``Passes`` (``draftwise.lm``), run by whoever runs the stream.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from draftwise.config import DrafterKind, GenerationConfig, SamplingConfig
from draftwise.events import MODEL, NGRAM
from draftwise.lm import Forward, LanguageModel, Passes, Tokenizer, ready, sync
from draftwise.offers import Offer
from draftwise.retokenize import TextTokens, TokenText, added_text, proposal_ids, settled
from draftwise.tokenizer_compat import shares_vocabulary
from draftwise.verify import Verdict, logits_to_probs, sample


@dataclass(frozen=True)
class Proposal:
    """A proposed block of draft tokens.

    ``probs`` holds the draft distribution ``q`` at each position (what the rejection rule
    needs); ``None`` means the drafter is deterministic (a point mass on each token).
    ``catchup_seconds`` is time spent feeding context the drafter had not seen (a draft
    model's lazy prefill), counted apart from drafting itself; ``pass_seconds`` is what the
    draft model's own passes took (None without a model: the drafting's wall time stands).
    The first ``forced`` tokens are a grammar's forced text (``draftwise.constrained.Constrained``),
    the rest ``source``'s. ``refused`` is ``q`` at the position after the last token, where the
    draft drew a token that a grammar refused and the block was cut: verification rejects it
    there (``draftwise.verify.verify_sampling``).
    """

    tokens: torch.Tensor  # [k] long
    probs: torch.Tensor | None = None  # [k, V] float32 or None
    source: str | None = None
    catchup_seconds: float = 0.0
    catchup_tokens: int = 0
    forced: int = 0
    pass_seconds: float | None = None
    refused: torch.Tensor | None = None  # [V] float32 or None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def token_probs(self) -> list[float]:
        """q(x_i) of each proposed token (1.0 for a point mass)."""
        if self.probs is None:
            return [1.0] * len(self)
        return self.probs.gather(1, self.tokens[:, None]).squeeze(1).tolist()


EMPTY_PROPOSAL = Proposal(tokens=torch.empty(0, dtype=torch.long))


@runtime_checkable
class Drafter(Protocol):
    """The one interface every drafter implements."""

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        """Begin a new sequence after ``prompt``: read it, with no model pass and no KV cache
        touched (a model drafter feeds its model lazily, in its proposals), since a server
        prepares a run off the rounds that run every stream's passes
        (``SpeculativeEngine.prepare``)."""

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        """What each source could propose after ``context``, preferred first (cheap: no model pass)."""

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        """Propose up to ``k`` tokens to follow ``context`` (the committed tokens so far),
        from ``source`` (default: the preferred one); ``drive(...)`` runs it alone."""

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Learn the verdict on the last proposal; ``context`` is the committed sequence after it."""


class ModelDrafter:
    """A smaller LM sharing the target's tokenizer drafts autoregressively.

    Its prefill is lazy: the prompt is fed on the first proposal, so a generation whose
    policy never finds model drafting worth it never pays for the draft model at all.

    Confidence early stop: once the draft's top-1 probability at a position falls below
    ``confidence_threshold``, that token is still proposed (its cost is already paid and the
    target checks it for free within the same pass) but no further token is drafted.
    """

    CATCHUP = 8  # more unfed context tokens than this are fed as a catch-up of their own

    def __init__(self, lm: LanguageModel) -> None:
        self.lm = lm
        self._config = GenerationConfig()
        self._generator: torch.Generator | None = None
        self._stale = False

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self._config = config
        self._generator = generator
        self._stale = True  # the cache is another sequence's: emptied by the first proposal

    def cached(self) -> int:
        """Tokens of this sequence the draft model's cache holds."""
        return 0 if self._stale else len(self.lm.tokens)

    def room(self, context_length: int) -> int:
        """Tokens the draft model can still draft after a context this long."""
        limit = self.lm.max_context
        return limit - context_length - 1 if limit is not None else 1 << 30

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        if self.room(len(context)) <= 0:
            return ()
        return (Offer(MODEL, behind=max(0, len(context) - 1 - self.cached()), passes=True),)

    def _catch_up(self, context: Sequence[int]) -> Passes[tuple[list[int], float, int]]:
        """Sync the cache with ``context``; feed a long gap now, as a prefill. Returns what
        is left to feed with the first draft step, the catch-up's seconds and tokens."""
        if self._stale:
            self.lm.reset()
            self._stale = False
        feed = sync(self.lm, context)
        if len(feed) <= self.CATCHUP:
            return feed, 0.0, 0
        started = time.perf_counter()
        yield Forward(self.lm, feed[:-1], last=1)
        return feed[-1:], time.perf_counter() - started, len(feed) - 1

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        return self.draft(context, k)

    def draft(
        self, context: Sequence[int], k: int, enough: Callable[[list[int]], bool] | None = None
    ) -> Passes[Proposal]:
        """Up to ``k`` draft tokens after ``context``; ``enough`` may end the block sooner: it
        sees the tokens drafted so far after each one."""
        k = min(k, self.room(len(context)))
        if k <= 0:
            return EMPTY_PROPOSAL
        sampling = self._config.sampling
        threshold = self._config.draft.confidence_threshold
        # proposal_top narrows q to its N most likely tokens; lossless because the rejection
        # rule receives exactly the q sampled from. Greedy drafting only reports q.
        top_k, top_n = sampling.top_k, self._config.draft.proposal_top
        if top_n and not sampling.greedy:
            top_k = min(top_k or top_n, top_n)
        feed, catchup_seconds, catchup_tokens = yield from self._catch_up(context)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        own = 0.0  # seconds of the draft model's own passes
        for _ in range(k):
            started = time.perf_counter()
            logits = yield Forward(self.lm, feed, last=1)  # [1, V]
            info = self.lm.last_pass  # under load the stream also waited for other passes of the round
            own += info.seconds if info is not None else time.perf_counter() - started
            q = logits_to_probs(logits, sampling.temperature, top_k, sampling.top_p)[0]
            token = int(logits[0].argmax()) if sampling.greedy else sample(q, self._generator)
            tokens.append(token)
            rows.append(q)
            if (threshold > 0 and float(q.max()) < threshold) or (enough is not None and enough(tokens)):
                break
            feed = [token]
        return Proposal(
            tokens=torch.tensor(tokens, dtype=torch.long),
            probs=torch.stack(rows),
            source=MODEL,
            catchup_seconds=catchup_seconds,
            catchup_tokens=catchup_tokens,
            pass_seconds=own,
        )

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        # Drop rejected draft tokens now so the cache never holds more than it must.
        if self.cached():
            sync(self.lm, context)


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last ``n`` tokens
    and propose what followed it, trying ``n`` from ``ngram_max`` down to ``ngram_min``.
    The context is the prompt and everything generated so far.

    An index from each n-gram to the latest position where it ended is kept up to date
    incrementally, so a lookup costs O(1) rather than a scan of the context.

    Example: context ``[a b c x a b]`` with n = 2: the suffix ``a b`` last occurred ending at
    position 1, followed by ``c x a ...``, so ``[c, x, a]`` is proposed for k = 3.
    """

    def __init__(self, min_n: int = 1) -> None:
        self.min_n = min_n  # floor under the config's ngram_min
        self._config = GenerationConfig()
        self._index: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self._copy: tuple[int, int] | None = None  # (match end, context length) of the last lookup
        self.copying = False  # whether the last lookup went on with the match before it

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self._config = config
        draft = config.draft
        self._index = {
            n: {} for n in range(min(max(draft.ngram_min, self.min_n), draft.ngram_max), draft.ngram_max + 1)
        }
        self._indexed = 0
        self._copy = None

    def _extend_index(self, context: Sequence[int]) -> None:
        # The n-grams ending at the last position are left out: the suffix must match an
        # *earlier* occurrence, not itself.
        for end in range(self._indexed, len(context) - 1):
            for n, table in self._index.items():
                if end + 1 >= n:
                    table[tuple(context[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, len(context) - 1)

    def lookup(self, context: Sequence[int]) -> tuple[int, int]:
        """(n, end): the longest matched suffix length and where its earlier occurrence
        ended; (0, -1) without a match.

        A copy in progress wins: where the tokens committed since the last lookup are the
        ones that followed its match, the match goes on from there (its length counts as the
        longest), whichever occurrence of the last ``n`` tokens is the latest. A context that
        copies a long passage (a file being edited, a quote) then keeps copying the same
        place rather than jumping to a later repeat of its last few tokens.
        """
        if not context:
            return 0, -1
        self._extend_index(context)
        copied = self._copy_goes_on(context)
        self.copying = copied >= 0
        if self.copying:
            self._copy = (copied, len(context))
            return max(self._index), copied
        for n in sorted(self._index, reverse=True):
            if n <= len(context):
                end = self._index[n].get(tuple(context[len(context) - n :]))
                if end is not None:
                    self._copy = (end, len(context))
                    return n, end
        self._copy = None
        return 0, -1

    def _copy_goes_on(self, context: Sequence[int]) -> int:
        """Where the last match ends now, if the context went on as it did there; else -1."""
        if self._copy is None:
            return -1
        end, length = self._copy
        grown = len(context) - length
        if grown < 0 or end + grown >= len(context) - 1:
            return -1
        if list(context[end + 1 : end + 1 + grown]) != list(context[length : length + grown]):
            return -1
        return end + grown

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        n, end = self.lookup(context)
        if n == 0:
            return ()
        # Statistics per match length (1, 2, 3 and longer), and apart for a copy in progress
        # (a match the context went on following): only that one is grounded, a passage
        # being copied (a quote, a file being edited) that may earn long blocks.
        key = f"{NGRAM}:copy" if self.copying else f"{NGRAM}:{min(n, 3)}"
        return (Offer(NGRAM, limit=len(context) - end - 1, key=key, cost_hint=0.0, grounded=self.copying),)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        return ready(self.lookup_block(context, k))

    def lookup_block(self, context: Sequence[int], k: int) -> Proposal:
        """The block of up to ``k`` tokens that followed the match (no pass)."""
        if k <= 0:
            return EMPTY_PROPOSAL
        n, end = self.lookup(context)
        if n == 0:
            return EMPTY_PROPOSAL
        follow = list(context[end + 1 : end + 1 + k])
        return Proposal(tokens=torch.tensor(follow, dtype=torch.long), source=NGRAM)

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        """Nothing to learn: the index catches up with the context on the next lookup."""


class CrossVocabDrafter:
    """A draft model whose tokenizer differs from the target's drafts through text.

    The target's committed tokens are read as text and encoded in the draft's vocabulary;
    the draft model continues that (greedily: its best guess), and its text is encoded in
    the target's vocabulary together with the last committed tokens (``proposal_ids``), so
    the boundary with the context reads as the target's tokenizer writes it. The draft
    writes until the ``k``-th target token is followed by the start of another word
    (``settled``), so the last one proposed is a whole token (``" weather"``, not the
    ``" weat"`` of a text that stopped inside the word), and no further. The proposal
    carries no probabilities, so it is verified as a point mass (as n-gram lookup is):
    greedy output stays the target's, sampled output follows the target's distribution.

    The draft model's cache follows the accepted text: ``sync`` rolls it back to the longest
    common prefix of what it holds and the re-encoded text, and only the rest is fed.

    Example (target Qwen, draft SmolLM2): committed ``"def add(a, b):\n"``; the draft writes
    ``"    return a + b\n"`` in its tokens; re-encoded after the last committed token that
    is Qwen's ``"   " " return" " a" " +" " b" "\n"``, of which ``k = 4`` are proposed.
    """

    LOOKBEHIND = 4  # committed target tokens re-encoded with a block's text

    def __init__(self, lm: LanguageModel, target_tokenizer: Tokenizer) -> None:
        if lm.tokenizer is None:
            raise ValueError("a draft with another vocabulary needs its tokenizer")
        self.model = ModelDrafter(lm)
        self.target_tokenizer = target_tokenizer
        self.read = TokenText(target_tokenizer)
        self.draft_ids = TextTokens(lm.tokenizer)
        self._ends = frozenset(lm.eos_token_ids)

    @property
    def lm(self) -> LanguageModel:
        return self.model.lm

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        # Greedy whatever the user samples with: the proposal is a point mass, best at the
        # draft's most likely text.
        self.model.start(prompt, config.model_copy(update={"sampling": SamplingConfig()}), None)
        self.read.reset(prompt)
        self.draft_ids.reset(self.read.text)

    def _follow(self, context: Sequence[int]) -> None:
        self.read.follow(context)
        self.draft_ids.follow(self.read.text)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        self._follow(context)
        if self.model.room(len(self.draft_ids.ids)) <= 0:
            return ()
        return (Offer(MODEL, behind=max(0, len(self.draft_ids.ids) - 1 - self.model.cached()), passes=True),)

    def _steps(self, k: int) -> int:
        """The most draft tokens a block of ``k`` target tokens may take: those of ``k + 2``
        target tokens, as the two vocabularies have measured each other on the context so
        far (drafting stops sooner once ``k`` whole target tokens are written)."""
        if not self.draft_ids.ids:  # nothing to continue yet (a prompt of half a character)
            return 0
        ratio = min(3.0, max(0.5, len(self.draft_ids.ids) / max(1, self.read.clean)))
        return min(self.model.room(len(self.draft_ids.ids)), math.ceil((k + 2) * ratio))

    def _target_ids(self, context: Sequence[int], drafted: list[int]) -> list[int]:
        """The target's ids for the text of ``drafted``, written after ``context``."""
        text = self._text_of(drafted)
        return proposal_ids(self.target_tokenizer, context, self.read, text, self.LOOKBEHIND) if text else []

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        self._follow(context)
        steps = self._steps(k) if k > 0 else 0
        if steps <= 0:
            return EMPTY_PROPOSAL

        def enough(drafted: list[int]) -> bool:
            # k whole target tokens are written, or the draft's text has ended.
            ids = self._target_ids(context, drafted)
            return drafted[-1] in self._ends or settled(self.target_tokenizer, ids, k)

        drafted = yield from self.model.draft(self.draft_ids.ids, steps, enough)
        ids = self._target_ids(context, drafted.tokens.tolist())
        return Proposal(
            tokens=torch.tensor(ids[:k], dtype=torch.long),
            source=MODEL,
            catchup_seconds=drafted.catchup_seconds,
            catchup_tokens=drafted.catchup_tokens,
            pass_seconds=drafted.pass_seconds,
        )

    def _text_of(self, drafted: list[int]) -> str:
        """The text of ``drafted`` up to the draft's end of text (kept where the target
        writes that markup too, such as ``<|im_end|>``)."""
        assert self.lm.tokenizer is not None
        cut = next((i for i, t in enumerate(drafted) if t in self._ends), None)
        if cut is not None:
            markup = self.lm.tokenizer.decode(drafted[cut : cut + 1])
            drafted = drafted[: cut + 1] if markup in self.target_tokenizer.control_tokens else drafted[:cut]
        return added_text(self.lm.tokenizer, self.draft_ids.ids[-TokenText.ANCHOR :], drafted, whole=False) or ""

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        self._follow(context)
        if self.model.cached() and self.draft_ids.ids:
            sync(self.lm, self.draft_ids.ids)


LOOKUP_MIN_N = 3  # the hybrid's shortest suffix that prompt lookup drafts after (see below)


class HybridDrafter:
    """Prompt lookup where the context repeats itself, the draft model everywhere else.

    It offers both sources each step, n-gram lookup first when it found a suffix of at least
    ``min_n`` tokens continued by two or more (a one-token match is too often wrong to
    displace a real draft). A fixed or heuristic policy takes the first offer; the cost
    policy weighs both against plain decoding. Both observe every verdict; the draft model's
    cache catches up with tokens it did not draft when it is next asked.

    Example: context ``[5 8 2 9 4 1 ... 5 8 2]`` with ``k = 3``: the suffix ``5 8 2`` occurred
    before, so ``[9 4 1]`` is offered from the context for free; had only ``8 2`` repeated,
    the draft model's offer would come first.
    """

    def __init__(self, model: ModelDrafter | CrossVocabDrafter, min_n: int = LOOKUP_MIN_N) -> None:
        self.model = model
        self.ngram = NGramDrafter(min_n=min_n)

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        self.model.start(prompt, config, generator)
        self.ngram.start(prompt, config, generator)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        lookup = tuple(o for o in self.ngram.offers(context) if (o.limit or 0) >= 2)
        return lookup + self.model.offers(context)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        if source is None:
            source = self.offers(context)[0].source
        return (self.ngram if source == NGRAM else self.model).propose(context, k)

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        self.model.observe(context, verdict)
        self.ngram.observe(context, verdict)


class Sources:
    """Several drafters as one, in the order given (preferred first): the offers of the first
    drafter that has any (``first_only``: while it has some, the later ones are not asked),
    or of all of them; a block comes from the drafter that offered its source, and every
    drafter observes every verdict. How a request's prediction joins the server's drafter
    (``draftwise.prediction.with_prediction``).
    """

    def __init__(self, drafters: Sequence[Drafter], first_only: bool = False) -> None:
        self.drafters = tuple(drafters)
        self.first_only = first_only
        self._owner: dict[str, Drafter] = {}

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> None:
        for drafter in self.drafters:
            drafter.start(prompt, config, generator)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        offers: list[Offer] = []
        for drafter in self.drafters:
            own = drafter.offers(context)
            self._owner.update((offer.source, drafter) for offer in own)
            offers.extend(own)
            if offers and self.first_only:
                break
        return tuple(offers)

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        if source is None:
            offers = self.offers(context)
            if not offers:
                return ready(EMPTY_PROPOSAL)
            source = offers[0].source
        if source not in self._owner:
            self.offers(context)
        owner = self._owner.get(source)
        return owner.propose(context, k, source) if owner is not None else ready(EMPTY_PROPOSAL)

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        for drafter in self.drafters:
            drafter.observe(context, verdict)


def text_bridge(target_tokenizer: Tokenizer | None, draft: LanguageModel | None) -> Tokenizer | None:
    """``target_tokenizer`` where ``draft`` speaks another vocabulary and so drafts through
    text; None where it proposes the target's own ids (or there is no draft). It compares
    whole vocabularies: decide once per pair of models, not per request."""
    if target_tokenizer is None or draft is None or draft.tokenizer is None:
        return None
    return None if shares_vocabulary(target_tokenizer, draft.tokenizer) else target_tokenizer


def model_drafter(draft: LanguageModel, target_tokenizer: Tokenizer | None = None) -> ModelDrafter | CrossVocabDrafter:
    """The drafter of a draft model: through text, to the vocabulary of ``target_tokenizer`` (see
    ``text_bridge``), or proposing its own ids."""
    return ModelDrafter(draft) if target_tokenizer is None else CrossVocabDrafter(draft, target_tokenizer)


def build_drafter(kind: DrafterKind, draft: LanguageModel | None, target_tokenizer: Tokenizer | None = None) -> Drafter:
    """The drafter called ``kind``, drafting with ``draft`` where it needs a model (through
    text to the vocabulary of ``target_tokenizer``, see ``text_bridge``)."""
    if kind == NGRAM:
        return NGramDrafter()
    if draft is None:
        raise ValueError(f"drafter {kind!r} needs a draft model")
    model = model_drafter(draft, target_tokenizer)
    return HybridDrafter(model) if kind == "hybrid" else model
