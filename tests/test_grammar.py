"""Structured output: the grammar as a mask on verification and as a free drafter.

Layers: the mask in closed form; masked sampling against its exact law (chi-square, with a
control that fails without the mask); a grammar's masks, forced tokens and cuts on the tiny
byte tokenizer, worked by hand; greedy exactness against token-by-token constrained decoding
with every drafter; edges (bad schemas, a grammar that cannot finish).
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from draftwise import GenerationConfig, SpeculativeEngine, autoregressive, engine as engine_module
from draftwise.api.tools import CallStream, held_back, parse_tool_calls, tool_call_grammar
from draftwise.backends.tiny import tiny_tokenizer
from draftwise.config import DraftConfig, GrammarSpec, SamplingConfig
from draftwise.constrained import Constrained
from draftwise.constraint import REASON_CHARS, GrammarDeadEnd, GrammarError, llguidance_reason
from draftwise.drafters import ModelDrafter, NGramDrafter, Proposal, build_drafter
from draftwise.events import GRAMMAR
from draftwise.grammar import Grammars, grammars_of
from draftwise.lm import drive, ready
from draftwise.offers import PLAIN, Choice
from draftwise.target import LocalTarget
from draftwise.verify import TokenSource, apply_mask, masked_argmax, pack_bits, unpack_bits, verify, verify_sampling
from grammar_support import LATE_DEAD_END, UNFINISHABLE, count_compiles, optional_properties

from stats_support import ALPHA, as_dist, chi2_pvalue

pytest.importorskip("llguidance")

# A bounded record: every answer a model can give under it ends within a few dozen tokens.
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "tag"],
    "additionalProperties": False,
}


def schema(value: dict) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", text=json.dumps(value))


def regex(pattern: str) -> GrammarSpec:
    return GrammarSpec(kind="regex", text=pattern)


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- the mask in closed form --------------------------------------------------------------------


def bits(*rows: list[bool]) -> torch.Tensor:
    return pack_bits(torch.tensor(rows))


def test_apply_mask_worked_example():
    masked = apply_mask(torch.tensor([[2.0, 5.0, 1.0]]), bits([True, False, True]))
    assert masked.tolist() == [[2.0, -math.inf, 1.0]]


def test_the_bitmask_holds_token_j_at_bit_j_mod_32_of_word_j_div_32():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 33]] = True
    allowed[1, 69] = True
    packed = pack_bits(allowed)
    assert packed.shape == (2, 3) and packed.dtype == torch.int32
    assert packed.tolist() == [[1, 2, 0], [0, 0, 1 << 5]]
    assert torch.equal(unpack_bits(packed, 70), allowed)
    assert not unpack_bits(packed, 100)[:, 70:].any()  # past the mask: not allowed


def test_masked_argmax_keeps_an_allowed_argmax_and_masks_the_other_rows():
    rows = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    mask = bits([True, True, False], [False, True, True], [True, True, False])
    assert masked_argmax(rows, mask).tolist() == [1, 2, 0]
    assert masked_argmax(rows, None).tolist() == [1, 0, 2]
    # A score row wider than the mask (padding ids): its argmax there is not allowed.
    assert masked_argmax(torch.tensor([[1.0, 0.0, 9.0]]), bits([True, True])).tolist() == [0]


def test_greedy_verification_takes_the_argmax_under_the_mask():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    mask = bits([True, False, True, True], [False, True, True, True], [True, True, True, True])
    # Unmasked the argmax is 1, 0, 3; masked it is 3, 2, 3.
    verdict, _ = verify(torch.tensor([3, 1]), None, logits, 0.0, 0, 1.0, None, mask)
    assert (verdict.n_accepted, verdict.next_token) == (1, 2)
    verdict, _ = verify(torch.tensor([3, 2]), None, logits, 0.0, 0, 1.0, None, mask)
    assert (verdict.n_accepted, verdict.next_token) == (2, 3)
    unmasked, _ = verify(torch.tensor([3, 2]), None, logits, 0.0, 0, 1.0, None)
    assert (unmasked.n_accepted, unmasked.next_token) == (0, 1)


# --- masked sampling: the law of token-by-token masked sampling ----------------------------------

P = torch.tensor([0.30, 0.25, 0.05, 0.40])
ALLOWED = torch.tensor([True, False, True, True])
Q = torch.tensor([0.50, 0.00, 0.25, 0.25])  # a draft that proposes allowed tokens only
N = 8_000


def first_token(mask: torch.Tensor | None, point_mass: bool, generator: torch.Generator) -> int:
    """One verification of a one-token draft; the first token it emits."""
    if point_mass:
        draft, q = torch.tensor([3]), None
    else:
        draft, q = torch.multinomial(Q, 1, generator=generator), Q[None]
    logits = P.log()[None].expand(2, -1)
    rows = None if mask is None else pack_bits(mask[None].expand(2, -1))
    verdict, _ = verify(draft, q, logits, 1.0, 0, 1.0, generator, rows)
    return int(draft[0]) if verdict.n_accepted else verdict.next_token


@pytest.mark.parametrize("point_mass", [False, True])
def test_masked_verification_samples_the_masked_distribution(point_mass):
    generator = torch.Generator().manual_seed(7)
    counts = Counter(first_token(ALLOWED, point_mass, generator) for _ in range(N))
    assert chi2_pvalue(counts, as_dist(P * ALLOWED / (P * ALLOWED).sum())) > ALPHA


def test_the_same_check_fails_without_the_mask():
    """Control: unmasked verification emits forbidden token 1 a quarter of the time; the test
    above would see it."""
    generator = torch.Generator().manual_seed(7)
    counts = Counter(first_token(None, False, generator) for _ in range(N))
    assert chi2_pvalue(counts, as_dist(P * ALLOWED / (P * ALLOWED).sum())) < ALPHA


# A draft model that puts half its mass on forbidden token 1: the grammar cuts its draft there.
Q_ASTRAY = torch.tensor([0.20, 0.50, 0.10, 0.20])


class Refuses:
    """What ``Constrained`` asks of a grammar while it cuts a draft: token 1 is refused."""

    def forced(self) -> list[int]:
        return []

    def cut(self, tokens, after=()) -> int:
        return next((i for i, token in enumerate(tokens) if not ALLOWED[token]), len(tokens))


class DrawsAstray:
    """A draft model's one-token block, drawn from ``Q_ASTRAY``."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def propose(self, context, k, source=None):
        drawn = torch.multinomial(Q_ASTRAY, 1, generator=self.generator)
        return ready(Proposal(tokens=drawn, probs=Q_ASTRAY[None], source="model"))


def first_token_after_a_cut(generator: torch.Generator, keep_refused: bool = True) -> int:
    """A draft model's block under the grammar (cut at a refused token), verified; the first
    token it emits."""
    proposal = drive(Constrained(DrawsAstray(generator), Refuses()).propose([0], 1))
    k = len(proposal)
    logits = P.log()[None].expand(k + 1, -1)
    rows = pack_bits(ALLOWED[None].expand(k + 1, -1))
    refused = proposal.refused if keep_refused else None
    verdict, _ = verify(proposal.tokens, proposal.probs, logits, 1.0, 0, 1.0, generator, rows, refused)
    return int(proposal.tokens[0]) if verdict.n_accepted else verdict.next_token


def test_a_draft_cut_at_a_refused_token_still_samples_the_masked_distribution():
    # Issue 58: half the draws are token 1, cut; the token then comes from max(0, p - q).
    generator = torch.Generator().manual_seed(11)
    counts = Counter(first_token_after_a_cut(generator) for _ in range(N))
    assert chi2_pvalue(counts, as_dist(P * ALLOWED / (P * ALLOWED).sum())) > ALPHA


def test_the_cut_row_drawn_from_p_is_another_law():
    """Control: drawn from the masked ``p`` after a cut (the refused row's ``q`` dropped), token 0
    comes out too often; the test above would see it."""
    generator = torch.Generator().manual_seed(11)
    counts = Counter(first_token_after_a_cut(generator, keep_refused=False) for _ in range(N))
    assert chi2_pvalue(counts, as_dist(P * ALLOWED / (P * ALLOWED).sum())) < ALPHA


def test_the_worked_example_of_a_cut_row_in_closed_form():
    # verify_sampling's docstring: masked p = [0.5, 0.5, 0], q = [0.5, 0, 0.5], the draft's
    # token 2 refused and cut: the correction comes from max(0, p - q) = [0, 0.5, 0].
    p = torch.tensor([[0.5, 0.5, 0.0]])
    verdict = verify_sampling(torch.empty(0, dtype=torch.long), None, p, None, torch.tensor([0.5, 0.0, 0.5]))
    assert (verdict.n_accepted, verdict.next_token, verdict.next_source) == (0, 1, TokenSource.CORRECTED)


# --- a grammar's masks, forced tokens and cuts, by hand -------------------------------------------


@pytest.fixture(scope="module")
def grammars(tiny_target):
    return grammars_of(tiny_target)


def allowed(row: torch.Tensor) -> set[int]:  # a bitmask row's allowed tokens
    return set(torch.nonzero(unpack_bits(row[None], 32 * row.shape[0])[0]).flatten().tolist())


def test_masks_forced_tokens_and_cuts_worked_by_hand(grammars, tiny_target):
    # The tiny tokenizer spells every byte as a token: "a(b|c)d" forces "a", then chooses.
    tok = tiny_target.tokenizer
    a, b, c, d = (ids(tok, ch)[0] for ch in "abcd")
    constraint = grammars.constraint(regex("a(b|c)d"))
    assert constraint.forced() == [a]
    rows = constraint.masks([a])
    assert rows.shape == (2, (tiny_target.vocab_size + 31) // 32)
    assert allowed(rows[0]) == {a} and allowed(rows[1]) == {b, c}
    assert constraint.masks([]).shape[0] == 1  # walked and rolled back: nothing committed
    constraint.commit([a])
    assert constraint.forced() == []  # a choice: b or c
    assert constraint.cut([b, d, a]) == 2 and constraint.cut([d]) == 0
    constraint.commit([c, d])
    assert constraint.finished
    assert allowed(constraint.masks([])[0]) == set(tiny_target.eos_token_ids)


def test_masks_past_a_refused_token_allow_nothing_and_leave_the_grammar_whole(grammars, tiny_target):
    a, b, c, d = (ids(tiny_target.tokenizer, ch)[0] for ch in "abcd")
    constraint = grammars.constraint(regex("a(b|c)d"))
    rows = constraint.masks([a, d, b])  # d is refused after a
    assert [allowed(r) for r in rows] == [{a}, {b, c}, set(), set()]
    constraint.commit([a, c])  # the walk left nothing behind
    assert constraint.forced() == [d]


def test_a_block_that_completes_the_grammar_is_walked_back_whole(grammars, tiny_target):
    # The matcher stops once "a c d" completes the grammar, and takes the end token after
    # that without keeping it: walked back by the block's length, it would lose "a" too, and
    # refuse the "b" the target samples instead of the drafted "c".
    a, b, c, d = (ids(tiny_target.tokenizer, ch)[0] for ch in "abcd")
    eos = tiny_target.eos_token_ids[0]
    constraint = grammars.constraint(regex("a(b|c)d"))
    constraint.commit([a])
    rows = constraint.masks([c, d, eos])
    assert [allowed(r) for r in rows[:3]] == [{b, c}, {d}, {eos}]
    assert constraint.cut([c, d, eos]) == 3
    constraint.commit([b])
    assert constraint.forced() == [d]


def test_a_grammar_is_compiled_once_and_each_stream_gets_its_own_state(tiny_target, monkeypatch):
    built = count_compiles(monkeypatch)
    grammars = grammars_of(tiny_target)  # a fresh table: nothing compiled yet
    a, b, d = (ids(tiny_target.tokenizer, ch)[0] for ch in "abd")
    grammars.check(regex("a(b|c)d"))  # the request's check compiles it
    first, second = grammars.constraint(regex("a(b|c)d")), grammars.constraint(regex("a(b|c)d"))
    grammars.check(regex("a(b|c)d"))
    assert len(built) == 1
    first.commit([a, b])  # one stream's progress is not the other's
    assert first.forced() == [d] and second.forced() == [a]
    grammars.constraint(regex("x"))
    assert len(built) == 2


def test_json_is_written_compactly_with_spaces_after_separators(grammars, tiny_target):
    # The layout that leaves the model no choice of white space: the keys come forced.
    constraint = grammars.constraint(
        schema({"type": "object", "properties": {"ab": {"type": "integer"}}, "required": ["ab"]})
    )
    forced = tiny_target.tokenizer.decode(constraint.forced())
    assert forced == '{"ab": '


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (schema({"type": "strin"}), "invalid JSON schema"),
        (GrammarSpec(kind="json_schema", text="{not json"), "not JSON"),
        (GrammarSpec(kind="lark", text="start: ("), "invalid Lark grammar"),
        (GrammarSpec(kind="gbnf", text="root ::= ("), "GBNF"),
    ],
)
def test_a_bad_grammar_is_one_line_naming_the_problem(grammars, spec, fragment):
    with pytest.raises(GrammarError) as caught:
        grammars.constraint(spec)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


# --- greedy exactness: identical to token-by-token constrained decoding --------------------------


def speculative(target, draft, drafter: str) -> SpeculativeEngine:
    grammars = grammars_of(target)
    return SpeculativeEngine(LocalTarget(target), build_drafter(drafter, draft), target.tokenizer, grammars=grammars)


@pytest.mark.parametrize("drafter", ["ngram", "model", "hybrid"])
@pytest.mark.parametrize("prompt", ["Give me a record: ", "name age ok tag red green blue {"])
def test_greedy_output_is_token_by_token_constrained_decoding(tiny_target, tiny_near_draft, drafter, prompt):
    config = GenerationConfig(max_new_tokens=80, grammar=schema(RECORD))
    plain = autoregressive(tiny_target).generate(prompt, config)
    fast = speculative(tiny_target, tiny_near_draft, drafter).generate(prompt, config)
    assert fast.tokens == plain.tokens
    assert plain.metrics.finish_reason == "eos"
    record = json.loads(fast.text.removesuffix("<|eos|>"))
    assert set(record) == {"name", "age", "ok", "tag"} and record["tag"] in ("red", "green", "blue")
    assert fast.metrics.proposed_by_source.get(GRAMMAR, 0) > 0  # the keys were drafted, free
    assert GRAMMAR not in plain.metrics.proposed_by_source  # plain decoding drafts nothing


def test_sampled_output_follows_the_schema(tiny_target, tiny_near_draft):
    for seed in range(4):
        config = GenerationConfig(
            max_new_tokens=80, grammar=schema(RECORD), sampling=SamplingConfig(temperature=1.0, seed=seed)
        )
        result = speculative(tiny_target, tiny_near_draft, "hybrid").generate("A record: ", config)
        assert result.metrics.finish_reason == "eos"
        assert json.loads(result.text.removesuffix("<|eos|>"))["tag"] in ("red", "green", "blue")


def test_other_sources_drafts_are_cut_at_the_first_forbidden_token(tiny_target):
    # The prompt repeats "x": the n-gram drafter proposes it; the grammar allows only digits.
    engine = SpeculativeEngine(
        LocalTarget(tiny_target), NGramDrafter(), tiny_target.tokenizer, grammars=grammars_of(tiny_target)
    )
    config = GenerationConfig(max_new_tokens=12, grammar=regex("[0-9]{12}"), draft=DraftConfig(k_policy="fixed", k=4))
    result = engine.generate("xxxxxxxx", config)
    assert all(ch.isdigit() for ch in result.text)
    assert result.events[0].proposed == []  # "x x x x", cut to nothing
    proposed = [t for event in result.events for t in event.proposed]
    assert all(tiny_target.tokenizer.decode([t]).isdigit() for t in proposed)


def test_a_block_goes_on_past_the_forced_text_with_another_sources_draft(grammars, tiny_target):
    # "ab" is forced; the n-gram drafter, asked about the context as it will be after "ab",
    # finds "ab12x" in the prompt and offers "12x...", cut at "x", which the grammar forbids.
    tok = tiny_target.tokenizer
    a, b, one, two = (ids(tok, ch)[0] for ch in "ab12")
    drafter = Constrained(NGramDrafter(), grammars.constraint(regex("ab[0-9]+")))
    prompt = ids(tok, "ab12x")
    drafter.start(prompt, GenerationConfig(), None)
    forced, mixed = drafter.offers(prompt)
    assert (forced.source, forced.limit, forced.sure) == (GRAMMAR, 2, 2)
    assert (mixed.source, mixed.sure, mixed.limit) == ("grammar+ngram", 2, 2 + 5)
    proposal = drive(drafter.propose(prompt, 6, mixed.source))
    assert proposal.tokens.tolist() == [a, b, one, two]
    assert (proposal.source, proposal.forced) == ("ngram", 2)
    assert drive(drafter.propose(prompt, 2, mixed.source)).tokens.tolist() == [a, b]  # the forced part only


def test_a_mixed_block_gives_forced_tokens_a_point_mass_beside_the_model(grammars, tiny_target, tiny_near_draft):
    tok = tiny_target.tokenizer
    drafter = Constrained(ModelDrafter(tiny_near_draft), grammars.constraint(regex("ab[0-9]+")))
    config = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=0))
    prompt = ids(tok, "digits: ")
    drafter.start(prompt, config, torch.Generator().manual_seed(0))
    mixed = [offer for offer in drafter.offers(prompt) if offer.source == "grammar+model"]
    proposal = drive(drafter.propose(prompt, 5, mixed[0].source))
    assert proposal.probs is not None and proposal.probs.shape[0] == len(proposal) >= 2
    assert proposal.token_probs()[:2] == [1.0, 1.0]  # "a", "b": the only tokens allowed
    assert proposal.probs[:2].sum(dim=1).tolist() == [1.0, 1.0]
    assert proposal.tokens[:2].tolist() == ids(tok, "ab")


class _MixedFirst:
    """A draft policy that always drafts the longest block past the forced text it is offered."""

    weighed = ()

    def choose(self, offers, remaining):
        mixed = [offer for offer in offers if offer.source.startswith("grammar+")]
        offer = mixed[0] if mixed else (offers[0] if offers else None)
        return Choice(offer, offer.sure + 6) if offer is not None else PLAIN

    def update(self, outcome):
        pass


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_blocks_past_the_forced_text_keep_greedy_output_exact(tiny_target, tiny_near_draft, drafter, monkeypatch):
    # The prompt holds a record, so the n-gram drafter has something to copy after each key.
    monkeypatch.setattr(engine_module, "make_policy", lambda config, profile=None: _MixedFirst())
    prompt = 'name age ok tag red green blue {"name": "ab", "age": 12, "ok": true, "tag": "red"} {'
    config = GenerationConfig(max_new_tokens=80, grammar=schema(RECORD))
    plain = autoregressive(tiny_target).generate(prompt, config)
    fast = speculative(tiny_target, tiny_near_draft, drafter).generate(prompt, config)
    assert fast.tokens == plain.tokens
    mixed = [event for event in fast.events if event.forced and len(event.proposed) > event.forced]
    assert mixed and {event.source for event in mixed} <= {"ngram", "model"}
    assert fast.metrics.proposed_by_source[GRAMMAR] == sum(event.forced for event in fast.events)


def test_a_grammar_that_cannot_finish_ends_at_the_length_limit(tiny_target):
    config = GenerationConfig(max_new_tokens=5, grammar=schema(RECORD))
    result = autoregressive(tiny_target).generate("A record: ", config)
    assert result.metrics.finish_reason == "length" and result.text == '{"nam'  # one byte a token


# --- what llguidance cannot follow: refused at the check, or an error mid-answer -------------------


def assert_short(message: str) -> None:
    assert "\n" not in message and len(message) < 100 + REASON_CHARS, message
    assert "<state>" not in message and "backtrace" not in message and "panic" not in message


@pytest.fixture(scope="module")
def merged_grammars():
    """Grammars over a vocabulary with a token that runs past a forced ``{`` (``{"``, as real
    vocabularies have): llguidance forces no token at the start of an object there."""
    tok = tiny_tokenizer(merges=[("{", '"')])
    return Grammars(tok, len(tok), [tok.eos_token_id])


VOCABULARIES = ["grammars", "merged_grammars"]


@pytest.mark.parametrize("vocabulary", VOCABULARIES)
def test_a_schema_over_llguidances_row_limit_is_refused_at_the_check(request, vocabulary):
    grammars = request.getfixturevalue(vocabulary)
    with pytest.raises(GrammarError) as caught:
        grammars.check(schema(optional_properties(3000)))
    assert "JSON schema cannot be followed: too many alternatives at one point" in str(caught.value)
    assert_short(str(caught.value))
    grammars.check(schema(optional_properties(100)))  # well under the limit: fine
    grammars.check(schema(LATE_DEAD_END))  # a choice comes first: the check stops there


@pytest.mark.parametrize("vocabulary", VOCABULARIES)
@pytest.mark.parametrize("name", sorted(UNFINISHABLE))
def test_a_schema_no_answer_can_finish_is_refused_at_the_check(request, vocabulary, name):
    grammars = request.getfixturevalue(vocabulary)
    with pytest.raises(GrammarError) as caught:
        grammars.check(schema(UNFINISHABLE[name]))
    assert "cannot be followed" in str(caught.value)
    assert_short(str(caught.value))


@pytest.mark.parametrize("name", sorted(UNFINISHABLE))
def test_an_unfinishable_schema_never_ends_in_a_normal_stop(tiny_target, name):
    """Before the check walked its first steps, each gave ``{"`` or nothing, finish reason eos."""
    config = GenerationConfig(max_new_tokens=40, grammar=schema(UNFINISHABLE[name]))
    with pytest.raises(GrammarError, match="cannot be followed"):
        autoregressive(tiny_target).generate("A record: ", config)


@pytest.mark.parametrize("drafter", ["off", "ngram"])
def test_a_dead_end_mid_answer_is_an_error_not_a_stop(tiny_target, grammars, drafter):
    grammars.check(schema(LATE_DEAD_END))  # the check sees only the choice of "a" or "b"
    engine = speculative(tiny_target, None, drafter) if drafter != "off" else autoregressive(tiny_target)
    events = []
    with pytest.raises(GrammarDeadEnd) as caught:
        for event in engine.stream("A record: ", GenerationConfig(max_new_tokens=60, grammar=schema(LATE_DEAD_END))):
            events.append(event)
    assert "JSON schema cannot go past: too many alternatives" in str(caught.value)
    assert_short(str(caught.value))
    assert caught.value.status == 400  # the request's own schema fails, not the server
    text = "".join(event.text for event in events)
    assert text.startswith('{"k": "') and not any(event.finished for event in events)


def test_a_dead_end_is_seen_where_the_matcher_fails_however_it_is_reached(grammars, tiny_target):
    tok = tiny_target.tokenizer
    constraint = grammars.constraint(schema(LATE_DEAD_END))
    constraint.commit(constraint.forced() + ids(tok, 'a", "o": '))
    with pytest.raises(GrammarDeadEnd):
        constraint.commit(ids(tok, "{"))
    with pytest.raises(GrammarDeadEnd):  # once broken, every later use says so
        constraint.masks([])
    walked = grammars.constraint(schema(LATE_DEAD_END))
    walked.commit(walked.forced())
    with pytest.raises(GrammarDeadEnd):  # a drafted block that walks into the limit
        walked.masks(ids(tok, 'a", "o": {'))


def test_a_failed_compile_is_kept_and_a_panic_is_one_short_line(tiny_target, monkeypatch):
    """12,000 properties: 3 to 4 s of compile, then an assertion inside llguidance (a Rust panic
    with its backtrace). The message is one line, and a second request pays no compile."""
    built = count_compiles(monkeypatch)
    grammars = grammars_of(tiny_target)
    messages = []
    for _ in range(2):
        with pytest.raises(GrammarError) as caught:
            grammars.check(schema(optional_properties(12_000)))
        messages.append(str(caught.value))
    assert len(built) == 1 and messages[0] == messages[1]
    assert messages[0].startswith("invalid JSON schema: llguidance failed on it")
    assert_short(messages[0])


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (
            "Parser Error: Current row has 12007 items; max is 2000; consider making your grammar "
            "left-recursive if it's right-recursive\n<state>\n" + "x" * 100_000,
            "too many alternatives at one point (12007 parser items, the limit is 2000), as with many optional "
            "properties",
        ),
        ("panic: assertion failed: n < u16::MAX\n<backtrace>\n   0: <unknown>\n", "llguidance failed on it"),
        ("NoExtensionBias\n<state>\nTokens: ⟦⟧", "no text can complete it"),
        ("lexer error: too many expressions constructed\n<non-verbose/>", "lexer error: too many expressions"),
        ("y" * 5000, "y" * (REASON_CHARS - 1) + "…"),
        ("", "llguidance gave no reason"),
    ],
)
def test_llguidances_message_is_cut_to_its_first_meaningful_line(message, reason):
    assert llguidance_reason(message).startswith(reason)
    assert len(llguidance_reason(message)) <= REASON_CHARS


# --- tool calls: a grammar with a trigger, and the answer read back ---------------------------------


def test_a_triggered_grammar_is_free_text_until_its_opening(grammars, tiny_target):
    tok = tiny_target.tokenizer
    constraint = grammars.constraint(GrammarSpec(kind="regex", text="<t>[0-9]{2}", trigger="<t>"))
    a, opening, one = ids(tok, "a"), ids(tok, "<t>"), ids(tok, "1")
    assert constraint.masks(a) is None and constraint.forced() == []  # free text: no mask at all
    assert constraint.cut(a + opening + one + a) == 5  # the "a" after the opening is cut
    rows = constraint.masks(a + opening + one)
    digits = {ids(tok, str(n))[0] for n in range(10)}
    assert [allowed(r) == digits for r in rows] == [False] * 4 + [True, True]
    constraint.commit(a + opening[:2])  # the opening may come over two steps
    assert not constraint.active
    constraint.commit(opening[2:] + one)
    assert constraint.active and allowed(constraint.masks([])[0]) == digits


def test_a_trigger_written_in_other_tokens_than_the_tokenizers_still_starts_the_grammar():
    """A model may write the opening tag in tokens of its own choosing (SmolLM2: " <" then
    "tool", ...): the trigger is found in the text, so the call that follows is constrained."""
    tok = tiny_tokenizer(merges=[(" ", "<")])
    grammars = Grammars(tok, len(tok), [tok.eos_token_id])
    constraint = grammars.constraint(GrammarSpec(kind="regex", text="<t>[0-9]{2}", trigger="<t>"))
    space_open = ids(tok, " <")
    assert len(space_open) == 1 and ids(tok, "<t>")[0] != space_open[0]  # not the tokenizer's "<"
    a, one, digits = ids(tok, "a"), ids(tok, "1"), {ids(tok, str(n))[0] for n in range(10)}
    block = a + space_open + ids(tok, "t>") + one
    assert [allowed(r) == digits for r in constraint.masks(block)] == [False] * 4 + [True, True]
    assert constraint.cut(block + a) == len(block)  # the "a" after the first digit is cut
    constraint.commit(block)
    assert constraint.active and allowed(constraint.masks([])[0]) == digits


def test_a_trigger_spread_over_many_commits_starts_the_grammar(grammars, tiny_target):
    tok = tiny_target.tokenizer
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    constraint = grammars.constraint(tool_call_grammar([("f", schema)], parallel=False, required=False))
    for token in ids(tok, "Hi <tool_call>"):  # one byte a commit: the tag's start is kept across them
        assert not constraint.active
        constraint.commit([token])
    assert constraint.active
    assert tok.decode(constraint.forced()) == '\n{"name": "f", "arguments": {"x": '


def test_tool_calls_are_forced_up_to_the_first_argument_and_read_back(grammars, tiny_target):
    weather = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    spec = tool_call_grammar([("get_weather", weather)], parallel=True, required=True)
    forced = tiny_target.tokenizer.decode(grammars.constraint(spec).forced())
    assert forced == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
    first, second = '{"name": "a", "arguments": {"x": 1}}', '{"name": "b"}'
    text = f"Sure.\n<tool_call>\n{first}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>"
    assert parse_tool_calls(text) == ("Sure.\n", [("a", '{"x": 1}'), ("b", "{}")])
    assert parse_tool_calls("<tool_call>\n{broken\n</tool_call>") == ("<tool_call>\n{broken\n</tool_call>", [])


def test_one_tool_call_ends_the_answer_unless_calls_may_be_parallel(grammars, tiny_target):
    tok = tiny_target.tokenizer
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    call = ids(tok, '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    one = grammars.constraint(tool_call_grammar([("f", schema)], parallel=False, required=True))
    one.commit(call)
    assert allowed(one.masks([])[0]) == set(tiny_target.eos_token_ids)  # nothing but the end
    several = grammars.constraint(tool_call_grammar([("f", schema)], parallel=True, required=True))
    several.commit(call)
    assert ids(tok, "\n")[0] in allowed(several.masks([])[0])  # another call may follow


@pytest.mark.parametrize(
    ("text", "end"), [("plain", 5), ("then <tool", 5), ("x<tool_call>\n{", 1), ("<", 0), ("a < b", 5)]
)
def test_streamed_text_stops_where_a_tool_call_may_open(text, end):
    assert held_back(text) == end


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_streamed_answer_gives_its_content_then_each_call_as_it_goes(step):
    first, second = '{"name": "f", "arguments": {"a": 1, "b": {"c": "}"}}}', '{"name": "g", "arguments": {}}'
    text = f"Hi <tool_call>\n{first}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>"
    reader = CallStream()
    pieces = [p for i in range(0, len(text), step) for p in reader.push(text[i : i + step])] + reader.flush()
    content, calls = "", []
    for kind, value in pieces:
        if kind == "content":
            content += value
        elif kind == "call":
            calls.append([value, ""])
        else:
            calls[-1][1] += value
    assert content == "Hi " and calls == [["f", '{"a": 1, "b": {"c": "}"}}'], ["g", "{}"]]
    assert calls == [[n, a] for n, a in parse_tool_calls(text)[1]]  # as the whole answer reads


def test_a_stream_cut_inside_a_call_flushes_what_it_held():
    reader = CallStream()
    assert reader.push('<tool_call>\n{"name": "f", "arguments": {"a": [1}') == [
        ("call", "f"),
        ("arguments", '{"a": [1'),
    ]
    assert reader.flush() == [("arguments", "}")]
    plain = CallStream()
    assert plain.push("a <tool") == [("content", "a ")] and plain.flush() == [("content", "<tool")]
