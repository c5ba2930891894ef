"""No request stalls the others (issue 48): what a hostile or merely large request may cost
before the server refuses it or runs it, and where that cost is paid.

A chat with too many messages is refused before its messages are checked; a prediction too
large for the context is refused by its size, before the tokenizer reads it; a prediction is
encoded when its request is admitted, not in the rounds every stream waits on, and drafts
what it drafted when it was encoded there, tokenized once a request. Grammars compile one at
a time, while a grammar already compiled waits for none of them and is found without
building its text again. (Prompt pieces sized in time: ``test_scheduler``.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest

from draftwise import grammar as grammar_module
from draftwise.api.errors import APIError
from draftwise.api.pool import Slot, _paced
from draftwise.api.schemas import MAX_MESSAGES, ChatCompletionRequest
from draftwise.api.translate import check_prediction
from draftwise.backends.tiny import tiny_tokenizer
from draftwise.config import DraftConfig, GenerationConfig, GrammarSpec, SamplingConfig
from draftwise.drafters import NGramDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.grammar import Grammars
from draftwise.lm import Forward, drive, longest_token
from draftwise.prediction import PredictionDrafter, encode_prediction
from draftwise.profile import CostProfile
from draftwise.retokenize import TokenText
from draftwise.scheduler import Scheduler, run_together
from draftwise.target import LocalTarget

MODEL = "tiny:0"
PREDICTED = "def area(radius):\n    return 3.14159 * radius * radius\n\nprint(area(2.0))\n"


def _chat(messages: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "a"}] * messages, **fields}


def test_a_chat_may_hold_as_many_messages_as_the_cap_and_no_more():
    assert len(ChatCompletionRequest.model_validate(_chat(MAX_MESSAGES)).messages) == MAX_MESSAGES
    with pytest.raises(pydantic.ValidationError) as caught:
        ChatCompletionRequest.model_validate(_chat(MAX_MESSAGES + 1))
    (error,) = caught.value.errors()
    assert error["loc"] == ("messages",) and error["type"] == "too_long"


@pytest.fixture(scope="module")
def url(tiny_target) -> Iterator[str]:
    pytest.importorskip("fastapi")
    from draftwise.api.app import create_app
    from draftwise.api.settings import ServerSettings
    from draftwise.prepare import Pair

    from server_support import serve_in_background

    app = create_app(ServerSettings(target=MODEL, max_context=64), Pair(tiny_target).fork())
    with serve_in_background(app) as base:
        yield base


def test_too_many_messages_are_a_one_line_400_naming_messages(url):
    httpx = pytest.importorskip("httpx")
    response = httpx.post(f"{url}/v1/chat/completions", json=_chat(100_000, max_tokens=2), timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and str(MAX_MESSAGES) in error["message"]
    assert "\n" not in error["message"]


class CountingTokenizer:
    """One token per byte; counts the texts it encodes."""

    def __init__(self) -> None:
        self.encoded: list[int] = []  # the size of each text encoded

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        self.encoded.append(len(ids))
        return ids


def _predicting(size: int) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(_chat(1, prediction={"type": "content", "content": "x" * size}))


def test_a_prediction_longer_than_the_room_could_hold_is_refused_unread():
    # A context of 64 with 10 prompt tokens leaves 54; no token is longer than 4 bytes, so a
    # text of more than 216 bytes holds more than 54 tokens: refused without tokenizing.
    tokenizer = CountingTokenizer()
    with pytest.raises(APIError) as caught:
        check_prediction(_predicting(1_000_000), tokenizer, 10, 64, 4)
    assert caught.value.body.param == "prediction" and "1000000 bytes" in str(caught.value)
    assert tokenizer.encoded == []
    with pytest.raises(APIError):
        check_prediction(_predicting(217), tokenizer, 10, 64, 4)
    assert tokenizer.encoded == []


def test_a_prediction_the_size_bound_lets_through_is_counted_exactly():
    tokenizer = CountingTokenizer()
    with pytest.raises(APIError) as caught:  # 216 bytes may be 54 tokens: read, and it is 216
        check_prediction(_predicting(216), tokenizer, 10, 64, 4)
    assert "216 tokens" in str(caught.value) and tokenizer.encoded == [216]
    check_prediction(_predicting(54), tokenizer, 10, 64, 4)
    assert tokenizer.encoded == [216, 54]


def test_the_longest_token_is_counted_in_bytes_not_in_the_vocabulary_s_spelling():
    # Byte-level vocabularies spell a space as "Ġ", two bytes of UTF-8: a run of eight spaces
    # is a token of 8 bytes spelled in 16. The size bound divides by the bytes.
    tokenizer = tiny_tokenizer(merges=[(" ", " "), ("  ", "  "), ("    ", "    ")])
    spelled = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())
    assert longest_token(tokenizer) == 8 < spelled == 16


class Counting:
    """A tokenizer that counts its encodes and decodes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encodes = self.decodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.encodes += 1
        return list(self.inner.encode(*args, **kwargs))

    def decode(self, *args: Any, **kwargs: Any) -> str:
        self.decodes += 1
        return str(self.inner.decode(*args, **kwargs))


def test_a_prediction_encoded_ahead_is_not_read_again_at_start_and_drafts_the_same():
    tokenizer = Counting(tiny_tokenizer(merges=[("r", "a"), ("ra", "d"), ("i", "u")]))
    prompt = tokenizer.encode("Rename area to disc_area.\n", add_special_tokens=False)
    ahead = PredictionDrafter(tokenizer, encode_prediction(tokenizer, PREDICTED))
    tokenizer.encodes = tokenizer.decodes = 0
    ahead.start(prompt, GenerationConfig(), None)
    # Only the prompt is read (its last few tokens one by one); the prediction, two decodes a
    # token, was read when it was encoded.
    assert tokenizer.encodes == 0 and tokenizer.decodes <= 1 + 2 * TokenText.WINDOW < 2 * len(ahead.ids)
    fresh = PredictionDrafter(tokenizer.inner)
    fresh.start(prompt, GenerationConfig(prediction=PREDICTED), None)
    assert (ahead.ids, ahead.text, ahead._offsets) == (fresh.ids, fresh.text, fresh._offsets)
    output = tokenizer.encode("def disc_area(radius):\n", add_special_tokens=False)
    for n in range(len(output) + 1):
        context = prompt + output[:n]
        assert ahead.offers(context) == fresh.offers(context)
        assert drive(ahead.propose(context, 6)).tokens.tolist() == drive(fresh.propose(context, 6)).tokens.tolist()


def test_a_server_prices_its_target_s_batched_passes_by_the_shared_profile(tiny_target):
    class Batched:  # a target whose sequences share passes (llama.cpp's slots)
        batch = object()

    profile = CostProfile()
    profile.pass_times.add(1, 0.03)
    profile.pass_times.add(32, 0.5)
    (pace,) = _paced(Scheduler(), [Slot(Batched(), None, profile)])._paces
    assert pace.batch is Batched.batch and pace.curve(32) == 0.5
    profile.pass_times.add(32, 1.0)  # the profile learns as requests run: so does the curve
    assert pace.curve(32) > 0.5
    assert _paced(Scheduler(), [Slot(tiny_target, None)])._paces == []  # each pass alone: nothing to pace


def test_a_verifier_prices_its_target_s_batched_passes_by_its_timed_curve(tiny_target):
    from draftwise.remote.sessions import VerifierService
    from draftwise.remote.settings import VerifierSettings

    class Batched:  # the tiny target, its sequences sharing passes as llama.cpp's slots do
        batch = object()

        def __getattr__(self, name: str) -> Any:
            return getattr(tiny_target, name)

    profile = CostProfile()
    profile.pass_times.add(1, 0.03)
    profile.pass_times.add(32, 0.5)
    settings = VerifierSettings(target="tiny:0")
    services = [VerifierService(settings, Batched(), profile), VerifierService(settings, Batched())]
    try:
        (pace,) = services[0].scheduler._paces
        assert pace.batch is Batched.batch and pace.curve(32) == 0.5
        assert not pace.others()  # no session has verified: a prompt alone takes whole passes
        assert pace.others == services[0]._others_active
        assert services[1].scheduler._paces == []  # no timed curve: pieces of the row budget, as before
    finally:
        for service in services:
            service.scheduler.close()


def test_a_verifier_counts_a_session_that_just_verified_as_wanting_a_pass_soon(tiny_target):
    from draftwise.remote.protocol import OpenSession
    from draftwise.remote.sessions import VerifierService
    from draftwise.remote.settings import VerifierSettings

    service = VerifierService(VerifierSettings(target="tiny:0"), tiny_target)
    try:
        opened = service.open(OpenSession(prompt=[1, 2, 3], sampling=SamplingConfig(temperature=0)))
        session = service._sessions[opened.session_id]
        assert not service._others_active()  # opened, never verified
        session.verified_at = time.monotonic()
        assert service._others_active()  # its client is drafting its next block
        session.verified_at -= service.active_s  # VerifierSettings.active_s
        assert not service._others_active()
    finally:
        service.scheduler.close()


def test_a_server_generation_prepared_at_admission_gives_the_same_steps(tiny_target):
    slot = Slot(tiny_target, None)
    assert tiny_target.tokenizer is not None
    prompt = tiny_target.tokenizer.encode("Rename area to disc_area.\n")
    config = GenerationConfig(
        max_new_tokens=24,
        prediction=PREDICTED,
        draft=DraftConfig(k_policy="fixed", k=4),
        sampling=SamplingConfig(temperature=0),
    )
    ids = tiny_target.tokenizer.encode(PREDICTED, add_special_tokens=False, parse_special=False)
    engine, prepared = slot.prepare("ngram", prompt, config, ids)  # as the pool's setup thread does
    (ahead,) = run_together([engine.steps(prepared)])
    (rounds,) = run_together([slot.engine("ngram").steps(prompt, config)])  # prepared in the rounds
    assert [(e.tokens, e.source, e.proposed, e.n_accepted) for e in ahead] == [
        (e.tokens, e.source, e.proposed, e.n_accepted) for e in rounds
    ]
    assert any(e.source == "prediction" for e in ahead)


def test_a_prepared_run_reaches_its_first_pass_without_reading_text(tiny_target):
    # What grows with the prompt and the prediction (encoding the prediction and reading it
    # back, the drafters' reading of the prompt) is done when the run is prepared: advancing it
    # to its first pass, which the round thread does, calls the tokenizer not once.
    tokenizer = Counting(tiny_target.tokenizer)
    engine = SpeculativeEngine(LocalTarget(tiny_target), NGramDrafter(), tokenizer)
    prompt = tiny_target.tokenizer.encode("Rename area to disc_area.\n" * 20)
    prepared = engine.prepare(prompt, GenerationConfig(max_new_tokens=8, prediction=PREDICTED * 20))
    assert tokenizer.encodes >= 1 and tokenizer.decodes > len(prompt)  # the prediction, and the prompt read
    tokenizer.encodes = tokenizer.decodes = 0
    tiny_target.reset()  # no start of the prompt left cached by another test
    first = next(engine.steps(prepared))
    assert isinstance(first, Forward) and first.tokens == prompt[: len(first.tokens)]  # the prefill
    assert tokenizer.encodes == tokenizer.decodes == 0


def test_a_prediction_is_tokenized_once_a_request(url, tiny_target, monkeypatch):
    # Its check at admission reads its tokens; the generation takes those, not a second encode.
    httpx = pytest.importorskip("httpx")
    predicted = "def f(x):\n    return x\n"
    tokenizer = tiny_target.tokenizer  # the server's: its models are forks of this one
    encode, read = tokenizer.encode, []

    def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if text == predicted:
            read.append(text)
        return list(encode(text, *args, **kwargs))

    monkeypatch.setattr(tokenizer, "encode", counting)
    body = _chat(1, max_tokens=4, prediction={"type": "content", "content": predicted})
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(read) == 1


def _grammars() -> Grammars:
    pytest.importorskip("llguidance")
    tokenizer = tiny_tokenizer()
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _regex(pattern: str) -> GrammarSpec:
    return GrammarSpec(kind="regex", text=pattern)


def test_grammars_compile_one_at_a_time_and_a_kept_one_waits_for_none(monkeypatch):
    grammars = _grammars()
    kept = _regex("a+")
    grammars.check(kept)
    compile_, guard = grammar_module._compiled, threading.Lock()
    running, most, entered = [0], [0], []
    blocked, release = threading.Event(), threading.Event()

    def counting(spec: GrammarSpec, grammar: str, vocabulary: Any) -> Any:
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
            entered.append(spec.text)
        try:
            if spec.text == "b+":  # a long compile: held until the test lets it go
                blocked.set()
                release.wait(30)
            return compile_(spec, grammar, vocabulary)
        finally:
            with guard:
                running[0] -= 1

    monkeypatch.setattr(grammar_module, "_compiled", counting)
    compiles = [threading.Thread(target=grammars.check, args=(_regex(p),)) for p in ("b+", "c+", "d+")]
    hit = threading.Thread(target=lambda: (grammars.check(kept), grammars.constraint(kept)))
    try:
        compiles[0].start()
        assert blocked.wait(30)
        for thread in compiles[1:]:
            thread.start()
        time.sleep(0.5)  # time enough for the others to reach the compile, were they let in
        hit.start()
        hit.join(10)
        assert not hit.is_alive()  # the kept grammar did not wait for the compile under way
        assert entered == ["b+"]
    finally:
        release.set()
        for thread in compiles:
            thread.join(30)
    assert most[0] == 1 and sorted(entered) == ["b+", "c+", "d+"]


def test_a_kept_grammar_is_found_without_building_its_text_again(monkeypatch):
    from grammar_support import count_compiles

    grammars = _grammars()
    built = count_compiles(monkeypatch)
    text, texts = grammar_module.grammar_text, []
    monkeypatch.setattr(grammar_module, "grammar_text", lambda spec: texts.append(spec.kind) or text(spec))
    record = '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    grammars.check(GrammarSpec(kind="json_schema", text=record))
    # The same schema again, as the request's stream (on the round thread) and the next
    # request's check ask for it: each a spec of its own, equal to the first.
    grammars.constraint(GrammarSpec(kind="json_schema", text=record))
    grammars.check(GrammarSpec(kind="json_schema", text=record, name="record"))
    assert texts == ["json_schema"] and len(built) == 1
    # Another spec of the same grammar builds its text, once, but is not compiled again.
    grammars.check(GrammarSpec(kind="json_object"))
    grammars.check(GrammarSpec(kind="json_schema", text='{"type": "object"}'))
    grammars.constraint(GrammarSpec(kind="json_object"))
    assert texts == ["json_schema", "json_object", "json_schema"] and len(built) == 2
