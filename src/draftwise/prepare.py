"""Prepare a target and draft pair for generating: the one way every entry point does it.

``draftwise generate``, ``serve`` (one process or a Ray replica), ``serve-verifier`` (both
kinds), the dashboard's server (a ``draftwise serve``) and ``bench`` (local or a Ray worker)
all call ``prepare_pair``: load the pair (``load_pair``, which checks how the draft reaches the
target: with the target's own token ids, or through text when it speaks another vocabulary, see
``draftwise.tokenizer_compat``; a draft that cannot write the target's text is refused), warm
both models up, and, for the cost policy, measure what drafting costs with them
(``draftwise.costs.calibrate``, cached per model and CPU). Written once, no entry point can
skip a step: ``serve --ray`` replicas once ran the cost policy uncalibrated.

``recommended`` is the registry's advice on which draft model and drafter go with a target,
and ``choose_drafter`` the one rule by which ``generate`` and ``serve`` take it or the user's.

This sits above ``draftwise.loading`` (and so above the backends) and below every service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from draftwise.config import NEEDS_DRAFT_MODEL, DraftConfig, DrafterKind, DrafterName, ModelOptions
from draftwise.costs import calibrate, choose_kernels
from draftwise.errors import ConfigError
from draftwise.lm import LanguageModel
from draftwise.loading import load_pair
from draftwise.profile import CostProfile, read_host
from draftwise.registry import paired_draft

Log = Callable[[str], None]
WARM_UP_TEXT = "The quick brown fox"  # any plain text: only the pass matters, not its output
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class Pair:
    """A prepared pair: the target, the draft model (None: n-gram drafting, or a verifier's
    target alone) and what drafting costs with them (None unless the cost policy needs it)."""

    target: LanguageModel
    draft: LanguageModel | None = None
    profile: CostProfile | None = None

    def fork(self) -> Pair:
        """The same pair on sequences of its own (the weights shared, empty caches), for a
        caller that hands a pair to an app and goes on using this one."""
        return Pair(self.target.fork(), None if self.draft is None else self.draft.fork(), self.profile)


def recommended(target: str) -> tuple[str | None, DrafterKind]:
    """(draft model, drafter) the registry recommends for ``target``: its packaged draft with
    the hybrid drafter, or n-gram lookup where none is known."""
    draft = paired_draft(target)
    return (draft, "hybrid") if draft is not None else (None, "ngram")


def choose_drafter(target: str, draft: str | None, drafter: DrafterName | None) -> tuple[str | None, DrafterName]:
    """(draft model, drafter) from what the user named, the one rule of ``generate`` and
    ``serve``: a named draft is taken, with the hybrid drafter unless another is named; a
    drafter that drafts with a model and no draft named takes the registry's draft for
    ``target`` (``ConfigError`` where none is known); n-gram lookup or none ("off") loads no
    draft; neither named: the registry's advice (``recommended``)."""
    if draft is not None:
        return draft, drafter or "hybrid"
    advised_draft, advised_drafter = recommended(target)
    if drafter is None:
        return advised_draft, advised_drafter
    if drafter in NEEDS_DRAFT_MODEL:
        if advised_draft is None:
            raise ConfigError(f"--drafter {drafter} needs --draft: no draft model is known for {target!r}")
        return advised_draft, drafter
    return None, drafter


def warm_up(lm: LanguageModel) -> None:
    """One short pass, then a clean cache: the first call pages the weights in and picks
    kernels, a one-off cost that would otherwise be billed to whichever request goes first."""
    ids = lm.tokenizer.encode(WARM_UP_TEXT) if lm.tokenizer is not None else []
    ids = (ids or [0])[:WARM_UP_TOKENS]
    lm.reset()
    lm.forward(ids, last=1)
    lm.reset()


def prepare(
    target: LanguageModel,
    draft: LanguageModel | None,
    drafting: DraftConfig | None,
    *,
    slots: int = 1,
    log: Log | None = None,
    pace: bool = False,
    host: CostProfile | None = None,
) -> Pair:
    """Choose the target's kernels for prompt pieces where its backend leaves that to timing
    (``draftwise.costs.choose_kernels``), warm up loaded models and, when ``drafting`` uses the
    cost policy, measure their costs for ``slots`` streams batched together
    (``draftwise.costs.calibrate``), or take them as they stand from ``host``, a host profile
    (``ModelOptions.costs``); both measurements are cached. ``drafting`` None: nothing drafts
    with these models here (a verifier's target); with ``pace``, the target's passes are timed
    all the same where ``slots`` sequences share them, for a scheduler to size prompt pieces in
    time beside the others (a verifier's sessions)."""
    choose_kernels(target, log or (lambda message: None))  # before any pass: prompt pieces' kernels
    for lm in (target, draft):
        if lm is not None:
            warm_up(lm)
    cost_policy = drafting is not None and drafting.k_policy == "cost"
    if not cost_policy and not (pace and slots > 1 and target.batch is not None):
        return Pair(target, draft)
    if host is not None:
        return Pair(target, draft, host)
    if drafting is not None and cost_policy:
        profile = calibrate(
            target, draft, drafting.k_max, log, slots=slots, k_long=drafting.k_long, settings=drafting.cost
        )
        return Pair(target, draft, profile)
    return Pair(target, draft, calibrate(target, None, DraftConfig().k_max, log, slots=slots))


def prepare_pair(
    target: str,
    draft: str | None,
    options: ModelOptions | None,
    drafting: DraftConfig | None,
    *,
    slots: int = 1,
    log: Log | None = None,
    pace: bool = False,
) -> Pair:
    """Load ``target`` and ``draft`` (None: the target alone), check how the draft reaches the
    target (its token ids, or through text: ``load_pair``), warm them up and calibrate the
    cost policy, or with ``pace`` the target's passes (see ``prepare``).

    ``slots``: streams that run at once, batched on llama.cpp (see ``load_pair``): the
    loaded models and ``slots - 1`` forks of them.
    """
    costs = (options or ModelOptions()).host_costs()
    settings = drafting.cost if drafting is not None else DraftConfig().cost
    host = read_host(costs, settings) if costs is not None else None  # a broken file fails before the loading
    target_lm, draft_lm = load_pair(target, draft, options, log=log, slots=slots)
    if host is not None and log is not None:
        log(f"pricing drafting from the host profile {costs}, not from this machine's times")
    return prepare(target_lm, draft_lm, drafting, slots=slots, log=log, pace=pace, host=host)
