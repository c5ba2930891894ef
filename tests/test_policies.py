"""Draft policies: the fixed rule, transformers' heuristic, and the cost policy that picks by
measured expected tokens per second, tested in closed form and against simulated hosts."""

from __future__ import annotations

import random

import pytest

from draftwise import DraftConfig
from draftwise.config import CostPolicyConfig
from draftwise.lm import PassInfo
from draftwise.offers import PLAIN, Choice, Offer, Outcome
from draftwise.policies import CostAwareK, FixedK, HeuristicK, make_policy
from draftwise.profile import Acceptance, CostProfile, PassTimes

COST = CostPolicyConfig()  # the cost policy's default numbers

MODEL = Offer("model")


def step(
    k: int,
    proposed: int | None = None,
    accepted: int = 0,
    draft_s: float = 0.0,
    verify_s: float = 0.0,
    offer: Offer = MODEL,
) -> Outcome:
    """The outcome of a step that asked ``offer`` for ``k`` tokens (0: a plain step)."""
    choice = Choice(offer, k) if k else PLAIN
    return Outcome(
        choice,
        n_proposed=k if proposed is None else proposed,
        n_accepted=accepted,
        draft_seconds=draft_s,
        verify_seconds=verify_s,
    )


def test_fixed_never_changes():
    policy = FixedK(3)
    policy.update(step(3, accepted=3, draft_s=0.1, verify_s=0.1))
    policy.update(step(3, accepted=0, draft_s=0.1, verify_s=0.1))
    assert policy.choose([MODEL], 100) == Choice(MODEL, 3)
    assert policy.choose([], 100) == PLAIN  # nothing offered (no n-gram match): a plain step
    lookup = Offer("ngram", limit=2)
    assert policy.choose([lookup, MODEL], 100) == Choice(lookup, 2)  # the first offer, cut to what it has


def test_heuristic_plus_two_minus_one_within_bounds():
    policy = HeuristicK(5, k_max=10)
    seen = []
    for proposed, accepted in [(5, 5), (7, 7), (9, 9), (10, 3), (9, 0), (8, 7)]:
        policy.update(step(policy.choose([MODEL], 100).k, proposed, accepted))
        seen.append(policy.choose([MODEL], 100).k)
    assert seen == [7, 9, 10, 9, 8, 7]
    for _ in range(20):
        policy.update(step(1, 1, 0))
    assert policy.choose([MODEL], 100).k == 1


def test_heuristic_ignores_empty_proposals_and_starts_at_least_at_one():
    policy = HeuristicK(0, k_max=4)
    assert policy.choose([MODEL], 100).k == 1
    policy.update(step(1, 0, 0))  # e.g. no n-gram match: nothing learnt
    assert policy.choose([MODEL], 100).k == 1


# --- the cost policy ---------------------------------------------------------------------------

# Pass times of the 1.5B target by rows (llama-bench -t 2, stock build), in ms: the two hosts
# this project runs on. A 4-row pass costs 1.3 one-row passes on the first, 3.3 on the second.
INTEL = {1: 63, 2: 87, 4: 81, 8: 147, 16: 167, 32: 287, 64: 517}
AMD = {1: 29, 2: 51, 4: 94, 8: 182, 16: 199, 32: 358, 64: 639}
LOOKUP = Offer("ngram", key="ngram:1", cost_hint=0.0)
DRAFT_MODEL = Offer("model", passes=True)


def host(curve_ms: dict[int, float], draft_ms: float | None = None, **config) -> CostAwareK:
    """A cost policy that knows ``curve_ms`` (calibrated) and, given, a draft model's token cost."""
    profile = CostProfile(pass_times=measured(curve_ms))
    if draft_ms is not None:
        profile.draft_token_seconds["model"] = draft_ms / 1000
    return CostAwareK(DraftConfig(**{"k_max": 12, **config}), profile)


def know(policy: CostAwareK, key: str, rates: list[float], blocks: int = 200) -> None:
    """Give the policy's acceptance of ``key`` the record of ``blocks`` long blocks drafted by a
    source that keeps position i with chance ``rates[i]`` (drawn, seeded)."""
    draw = random.Random(7)
    for _ in range(blocks):
        kept = 0
        while kept < len(rates) and draw.random() < rates[kept]:
            kept += 1
        policy.acceptance(key).add(len(rates), kept)


def measured(curve_ms: dict[int, float]) -> PassTimes:
    times = PassTimes()
    for rows, ms in curve_ms.items():
        times.add(rows, ms / 1000)
    return times


def true_rate(curve_ms: dict[int, float], rates: list[float], k: int, draft_ms: float = 0.0) -> float:
    """Tokens per second of drafting ``k`` alone from a source with these true rates."""
    times = measured(curve_ms)
    reach, tokens = 1.0, 1.0
    for rate in rates[:k]:
        reach *= rate
        tokens += reach
    return tokens / (k * draft_ms / 1000 + times.at(k + 1))


def simulate(policy, offer, rates, curve_ms, steps, draft_ms=0.0, seed=3, slow=1.0, others=0):
    """Run ``steps`` choices on a simulated host: a block of k is kept position by position
    with the true ``rates``, and takes the curve's time (times ``slow``: a host whose passes
    cost more than the policy was told), beside ``others`` streams decoding plainly, a row
    each, in the same pass. Returns (the choices, seconds taken, tokens of every stream)."""
    times = measured(curve_ms)
    draw, seconds, tokens, ks = random.Random(seed), 0.0, 0, []
    for _ in range(steps):
        choice = policy.choose([offer], 10_000)
        kept = 0
        while kept < choice.k and draw.random() < rates[min(kept, len(rates) - 1)]:
            kept += 1
        verify = slow * times.at(others + choice.k + 1)
        draft = choice.k * draft_ms / 1000
        shared = PassInfo(others + choice.k + 1, verify, others + 1) if others else None
        policy.update(
            Outcome(
                choice,
                n_proposed=choice.k,
                n_accepted=kept,
                draft_seconds=draft,
                verify_seconds=verify,
                pass_info=shared,
            )
        )
        ks.append(choice.k)
        seconds, tokens = seconds + draft + verify, tokens + others + kept + 1
    return ks, seconds, tokens


def test_acceptance_by_position_closed_form():
    counts = Acceptance(CostPolicyConfig(acceptance_memory=1.0))  # no forgetting: the docstring's example
    for kept in (4, 4, 1):
        counts.add(4, kept)
    assert counts.tried == [3, 3, 2, 2] and counts.kept == [3, 2, 2, 2]
    assert counts.pooled() == pytest.approx(10 / 12)
    rates = counts.rates(5)
    assert rates[1] == pytest.approx((2 + 2 * 10 / 12) / 5)
    assert rates[4] == rates[3] == pytest.approx((2 + 2 * 10 / 12) / 4)  # never reached: the last reached one's
    assert counts.expected(2) == pytest.approx([1, 1 + rates[0], 1 + rates[0] + rates[0] * rates[1]])
    assert Acceptance().rates(1) == [0.5]  # no evidence: even odds
    assert Acceptance().rates(1, optimistic=True) == [COST.optimism_cap]  # at most the plausible best


def test_acceptance_forgets_at_every_position_each_block():
    counts = Acceptance()
    counts.add(3, 3)
    counts.add(3, 0)  # rejected at once: only position 0 reached, every position forgets
    assert counts.tried == pytest.approx([1.7, 0.7, 0.7]) and counts.kept == pytest.approx([0.7, 0.7, 0.7])


def test_the_docstrings_example_drafts_on_one_host_and_not_the_other():
    fast_rows = host({1: 63, 5: 100}, draft_ms=12)
    slow_rows = host({1: 29, 5: 110}, draft_ms=12)
    for policy in (fast_rows, slow_rows):
        know(policy, "model", [0.95] * 12, blocks=1)
        policy.acceptance("model").tried = [1e6] * 4
        policy.acceptance("model").kept = [0.95e6] * 4
    assert fast_rows.arms(DRAFT_MODEL, 1000)[3].rate == pytest.approx(4.52 / 0.148, rel=1e-3)
    assert slow_rows.arms(DRAFT_MODEL, 1000)[3].rate == pytest.approx(4.52 / 0.158, rel=1e-3)
    assert fast_rows.plain().rate == pytest.approx(1 / 0.063) and slow_rows.plain().rate == pytest.approx(1 / 0.029)


@pytest.mark.parametrize(("curve", "drafts"), [(INTEL, True), (AMD, False)])
def test_a_draft_right_95_percent_of_the_time_drafts_on_intel_not_on_amd(curve, drafts):
    # The 0.5B draft's token costs about a third of the 1.5B target's one-row pass on both.
    policy = host(curve, draft_ms=curve[1] / 3)
    know(policy, "model", [0.95] * 12)
    choice = policy.choose([DRAFT_MODEL], 1000)
    assert (choice.k > 0) is drafts
    ks, _, _ = simulate(host(curve, draft_ms=curve[1] / 3), DRAFT_MODEL, [0.95], curve, 60, curve[1] / 3)
    assert (sum(k > 0 for k in ks[-30:]) >= 25) is drafts  # found from nothing, by exploring


@pytest.mark.parametrize(
    ("curve", "rates"),
    [
        (INTEL, [0.9, 0.9, 0.9, 0.3, 0.3, 0.3]),  # right early in a block, wrong late
        ({1: 30, 2: 40, 4: 46, 8: 140, 16: 150}, [0.8] * 16),
        (AMD, [0.99] * 16),  # a copy: long blocks pay on the curve's flat stretch
    ],
)
def test_a_simulated_host_gets_its_known_best_arm(curve, rates):
    ks, _, _ = simulate(host(curve), LOOKUP, rates, curve, 300)
    best = max(range(13), key=lambda k: true_rate(curve, rates, k) if k else 1000 / curve[1])
    settled = max(set(ks[-100:]), key=ks[-100:].count)
    assert true_rate(curve, rates, settled) >= 0.95 * true_rate(curve, rates, best)


def test_a_drafter_that_turns_wrong_mid_answer_is_dropped_within_three_blocks():
    policy = host(INTEL, draft_ms=21)
    simulate(policy, DRAFT_MODEL, [0.95], INTEL, 50, 21)
    assert policy.choose([DRAFT_MODEL], 1000).k > 0
    ks, _, _ = simulate(policy, DRAFT_MODEL, [0.0], INTEL, 10, 21)
    assert ks.index(0) <= 3 and ks[3:] == [0] * 7


@pytest.mark.parametrize("curve", [INTEL, AMD])
def test_the_guard_bounds_what_wrong_estimates_cost(curve):
    # The passes really take twice what calibration said, and the lookup is right 40% of the
    # time: every drafting step loses. Drafting costs at most the allowance of the run's time,
    # the opening and one block more than plain decoding would have.
    policy = host(curve)
    ks, seconds, tokens = simulate(policy, LOOKUP, [0.4], curve, 400, slow=2.0)
    plain = 2.0 * curve[1] / 1000
    worst_block = 2.0 * measured(curve).at(13) - plain
    bound = COST.allowance * seconds + COST.opening * curve[1] / 1000 + worst_block
    assert any(ks)  # it did draft (the estimates said it pays)
    assert seconds - tokens * plain <= bound


@pytest.mark.parametrize("curve", [INTEL, AMD])
def test_beside_other_streams_the_guard_bounds_the_rounds_loss_by_this_streams_share(curve):
    # Three other streams ride in every pass. A block the estimates price as paying (passes
    # take twice what they said, the lookup is right 40% of the time) slows all four: the
    # round loses at most this stream's quarter of the allowance, the opening and one block,
    # so four such streams together lose at most the allowance.
    policy = host(curve)
    policy.others_rows = policy.others_streams = 3
    ks, seconds, tokens = simulate(policy, LOOKUP, [0.4], curve, 400, slow=2.0, others=3)
    times = measured(curve)
    plain_token = 2.0 * times.at(4) / 4
    worst_block = 2.0 * (times.at(16) - times.at(4))
    bound = COST.allowance * seconds / 4 + COST.opening * plain_token + worst_block
    assert any(ks)
    assert seconds - tokens * plain_token <= bound


def test_the_guard_prices_a_plain_token_at_the_mean_of_the_plain_steps_not_after_a_stall():
    # Plain steps of 65 ms, the last stalled (200 ms); then blocks of 3, all kept, in 330 ms: dearer
    # than the plain steps' mean (77.3 ms a token), so the account falls by their loss less the
    # allowance. A running mean, raised by the stall and frozen since (84.5 ms), saw gains.
    policy = host(AMD)
    policy.choose([LOOKUP], 1000)  # the lookup is offered: its account opens
    for seconds in (plain := [0.065] * 10 + [0.2]):
        policy.update(step(0, verify_s=seconds))
    assert policy.plain_token(1) == pytest.approx(mean := sum(plain) / len(plain))
    before = policy.accounts["ngram"]
    for _ in range(10):
        policy.update(step(3, accepted=3, verify_s=0.33, offer=LOOKUP))
    lost = 10 * (4 * mean - 0.33 + COST.allowance * 0.33)
    assert lost < 0 and policy.accounts["ngram"] - before == pytest.approx(lost)


def test_while_the_guard_holds_drafting_back_a_grammar_s_forced_tokens_still_go():
    # The account is overdrawn: no token is guessed, but the three tokens a grammar forces are
    # drafted (sure, free), since a 4-row pass that surely emits 4 tokens beats four plain steps.
    policy = host(AMD)
    policy.accounts["ngram"] = -1.0
    forced = Offer("ngram", key="ngram:1", cost_hint=0.0, sure=3)
    assert policy.choose([forced], 1000) == Choice(forced, 3)
    assert policy.choose([LOOKUP], 1000) == PLAIN


@pytest.mark.parametrize("curve", [INTEL, AMD])
def test_a_hopeless_source_is_probed_only_as_fast_as_the_allowance_pays(curve):
    ks, seconds, tokens = simulate(host(curve), LOOKUP, [0.0], curve, 500)
    lost = seconds - tokens * curve[1] / 1000
    allowed = COST.allowance * seconds + COST.opening * curve[1] / 1000
    assert lost <= allowed
    # Each probe keeps nothing and loses at least the cheapest block's extra time over a plain
    # step: no more probes than what the allowance and the opening pay for, and more than one
    # (the probes go on, ever more rarely, in case the source turns right).
    cheapest = min(ms for rows, ms in curve.items() if rows > 1) / 1000 - curve[1] / 1000
    probes = sum(k > 0 for k in ks)
    assert 1 < probes <= allowed / cheapest


def test_no_probe_where_no_plausible_acceptance_could_pay():
    # Every row costs the same 10 ms, beside other streams or not: a block of k rows emits
    # fewer than k + 1 tokens at any acceptance below 1, so nothing is tried.
    policy = host({n: 10 * n for n in (1, 2, 4, 8, 16, 32, 64)})
    assert all(policy.choose([LOOKUP], 1000) == PLAIN for _ in range(20))
    policy.others_rows = policy.others_streams = 8
    assert all(policy.choose([LOOKUP], 1000) == PLAIN for _ in range(20))


def test_a_long_prompt_is_not_prefilled_into_a_draft_model_just_to_try_it():
    policy = host(INTEL, draft_ms=5)
    policy.profile.catchup_token_seconds["model"] = 0.002
    assert policy.choose([Offer("model", behind=2000, passes=True)], 128) == PLAIN  # 4 s to find out
    assert policy.choose([Offer("model", behind=20, passes=True)], 128).k > 0


def test_a_catch_up_is_priced_over_a_few_steps_not_the_whole_budget():
    policy = host(INTEL, draft_ms=5)
    know(policy, "model", [0.95] * 12)
    policy.profile.catchup_token_seconds["model"] = 0.01
    policy.accounts["model"] = 100.0
    assert policy.choose([Offer("model", behind=2000, passes=True)], 100_000) == PLAIN
    assert policy.choose([Offer("model", behind=10, passes=True)], 100_000).k >= 4


def test_costs_and_acceptance_carry_to_the_next_generation():
    first = host(INTEL, draft_ms=21)
    simulate(first, DRAFT_MODEL, [0.95], INTEL, 40, 21)
    second = CostAwareK(DraftConfig(k_max=12), first.profile)
    assert second.pass_times.at(1) == first.pass_times.at(1)
    assert second.acceptance("model").rates(1)[0] > 0.8
    assert second.acceptance("model") is not first.acceptance("model")  # each stream its own
    assert second.choose([DRAFT_MODEL], 1000).k >= 2  # drafts at once


@pytest.mark.parametrize(("name", "cls"), [("fixed", FixedK), ("heuristic", HeuristicK), ("cost", CostAwareK)])
def test_make_policy(name, cls):
    assert isinstance(make_policy(DraftConfig(k_policy=name)), cls)


def test_pass_times_interpolate_between_measured_sizes_and_extend_the_last_segment():
    times = PassTimes()
    assert times.at(1) is None
    times.add(6, 0.61)
    assert times.at(1) == times.at(9) == 0.61  # one size known: flat either way
    times.add(1, 0.28)
    assert times.at(3) == pytest.approx(0.28 + 2 / 5 * 0.33)
    assert times.at(9) == pytest.approx(0.61 + 3 * 0.33 / 5)
    times.add(1, 0.38)  # a decayed mean per size
    assert times.at(1) == pytest.approx(0.7 * 0.28 + 0.3 * 0.38)
    times.add(1, 5.0)  # a stall counts as twice the mean
    assert times.at(1) == pytest.approx(0.7 * 0.31 + 0.3 * 0.62)


# --- beside other streams: rows priced on the round they ride in ------------------------------


def _shared_pass(rows: int, seconds: float, streams: int | None = None) -> Outcome:
    """A plain step's outcome whose pass held ``rows`` rows, all but one other streams' (of
    ``streams`` streams in all; by default a stream a row)."""
    info = PassInfo(rows, seconds, streams or rows)
    return Outcome(PLAIN, n_proposed=0, n_accepted=0, draft_seconds=0.0, verify_seconds=seconds, pass_info=info)


def test_passes_shared_with_other_streams_make_a_curve_of_their_own():
    profile = CostProfile()
    profile.learn(_shared_pass(1, 0.04))  # alone: the pass held only this stream's row
    for _ in range(4):  # every stream in a shared pass reports it; it counts once
        profile.learn(_shared_pass(4, 0.17))
    profile.learn(_shared_pass(4, 0.15))
    assert profile.pass_times.at(4) == 0.04 and not profile.pass_times.known(4)
    assert profile.shared_times.at(4) == pytest.approx(0.7 * 0.17 + 0.3 * 0.15)
    assert (profile.others_rows, profile.others_streams) == (3, 3)


def test_beside_other_streams_the_shared_curve_never_falls():
    # Passes timed under load scatter between sizes: 6 rows read faster than 5. Beside other
    # streams a row is priced on the curve as it rises, so the dip makes no row free.
    policy = host(AMD)
    for rows, ms in {4: 147, 5: 162, 6: 157, 8: 190}.items():
        policy.update(_shared_pass(rows, ms / 1000))
    assert policy.profile.shared_times.at(6) == pytest.approx(0.157)
    assert policy.others_rows == 7 and policy.profile.shared_times.at(6, rising=True) == pytest.approx(0.162)
    policy.others_rows = 4
    know(policy, "ngram:1", [0.5] * 12)
    assert policy.arms(LOOKUP, 1000)[0].seconds == pytest.approx(0.162)  # T(4 + 2) read as T(5)


def test_beside_other_streams_a_row_costs_at_least_what_it_costs_alone():
    # Under load the shared passes measured are the rounds' 4 rows and a prompt's 64-row
    # pieces: the line between them prices 7 rows below an idle 7-row pass. The idle curve is
    # the floor, so a 3-token block beside the round is priced at T(7) alone at least.
    policy = host(AMD)
    policy.update(_shared_pass(64, 0.70, streams=2))
    policy.update(_shared_pass(4, 0.11, streams=4))
    assert policy.profile.shared_times.at(7, rising=True) < measured(AMD).at(7)
    assert policy.others_rows == 3
    know(policy, "ngram:1", [0.5] * 12)
    assert policy.arms(LOOKUP, 1000)[2].seconds == pytest.approx(measured(AMD).at(7))


def test_a_stream_beside_b_rows_prices_its_rows_on_the_round_it_is_in():
    # The last pass held 8 other streams' rows: a block of k rows emits 8 + E tokens in a pass
    # of T(9 + k); plain 9 in T(9). Groups of 4 rows: 12 rows cost less than 9.
    curve = {1: 65, 2: 88, 4: 86, 8: 152, 9: 190, 10: 200, 11: 210, 12: 160, 13: 195, 16: 169, 32: 338}
    policy = host(curve)
    know(policy, "ngram:1", [0.5] * 12)
    policy.update(_shared_pass(9, 0.19))
    assert policy.others_rows == policy.others_streams == 8
    expected = policy.acceptance("ngram:1").expected(3)[3]
    assert policy.arms(LOOKUP, 1000)[2].rate == pytest.approx((8 + expected) / 0.160)
    assert policy.plain().rate == pytest.approx(9 / 0.190)
    choice = policy.choose([LOOKUP], 1000)
    assert choice.k > 0 and (8 + choice.k + 1) % 4 == 0  # the pass's rows fill whole groups


def test_under_load_a_draft_models_passes_keep_its_stream_out_of_rounds():
    # Beside 8 rows, each drafted token is a round of its own (the others' 8-row pass and the
    # draft's): k tokens cost k rounds in which this stream emits nothing.
    policy = host(INTEL, draft_ms=21)
    know(policy, "model", [0.95] * 12)
    assert policy.choose([DRAFT_MODEL], 1000).k > 0  # alone it pays
    policy.others_rows = policy.others_streams = 8
    arm = policy.arms(DRAFT_MODEL, 1000)[1]  # k = 2
    expected = policy.acceptance("model").expected(2)[2]
    t8, t11 = 0.147, measured(INTEL).at(11)
    assert arm.rate == pytest.approx((8 * 3 + expected) / (2 * (t8 + 0.021) + t11))
    assert policy.choose([DRAFT_MODEL], 1000) == PLAIN


def test_a_prompt_fed_beside_counts_as_one_stream_not_as_its_rows():
    # One other stream feeds 60 rows of its prompt: counted as 60 streams each emitting a token,
    # twelve draft rounds beside it looked nearly free. It emits nothing, at most one token.
    policy = host(AMD, draft_ms=11)
    know(policy, "model", [0.95] * 12)
    policy.update(_shared_pass(61, 0.85, streams=2))
    assert (policy.others_rows, policy.others_streams) == (60, 1)
    assert policy.choose([DRAFT_MODEL], 1000) == PLAIN
    rows_as_streams = max(arm.rate for arm in policy.arms(DRAFT_MODEL, 1000))
    policy.others_streams = 60
    assert max(arm.rate for arm in policy.arms(DRAFT_MODEL, 1000)) > 10 * rows_as_streams


# --- forced tokens (a grammar's): sure, free, and a block may go on past them -----------------


def _on_the_line(k_max: int = 4) -> CostAwareK:
    """A policy that knows passes of 0.4 s plus 0.12 s a row past the first, up to 24 rows."""
    return host({rows: 400 + 120 * (rows - 1) for rows in range(1, 25)}, k_max=k_max, k=2)


def test_forced_tokens_are_drafted_whole_past_k_max_with_nothing_to_learn():
    # 10 forced tokens: 11 tokens in a pass of 0.4 + 10 x 0.12 = 1.6 s, against one in 0.4 s.
    policy = _on_the_line()
    forced = Offer("grammar", limit=10, cost_hint=0.0, grounded=True, sure=10)
    assert policy.arms(forced, 1000)[9].rate == pytest.approx(11 / 1.6)
    assert policy.choose([forced], 1000) == Choice(forced, 10)  # not cut at k_max
    policy.update(step(10, 10, 10, verify_s=1.6, offer=forced))
    assert "grammar" not in policy.profile.acceptance  # forced tokens say nothing of a source


def test_a_block_past_forced_tokens_is_priced_at_its_sources_acceptance():
    policy = _on_the_line()
    forced = Offer("grammar", limit=3, cost_hint=0.0, sure=3)
    mixed = Offer("grammar+ngram", key="grammar+ngram:3", cost_hint=0.0, sure=3)
    know(policy, "grammar+ngram:3", [0.95] * 4)
    expected = policy.acceptance("grammar+ngram:3").expected(4)[4]
    assert policy.arms(mixed, 1000)[6].rate == pytest.approx((3 + expected) / 1.24)
    choice = policy.choose([forced, mixed], 1000)
    assert choice.offer == mixed and choice.k > 3  # past the forced three
    for _ in range(10):  # the forced three kept, the draft after them wrong at once
        policy.update(step(7, 7, 3, verify_s=1.24, offer=mixed))
    assert policy.acceptance("grammar+ngram:3").rates(1)[0] < 0.2
    assert policy.choose([forced, mixed], 1000).k == 3  # only what is sure pays


def test_only_the_tokens_after_the_forced_ones_count_for_the_source():
    policy = _on_the_line()
    mixed = Offer("grammar+ngram", key="grammar+ngram:3", cost_hint=0.0, sure=3)
    policy.update(step(3, 3, 3, offer=mixed))  # cut to the forced three: nothing to learn
    policy.update(step(7, 7, 2, offer=mixed))  # a forced token refused: the draft was not reached
    assert "grammar+ngram:3" not in policy.profile.acceptance
    policy.update(step(7, 7, 5, offer=mixed))  # 2 of 4 drafted kept, then a rejection
    counts = policy.profile.acceptance["grammar+ngram:3"]
    assert counts.tried == [1, 1, 1] and counts.kept == [1, 1, 0]


def test_the_draft_models_own_passes_price_its_tokens_not_the_rounds_it_waited():
    profile = CostProfile()
    outcome = Outcome(
        Choice(DRAFT_MODEL, 4),
        n_proposed=4,
        n_accepted=2,
        draft_seconds=0.8,
        verify_seconds=0.1,
        draft_pass_seconds=0.04,
    )
    profile.learn(outcome)  # 0.8 s waited across rounds, 0.04 s of its own passes
    assert profile.draft_token_seconds["model"] == pytest.approx(0.01)
    profile.learn(
        Outcome(Choice(LOOKUP, 2), n_proposed=2, n_accepted=2, draft_seconds=0.002, verify_seconds=0.1)
    )  # no model: the wall time stands
    assert profile.draft_token_seconds["ngram"] == pytest.approx(0.001)


def test_over_a_profile_s_generations_exploration_loses_one_opening_and_the_allowance():
    # A server's requests share one profile. Ten in a row are each offered a lookup none has a
    # record of, and none ever pays: together they lose no more than one opening and the
    # allowance of their time, where a budget opened for each would lose an opening each.
    profile = host(AMD).profile
    seconds = tokens = 0.0
    for n in range(10):
        policy = CostAwareK(DraftConfig(k_max=12), profile)
        _, spent, emitted = simulate(policy, Offer("ngram", key=f"ngram:{n}", cost_hint=0.0), [0.0], AMD, 5)
        seconds, tokens = seconds + spent, tokens + emitted
    plain = AMD[1] / 1000
    assert 0 < seconds - tokens * plain <= COST.opening * plain + COST.allowance * seconds
