"""What a draft policy is offered, what it chooses, and what the step it chose did.

Each step a drafter says what each of its sources could propose (``Offer``: a draft model,
n-gram lookup, a prediction, a grammar's forced text), the policy answers with a ``Choice``
(a source and a draft length, or ``PLAIN``), and after the step it learns the ``Outcome``.
The drafters, the engine and the policies speak these three; none asks which drafter or
policy it has (``draftwise.policies``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from draftwise.lm import PassInfo


@dataclass(frozen=True)
class Offer:
    """What one source of a drafter could propose for the next step.

    ``limit`` is the most tokens it has (an n-gram continuation found in the context), None for
    as many as asked. ``behind`` counts context tokens the source must feed before it can draft
    (a draft model that skipped the prompt, or steps it sat out): a cost paid once. ``key``
    names the acceptance statistics the source's proposals share (n-gram lookups keep one per
    match length: a 3-token match is right far more often than a 1-token one). ``cost_hint``
    prices a draft token as a share of one plain target pass until the source's own cost is
    measured: a source that runs no model says 0; a draft model is priced at a whole target
    pass, the most a draft worth running can cost (calibration then measures it). A
    ``grounded`` source copies text the output is expected to follow (a prediction, an n-gram
    copy in progress): the cost policy may give it blocks past ``k_max`` once it has been right
    long enough (``CostAwareK``). A source that ``follows`` text the request says the output
    follows (OpenAI's prediction: a claim of the caller's, where an n-gram copy is a guess of
    the drafter's) is priced, while a run of its tokens is kept, at least at Laplace's rule
    over the run: after ``r`` kept in a row, the next is kept with chance ``(r + 1) / (r +
    2)``, a confidence the acceptance's few blocks of memory cannot reach. The first ``sure``
    tokens of a block are forced by a grammar, drafted at no cost and priced as accepted (the
    mask allows nothing else there but another spelling of the same text); the source's
    acceptance and cost price the tokens after them (a forced key, then a value). A source
    whose tokens each take a pass of a draft model (``passes``) keeps its stream out of one
    round per token when streams share passes.
    """

    source: str
    limit: int | None = None
    behind: int = 0
    key: str = ""
    cost_hint: float = 1.0
    grounded: bool = False
    follows: bool = False
    sure: int = 0
    passes: bool = False

    @property
    def stats_key(self) -> str:
        return self.key or self.source


@dataclass(frozen=True)
class Choice:
    """Draft ``k`` tokens from ``offer`` (None with ``k == 0``: plain decoding)."""

    offer: Offer | None
    k: int

    @property
    def source(self) -> str | None:
        return self.offer.source if self.offer is not None else None


PLAIN = Choice(None, 0)


@dataclass(frozen=True)
class Outcome:
    """What a step did and cost, as the policy learns it; named fields after ``choice``."""

    choice: Choice
    _: KW_ONLY
    n_proposed: int
    n_accepted: int
    draft_seconds: float  # drafting, as the stream waited for it: catching up is ``catchup_seconds``
    verify_seconds: float
    catchup_seconds: float = 0.0
    catchup_tokens: int = 0
    # The target pass that verified the block, where the backend reports it: with other
    # streams' rows batched in, its rows and time say more than verify_seconds does.
    pass_info: PassInfo | None = None
    # The draft model's own passes of the block (a round also runs other streams' passes,
    # which the stream waits for but which are not drafting's cost); None: ``draft_seconds``.
    draft_pass_seconds: float | None = None

    @property
    def own_rows(self) -> int:
        return self.n_proposed + 1

    @property
    def others_rows(self) -> int:
        """Rows of other streams in the same pass."""
        return max(0, self.pass_info.rows - self.own_rows) if self.pass_info is not None else 0

    @property
    def others_streams(self) -> int:
        """Other streams in the same pass."""
        return max(0, self.pass_info.sequences - 1) if self.pass_info is not None else 0
