"""The cost policy on recorded host profiles (``tests/data/hosts``), from a cold start.

A real run starts knowing the host's costs (calibrated) but no source's acceptance: here
the policy gets what calibration gives and nothing else, the draft model has read nothing of
a 35-token prompt (its lazy prefill), and an n-gram lookup that is mostly wrong is offered
beside it. Each host's true costs are its profile's; a block keeps each position with the
source's true rate. The fixed configurations run on the same simulated host, so "the best
fixed configuration in hindsight" is computed, not assumed.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from draftwise import DraftConfig
from draftwise.offers import Offer, Outcome
from draftwise.policies import CostAwareK, DraftPolicy, FixedK
from draftwise.profile import Acceptance, CostProfile, read_host

HOSTS = Path(__file__).parent / "data" / "hosts"
PROMPT = 35  # tokens of make-run's chat prompt, which the draft model has not read


@dataclass(frozen=True)
class Source:
    offer: Offer
    rate: float  # true chance of keeping each position of its block once reached


MODEL = Source(Offer("model", passes=True), 0.94)  # the 0.5B draft on make-run's prompt
WRONG_LOOKUP = Source(Offer("ngram", limit=4, key="ngram:1", cost_hint=0.0), 0.1)


def host(name: str) -> CostProfile:
    return read_host(HOSTS / f"{name}.json")


def decode(policy: DraftPolicy, truth: CostProfile, sources: list[Source], tokens: int, seed: int = 5) -> float:
    """Tokens per second of ``tokens`` tokens decoded with ``policy`` on a host whose costs are
    ``truth``'s, with ``sources`` offered at every step."""
    draw, seconds, emitted, behind = random.Random(seed), 0.0, 0, PROMPT
    by_name = {s.offer.source: s for s in sources}
    while emitted < tokens:
        offers = [replace(s.offer, behind=behind) if s.offer.passes else s.offer for s in sources]
        choice = policy.choose(offers, tokens - emitted)
        source = by_name.get(choice.source or "")
        kept = 0
        while source is not None and kept < choice.k and draw.random() < source.rate:
            kept += 1
        draft = catchup = 0.0
        if source is not None:
            draft = choice.k * truth.draft_token_seconds.get(source.offer.source, 0.0)
            if source.offer.passes:
                catchup = behind * truth.catchup_token_seconds[source.offer.source]
        verify = truth.pass_times.at(choice.k + 1) or 0.0
        caught_up = bool(catchup) or (source is not None and source.offer.passes)
        fed = behind if catchup else 0
        outcome = Outcome(
            choice,
            n_proposed=choice.k,
            n_accepted=kept,
            draft_seconds=draft,
            verify_seconds=verify,
            catchup_seconds=catchup,
            catchup_tokens=fed,
        )
        policy.update(outcome)
        seconds += draft + catchup + verify
        emitted += kept + 1
        behind = 0 if caught_up else behind + kept + 1
    return emitted / seconds


def cold(truth: CostProfile) -> CostAwareK:
    """The cost policy as a run starts it: the host's calibrated costs, no acceptance."""
    return CostAwareK(DraftConfig(), copy.deepcopy(truth))


def best_fixed(truth: CostProfile, sources: list[Source], tokens: int) -> float:
    """The best of plain decoding and each source alone at k = 1 to 8, on the same host."""
    plain = 1 / (truth.pass_times.at(1) or 1.0)
    return max(
        plain,
        *(decode(FixedK(k), truth, [source], tokens) for source in sources for k in range(1, 9)),
    )


SEEDS = range(8)


def mean_rate(truth: CostProfile, sources: list[Source], tokens: int, fixed: bool = False) -> float:
    """Over ``SEEDS``: the cost policy's mean tokens per second from a cold start, or with
    ``fixed`` the best fixed configuration's in hindsight."""
    rates = [
        max(
            1 / (truth.pass_times.at(1) or 1.0),
            *(decode(FixedK(k), truth, [s], tokens, seed) for s in sources for k in range(1, 9)),
        )
        if fixed
        else decode(cold(truth), truth, sources, tokens, seed)
        for seed in SEEDS
    ]
    return sum(rates) / len(rates)


def test_on_the_intel_host_a_cold_start_finds_the_draft_model():
    # The host: --drafter model --k 6 ran 1.30x of plain there, the cost policy 1.0x
    # (it never paid for the probe behind the draft model's catch-up). From nothing, over
    # make run's 512 tokens, it now drafts: within reach of the best fixed configuration.
    truth = host("intel-xeon")
    plain = 1 / (truth.pass_times.at(1) or 1.0)
    rate = mean_rate(truth, [MODEL], 512)
    assert rate >= 1.2 * plain
    assert rate >= 0.9 * mean_rate(truth, [MODEL], 512, fixed=True)


def test_on_the_intel_host_a_catch_up_too_dear_for_a_short_budget_is_not_paid():
    # Over 128 tokens the catch-up goes once the run has lasted long enough to repay it (about
    # 16 tokens in), and by then the prompt and those tokens cost more than 3% of the plain
    # time left: the model is not tried, and the run loses nothing to it.
    truth = host("intel-xeon")
    plain = 1 / (truth.pass_times.at(1) or 1.0)
    assert mean_rate(truth, [MODEL], 128) >= 0.97 * plain


def test_on_the_intel_host_a_wrong_lookup_does_not_shut_the_draft_model_out():
    # Failed n-gram blocks once drained the one account, and the model was never tried.
    truth = host("intel-xeon")
    plain = 1 / (truth.pass_times.at(1) or 1.0)
    assert mean_rate(truth, [WRONG_LOOKUP, MODEL], 512) >= 1.15 * plain


@pytest.mark.parametrize("sources", [[MODEL], [WRONG_LOOKUP, MODEL], [WRONG_LOOKUP]], ids=["model", "hybrid", "lookup"])
@pytest.mark.parametrize("name", ["amd-epyc", "intel-xeon"])
def test_a_cold_start_costs_little_where_drafting_cannot_pay_much(name, sources):
    # The guard's bound (CostAwareK, step 5): the allowance, and per source an opening and a
    # block; over 128 tokens that is a few percent of plain decoding at most.
    truth = host(name)
    plain = 1 / (truth.pass_times.at(1) or 1.0)
    assert mean_rate(truth, sources, 128) >= 0.93 * plain


@pytest.mark.parametrize("kept_all", [True, False], ids=["kept", "rejected"])
def test_probes_start_short_and_grow_only_with_what_the_source_keeps(kept_all):
    # On the Intel profile a pass of 13 rows costs 3.5 one-row passes, and at the optimistic
    # acceptance the longest block looks best: a first probe of 12 guesses lost a short
    # answer's budget where a block of 3 tells as much (whether the first guess is kept).
    truth = host("intel-xeon")
    policy, lookup, ks = cold(truth), Offer("ngram", key="ngram:1", cost_hint=0.0), []
    for _ in range(6):
        choice = policy.choose([lookup], 500)
        kept = choice.k if kept_all else 0
        verify = truth.pass_times.at(choice.k + 1) or 0.0
        policy.update(Outcome(choice, n_proposed=choice.k, n_accepted=kept, draft_seconds=0.0, verify_seconds=verify))
        ks.append(choice.k)
    assert 1 <= ks[0] <= 3
    if kept_all:
        assert max(ks) == DraftConfig().k_max  # a source that keeps what it guesses earns long blocks
    else:
        assert max(ks) <= 3


def test_a_draft_model_is_prefilled_for_a_run_that_has_lasted_not_for_its_token_budget():
    # A 40-token prompt the draft model has not read, and a budget of 4,096 tokens: priced on
    # the budget, the catch-up looked cheap, and answers that ended at 20 tokens paid it. It
    # goes once the run has lasted long enough that what the model could save over as many
    # tokens again covers it (on the Intel profile, where the model can win).
    truth = host("intel-xeon")
    policy, emitted, probed_at = cold(truth), 0, None
    plain_step = truth.pass_times.at(1) or 0.0
    while probed_at is None and emitted < 200:
        choice = policy.choose([replace(MODEL.offer, behind=40 + emitted)], 4096 - emitted)
        if choice.source == "model":
            probed_at = emitted
        policy.update(Outcome(choice, n_proposed=0, n_accepted=0, draft_seconds=0.0, verify_seconds=plain_step))
        emitted += 1
    assert probed_at is not None and 10 <= probed_at <= 100


def test_a_prediction_kept_token_after_token_earns_long_blocks_on_the_amd_profile():
    # The acceptance remembers about three blocks, so a source always right is estimated near
    # 0.97 a token, and on this curve blocks of 3 then beat every longer one: a prediction the
    # output followed word for word drafted 3 tokens a step for ever. A caller's prediction is
    # priced while it holds at least at Laplace's rule over its run (Offer.follows).
    truth = host("amd-epyc")
    policy, ks = cold(truth), []
    prediction = Offer("prediction", key="prediction", cost_hint=0.0, grounded=True, follows=True)
    for _ in range(30):
        choice = policy.choose([prediction], 4096)
        verify = truth.pass_times.at(choice.k + 1) or 0.0
        kept = Outcome(choice, n_proposed=choice.k, n_accepted=choice.k, draft_seconds=0.0, verify_seconds=verify)
        policy.update(kept)
        ks.append(choice.k)
    assert max(ks) > DraftConfig().k_max


def test_a_floor_lifts_each_position_s_rate_in_the_expected_tokens():
    fresh = Acceptance()  # no record: even odds at every position
    assert fresh.expected(2) == pytest.approx([1.0, 1.5, 1.75])
    assert fresh.expected(2, floor=0.8) == pytest.approx([1.0, 1.8, 2.44])
    assert fresh.expected(2, floor=0.3) == pytest.approx([1.0, 1.5, 1.75])
