"""Draft-length policies: the fixed rule, transformers' heuristic and the cost-aware choice."""

from __future__ import annotations

import pytest

from draftwise import DraftConfig
from draftwise.policies import CostAwareK, FixedK, HeuristicK, expected_speedup, make_policy


def test_fixed_never_changes():
    policy = FixedK(3)
    policy.update(3, 3, 3, 0.1, 0.1)
    policy.update(3, 3, 0, 0.1, 0.1)
    assert policy.next_k() == 3


def test_heuristic_plus_two_minus_one_within_bounds():
    policy = HeuristicK(5, k_max=10)
    seen = []
    for proposed, accepted in [(5, 5), (7, 7), (9, 9), (10, 3), (9, 0), (8, 7)]:
        policy.update(policy.next_k(), proposed, accepted, 0.0, 0.0)
        seen.append(policy.next_k())
    assert seen == [7, 9, 10, 9, 8, 7]
    for _ in range(20):
        policy.update(policy.next_k(), 1, 0, 0.0, 0.0)
    assert policy.next_k() == 1


def test_heuristic_ignores_empty_proposals_and_starts_at_least_at_one():
    policy = HeuristicK(0, k_max=4)
    assert policy.next_k() == 1
    policy.update(1, 0, 0, 0.0, 0.0)  # e.g. no n-gram match: nothing learnt
    assert policy.next_k() == 1


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


def feed(policy: CostAwareK, steps: int, k: int, accepted: int, draft_token_s: float, verify_s: float) -> None:
    for _ in range(steps):
        policy.update(k, k, accepted, draft_token_s * k, verify_s)


def test_cost_starts_at_configured_k_before_any_measurement():
    assert CostAwareK(DraftConfig(k=3, k_max=8)).next_k() == 3
    assert CostAwareK(DraftConfig(k=0, k_max=8)).next_k() == 1


def test_cost_drafts_nothing_when_drafting_is_expensive_and_poor():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    assert policy.alpha < 0.2 and policy.cost_ratio == pytest.approx(0.9)
    assert policy.next_k() == 0


def test_cost_drafts_long_blocks_when_cheap_and_accurate():
    policy = CostAwareK(DraftConfig(k_max=12))
    feed(policy, 30, k=6, accepted=6, draft_token_s=0.01, verify_s=1.0)
    assert policy.alpha > 0.95
    assert policy.next_k() == 12


def test_cost_picks_the_argmax_of_expected_speedup():
    policy = CostAwareK(DraftConfig(k_max=12))
    feed(policy, 30, k=4, accepted=2, draft_token_s=0.1, verify_s=1.0)
    best = max(range(13), key=lambda k: expected_speedup(policy.alpha, k, policy.cost_ratio))
    assert 0 < policy.next_k() == best < 12


def test_cost_probes_again_after_idle_steps():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=4))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    ks = [policy.next_k() for _ in range(9)]
    assert ks[:3] == [0, 0, 0] and ks[3] >= 1
    assert ks[4:7] == [0, 0, 0] and ks[7] >= 1


def test_cost_recovers_when_the_draft_becomes_good():
    policy = CostAwareK(DraftConfig(k_max=8, probe_every=2))
    feed(policy, 10, k=2, accepted=0, draft_token_s=0.9, verify_s=1.0)
    assert policy.next_k() == 0
    feed(policy, 30, k=4, accepted=4, draft_token_s=0.02, verify_s=1.0)
    assert policy.next_k() >= 4


def test_cost_learns_timing_from_steps_without_proposals():
    policy = CostAwareK(DraftConfig())
    policy.update(0, 0, 0, 0.0, 0.5)
    assert policy.cost_ratio is None  # no draft timing yet
    alpha = policy.alpha
    policy.update(3, 0, 0, 0.0, 0.5)  # k asked, nothing proposed: acceptance unchanged
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
    for proposed in [4, 0, 8, 2, 12, 0, 6, 1, 4, 8, 3, 12]:
        accepted = 1 if proposed >= 12 else 0
        growing.update(proposed, proposed, accepted, 1e-5 * proposed, _pass_seconds(proposed + 1))
        flat.update(proposed, proposed, accepted, 1e-5 * proposed, 0.4)
    assert growing.alpha < 0.25
    assert growing.cost_ratio == pytest.approx((1e-5 + 0.12) / 0.4, rel=1e-6)
    assert growing.next_k() == 0
    assert flat.cost_ratio == pytest.approx(1e-5 / 0.4, rel=1e-6)
    assert flat.next_k() >= 1


def test_cost_assumes_flat_verification_until_block_sizes_differ():
    policy = CostAwareK(DraftConfig(k=4, k_max=12))
    for _ in range(5):
        policy.update(4, 4, 4, 0.04, 0.5)
    assert policy.cost_ratio == pytest.approx(0.01 / 0.5)
