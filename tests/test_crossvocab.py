"""Drafts with another tokenizer: the text bridge, exactness and the distribution.

Closed-form cases on tiny tokenizers first (reading tokens as text a token at a time,
encoding a growing text, the boundary with the committed tokens); then greedy exactness with
drafts of other vocabularies (the target's own model under shuffled ids, which must be
accepted every time, and unrelated models); then the sampled distribution, chi-square tested.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from draftwise.backends.hf import HFModel
from draftwise.backends.tiny import tiny_lm, tiny_tokenizer
from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.drafters import CrossVocabDrafter, HybridDrafter, ModelDrafter, build_drafter, text_bridge
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.errors import IncompatibleModelsError
from draftwise.lm import drive
from draftwise.retokenize import (
    TextTokens,
    TokenText,
    added_text,
    lead_ids,
    proposal_ids,
    round_trip_loss,
    settled,
)
from draftwise.tokenizer_compat import draft_mode

from stats_support import ALPHA, chi2_pvalue, exact_pairs, sample_pairs

# Merges that make " the", " cat" and " sat" one token each, and " th" two (" t" "h").
MERGES = [
    (" ", "t"),
    ("h", "e"),
    (" t", "he"),
    ("t", "h"),
    (" ", "c"),
    ("a", "t"),
    (" c", "at"),
    (" ", "s"),
    (" s", "at"),
]
PROMPT = "The cat sat on the mat. The cat sat on the"
N = 40


@pytest.fixture(scope="module")
def merged():
    return tiny_tokenizer(MERGES)


def names(tokenizer, ids):
    return [tokenizer.decode([i]) for i in ids]


# --- reading tokens as text -------------------------------------------------------------------


def test_token_text_waits_for_the_rest_of_a_character():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("café")  # c a f 0xC3 0xA9
    read = TokenText(tokenizer)
    read.reset(ids[:1])
    for n in range(2, len(ids) + 1):
        read.follow(ids[:n])
        assert read.text == ("café" if n == 5 else "caf"[:n])
        assert read.clean == (3 if n == 4 else n)
    assert read.cuts[5] == 4 and 4 not in read.cuts  # no cut inside é


def test_token_text_of_a_long_sequence_reads_as_one_decode():
    tokenizer = tiny_tokenizer()
    text = "naïve café " * 20
    ids = tokenizer.encode(text)
    read = TokenText(tokenizer)
    read.reset(ids[:37])
    for n in range(38, len(ids) + 1, 3):
        read.follow(ids[:n])
    read.follow(ids)
    assert read.text == text and read.clean == len(ids)
    assert min(read.cuts) >= len(ids) - TokenText.WINDOW  # only the last few cuts are kept
    read.follow(ids[:10])  # not an extension: read from scratch
    assert read.text == tokenizer.decode(ids[:10])


def test_added_text_waits_for_a_whole_character_or_stops_before_it():
    tokenizer = tiny_tokenizer()
    anchor, new = tokenizer.encode("ab"), tokenizer.encode("cé")[:-1]  # c and half of é
    assert added_text(tokenizer, anchor, new) is None
    assert added_text(tokenizer, anchor, new, whole=False) == "c"
    assert added_text(tokenizer, anchor, tokenizer.encode("cé")) == "cé"


def test_text_tokens_grown_word_by_word_are_the_whole_texts_ids(merged):
    words = "The cat sat on the mat and the cat sat on the hat while the rat sat".split(" ")
    ids = TextTokens(merged)
    text = ""
    for i, word in enumerate(words):
        text += (" " if i else "") + word
        ids.follow(text)
        assert ids.ids == merged.encode(text, add_special_tokens=False)
    assert len(ids.cuts) > 1  # the text was not re-encoded whole each time
    ids.follow("Another text")  # not an extension: encoded from scratch
    assert ids.ids == merged.encode("Another text", add_special_tokens=False)


def test_lead_ids_are_what_the_tokenizer_writes_first():
    tokenizer = tiny_tokenizer()
    assert lead_ids(tokenizer) == []
    tokenizer.hf.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.hf.bos_token_id
    from tokenizers import processors

    tokenizer.hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    assert lead_ids(tokenizer) == [bos]
    ids = TextTokens(tokenizer)
    ids.follow("hi")
    assert ids.ids == [bos, *tokenizer.encode("hi", add_special_tokens=False)]


# --- the boundary with the committed tokens --------------------------------------------------


def read_of(tokenizer, context):
    read = TokenText(tokenizer)
    read.reset(context)
    return read


def test_proposal_continues_after_a_whole_word(merged):
    context = merged.encode("on the", add_special_tokens=False)
    ids = proposal_ids(merged, context, read_of(merged, context), " cat sat")
    assert names(merged, ids) == [" cat", " sat"]


def test_text_that_merges_into_the_committed_tokens_is_not_proposed(merged):
    context = merged.encode("on th", add_special_tokens=False)
    assert names(merged, context[-2:]) == [" t", "h"]
    # " th" + "e cat" is " the cat": the target would not have written " t" "h" before it.
    assert proposal_ids(merged, context, read_of(merged, context), "e cat") == []


def test_a_committed_half_character_is_written_by_the_proposal():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("caf") + tokenizer.encode("é")[:1]  # the first byte of é is committed
    read = read_of(tokenizer, ids)
    assert read.text == "caf"
    assert proposal_ids(tokenizer, ids, read, "é!") == tokenizer.encode("é!")[1:]


@pytest.mark.parametrize(
    ("text", "k", "expected"),
    [
        (" the cat", 1, True),  # " cat" starts a new word: " the" stays
        (" the cat", 2, False),  # nothing follows " cat": it may grow (" cats")
        (" the ca", 1, True),
        (" th", 1, False),  # " t" "h": the word goes on, " t" may become " the"
        ("cat.", 2, True),  # "c" "at" ".": punctuation after a letter ends the word
        ("cat.", 1, False),  # "c" "at": inside a word
        ("\n\n", 1, False),  # white space after white space may merge
        (" the", 0, False),
    ],
)
def test_a_draft_is_settled_where_its_kth_token_ends_a_word(merged, text, k, expected):
    ids = merged.encode(text, add_special_tokens=False)
    assert settled(merged, ids, k) is expected


# --- which drafts are accepted --------------------------------------------------------------


def test_draft_mode_shared_text_or_refused(merged):
    assert draft_mode(tiny_tokenizer(), tiny_tokenizer()) == "shared"
    assert draft_mode(tiny_tokenizer(), merged) == "text"
    assert draft_mode(tiny_tokenizer(), tiny_tokenizer(shuffle=1)) == "text"
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from draftwise.backends.hf import HFTokenizer

    # Word pieces without bytes: what it lacks comes back as <unk>.
    words = Tokenizer(models.WordLevel({"Hello": 0, ",": 1, "<unk>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    lossy = HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>"))
    assert round_trip_loss(lossy) is not None
    with pytest.raises(IncompatibleModelsError, match="cannot write every character"):
        draft_mode(tiny_tokenizer(), lossy, "t", "d")


def test_a_draft_drafts_through_text_only_for_another_vocabulary(tiny_target, tiny_random_draft, merged):
    assert text_bridge(tiny_target.tokenizer, tiny_random_draft) is None
    assert type(build_drafter("model", tiny_random_draft)) is ModelDrafter
    other = tiny_lm(1, tokenizer=merged)
    through = text_bridge(tiny_target.tokenizer, other)
    assert through is tiny_target.tokenizer
    assert type(build_drafter("model", other, through)) is CrossVocabDrafter
    hybrid = build_drafter("hybrid", other, through)
    assert isinstance(hybrid, HybridDrafter) and type(hybrid.model) is CrossVocabDrafter
    # The engine decides on its own when handed the draft model.
    assert type(SpeculativeEngine.from_models(tiny_target, other).drafter) is CrossVocabDrafter


# --- greedy exactness -----------------------------------------------------------------------


def printable(lm: HFModel) -> HFModel:
    """``lm`` writing printable ASCII only: a random model's bytes are rarely valid UTF-8,
    and a draft drafts text. A bias keeps every other byte out, as ``padded`` keeps padding."""
    head = lm.model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    allowed = [lm.tokenizer.get_vocab()[s] for s in map(chr, range(33, 127))]
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.fill_(-1e4)
        biased.bias[allowed] = 0.0
    lm.model.set_output_embeddings(biased)
    return lm


def reworded(lm: HFModel, shuffle: int, noise: float = 0.0) -> HFModel:
    """``lm``'s model under another numbering of the same tokens (``tiny_tokenizer(shuffle=)``):
    it writes the same text, in other ids; ``noise`` on its output layer makes it disagree
    in part."""
    tokenizer = tiny_tokenizer(shuffle=shuffle)
    theirs = lm.tokenizer.get_vocab()
    index = torch.tensor([theirs[s] for s, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])])
    model = copy.deepcopy(lm.model)
    head = model.get_output_embeddings()
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(7)
        for table in (model.get_input_embeddings().weight, head.weight, head.bias):
            table.copy_(table[index])
        head.weight.add_(noise * head.weight.std() * torch.randn_like(head.weight))
    return HFModel(model, tokenizer, name=f"{lm.name} shuffled {shuffle}")


def config(max_new_tokens: int = N, **draft) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, draft=DraftConfig(**draft))


@pytest.fixture(scope="module")
def target() -> HFModel:
    return printable(tiny_lm(0))


@pytest.fixture(scope="module")
def baseline(target) -> list[int]:
    return autoregressive(target).generate(PROMPT, config()).tokens


@pytest.fixture(scope="module")
def drafts(target, merged) -> dict[str, HFModel]:
    return {
        "same-words": reworded(target, shuffle=3),
        "near-words": reworded(target, shuffle=4, noise=0.5),
        "random-merged": tiny_lm(1, tokenizer=merged),
    }


POLICIES = [
    {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.0},
    {"k_policy": "heuristic", "k": 2, "confidence_threshold": 0.0},
    {"k_policy": "cost", "confidence_threshold": 0.0},
    {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.6},
]


@pytest.mark.parametrize("kind", ["model", "hybrid"])
@pytest.mark.parametrize("draft", ["same-words", "near-words", "random-merged"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda d: "-".join(f"{v}" for v in d.values()))
def test_greedy_output_is_the_targets(target, baseline, drafts, kind, draft, policy):
    drafter = build_drafter(kind, drafts[draft], target.tokenizer)  # the draft speaks another vocabulary
    result = SpeculativeEngine.from_models(target, drafter).generate(PROMPT, config(**policy))
    assert result.tokens == baseline
    assert result.metrics.new_tokens == N


def test_the_targets_own_model_in_other_words_is_always_accepted(target, baseline, drafts):
    engine = SpeculativeEngine.from_models(target, drafts["same-words"])
    result = engine.generate(PROMPT, config(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert result.tokens == baseline
    assert result.metrics.proposed >= N // 2  # it did draft: every step but a few
    assert result.metrics.acceptance_rate == 1.0


def test_the_drafts_cache_follows_the_accepted_text(target, drafts):
    draft = drafts["near-words"]
    drafter = CrossVocabDrafter(draft, target.tokenizer)
    SpeculativeEngine.from_models(target, drafter).generate(PROMPT, config(k_policy="fixed", k=4))
    # After the last verdict, what the draft holds is a prefix of the generated text's ids.
    assert draft.tokens == drafter.draft_ids.ids[: len(draft.tokens)]
    assert draft.tokenizer.decode(drafter.draft_ids.ids) == drafter.read.text


def test_a_draft_stops_at_the_first_token_that_settles_its_block(target, baseline, drafts, monkeypatch):
    # The target's own model in other ids writes the target's text, a character a token in
    # both vocabularies: the block of k ends at the first draft token after which the k-th
    # target token starts a word, or at the allowance of k + 2.
    draft = drafts["same-words"]
    drafter = CrossVocabDrafter(draft, target.tokenizer)
    prompt = target.tokenizer.encode(PROMPT)
    calls: list[int] = []
    forward = draft.forward

    def counted(tokens, last=None):
        calls.append(len(tokens))
        return forward(tokens, last=last)

    monkeypatch.setattr(draft, "forward", counted)
    drafter.start(prompt, config(confidence_threshold=0.0), None)
    drive(drafter.propose(prompt, 1))  # the prompt's catch-up, a pass of its own
    early = 0
    for at in range(len(baseline) - 6):
        context, rest = prompt + baseline[:at], baseline[at:]
        for k in (1, 2, 3):
            calls.clear()
            assert drive(drafter.propose(context, k)).tokens.tolist() == rest[:k]
            first = next((d for d in range(1, k + 3) if settled(target.tokenizer, rest[:d], k)), k + 2)
            assert len(calls) == first
            early += first < k + 2
    assert early  # some blocks stopped before their allowance


def test_a_draft_whose_context_is_full_stops_drafting(target, drafts):
    draft = reworded(target, shuffle=5)
    draft.model.config.max_position_embeddings = 48
    drafter = CrossVocabDrafter(draft, target.tokenizer)
    prompt = target.tokenizer.encode(PROMPT)  # 42 tokens: room for a few draft tokens
    drafter.start(prompt, config(), None)
    assert drafter.offers(prompt) and 0 < len(drive(drafter.propose(prompt, 12))) < 12
    longer = target.tokenizer.encode(PROMPT + " mat.")
    assert drafter.offers(longer) == () and len(drive(drafter.propose(longer, 4))) == 0
    result = SpeculativeEngine.from_models(target, drafter).generate(PROMPT, config(k_policy="fixed", k=4))
    assert result.tokens == autoregressive(target).generate(PROMPT, config()).tokens


# --- the sampled distribution ---------------------------------------------------------------


def test_sampled_output_follows_the_targets_distribution(target, drafts):
    prompt = target.tokenizer.encode("The cat sat on the mat. The cat")
    engine = SpeculativeEngine.from_models(target, drafts["near-words"])
    counts, outcomes = sample_pairs(engine, prompt, DraftConfig(k_policy="fixed", k=4, confidence_threshold=0.0))
    assert chi2_pvalue(counts, exact_pairs(target, prompt)) > ALPHA
    assert outcomes == {0, 1}  # the draft token was both accepted and rejected


def test_sampling_drafts_greedily_whatever_the_temperature(target, drafts):
    drafter = CrossVocabDrafter(drafts["same-words"], target.tokenizer)
    prompt = target.tokenizer.encode(PROMPT)
    seen = Counter()
    for seed in range(4):
        sampled = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=seed))
        drafter.start(prompt, sampled, torch.Generator().manual_seed(seed))
        seen[tuple(drive(drafter.propose(prompt, 4)).tokens.tolist())] += 1
    assert len(seen) == 1  # the same block every time: the draft's best guess


# --- through the API server -----------------------------------------------------------------


def test_the_server_drafts_through_text_for_a_draft_of_another_vocabulary(target, drafts):
    openai = pytest.importorskip("openai")
    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings
    from draftwise.prepare import Pair

    from server_support import serve_in_background

    # The printable target never writes EOS: every request runs its 24 tokens.
    expected = autoregressive(target).generate(PROMPT, GenerationConfig(max_new_tokens=24))
    app = create_app(ServerSettings(target="tiny:0"), Pair(target, drafts["same-words"]).fork())
    spec = {"speculative": {"drafter": "model", "k_policy": "fixed", "k": 4, "confidence_threshold": 0.0}}
    with serve_in_background(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        response = client.completions.create(
            model="tiny:0", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=spec
        )
    assert response.choices[0].text == expected.text
    assert response.speculative["proposed"] > 0
    assert response.speculative["accepted"] == response.speculative["proposed"]
