"""Predicted Outputs: the prediction drafter's alignment, its counts, and the policy's long blocks.

Closed-form cases on the tiny byte-level tokenizer (one token per byte, or with merges), then
greedy exactness through the engine on the tiny random target.
"""

from __future__ import annotations

import pytest

from draftwise import DraftConfig, GenerationConfig, SpeculativeEngine
from draftwise.backends.tiny import tiny_tokenizer
from draftwise.drafters import NGramDrafter, Sources
from draftwise.engine import autoregressive
from draftwise.events import PREDICTION
from draftwise.lm import drive
from draftwise.metrics import GenerationMetrics
from draftwise.offers import Choice, Offer, Outcome
from draftwise.policies import CostAwareK
from draftwise.prediction import PredictionDrafter, token_offsets, with_prediction
from draftwise.target import LocalTarget
from scripted_support import ScriptedTarget

FIXED4 = DraftConfig(k_policy="fixed", k=4)
PREDICTED = "def area(radius):\n    return 3.14159 * radius * radius\n\nprint(area(2.0))\n"


def drafter_for(prompt: str, prediction: str, tokenizer=None) -> tuple[PredictionDrafter, list[int]]:
    tokenizer = tokenizer or tiny_tokenizer()
    drafter = PredictionDrafter(tokenizer)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    drafter.start(ids, GenerationConfig(prediction=prediction), None)
    return drafter, ids


def draft_text(drafter: PredictionDrafter, context: list[int], k: int) -> str:
    return drafter.tokenizer.decode(drive(drafter.propose(context, k)).tokens.tolist())


def test_it_drafts_the_prediction_from_the_start_and_follows_the_output():
    drafter, prompt = drafter_for("Rename area to disc_area.\n", PREDICTED)
    offer = drafter.offers(prompt)[0]
    # Not followed yet: its acceptance is kept apart, and it drafts no long blocks.
    assert (offer.source, offer.limit, offer.key, offer.grounded) == (
        PREDICTION,
        len(PREDICTED),
        "prediction:found",
        False,
    )
    assert offer.cost_hint == 0.0
    assert draft_text(drafter, prompt, 8) == "def area"
    context = prompt + drafter.tokenizer.encode("def ar", add_special_tokens=False)
    assert draft_text(drafter, context, 6) == "ea(rad"
    offer = drafter.offers(context)[0]  # followed: grounded
    assert (offer.key, offer.grounded, offer.limit) == (PREDICTION, True, len(PREDICTED) - 6)
    assert drive(drafter.propose(context, 3)).probs is None  # a point mass


def test_it_offers_nothing_while_lost_and_resyncs_on_the_last_output_tokens():
    tok = tiny_tokenizer()
    drafter, prompt = drafter_for("edit:\n", PREDICTED, tok)
    # The output renames the function: off the prediction after "def ".
    context = prompt + tok.encode("def disc_", add_special_tokens=False)
    assert drafter.offers(context) == ()
    # Three more tokens that occur in the prediction ("are"): it finds its place after them.
    context += tok.encode("are", add_special_tokens=False)
    assert draft_text(drafter, context, 10) == "a(radius):"


def test_it_looks_forward_from_its_place_first():
    tok = tiny_tokenizer()
    text = "x = 1\ny = 2\nx = 1\nz = 3\n"
    drafter, prompt = drafter_for(">", text, tok)
    # Followed up to "y = 2\n", then it leaves: "q" replaces the second "x", and " = 1" follows.
    context = prompt + tok.encode("x = 1\ny = 2\nq = 1", add_special_tokens=False)
    # " = 1" occurs twice; the occurrence after its old place is the one that continues.
    assert draft_text(drafter, context, 6) == "\nz = 3"


def test_a_change_inside_a_token_resyncs_on_the_text():
    # With merges, the prediction's "cd" is one token; the output writes "c" and "d" as two.
    tok = tiny_tokenizer(merges=[("c", "d"), ("a", "b"), ("ab", "cd")])
    text = "0123456789 abcd-tail of the file\n"
    drafter, prompt = drafter_for(">", text, tok)
    written = tok.encode("0123456789 ", add_special_tokens=False) + [tok.get_vocab()["ab"], tok.get_vocab()["c"]]
    context = prompt + written
    assert tok.decode(written).endswith(" abc")
    # No three of the output's last tokens occur in the prediction's (it holds "abcd", one
    # token), but its last 12 characters do, and end inside "abcd": the rest of that token
    # is proposed first, then the prediction's own tokens.
    assert draft_text(drafter, context, 6) == "d-tail"


def test_token_offsets_map_characters_to_tokens():
    tok = tiny_tokenizer(merges=[("a", "b")])
    ids = tok.encode("ab é", add_special_tokens=False)  # "ab", " ", and é as two byte tokens
    text, offsets = token_offsets(tok, ids)
    assert text == "ab é"
    assert offsets == {0: 0, 2: 1, 3: 2, 4: 4}  # no boundary inside é


def test_without_a_prediction_the_drafter_is_unchanged():
    ngram = NGramDrafter()
    assert with_prediction(ngram, None, None) is ngram
    assert with_prediction(None, None, None) is None
    both = with_prediction(ngram, tiny_tokenizer(), "x")
    assert isinstance(both, Sources) and isinstance(both.drafters[0], PredictionDrafter)
    with pytest.raises(ValueError, match="tokenizer"):
        with_prediction(ngram, None, "x")


def _plain(tiny_target, prompt: str, n: int) -> list[int]:
    return autoregressive(tiny_target).generate(prompt, GenerationConfig(max_new_tokens=n)).tokens


def _engine(tiny_target, drafter=None) -> SpeculativeEngine:
    return SpeculativeEngine(LocalTarget(tiny_target), drafter, tokenizer=tiny_target.tokenizer)


def _scripted(text: str, drafter=None) -> tuple[SpeculativeEngine, list[int]]:
    tokenizer = tiny_tokenizer()
    script = tokenizer.encode(text, add_special_tokens=False)
    return SpeculativeEngine(ScriptedTarget(script), drafter, tokenizer), script


def test_an_exact_prediction_is_accepted_whole():
    """Closed form: 20 tokens, blocks of 4 from the prediction, each block accepted with the
    target's bonus after it: 4 passes, 16 accepted prediction tokens, none rejected."""
    engine, script = _scripted(PREDICTED)
    result = engine.generate(">", GenerationConfig(max_new_tokens=20, draft=FIXED4, prediction=PREDICTED))
    assert result.tokens == script[:20]
    assert result.metrics.target_passes == 4
    assert result.metrics.prediction_tokens(PREDICTION) == (16, 0)
    assert all(e.source == PREDICTION for e in result.events)


def test_a_changed_token_is_rejected_and_counted():
    """Closed form: the prediction's 8th character is wrong. Pass 1 accepts 4 and adds a
    bonus; pass 2 proposes characters 6-8 (4 of the budget of 9 are left, one of them for
    the target's own token), keeps 6 and 7 and corrects the 8th; one plain step ends it.
    6 accepted, 1 rejected."""
    engine, script = _scripted(PREDICTED, NGramDrafter())
    wrong = PREDICTED[:7] + "#" + PREDICTED[8:]
    result = engine.generate(">", GenerationConfig(max_new_tokens=9, draft=FIXED4, prediction=wrong))
    assert result.tokens == script[:9]
    assert result.metrics.prediction_tokens(PREDICTION) == (6, 1)
    assert [(e.source, e.n_accepted) for e in result.events] == [(PREDICTION, 4), (PREDICTION, 2), (None, 0)]


def test_an_edit_costs_a_few_plain_steps_then_the_prediction_resumes():
    """The output renames ``area``: the prediction is drafted up to the change, rejected
    there, and drafted again once three output tokens are back on it."""
    edited = PREDICTED.replace("area", "disc_area")
    engine, script = _scripted(edited)
    result = engine.generate(">", GenerationConfig(max_new_tokens=len(script), draft=FIXED4, prediction=PREDICTED))
    assert result.tokens == script
    accepted, rejected = result.metrics.prediction_tokens(PREDICTION)
    assert accepted >= len(script) - 30 and rejected <= 8


def test_an_unrelated_prediction_stops_being_drafted(tiny_target):
    """A wrong prediction costs no output and few passes: after a rejection or two the cost
    policy stops drafting from it (only its probes come back)."""
    plain = _plain(tiny_target, "Once upon", 64)
    config = GenerationConfig(max_new_tokens=64, prediction="SELECT name FROM users WHERE id = 1;\n" * 8)
    result = _engine(tiny_target).generate("Once upon", config)
    assert result.tokens == plain
    drafted = [e for e in result.events if e.source == PREDICTION]
    assert len(drafted) <= 4
    assert result.metrics.prediction_tokens(PREDICTION)[0] <= 2


def test_metrics_count_kept_tokens_by_source():
    metrics = GenerationMetrics()
    assert metrics.prediction_tokens(PREDICTION) == (0, 0)


def _outcome(offer: Offer, proposed: int, accepted: int) -> Outcome:
    return Outcome(
        Choice(offer, proposed), n_proposed=proposed, n_accepted=accepted, draft_seconds=0.0, verify_seconds=0.01
    )


def test_a_grounded_source_earns_long_blocks_by_its_run():
    policy = CostAwareK(DraftConfig(k_max=12, k_long=48))
    grounded = Offer(PREDICTION, key=PREDICTION, cost_hint=0.0, grounded=True)
    other = Offer("ngram", key="ngram:2", cost_hint=0.0)
    assert policy.longest(grounded) == 12  # no run yet
    policy.update(_outcome(grounded, 12, 12))
    policy.update(_outcome(grounded, 8, 8))
    assert policy.longest(grounded) == 40  # 20 in a row
    assert policy.longest(other) == 12  # never past k_max: not grounded
    policy.update(_outcome(grounded, 40, 40))
    assert policy.longest(grounded) == 48  # capped at k_long
    assert policy.longest(Offer(PREDICTION, limit=30, key=PREDICTION, grounded=True)) == 30  # and at what it has
    policy.update(_outcome(grounded, 48, 5))  # a rejection: the run starts again
    assert policy.longest(grounded) == 12


def test_a_long_block_pays_only_where_the_curve_makes_it_cheap():
    """With a measured curve where 64 rows cost 10x one row, a source right 99 times in 100
    with a long run drafts long; at 80 in 100 it drafts far less."""
    policy = CostAwareK(DraftConfig(k_max=12, k_long=48))
    for rows, seconds in {1: 0.029, 2: 0.051, 4: 0.094, 8: 0.182, 13: 0.195, 16: 0.199, 32: 0.358, 49: 0.5}.items():
        policy.profile.pass_times.add(rows, seconds)
    grounded = Offer(PREDICTION, key=PREDICTION, cost_hint=0.0, grounded=True)
    counts = policy.acceptance(PREDICTION)
    policy._runs[PREDICTION] = 40
    counts.tried, counts.kept = [100.0] * 12, [99.0] * 12
    sure = policy.choose([grounded], remaining=500)
    counts.tried, counts.kept = [100.0] * 12, [80.0] * 12
    doubtful = policy.choose([grounded], remaining=500)
    assert sure.k >= 15 and doubtful.k < sure.k


def test_the_other_drafter_drafts_only_where_the_output_left_the_prediction():
    tok = tiny_tokenizer()
    prompt = tok.encode("xyz xyz ", add_special_tokens=False)
    both = with_prediction(NGramDrafter(), tok, PREDICTED)
    both.start(prompt, GenerationConfig(prediction=PREDICTED), None)
    assert [o.source for o in both.offers(prompt)] == [PREDICTION]
    off = prompt + tok.encode("xyz", add_special_tokens=False)  # not in the prediction; "xyz" repeats
    assert [o.source for o in both.offers(off)] == ["ngram"]
    assert drive(both.propose(off, 2, "ngram")).tokens.tolist() == tok.encode(" x", add_special_tokens=False)


def test_a_rename_is_carried_through_the_rest_of_the_prediction():
    tok = tiny_tokenizer()
    drafter, prompt = drafter_for("edit:\n", PREDICTED, tok)
    # The output replaces "area" by "zone", then is back on the prediction at "(ra".
    context = prompt + tok.encode("def zone(ra", add_special_tokens=False)
    assert draft_text(drafter, context, 4) == "dius"
    # The later use is drafted with the new name, not the old.
    context = prompt + tok.encode(
        PREDICTED.replace("area", "zone").split("print(")[0] + "print(", add_special_tokens=False
    )
    assert draft_text(drafter, context, 10) == "zone(2.0))"


def test_an_edit_that_is_not_a_rename_is_not_carried():
    tok = tiny_tokenizer()
    text = "x = 64\ny = f(64)\nz = 64\n"
    drafter, prompt = drafter_for(">", text, tok)
    context = prompt + tok.encode("x = 32\ny = f(", add_special_tokens=False)  # a changed number
    assert draft_text(drafter, context, 3) == "64)"
