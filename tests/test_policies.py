"""Draft-length policies: the fixed rule, transformers' heuristic and the cost-aware choice."""

from __future__ import annotations

import pytest

from draftwise import DraftConfig
from draftwise.policies import (
    PLAIN,
    Choice,
    CostAwareK,
    CostProfile,
    FixedK,
    HeuristicK,
    Offer,
    Outcome,
    PassTimes,
    expected_speedup,
    make_policy,
)

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
    return Outcome(choice, k if proposed is None else proposed, accepted, draft_s, verify_s)


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


@pytest.mark.parametrize(
    ("alpha", "k", "c", "expected"),
    [
        (0.8, 4, 0.1, (1 - 0.8**5) / 0.2 / 1.4),  # 2.401
        (0.8, 4, 0.43, (1 - 0.8**5) / 0.2 / 2.72),
        (0.5, 1, 0.0, 1.5),
        (0.0, 3, 0.0, 1.0),
        (0.7, 0, 0.9, 1.0),
        (1.0, 2, 0.0, (1 - 0.999**3) / 0.001),  # alpha is capped below 1
    ],
)
def test_expected_speedup_closed_form(alpha, k, c, expected):
    assert expected_speedup(alpha, k, c) == pytest.approx(expected)


def feed(
    policy: CostAwareK,
    steps: int,
    k: int,
    accepted: int,
    draft_token_s: float,
    verify_s: float,
    plain_s: float | None = None,
    offer: Offer = MODEL,
) -> None:
    """``steps`` steps of draft length ``k``, after one plain step (``plain_s``, default
    ``verify_s``) the way the policy starts."""
    policy.update(step(0, verify_s=verify_s if plain_s is None else plain_s))
    for _ in range(steps):
        policy.update(step(k, k, accepted, draft_token_s * k, verify_s, offer))


def next_k(policy: CostAwareK, offers=(MODEL,), remaining: int = 1000) -> int:
    return policy.choose(list(offers), remaining).k


def test_cost_starts_with_one_plain_step_then_the_configured_k():
    for k, first_draft in [(3, 3), (0, 1)]:
        policy = CostAwareK(DraftConfig(k=k, k_max=8))
        assert next_k(policy) == 0  # measures what drafting has to beat
        policy.update(step(0, verify_s=0.3))
        assert next_k(policy) == first_draft  # measures the draft's cost


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


def test_pass_times_noise_is_the_standard_error_of_a_sizes_decayed_mean():
    times = PassTimes()
    assert times.noise(4) == 0.0
    times.add(4, 0.10)
    assert times.noise(4) == 0.0  # one pass: no scatter known
    times.add(4, 0.20)
    variance = 0.7 * (0.3 * 0.10**2)  # the decayed variance of the passes about the mean
    assert times.noise(4) == pytest.approx((variance * 0.3 / 1.7) ** 0.5)
    times.add(8, 0.30)
    assert times.noise(8) == 0.0
    assert times.noise(6) == pytest.approx(times.noise(4))  # unmeasured: its noisier neighbour
    assert times.noise(20) == 0.0  # past the last size, the last size's


def test_cost_drafts_nothing_when_drafting_is_expensive_and_poor():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    assert policy.alpha < 0.2
    assert next_k(policy) == 0


def test_cost_drafts_long_blocks_when_cheap_and_accurate():
    policy = CostAwareK(DraftConfig(k_max=12))
    feed(policy, 30, k=6, accepted=6, draft_token_s=0.01, verify_s=1.0)
    assert policy.alpha > 0.95
    assert next_k(policy) == 12


def test_cost_picks_the_argmax_of_expected_tokens_per_second():
    policy = CostAwareK(DraftConfig(k_max=12))
    feed(policy, 30, k=4, accepted=2, draft_token_s=0.1, verify_s=1.0)
    rates = {k: policy.rate(MODEL, k, 1000) for k in range(13)}
    assert rates[2] == pytest.approx(expected_speedup(policy.alpha, 2, 0.0) / (1.0 + 2 * 0.1))
    assert 0 < next_k(policy) == max(rates, key=rates.get) < 12


def test_cost_probes_again_after_idle_steps_backing_off():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    ks = [next_k(policy) for _ in range(4 + 8 + 16 + 32 + 32)]
    probes = [i for i, k in enumerate(ks) if k > 0]
    # each probe that leaves drafting unprofitable doubles the wait, up to 8 x probe_every
    assert probes == [3, 3 + 8, 3 + 8 + 16, 3 + 8 + 16 + 32, 3 + 8 + 16 + 32 + 32]


def test_cost_probe_wait_resets_once_drafting_pays():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    assert [next_k(policy) > 0 for _ in range(12)].count(True) == 2  # probes after 4, then 8 idle steps
    feed(policy, 30, k=4, accepted=4, draft_token_s=0.02, verify_s=1.0)
    assert next_k(policy) >= 4  # drafting pays again: the wait is back to probe_every
    feed(policy, 30, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    ks = [next_k(policy) for _ in range(4)]
    assert ks[:3] == [0, 0, 0] and ks[3] >= 1


def test_cost_recovers_when_the_draft_becomes_good():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=2))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    assert next_k(policy) == 0
    feed(policy, 30, k=4, accepted=4, draft_token_s=0.02, verify_s=1.0)
    assert next_k(policy) >= 4


def test_cost_learns_timing_from_steps_without_proposals():
    policy = CostAwareK(DraftConfig(k=3))
    policy.update(step(0, verify_s=0.5))
    assert policy.pass_times.at(1) == 0.5
    assert next_k(policy) == 3  # the model's draft cost is unknown: tried once with k
    alpha = policy.alpha
    policy.update(step(3, 0, 0, 0.0, 0.5))  # k asked, nothing proposed: acceptance unchanged
    assert policy.alpha == alpha


@pytest.mark.parametrize(("name", "cls"), [("fixed", FixedK), ("heuristic", HeuristicK), ("cost", CostAwareK)])
def test_make_policy(name, cls):
    assert isinstance(make_policy(DraftConfig(k_policy=name)), cls)


def _pass_seconds(tokens: int) -> float:
    """A CPU-like target: 0.4 s for one token, 0.12 s more for each extra token scored."""
    return 0.4 + 0.12 * (tokens - 1)


def test_cost_accounts_for_verification_that_grows_with_the_block():
    # Free drafts (n-gram) with poor acceptance: on a flat-cost target long blocks would be
    # worth trying, but here every extra token makes the pass slower, so drafting must stop.
    growing = CostAwareK(DraftConfig(k=4, k_max=12, probe_every=1000))
    flat = CostAwareK(DraftConfig(k=4, k_max=12, probe_every=1000))
    for proposed in [0, 4, 0, 8, 2, 12, 0, 6, 1, 4, 8, 3, 12]:
        accepted = 1 if proposed >= 12 else 0
        growing.update(step(proposed, proposed, accepted, 1e-5 * proposed, _pass_seconds(proposed + 1)))
        flat.update(step(proposed, proposed, accepted, 1e-5 * proposed, 0.4))
    assert growing.alpha < 0.25
    assert next_k(growing) == 0
    assert next_k(flat) >= 1


# Measured (Qwen2.5-Coder-1.5B, hf backend, packed float32): far from a line in the block size.
CPU_PASS = {1: 0.28, 2: 0.48, 4: 0.59, 6: 0.61, 9: 0.71, 13: 0.82}


def _cpu_pass(tokens: int) -> float:
    known = PassTimes()
    for size, seconds in CPU_PASS.items():
        known.add(size, seconds)
    return known.at(tokens)


@pytest.mark.parametrize("good_draft", [False, True])
def test_cost_settles_on_what_pays_with_a_measured_cpu_cost_curve(good_draft):
    # A 0.06 s draft token against the measured target: a draft that gets one token of each
    # block right (alpha ~0.5) cannot beat the 0.28 s plain step, an always-right one can.
    # A line fitted to the multi-token passes alone would put the plain step near 0.45 s.
    policy = CostAwareK(DraftConfig(k=4, k_max=12, probe_every=1000))
    ks = []
    for _ in range(30):
        k = next_k(policy)
        ks.append(k)
        accepted = k if good_draft else min(k, 1)
        policy.update(step(k, k, accepted, 0.06 * k, _cpu_pass(k + 1)))
    if good_draft:
        assert min(ks[-10:]) >= 4
    else:
        assert ks[-10:] == [0] * 10


def test_cost_takes_free_lookups_where_the_draft_model_does_not_pay():
    # The draft model costs 0.6 of a target pass per token and gets one token of each block
    # right (alpha 0.5); the n-gram continuation is free and always right: the lookup wins
    # when offered, and without it plain decoding beats the model.
    policy = CostAwareK(DraftConfig(k=4, k_max=8, probe_every=1000))
    lookup = Offer("ngram", limit=6, key="ngram:3", cost_hint=0.0)
    feed(policy, 20, k=3, accepted=1, draft_token_s=0.6, verify_s=1.0)
    for _ in range(20):
        policy.update(step(4, 4, 4, 1e-4, 1.1, lookup))
    assert policy.alpha_of("model") < 0.55 and policy.alpha_of("ngram:3") > 0.9
    assert policy.choose([lookup, MODEL], 1000).source == "ngram"
    assert policy.choose([MODEL], 1000) == PLAIN  # no match this step: plain beats the model


def test_cost_does_not_prefill_a_draft_model_for_a_long_prompt_just_to_try_it():
    # A lazy draft model 2,000 tokens behind, 128 tokens to generate: catching up would cost
    # more than the few steps' worth the policy may spend on finding out what a source is
    # worth, and more than drafting could win back.
    policy = CostAwareK(DraftConfig(k=4, k_max=8))
    policy.update(step(0, verify_s=0.1))
    assert policy.choose([Offer("model", behind=2000)], 128) == PLAIN
    assert policy.choose([Offer("model", behind=20)], 128).k == 4  # a short prompt: tried


def test_cost_profile_carries_costs_and_acceptance_to_the_next_generation():
    profile = CostProfile()
    first = CostAwareK(DraftConfig(k=4, k_max=8, probe_every=1000), profile)
    feed(first, 20, k=4, accepted=4, draft_token_s=0.01, verify_s=0.2)
    second = CostAwareK(DraftConfig(k=4, k_max=8, probe_every=1000), profile)
    assert second.pass_times.at(1) == first.pass_times.at(1)
    assert second.alpha_of("model") > 0.9  # the first generation's acceptance is the prior
    assert next_k(second) >= 4  # no plain step, no exploration: both were measured before


def test_cost_probes_only_sources_that_are_cheap_to_catch_up():
    # The model drafter sat out a long prompt: a probe would pay its whole prefill just to
    # re-measure, so probes skip it, however many plain steps go by.
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    far = Offer("model", behind=2000)
    assert all(policy.choose([far], 1000) == PLAIN for _ in range(40))
    near = Offer("model", behind=2)  # the probe that was due goes to a source cheap to try
    assert [policy.choose([near], 1000).k > 0 for _ in range(9)] == [True] + [False] * 7 + [True]


def test_cost_prices_a_catch_up_over_a_few_steps_not_the_whole_budget():
    # A good, cheap draft model that is 2,000 tokens behind: spread over 1,000 tokens to go
    # its catch-up would look free, but once paid it is sunk, so it must pay off within
    # CATCHUP_HORIZON steps; a few tokens behind, the same draft model is used at once.
    policy = CostAwareK(DraftConfig(k=4, k_max=8, probe_every=1000))
    feed(policy, 30, k=4, accepted=4, draft_token_s=0.01, verify_s=1.0)
    policy.profile.catchup_token_seconds["model"] = 0.1  # a tenth of a plain pass per token
    assert policy.choose([Offer("model", behind=2000)], 1000) == PLAIN
    assert policy.choose([Offer("model", behind=10)], 1000).k >= 4


# The 1.5B target's pass times by rows, llama-bench -t 2 on one of this project's hosts, in ms.
BATCH_CURVE = {1: 65, 2: 88, 3: 101, 4: 86, 8: 152, 16: 169, 32: 338}


def _batched(others: int, curve=BATCH_CURVE) -> CostAwareK:
    """A policy whose passes carry ``others`` rows of other streams, and a free, half-right lookup."""
    from draftwise.lm import PassInfo

    profile = CostProfile()
    for rows, ms in curve.items():
        profile.pass_times.add(rows, ms / 1000)
    policy = CostAwareK(DraftConfig(k=4, k_max=15, probe_every=1000), profile)
    lookup = Offer("ngram", key="ngram:1", cost_hint=0.0)
    for _ in range(40):  # acceptance 0.5 per token; every pass has `others` other rows
        pass_rows = others + 5
        outcome = Outcome(
            Choice(lookup, 4), 4, 1, 0.0, 0.1, pass_info=PassInfo(pass_rows, curve.get(pass_rows, 100) / 1000)
        )
        policy.update(outcome)
    return policy


def test_alone_a_stream_prices_its_block_at_a_whole_pass():
    policy = _batched(0, {**BATCH_CURVE, 5: 120})
    assert policy.choose([Offer("ngram", key="ngram:1", cost_hint=0.0)], 1000).k == 3  # 4 rows cost 86, 1 costs 65


def test_beside_eight_rows_a_stream_drafts_to_fill_the_cheap_shape():
    # Rows go through the quantized matrix kernel in groups of 4 and one at a time beyond: a
    # ninth row costs more than the four after it.
    curve = {**BATCH_CURVE, 9: 190, 10: 200, 11: 210, 12: 160, 13: 195}
    policy = _batched(8, curve)
    choice = policy.choose([Offer("ngram", key="ngram:1", cost_hint=0.0)], 1000)
    assert choice.k > 0 and (8 + choice.k + 1) % 4 == 0  # the pass's rows fill whole groups


def _shared_pass(rows: int, seconds: float) -> Outcome:
    """A plain step's outcome whose pass held ``rows`` rows, all but one other streams'."""
    from draftwise.lm import PassInfo

    return Outcome(PLAIN, 0, 0, 0.0, seconds, pass_info=PassInfo(rows, seconds))


def _scattered(others: int, curve: dict[int, float], scatter_ms: float, margin: float, luck=None) -> CostAwareK:
    """A policy beside ``others`` rows and a free, half-right lookup, whose shared passes of
    each size scatter by +-``scatter_ms`` about ``curve`` (ms by rows); ``luck`` maps a size
    to the side (+1 slow, -1 fast) its last three passes fell on, as a run of luck would have it."""
    profile = CostProfile()
    for rows, ms in curve.items():
        for i, sign in enumerate([1, -1] * 30 + [(luck or {}).get(rows, 0)] * 3):
            profile.learn(_shared_pass(rows, (ms + sign * scatter_ms + i * 1e-3) / 1000))
    policy = CostAwareK(DraftConfig(k=4, k_max=15, probe_every=1000, noise_margin=margin), profile)
    policy._counts["ngram:1"] = (5.0, 5.0)
    policy._others = float(others)
    return policy


def test_passes_shared_with_other_streams_make_a_curve_of_their_own():
    profile = CostProfile()
    profile.learn(_shared_pass(1, 0.04))  # alone: the pass held only this stream's row
    for _ in range(4):  # every stream in a shared pass reports it; it counts once
        profile.learn(_shared_pass(4, 0.17))
    profile.learn(_shared_pass(4, 0.15))
    assert profile.pass_times.at(4) == 0.04 and not profile.pass_times.known(4)
    assert profile.shared_times.at(4) == pytest.approx(0.7 * 0.17 + 0.3 * 0.15)


def test_beside_other_streams_rows_are_priced_on_the_shared_passes():
    # Calibrated on an idle machine, a fifth row costs 18 ms; under load, passes of 3 and 4
    # rows take 119 and 170 ms and 5 rows never ran. On the calibration a nine-in-ten lookup's
    # one-token draft pays beside 3 rows; on the shared passes each row costs 51 ms and it
    # does not.
    calibrated = {1: 37, 2: 80, 3: 86, 4: 109, 5: 127, 6: 157, 8: 267}
    lookup = [Offer("ngram", key="ngram:1", cost_hint=0.0)]
    idle = _batched(0, calibrated)
    idle._counts["ngram:1"], idle._others = (9.0, 1.0), 3.0
    assert idle.choose(lookup, 1000).k > 0
    loaded = _batched(0, calibrated)
    loaded._counts["ngram:1"] = (9.0, 1.0)
    for i in range(10):
        loaded.update(_shared_pass(4, 0.170 + i * 1e-6))
        loaded.update(_shared_pass(3, 0.119 + i * 1e-6))
    loaded._others = 3.0
    assert loaded.choose(lookup, 1000) == PLAIN


def test_scatter_between_sizes_does_not_make_rows_look_free():
    # Beside 4 rows, each extra row truly costs about 35 ms, but passes scatter by 30 ms and the
    # means end crossed (the last passes of 6 rows ran fast, of 5 slow): on the raw means a
    # half-right one-token draft costs nothing, and wins on paper.
    curve = {1: 40, 4: 150, 5: 185, 6: 220, 8: 290}
    lookup = [Offer("ngram", key="ngram:1", cost_hint=0.0)]
    luck = {5: 1, 6: -1}
    raw = _scattered(4, curve, 30, margin=0.0, luck=luck)
    assert raw.profile.shared_times.at(6) < raw.profile.shared_times.at(5)
    assert raw.choose(lookup, 1000).k > 0
    assert _scattered(4, curve, 30, margin=2.0, luck=luck).choose(lookup, 1000) == PLAIN


def test_a_dip_well_beyond_the_scatter_is_still_used():
    # Beside 8 rows the pass of 16 costs about what 9 do (the kernel changes), far beyond the
    # passes' scatter of 5 ms: the margin leaves the cheap shape worth filling.
    curve = {1: 40, 8: 300, 9: 335, 10: 370, 12: 440, 16: 330}
    policy = _scattered(8, curve, 5, margin=2.0)
    assert policy.choose([Offer("ngram", key="ngram:1", cost_hint=0.0)], 1000).k == 7


def test_past_the_measured_curve_batched_streams_stop_drafting():
    policy = _batched(32, {**BATCH_CURVE, 37: 390})
    assert policy.choose([Offer("ngram", key="ngram:1", cost_hint=0.0)], 1000) == PLAIN


def test_no_probe_when_no_acceptance_could_make_drafting_pay():
    # Past the measured curve each row adds its slope: even a drafter right 95% of the time
    # loses to plain decoding, so a probe has nothing to learn and never runs.
    policy = _batched(32, {**BATCH_CURVE, 37: 390})
    policy.probe_every = policy._probe_gap = 2
    lookup = Offer("ngram", key="ngram:1", cost_hint=0.0)
    assert [policy.choose([lookup], 1000).k for _ in range(20)] == [0] * 20
    # Alone, the same policy's costs leave room for drafting to pay: probes come back.
    policy._others = 0.0
    assert any(policy.choose([lookup], 1000).k > 0 for _ in range(4))


def test_a_new_generation_starts_from_the_load_the_last_one_saw():
    first = _batched(32, {**BATCH_CURVE, 37: 390})
    second = CostAwareK(DraftConfig(k=4, k_max=15, probe_every=1000), first.profile)
    assert second._others == pytest.approx(first._others) and second._others > 30
    assert second.choose([Offer("ngram", key="ngram:1", cost_hint=0.0)], 1000) == PLAIN


# --- forced tokens (a grammar's): sure, free, and a block may go on past them -----------------


def _on_the_line(k: int = 2, k_max: int = 4) -> CostAwareK:
    """A policy that knows the passes of ``_pass_seconds`` up to 24 rows."""
    policy = CostAwareK(DraftConfig(k=k, k_max=k_max, probe_every=1000))
    for rows in range(1, 25):
        policy.pass_times.add(rows, _pass_seconds(rows))
    return policy


def test_forced_tokens_are_drafted_whole_past_k_max_with_nothing_to_learn():
    # 10 forced tokens: 11 tokens in a pass of 0.4 + 10 x 0.12 = 1.6 s, against one in 0.4 s.
    policy = _on_the_line()
    forced = Offer("grammar", limit=10, cost_hint=0.0, grounded=True, sure=10)
    assert policy.rate(forced, 10, 1000) == pytest.approx(11 / 1.6)
    assert policy.choose([forced], 1000) == Choice(forced, 10)  # not cut at k_max, never "explored"
    policy.update(step(10, 10, 10, verify_s=1.6, offer=forced))
    assert "grammar" not in policy.profile.acceptance  # forced tokens say nothing of a source


def test_a_block_past_forced_tokens_is_priced_at_its_sources_acceptance():
    # 3 forced tokens, then an n-gram draft. Worked: at alpha 0.95, 3 forced + 4 drafted emit
    # 3 + (1 - 0.95^5) / 0.05 = 7.52 tokens in 0.4 + 7 x 0.12 = 1.24 s (6.07 tok/s), against
    # 4 in 0.76 s (5.26 tok/s) for the forced three alone.
    policy = _on_the_line()
    forced = Offer("grammar", limit=3, cost_hint=0.0, sure=3)
    mixed = Offer("grammar+ngram", key="grammar+ngram:3", cost_hint=0.0, sure=3)
    assert policy.choose([forced, mixed], 1000) == Choice(mixed, 5)  # tried once: 3 + k
    policy._counts["grammar+ngram:3"] = (19.0, 1.0)
    assert policy.rate(mixed, 7, 1000) == pytest.approx((3 + (1 - 0.95**5) / 0.05) / 1.24)
    assert policy.choose([forced, mixed], 1000) == Choice(mixed, 3 + 4)  # k_max more, past the forced three
    for _ in range(30):  # the forced three kept, the draft after them wrong at once
        policy.update(step(7, 7, 3, verify_s=_pass_seconds(8), offer=mixed))
    assert policy.alpha_of("grammar+ngram:3") < 0.2
    assert policy.choose([forced, mixed], 1000).k == 3  # only what is sure pays


def test_only_the_tokens_after_the_forced_ones_count_for_the_source():
    policy = _on_the_line()
    mixed = Offer("grammar+ngram", key="grammar+ngram:3", cost_hint=0.0, sure=3)
    policy.update(step(3, 3, 3, offer=mixed))  # cut to the forced three: nothing to learn
    policy.update(step(7, 7, 2, offer=mixed))  # a forced token refused: the draft was not reached
    assert "grammar+ngram:3" not in policy.profile.acceptance
    policy.update(step(7, 7, 5, offer=mixed))  # 2 of 4 drafted kept, then a rejection
    prior_accepted, prior_rejected = CostAwareK.PRIOR
    assert policy.profile.acceptance["grammar+ngram:3"] == pytest.approx(
        (CostAwareK.DECAY * prior_accepted + 2, CostAwareK.DECAY * prior_rejected + 1)
    )
