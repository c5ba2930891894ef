"""The decode loop: greedy exactness, stops and budgets, events and metrics, seeds, and the
rollback of the KV cache it relies on."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
import torch

from draftwise import (
    DraftConfig,
    GenerationConfig,
    HybridDrafter,
    ModelDrafter,
    NGramDrafter,
    Proposal,
    SamplingConfig,
    SpeculativeEngine,
    StepEvent,
    TokenSource,
    autoregressive,
)
from draftwise.backends.tiny import tiny_tokenizer
from draftwise.drafters import EMPTY_PROPOSAL
from draftwise.lm import drive, prefill, sync
from draftwise.offers import Offer
from draftwise.stopping import TextStream
from draftwise.target import LocalTarget
from scripted_support import ScriptedTarget

PROMPT = "The cat sat on the mat. The cat sat on the"
N = 40


def config(max_new_tokens: int = N, *, sampling: dict | None = None, **draft) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        sampling=SamplingConfig(**(sampling or {})),
        draft=DraftConfig(**draft),
    )


@pytest.fixture(scope="module")
def baseline(tiny_target) -> list[int]:
    """The target's own greedy continuation of PROMPT (EOS ignored so many passes happen)."""
    return autoregressive(tiny_target).generate(PROMPT, config()).tokens


def make_drafter(request, name: str):
    if name == "ngram":
        return NGramDrafter()
    if name == "hybrid":
        return HybridDrafter(ModelDrafter(request.getfixturevalue("tiny_near_draft")))
    return request.getfixturevalue(f"tiny_{name}_draft")


# --- greedy exactness -------------------------------------------------------------------------

POLICIES = [
    {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.0},
    {"k_policy": "heuristic", "k": 2, "confidence_threshold": 0.0},
    {"k_policy": "cost", "confidence_threshold": 0.0},
    {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.6},
    {"k_policy": "cost", "k": 3, "k_max": 6, "confidence_threshold": 0.9},
]


@pytest.mark.parametrize("drafter", ["same", "random", "near", "ngram", "hybrid"])
@pytest.mark.parametrize("draft", POLICIES, ids=lambda d: "-".join(f"{v}" for v in d.values()))
def test_greedy_output_is_the_targets(request, tiny_target, baseline, drafter, draft):
    engine = SpeculativeEngine.from_models(tiny_target, make_drafter(request, drafter))
    result = engine.generate(PROMPT, config(**draft))
    assert result.tokens == baseline
    assert result.metrics.new_tokens == N


def test_each_step_says_which_arm_the_cost_policy_took_and_why(tiny_target, tiny_same_draft, baseline):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_same_draft)
    result = engine.generate(PROMPT, config(k_policy="cost"))
    assert result.tokens == baseline
    for event in result.events:
        taken, *others = event.arms
        assert taken[:2] == (event.source or "plain", event.k)  # the one taken first
        assert "plain" in [arm[0] for arm in event.arms] and all(rate >= 0 for _, _, rate in event.arms)
    fixed = SpeculativeEngine.from_models(tiny_target, tiny_same_draft).generate(PROMPT, config(k_policy="fixed"))
    assert all(event.arms == [] for event in fixed.events)  # a fixed rule weighs nothing


def test_greedy_same_draft_accepts_everything(tiny_target, tiny_same_draft, baseline):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_same_draft)
    result = engine.generate(PROMPT, config(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert result.tokens == baseline
    assert all(e.n_accepted == len(e.proposed) == 4 for e in result.events)
    assert result.metrics.mean_accepted_length == 5.0
    assert result.metrics.acceptance_rate == 1.0


def test_one_model_object_as_target_and_draft(tiny_target, baseline):
    # Both sides sync the shared cache to the context before use, so sharing stays exact.
    engine = SpeculativeEngine.from_models(tiny_target, tiny_target)
    result = engine.generate(PROMPT, config(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert result.tokens == baseline
    assert result.metrics.acceptance_rate == 1.0


def test_greedy_same_draft_last_step_is_clamped_to_the_budget(tiny_target, tiny_same_draft):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_same_draft)
    result = engine.generate(PROMPT, config(N + 2, k_policy="fixed", k=4, confidence_threshold=0.0))
    # 8 full blocks of 4 + bonus = 40 tokens; 2 left -> draft only 1, plus its bonus.
    assert [len(e.proposed) for e in result.events] == [4] * 8 + [1]
    assert all(e.n_accepted == len(e.proposed) for e in result.events)
    assert len(result.tokens) == N + 2
    assert result.metrics.finish_reason == "length"


def test_greedy_random_draft_is_almost_never_accepted(tiny_target, tiny_random_draft, baseline):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_random_draft)
    result = engine.generate(PROMPT, config(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert result.tokens == baseline
    assert result.metrics.acceptance_rate < 0.2
    assert result.metrics.target_passes > N * 0.8


def test_greedy_ngram_accepts_on_repetitive_text(tiny_target, baseline):
    engine = SpeculativeEngine.from_models(tiny_target, NGramDrafter())
    result = engine.generate(PROMPT, config(k_policy="fixed", k=4))
    assert result.tokens == baseline
    assert result.metrics.accepted > 0
    assert result.metrics.target_passes < N


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 6, 7, 11])
def test_budget_edges_with_a_perfect_draft(tiny_target, tiny_same_draft, baseline, max_new_tokens):
    engine = SpeculativeEngine.from_models(tiny_target, tiny_same_draft)
    result = engine.generate(PROMPT, config(max_new_tokens, k_policy="fixed", k=4, confidence_threshold=0.0))
    assert result.tokens == baseline[:max_new_tokens]
    assert result.metrics.finish_reason == "length"
    assert all(len(e.proposed) <= max_new_tokens - 1 for e in result.events)


def test_max_new_tokens_one_is_a_single_plain_step(tiny_target, tiny_same_draft, baseline):
    events = list(SpeculativeEngine.from_models(tiny_target, tiny_same_draft).stream(PROMPT, config(1)))
    assert len(events) == 1
    assert events[0].proposed == [] and events[0].tokens == baseline[:1]
    assert events[0].finished and events[0].finish_reason == "length"


def test_eos_inside_an_accepted_block_ends_the_output(tiny_target, tiny_same_draft, baseline):
    # Use the baseline's 7th token as "EOS": it lands inside the second accepted block.
    at = next(i for i in range(6, N) if baseline[i] not in baseline[:i])
    eos = baseline[at]
    cfg = config(k_policy="fixed", k=4, confidence_threshold=0.0).model_copy(
        update={"ignore_eos": False, "eos_token_ids": (eos,)}
    )
    result = SpeculativeEngine.from_models(tiny_target, tiny_same_draft).generate(PROMPT, cfg)
    assert result.tokens == baseline[: at + 1]
    assert result.metrics.finish_reason == "eos"
    assert result.events[-1].n_accepted > len(result.events[-1].tokens) - 1  # the block went on past EOS
    assert autoregressive(tiny_target).generate(PROMPT, cfg).tokens == result.tokens
    # ignore_eos wins over the override.
    cfg_ignore = cfg.model_copy(update={"ignore_eos": True})
    assert SpeculativeEngine.from_models(tiny_target, tiny_same_draft).generate(PROMPT, cfg_ignore).tokens == baseline


def test_default_eos_is_the_models(tiny_target):
    assert LocalTarget(tiny_target).eos_token_ids == (tiny_target.tokenizer.eos_token_id,)


def test_one_token_prompt(tiny_target, tiny_random_draft):
    cfg = config(12, k_policy="fixed", k=3, confidence_threshold=0.0)
    plain = autoregressive(tiny_target).generate([65], cfg).tokens
    assert SpeculativeEngine.from_models(tiny_target, tiny_random_draft).generate([65], cfg).tokens == plain
    assert SpeculativeEngine.from_models(tiny_target, NGramDrafter()).generate([65], cfg).tokens == plain
    assert len(plain) == 12


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_rejected(tiny_target, prompt):
    with pytest.raises(ValueError, match="empty"):
        autoregressive(tiny_target).generate(prompt, config(4))


def test_stop_string_spanning_two_tokens(tiny_target, tiny_same_draft, baseline):
    tokenizer = tiny_target.tokenizer
    pieces = [tokenizer.decode([t]) for t in baseline]
    j = next(i for i in range(3, N - 1) if all(p.isascii() and p.isalnum() for p in pieces[i : i + 2]))
    stop = pieces[j] + pieces[j + 1]
    full = tokenizer.decode(baseline)
    needed = next(n for n in range(1, N + 1) if stop in tokenizer.decode(baseline[:n]))
    cfg = config(k_policy="fixed", k=4, confidence_threshold=0.0).model_copy(update={"stop": (stop,)})
    for engine in (autoregressive(tiny_target), SpeculativeEngine.from_models(tiny_target, tiny_same_draft)):
        result = engine.generate(PROMPT, cfg)
        assert result.text == full[: full.index(stop)]
        assert stop not in result.text
        assert result.tokens == baseline[:needed]
        assert result.metrics.finish_reason == "stop"


def test_streamed_text_reassembles_to_the_full_decode(tiny_target, tiny_random_draft):
    # Random byte-level output is full of partial and invalid UTF-8: a hard case.
    engine = SpeculativeEngine.from_models(tiny_target, tiny_random_draft)
    result = engine.generate(PROMPT, config(120, k_policy="fixed", k=3, confidence_threshold=0.0))
    assert any(t >= 128 for t in result.tokens)
    assert result.text == tiny_target.tokenizer.decode(result.tokens, skip_special_tokens=True)


# --- a scripted target: the loop's stop logic, without model numerics -------------------------


class OracleDrafter:
    """Proposes the script itself, ``extra`` tokens more than asked for: every block is
    accepted and long, so stops land in the middle of accepted blocks."""

    def __init__(self, script: Sequence[int], extra: int = 3) -> None:
        self.script = list(script)
        self.extra = extra
        self._prompt_len = 0

    def start(self, prompt, config, generator) -> None:
        self._prompt_len = len(prompt)

    def offers(self, context) -> tuple[Offer, ...]:
        return (Offer("oracle"),)

    def propose(self, context, k: int, source: str | None = None):
        yield from ()  # no pass
        done = len(context) - self._prompt_len
        block = self.script[done : done + k + self.extra]
        return Proposal(tokens=torch.tensor(block, dtype=torch.long)) if block else EMPTY_PROPOSAL

    def observe(self, context, verdict) -> None:
        pass


TEXT = "héllo €uro 😀 and ñ!"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def scripted(tokenizer, text: str = TEXT, drafter: bool = True, tail: Sequence[int] = ()) -> SpeculativeEngine:
    script = tokenizer.encode(text) + list(tail)
    return SpeculativeEngine(ScriptedTarget(script), OracleDrafter(script) if drafter else None, tokenizer)


def run(engine: SpeculativeEngine, max_new_tokens: int = 64, k: int = 3, **update) -> list[StepEvent]:
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, draft=DraftConfig(k_policy="fixed", k=k)).model_copy(
        update=update
    )
    return list(engine.stream("x", cfg))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("drafter", [True, False])
def test_multibyte_text_streams_without_broken_characters(tokenizer, drafter, k):
    events = run(scripted(tokenizer, drafter=drafter), k=k)
    assert "".join(e.text for e in events) == TEXT
    assert not any("\ufffd" in e.text for e in events)
    assert events[-1].finish_reason == "eos"
    assert events[-1].tokens[-1] == 256


def test_budget_hit_inside_an_accepted_block(tokenizer):
    events = run(scripted(tokenizer), max_new_tokens=4, k=2)
    assert len(events) == 1 and len(events[0].proposed) == 5  # the oracle over-proposes
    assert events[0].tokens == tokenizer.encode(TEXT)[:4]
    assert events[0].finish_reason == "length"
    assert events[0].text == "hél"  # 4 bytes: h, é (2 bytes), l


def test_eos_inside_an_accepted_block(tokenizer):
    script_len = len(tokenizer.encode("héllo"))
    engine = scripted(tokenizer, "héllo", tail=[256] + tokenizer.encode(" more"))
    events = run(engine, k=8)
    tokens = [t for e in events for t in e.tokens]
    assert tokens == tokenizer.encode("héllo") + [256]
    assert "".join(e.text for e in events) == "héllo"
    assert events[-1].n_accepted == len(events[-1].proposed) > script_len + 1  # accepted past EOS
    assert events[-1].finish_reason == "eos"


def test_eos_override_and_ignore_eos(tokenizer):
    o = tokenizer.encode("o")[0]
    events = run(scripted(tokenizer), eos_token_ids=(o,))
    assert "".join(e.text for e in events) == "héllo"
    assert events[-1].finish_reason == "eos"
    events = run(scripted(tokenizer), max_new_tokens=40, ignore_eos=True)
    assert sum(len(e.tokens) for e in events) == 40  # ran on through the script's EOS
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("lo", "hél"), ("uro", "héllo €"), ("€u", "héllo "), ("😀", "héllo €uro "), ("!", "héllo €uro 😀 and ñ")],
)
@pytest.mark.parametrize("drafter", [True, False])
def test_stop_strings(tokenizer, stop, expected, drafter):
    events = run(scripted(tokenizer, drafter=drafter), stop=(stop,), k=4)
    text = "".join(e.text for e in events)
    assert text == expected
    assert stop not in text
    assert events[-1].finish_reason == "stop"
    tokens = [t for e in events for t in e.tokens]
    # Tokens run up to the one that completes the stop string, and no further.
    assert tokenizer.decode(tokens).endswith(stop)
    assert stop not in tokenizer.decode(tokens[:-1])


def test_earliest_of_several_stop_strings_wins(tokenizer):
    events = run(scripted(tokenizer), stop=("and", "€"), k=8)
    assert "".join(e.text for e in events) == "héllo "


def test_partial_stop_prefix_is_released_at_the_end(tokenizer):
    # "ñ!x" never completes: the held-back "ñ!" must come out when EOS arrives.
    events = run(scripted(tokenizer), stop=("!x",))
    assert "".join(e.text for e in events) == TEXT
    assert events[-1].finish_reason == "eos"


# --- events and metrics ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drafter", "sampling"),
    [
        ("near", None),
        ("random", {"temperature": 0.8, "seed": 3}),
        ("ngram", {"temperature": 1.0, "top_k": 5, "seed": 1}),
        ("same", None),
    ],
)
def test_events_and_metrics_agree(request, tiny_target, drafter, sampling):
    engine = SpeculativeEngine.from_models(tiny_target, make_drafter(request, drafter))
    result = engine.generate(PROMPT, config(37, sampling=sampling, k_policy="heuristic", k=2, confidence_threshold=0.0))
    events, m = result.events, result.metrics
    assert [e.step for e in events] == list(range(len(events)))
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    assert sum(len(e.tokens) for e in events) == len(result.tokens) == m.new_tokens == 37
    assert m.target_passes == len(events)
    assert m.proposed == sum(len(e.proposed) for e in events)
    assert m.accepted == sum(e.n_accepted for e in events)
    assert m.accepted_length_counts == Counter(e.n_accepted for e in events)
    longest = max(len(e.proposed) for e in events)
    assert m.proposed_at == [sum(len(e.proposed) > i for e in events) for i in range(longest)]
    assert m.accepted_at == [sum(e.n_accepted > i for e in events) for i in range(longest)]
    assert m.acceptance_by_position == [a / p for a, p in zip(m.accepted_at, m.proposed_at)]
    assert m.mean_accepted_length == pytest.approx(37 / len(events))
    for e in events:
        assert len(e.draft_probs) == len(e.target_probs) == len(e.proposed)
        assert all(0.0 <= x <= 1.0 for x in e.draft_probs + e.target_probs)
        assert len(e.sources) == len(e.tokens)
        full = e.proposed[: e.n_accepted] + [e.next_token]
        assert e.tokens == full[: len(e.tokens)]
        want = [TokenSource.ACCEPTED] * e.n_accepted
        want.append(TokenSource.BONUS if e.n_accepted == len(e.proposed) else TokenSource.CORRECTED)
        assert e.sources == want[: len(e.tokens)]
        assert min(e.draft_seconds, e.verify_seconds, e.other_seconds, e.prefill_seconds) >= 0.0
        assert e.step_seconds >= e.draft_seconds + e.verify_seconds
        json.dumps(e.to_dict())
    assert events[0].prefill_seconds > 0 and all(e.prefill_seconds == 0 for e in events[1:])
    data = json.loads(json.dumps(m.to_dict()))
    assert data["new_tokens"] == 37 and data["finish_reason"] == "length"
    assert sum(data["accepted_length_histogram"].values()) == len(events)
    assert data["total_seconds"] == pytest.approx(
        m.prefill_seconds + m.draft_seconds + m.verify_seconds + m.other_seconds
    )
    assert result.text == tiny_target.tokenizer.decode(result.tokens, skip_special_tokens=True)


def test_baseline_events_propose_nothing(tiny_target):
    result = autoregressive(tiny_target).generate(PROMPT, config(6))
    assert all(e.k == 0 and e.proposed == [] and e.sources == [TokenSource.BONUS] for e in result.events)
    assert result.metrics.target_passes == 6 and result.metrics.acceptance_rate == 0.0


# --- seeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", [None, "near", "ngram"])
def test_seeded_sampling_is_reproducible(request, tiny_target, drafter):
    engine = SpeculativeEngine.from_models(tiny_target, make_drafter(request, drafter) if drafter else None)

    def sample(seed: int) -> list[int]:
        return engine.generate(
            PROMPT, config(24, sampling={"temperature": 1.0, "seed": seed}, k_policy="fixed", k=3)
        ).tokens

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first
    assert sample(13) != first


# --- the KV cache ----------------------------------------------------------------------------


def full_forward(lm, tokens: Sequence[int]) -> torch.Tensor:  # [n, V], no cache
    with torch.inference_mode():
        return lm.model(input_ids=torch.tensor([list(tokens)])).logits[0].float()


def test_cache_rollback_then_continue_matches_a_fresh_run(tiny_target):
    seq = list(range(40, 56))
    reference = full_forward(tiny_target, seq)
    tiny_target.reset()
    tiny_target.forward(seq[:10])
    tiny_target.rollback(6)
    assert tiny_target.cache.length == 6 and tiny_target.tokens == seq[:6]
    torch.testing.assert_close(tiny_target.forward(seq[6:12]), reference[6:12], atol=1e-4, rtol=1e-4)
    tiny_target.rollback(11)
    torch.testing.assert_close(tiny_target.forward(seq[11:], last=2), reference[-2:], atol=1e-4, rtol=1e-4)


def test_cache_rollback_bounds(tiny_target):
    tiny_target.reset()
    tiny_target.forward([1, 2, 3])
    tiny_target.rollback(3)  # no-op
    assert tiny_target.cache.length == 3
    for bad in (4, -1):
        with pytest.raises(ValueError, match="roll back"):
            tiny_target.rollback(bad)
    tiny_target.rollback(0)
    assert tiny_target.cache.length == 0 and tiny_target.tokens == []


def test_sync_feeds_only_what_is_missing(tiny_target):
    tiny_target.reset()
    tiny_target.forward([1, 2, 3, 4])
    assert sync(tiny_target, [1, 2, 3, 4, 5, 6]) == [5, 6]
    assert tiny_target.tokens == [1, 2, 3, 4]
    # Never an empty feed: the scores after the last token are what the caller wants.
    assert sync(tiny_target, [1, 2, 3, 4]) == [4]
    assert tiny_target.tokens == [1, 2, 3] and tiny_target.cache.length == 3
    tiny_target.forward([4])
    assert sync(tiny_target, [1, 2, 9, 4, 5]) == [9, 4, 5]
    assert tiny_target.tokens == [1, 2] and tiny_target.cache.length == 2


def test_prefill_keeps_what_the_cache_holds_of_the_prompt(tiny_target):
    fed: list[list[int]] = []
    forward = tiny_target.forward

    def counting(tokens, last=None):
        fed.append(list(tokens))
        return forward(tokens, last)

    tiny_target.reset()
    drive(prefill(tiny_target, [1, 2, 3, 4, 5, 6]))  # everything but the last token
    tiny_target.forward = counting
    try:
        drive(prefill(tiny_target, [1, 2, 3, 7, 8, 9]))  # shares [1 2 3] with the cache
        assert fed == [[7, 8]] and tiny_target.tokens == [1, 2, 3, 7, 8]
        kept = tiny_target.forward([9], last=1)
        drive(prefill(tiny_target, [1, 2, 3, 7, 8, 9]))  # the whole body is cached: nothing to feed
        assert fed == [[7, 8], [9]] and tiny_target.tokens == [1, 2, 3, 7, 8]
    finally:
        del tiny_target.forward
    tiny_target.reset()
    drive(prefill(tiny_target, [1, 2, 3, 7, 8, 9]))
    fresh = tiny_target.forward([9], last=1)
    torch.testing.assert_close(kept, fresh)  # the kept start scores as a fresh prefill does


# --- incremental detokenization ------------------------------------------------------------


class CountingTokenizer:
    """Counts how many tokens get decoded, to check streaming work stays linear."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, tokens, skip_special_tokens: bool = False) -> str:
        self.decoded += len(tokens)
        return self.inner.decode(tokens, skip_special_tokens=skip_special_tokens)


def push_in_chunks(stream: TextStream, tokens: list[int], generator: random.Random) -> tuple[str, int]:
    out, at = [], 0
    while at < len(tokens):
        n = generator.randint(1, 5)
        keep, text, hit = stream.push(tokens[at : at + n])
        out.append(text)
        at += keep
        if hit:
            return "".join(out), at
    out.append(stream.flush())
    return "".join(out), at


@pytest.mark.parametrize("seed", range(12))
def test_text_stream_matches_full_decode_on_random_bytes(tokenizer, seed):
    # Random bytes hold valid multi-byte characters, truncated ones and stray continuation
    # bytes alike; chunks of random size split them anywhere.
    generator = random.Random(seed)
    pool = list(tokenizer.encode("aé€😀 xyz")) + list(range(256))
    tokens = [generator.choice(pool) for _ in range(300)]
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    text, used = push_in_chunks(TextStream(tokenizer, ()), tokens, generator)
    assert text == full and used == len(tokens)
    stop = "xy"
    text, used = push_in_chunks(TextStream(tokenizer, (stop,)), tokens, generator)
    if stop in full:
        assert text == full[: full.index(stop)]
        assert stop in tokenizer.decode(tokens[:used]) and stop not in tokenizer.decode(tokens[: used - 1])
    else:
        assert text == full


def test_text_stream_work_is_linear_in_length(tokenizer):
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, ("never seen",))
    tokens = tokenizer.encode("The cat sat on the mat, héllo €uro. " * 30)
    for token in tokens:
        stream.push([token])
    # A full decode per push would be ~n^2 / 2 = 600k tokens; a window is a few tokens.
    assert counting.decoded < 40 * len(tokens)


@pytest.mark.parametrize(
    ("n_accepted", "emitted", "parts"),
    [
        (5, 6, [("grammar", 3, 3), ("ngram", 4, 2)]),  # 3 forced and 2 drafted kept, then a correction
        (7, 8, [("grammar", 3, 3), ("ngram", 4, 4)]),
        (5, 2, [("grammar", 3, 2), ("ngram", 4, 0)]),  # a stop after 2 tokens: the rest is not kept
        (1, 2, [("grammar", 3, 1), ("ngram", 4, 0)]),  # a forced token refused (another spelling won)
    ],
)
def test_a_blocks_forced_tokens_count_as_the_grammars_and_the_rest_as_its_sources(n_accepted, emitted, parts):
    event = StepEvent(
        step=0,
        k=7,
        source="ngram",
        proposed=list(range(7)),
        draft_probs=[1.0] * 7,
        target_probs=[1.0] * 7,
        n_accepted=n_accepted,
        next_token=9,
        tokens=list(range(emitted)),
        sources=[TokenSource.ACCEPTED] * emitted,
        text="",
        prefill_seconds=0.0,
        draft_seconds=0.0,
        verify_seconds=0.0,
        step_seconds=0.0,
        forced=3,
    )
    assert event.drafted_by() == parts
    assert replace(event, forced=0).drafted_by() == [("ngram", 7, min(n_accepted, emitted))]
