"""Verification functions on hand-built scores whose answers are known in advance."""

from __future__ import annotations

import math

import pytest
import torch

from draftwise.config import MIN_TEMPERATURE
from draftwise.verify import TokenSource, Verdict, logits_to_probs, verify, verify_greedy, verify_sampling

V = 8


def argmax_rows(choices: list[int], vocab: int = V) -> torch.Tensor:  # [len(choices), vocab]
    """Scores whose argmax in row i is ``choices[i]``, with a runner-up close behind."""
    logits = torch.zeros(len(choices), vocab)
    for i, c in enumerate(choices):
        logits[i, c] = 3.0
        logits[i, (c + 1) % vocab] = 2.5
    return logits


def probs(*rows: list[float], vocab: int = V) -> torch.Tensor:  # [len(rows), vocab]
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def tokens(*ids: int) -> torch.Tensor:  # [k] long
    return torch.tensor(ids, dtype=torch.long)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- greedy -------------------------------------------------------------------------------


def test_greedy_accept_all_gives_bonus():
    verdict = verify_greedy(tokens(5, 7, 1), argmax_rows([5, 7, 1, 4]))
    assert verdict == Verdict(n_accepted=3, next_token=4, n_proposed=3)
    assert verdict.next_source is TokenSource.BONUS


def test_greedy_reject_first():
    verdict = verify_greedy(tokens(5, 7, 1), argmax_rows([2, 7, 1, 4]))
    assert verdict == Verdict(n_accepted=0, next_token=2, n_proposed=3)
    assert verdict.next_source is TokenSource.CORRECTED


def test_greedy_reject_in_middle_ignores_later_agreement():
    # Position 2 agrees again after the mismatch at 1: it must not count.
    verdict = verify_greedy(tokens(5, 7, 1), argmax_rows([5, 3, 1, 4]))
    assert verdict == Verdict(n_accepted=1, next_token=3, n_proposed=3)
    assert verdict.next_source is TokenSource.CORRECTED


def test_greedy_empty_proposal_is_plain_decoding():
    verdict = verify_greedy(tokens(), argmax_rows([6]))
    assert verdict == Verdict(n_accepted=0, next_token=6, n_proposed=0)
    assert verdict.next_source is TokenSource.BONUS


# --- sampling: cases where the answer is forced ---------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_sampling_point_mass_on_impossible_token_is_rejected(seed):
    # p(0) = 0: the n-gram guess 0 can never be kept; the correction comes from p without 0.
    p = probs([0.0, 0.3, 0.7], [0.0, 0.0, 1.0])
    verdict = verify_sampling(tokens(0), None, p, gen(seed))
    assert verdict.n_accepted == 0
    assert verdict.next_token in (1, 2)


@pytest.mark.parametrize("seed", range(20))
def test_sampling_point_mass_on_certain_token_is_accepted(seed):
    p = probs([0.0, 1.0], [0.0, 0.0, 0.0, 1.0])
    verdict = verify_sampling(tokens(1), None, p, gen(seed))
    assert verdict == Verdict(n_accepted=1, next_token=3, n_proposed=1)


@pytest.mark.parametrize("seed", range(20))
def test_sampling_point_mass_rejection_never_repeats_the_guess(seed):
    p = probs([0.5, 0.5])
    verdict = verify_sampling(tokens(0), None, p.repeat(2, 1), gen(seed))
    # Either 0 is kept (then a bonus follows) or the correction is 1, never 0 again.
    assert (verdict.n_accepted, verdict.next_token) in {(1, 0), (1, 1), (0, 1)}


@pytest.mark.parametrize("seed", range(20))
def test_sampling_p_equal_q_accepts_everything(seed):
    p = probs([0.2, 0.3, 0.5], [0.6, 0.4], [0.1, 0.1, 0.1, 0.7], [0.0, 0.0, 0.0, 0.0, 1.0])
    verdict = verify_sampling(tokens(2, 0, 3), p[:3].clone(), p, gen(seed))
    assert verdict == Verdict(n_accepted=3, next_token=4, n_proposed=3)


@pytest.mark.parametrize("seed", range(20))
def test_sampling_residual_is_forced_when_one_token_has_excess_mass(seed):
    # max(0, p - q) = [0, 0, 0.4]: whenever token 0 is rejected, the correction must be 2.
    p = probs([0.2, 0.3, 0.5], [1.0])
    q = probs([0.6, 0.3, 0.1])
    verdict = verify_sampling(tokens(0), q, p, gen(seed))
    assert (verdict.n_accepted, verdict.next_token) in {(1, 0), (0, 2)}


@pytest.mark.parametrize("seed", range(20))
def test_sampling_reject_in_middle(seed):
    # Position 0: p == q (always kept). Position 1: p(x) = 0 (always rejected), residual
    # max(0, p - q) has mass only on token 3.
    p = probs([0.5, 0.5], [0.0, 0.4, 0.0, 0.6], [1.0])
    q = probs([0.5, 0.5], [0.5, 0.5])
    verdict = verify_sampling(tokens(1, 0), q, p, gen(seed))
    assert verdict == Verdict(n_accepted=1, next_token=3, n_proposed=2)
    assert verdict.next_source is TokenSource.CORRECTED


def test_sampling_empty_proposal_samples_from_p():
    verdict = verify_sampling(tokens(), None, probs([0.0, 0.0, 1.0]), gen(0))
    assert verdict == Verdict(n_accepted=0, next_token=2, n_proposed=0)


@pytest.mark.parametrize("seed", range(10))
def test_sampling_tiny_probabilities_are_compared_in_log_space(seed):
    # p(x) = q(x) = 1e-30: the ratio is exactly 1, so the token is always kept.
    p = probs([1e-30, 1.0 - 1e-30], [1.0])
    verdict = verify_sampling(tokens(0), p[:1].clone(), p, gen(seed))
    assert verdict.n_accepted == 1


def test_sampling_same_seed_same_verdict():
    p = probs([0.3, 0.3, 0.4], [0.2, 0.2, 0.6])
    q = probs([0.6, 0.2, 0.2])
    runs = {verify_sampling(tokens(0), q, p, gen(7)) for _ in range(5)}
    assert len(runs) == 1


# --- vocabulary alignment ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_sampling_draft_vocab_smaller_than_target(seed):
    # The draft knows only the first 4 ids; the target has 8. p == q on the shared ids.
    p = probs([0.25, 0.25, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    q = p[:1, :4].clone()
    verdict = verify_sampling(tokens(2), q, p, gen(seed))
    assert verdict == Verdict(n_accepted=1, next_token=7, n_proposed=1)


@pytest.mark.parametrize("seed", range(20))
def test_sampling_draft_vocab_larger_than_target(seed):
    # The draft puts mass 0.2 on a padded id (8) the target does not have: it is cut, and the
    # residual max(0, p - q) over the target's ids has mass only on token 1.
    p = probs([0.4, 0.6], [1.0])
    q = probs([0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2], vocab=V + 3)
    verdict = verify_sampling(tokens(0), q, p, gen(seed))
    assert (verdict.n_accepted, verdict.next_token) in {(1, 0), (0, 1)}


def test_sampling_vocab_alignment_accepts_with_the_right_frequency():
    p = probs([0.4, 0.6], [1.0])
    q = probs([0.8, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2], vocab=V + 3)
    generator = gen(3)
    kept = sum(verify_sampling(tokens(0), q, p, generator).n_accepted for _ in range(4000))
    # Acceptance probability min(1, 0.4 / 0.8) = 0.5; 4000 draws: sd ~ 32.
    assert abs(kept - 2000) < 200


# --- logits_to_probs --------------------------------------------------------------------------


def log_of(*values: float) -> torch.Tensor:  # [1, len(values)]
    return torch.tensor([values]).log()


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor([expected]), atol=1e-6, rtol=1e-5)


def test_probs_temperature_one_is_softmax():
    close(logits_to_probs(log_of(1, 2, 4), 1.0), [1 / 7, 2 / 7, 4 / 7])


def test_probs_temperature_scales_scores():
    r = math.sqrt(2)
    total = 1 + r + 2
    close(logits_to_probs(log_of(1, 2, 4), 2.0), [1 / total, r / total, 2 / total])


def test_probs_greedy_reports_plain_softmax_and_ignores_filters():
    close(logits_to_probs(log_of(1, 2, 4), 0.0, top_k=1, top_p=0.1), [1 / 7, 2 / 7, 4 / 7])


def test_probs_top_k():
    close(logits_to_probs(log_of(1, 2, 4), 1.0, top_k=2), [0.0, 1 / 3, 2 / 3])
    close(logits_to_probs(log_of(1, 2, 4), 1.0, top_k=3), [1 / 7, 2 / 7, 4 / 7])
    close(logits_to_probs(log_of(1, 2, 4), 1.0, top_k=50), [1 / 7, 2 / 7, 4 / 7])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.65, [0.0, 0.0, 3 / 7, 4 / 7]),  # mass before: 0, .4, .7, .9 -> keep .4 and .3
        (0.75, [0.0, 2 / 9, 3 / 9, 4 / 9]),
        (0.95, [0.1, 0.2, 0.3, 0.4]),
        (0.01, [0.0, 0.0, 0.0, 1.0]),  # the most likely token always survives
    ],
)
def test_probs_top_p(top_p, expected):
    close(logits_to_probs(log_of(0.1, 0.2, 0.3, 0.4), 1.0, top_p=top_p), expected)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300])
@pytest.mark.parametrize("top_k", [0, 3])
def test_probs_top_p_below_float32_keeps_the_most_likely_token(top_p, top_k):
    # In float32 these round to 0, where the mass rule alone ("mass before < top_p") keeps nothing.
    close(logits_to_probs(log_of(0.1, 0.2, 0.3, 0.4), 1.0, top_k=top_k, top_p=top_p), [0.0, 0.0, 0.0, 1.0])


def test_sampling_with_a_vanishing_top_p_is_the_argmax():
    logits = argmax_rows([5, 7, 1])
    for seed in range(5):
        verdict, _ = verify(tokens(5, 2), None, logits, 1.0, 0, 5e-324, gen(seed))
        assert verdict == Verdict(n_accepted=1, next_token=7, n_proposed=2)


def test_probs_at_the_temperature_floor_are_finite():
    # Large score gaps: scores / temperature is huge, yet every row still sums to 1.
    logits = torch.tensor([[30.0, 29.99, -5.0, -1e4], [-1e4, 0.0, 0.0, -3.0]])
    out = logits_to_probs(logits, MIN_TEMPERATURE)
    torch.testing.assert_close(out, torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, MIN_TEMPERATURE / 2])
def test_probs_refuse_a_temperature_below_the_floor(temperature):
    # SamplingConfig raises such a temperature to the floor; a direct caller hears about it.
    with pytest.raises(ValueError, match="temperature"):
        logits_to_probs(log_of(1, 2, 4), temperature)


def test_probs_top_k_then_top_p_on_the_renormalised_distribution():
    # top_k = 3 leaves [.2, .3, .4] / .9; mass before: 0, .444, .778 -> top_p = 0.6 keeps two.
    close(logits_to_probs(log_of(0.1, 0.2, 0.3, 0.4), 1.0, top_k=3, top_p=0.6), [0.0, 0.0, 3 / 7, 4 / 7])


def test_probs_rows_are_independent():
    logits = torch.cat([log_of(0.1, 0.2, 0.3, 0.4), log_of(0.4, 0.3, 0.2, 0.1)])
    out = logits_to_probs(logits, 1.0, top_k=2)
    torch.testing.assert_close(out, torch.tensor([[0, 0, 3 / 7, 4 / 7], [4 / 7, 3 / 7, 0, 0]]))


# --- dispatch ------------------------------------------------------------------------------


def test_verify_dispatches_on_temperature():
    logits = argmax_rows([5, 7, 1])
    verdict, token_probs = verify(tokens(5, 2), None, logits, 0.0, 0, 1.0, None)
    assert verdict == Verdict(n_accepted=1, next_token=7, n_proposed=2)
    torch.testing.assert_close(token_probs, logits.softmax(-1)[[0, 1], [5, 2]])

    one_hot = torch.full((3, V), -1e9)
    one_hot[0, 5] = one_hot[1, 2] = one_hot[2, 6] = 0.0
    verdict, token_probs = verify(tokens(5, 2), None, one_hot, 1.0, 0, 1.0, gen(0))
    assert verdict == Verdict(n_accepted=2, next_token=6, n_proposed=2)
    torch.testing.assert_close(token_probs, torch.tensor([1.0, 1.0]))
    _, none = verify(tokens(), None, logits[:1], 0.0, 0, 1.0, None)  # a plain step: nothing to report
    assert none.shape == (0,)


@pytest.mark.parametrize("nucleus", [1, 40, 601, 999])
def test_probs_top_p_over_a_large_vocabulary(nucleus):
    # Distinct probabilities over 1000 tokens; top_p is set halfway between two cumulative
    # masses so exactly `nucleus` tokens must survive, whatever their number.
    logits = torch.randn(1, 1000, generator=gen(nucleus)) * 0.5
    full = logits.double().softmax(-1)[0]
    ordered, order = full.sort(descending=True)
    cum = ordered.cumsum(0)
    top_p = float((cum[nucleus - 2] + cum[nucleus - 1]) / 2) if nucleus > 1 else float(cum[0] / 2)
    out = logits_to_probs(logits, 1.0, top_p=top_p)[0]
    kept = order[:nucleus]
    assert int((out > 0).sum()) == nucleus
    expected = full[kept] / full[kept].sum()
    torch.testing.assert_close(out[kept].double(), expected, atol=1e-6, rtol=1e-4)


def test_row_reductions_agree_with_torch():
    from draftwise.verify import row_argmax, row_logsumexp

    rows = torch.randn(6, 5000, generator=torch.Generator().manual_seed(3)) * 4
    rows[2, 10] = rows[2, 4000] = rows[2].max() + 1.0  # a tie: the first index wins, as torch says
    assert row_argmax(rows).tolist() == rows.argmax(-1).tolist()
    assert row_argmax(rows)[2] == 10
    assert torch.allclose(row_logsumexp(rows), torch.logsumexp(rows, -1), atol=1e-5)
    assert row_logsumexp(rows[:0]).shape == (0,)
