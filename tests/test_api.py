"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback.

Servers run on uvicorn in a background thread on 127.0.0.1 (a free port), with tiny
in-process models: target seed 0, drafts that agree in part (``tiny_near_draft``) or n-gram.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Literal

import pydantic
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.config import GenerationConfig, GrammarSpec  # noqa: E402
from draftwise.engine import autoregressive  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402

from server_support import HeldLM, serve_in_background, wait_for  # noqa: E402

MODEL = "tiny:0"
PROMPT = "Once upon a time"
# Fixed k and no confidence stop: every step drafts, so acceptances and corrections both occur.
FIXED = {"k_policy": "fixed", "k": 4, "confidence_threshold": 0.0}


def _serve(target, draft=None, **settings) -> Iterator[str]:
    app = create_app(ServerSettings(target=MODEL, **settings), Pair(target, draft).fork())
    with serve_in_background(app) as url:
        yield url


def _client(url: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kwargs)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels), parsed by prometheus-client."""
    text = httpx.get(f"{url}/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture(scope="module")
def server(tiny_target, tiny_near_draft) -> Iterator[str]:
    """Two slots, a draft model and room for a few waiting requests."""
    yield from _serve(tiny_target, tiny_near_draft, slots=2, queue_size=8)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return _client(server)


@pytest.fixture(scope="module")
def baseline(tiny_target):
    """Greedy output of the plain target (no drafter), the reference for every greedy test."""

    def run(prompt: str, max_new_tokens: int, **config):
        return autoregressive(tiny_target).generate(prompt, GenerationConfig(max_new_tokens=max_new_tokens, **config))

    return run


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid", "off"])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_plain_target(client, baseline, drafter, stream):
    expected = baseline(PROMPT, 40)
    spec = {"speculative": {"drafter": drafter, **FIXED}}
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=stream, extra_body=spec
    )
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
        stats = chunks[-1].speculative
    else:
        text, finish, stats = response.choices[0].text, response.choices[0].finish_reason, response.speculative
        assert response.usage.prompt_tokens == len(expected.prompt_ids)
        assert response.usage.completion_tokens == 40
        assert response.usage.total_tokens == len(expected.prompt_ids) + 40
    assert text == expected.text
    assert finish == "length"
    assert stats["drafter"] == drafter
    assert stats["new_tokens"] == 40
    # Every pass emits its accepted tokens plus one (nothing is cut: no stop, no EOS).
    assert stats["target_passes"] + stats["accepted"] == 40
    if drafter == "off":
        assert stats["proposed"] == 0 and stats["target_passes"] == 40
    if drafter == "model":
        assert stats["proposed"] > 0 and 0 < stats["accepted"] < stats["proposed"]
        assert stats["acceptance_rate"] == pytest.approx(stats["accepted"] / stats["proposed"])
        assert stats["mean_accepted_length"] == pytest.approx(40 / stats["target_passes"])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_plain_target(client, baseline, stream):
    # The tiny tokenizer has no chat template: the server falls back to a plain transcript.
    expected = baseline("system: be brief\nuser: hi\nassistant:", 24)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=stream,
        extra_body={"speculative": {"drafter": "model"}},
    )
    if stream:
        chunks = list(response)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
        assert all(c.object == "chat.completion.chunk" for c in chunks)
    else:
        assert response.object == "chat.completion"
        assert response.choices[0].message.role == "assistant"
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        assert response.usage.prompt_tokens == len(expected.prompt_ids)
    assert text == expected.text
    assert finish == "length"


def test_stop_sequence_and_usage_chunk(client, baseline):
    expected = baseline(PROMPT, 60, stop=("K",))
    assert expected.metrics.finish_reason == "stop", "the test prompt must reach the stop string"
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=60,
            temperature=0,
            stop=["K"],
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"speculative": {"drafter": "ngram"}},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text and "K" not in text
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.tokens)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=30,
                temperature=0.9,
                top_p=0.95,
                seed=seed,
                extra_body={"speculative": FIXED},
            )
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


def test_stream_provenance(client, baseline):
    expected = baseline(PROMPT, 40)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"speculative": {"drafter": "model", "provenance": True, **FIXED}},
        )
    )
    tokens = [t for c in chunks for t in (c.provenance or [])]
    assert [t["id"] for t in tokens] == expected.tokens
    stats = chunks[-1].speculative
    by_source = {s: [t for t in tokens if t["source"] == s] for s in ("accepted", "corrected", "bonus")}
    assert len(tokens) == sum(len(v) for v in by_source.values())
    assert len(by_source["accepted"]) == stats["accepted"] > 0
    assert len(by_source["corrected"]) + len(by_source["bonus"]) == stats["target_passes"]
    assert by_source["corrected"], "the near draft must be corrected at least once"
    for t in by_source["accepted"]:
        assert 0 < t["draft_prob"] <= 1 and 0 < t["target_prob"] <= 1
    for t in by_source["corrected"]:
        # Greedy: the target rejected the draft's token and put its own argmax instead.
        assert t["rejected"]["id"] != t["id"] and t["draft_prob"] is None
    # Without provenance the chunks carry none.
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert all(c.provenance is None for c in plain)


def test_concurrent_streaming_clients(server, baseline):
    prompts = ["The quick brown fox", "def main():", "Hello, world", PROMPT, "import numpy as np"]
    expected = {p: baseline(p, 48).text for p in prompts}
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True, extra_body={"speculative": FIXED}
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(all_of_them()) == [expected[p] for p in prompts]
    health = httpx.get(f"{server}/health").json()
    assert health["active"] == 0 and health["queued"] == 0


def test_models_health_docs(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["slots"] == 2
    assert httpx.get(f"{server}/docs").status_code == 200
    paths = httpx.get(f"{server}/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(paths)


def test_metrics_name_each_endpoint_by_its_route(tiny_target):
    """A request counts for the route that takes it, by its path template: a model id is not
    an endpoint, and a body refused before routing still counts for its route."""
    for url in _serve(tiny_target, max_body_bytes=1024):
        assert httpx.get(f"{url}/v1/models/{MODEL}").status_code == 200
        assert httpx.get(f"{url}/v1/models/gpt-4").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 200
        assert httpx.get(f"{url}/v1/nowhere").status_code == 404
        assert httpx.get(f"{url}/v1/completions").status_code == 405
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 2048}).status_code == 413
        counted = {
            labels: value for (name, labels), value in _metrics(url).items() if name == "draftwise_requests_total"
        }
        assert counted == {
            (("code", "200"), ("endpoint", "/v1/models/{model}")): 1,
            (("code", "404"), ("endpoint", "/v1/models/{model}")): 1,
            (("code", "200"), ("endpoint", "/v1/models")): 1,
            (("code", "404"), ("endpoint", "other")): 1,
            (("code", "405"), ("endpoint", "/v1/completions")): 1,
            (("code", "413"), ("endpoint", "/v1/completions")): 1,
        }


def test_a_full_queue_says_how_many_wait():
    """Two slots and a queue of 8 hold 10 requests, whether or not they have reached a slot
    yet (here none has): the refusal counts the 8 in the queue, not all 10."""
    from draftwise.api.monitoring import ServerMetrics
    from draftwise.api.pool import QueueFull, SlotPool

    pool = SlotPool([object(), object()], queue_size=8, timeout=10, metrics=ServerMetrics())
    try:
        for _ in range(10):
            pool.admit()
        with pytest.raises(QueueFull, match="^all 2 slots are busy and 8 requests are waiting$"):
            pool.admit()
    finally:
        pool.close()


def test_metrics_counters_move(tiny_target, tiny_near_draft):
    for url in _serve(tiny_target, tiny_near_draft):
        client = _client(url)
        before = _metrics(url)
        assert before[("draftwise_generated_tokens_total", ())] == 0
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            extra_body={"speculative": {"drafter": "model", **FIXED}},
        )
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"speculative": {"drafter": "off"}}
        )
        after = _metrics(url)
        stats = response.speculative
        assert after[("draftwise_generated_tokens_total", ())] == 42
        assert after[("draftwise_requests_total", (("code", "200"), ("endpoint", "/v1/completions")))] == 2
        assert after[("draftwise_generations_total", (("finish_reason", "length"),))] == 2
        passes = after[("draftwise_target_passes_total", ())]
        proposed = after[("draftwise_draft_tokens_proposed_total", ())]
        accepted = after[("draftwise_draft_tokens_accepted_total", ())]
        assert passes == stats["target_passes"] + 30 - accepted  # the drafted run: 30 = passes + accepted
        assert 0 < accepted < proposed
        assert after[("draftwise_draft_position_proposed_total", (("position", "0"),))] > 0
        at = [after.get(("draftwise_draft_position_accepted_total", (("position", str(i)),)), 0) for i in range(4)]
        assert sum(at) == accepted
        assert after[("draftwise_time_to_first_token_seconds_count", ())] == 2
        assert after[("draftwise_time_per_output_token_seconds_count", ())] == 42
        assert after[("draftwise_prompt_tokens_total", ())] == 2 * len(tiny_target.tokenizer.encode(PROMPT))
        assert after[("draftwise_queue_depth", ())] == 0 and after[("draftwise_active_generations", ())] == 0
        # Where the round thread's time went: passes, and the work between them; both grew.
        passes_s = after[("draftwise_round_thread_seconds", (("part", "passes"),))]
        between_s = after[("draftwise_round_thread_seconds", (("part", "between"),))]
        assert passes_s > before[("draftwise_round_thread_seconds", (("part", "passes"),))] and between_s > 0
        assert after[("draftwise_rounds", ())] >= passes


def test_a_slot_reuses_the_prompt_start_it_holds(tiny_target):
    """One slot: the second chat with the same system prompt prefills only what differs,
    says so in its usage and /metrics, and answers as a fresh prefill does."""
    system = {"role": "system", "content": "You answer in one short sentence about the sea."}

    def chat(client, text, cache=True):
        return client.chat.completions.create(
            model=MODEL,
            messages=[system, {"role": "user", "content": text}],
            max_tokens=8,
            temperature=0,
            extra_body={"speculative": {"drafter": "off", "cache_prompt": cache}},
        )

    for url in _serve(tiny_target, slots=1):
        client = _client(url)
        first = chat(client, "hi")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = chat(client, "tell me more")
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        assert _metrics(url)[("draftwise_prompt_tokens_cached_total", ())] == cached
        fresh = chat(client, "tell me more", cache=False)
        assert fresh.usage.prompt_tokens_details.cached_tokens == 0
        assert fresh.choices[0].message.content == second.choices[0].message.content


def test_queue_overflow_429_and_disconnect_cancels(tiny_target):
    """One slot, one waiting place: the third request is refused; closing the streams
    stops their generations early, which /metrics shows. The running generation is held
    after its first few passes until both streams are closed, so it cannot finish first."""
    held = HeldLM(tiny_target.fork())
    app = create_app(ServerSettings(target=MODEL, slots=1, queue_size=1, retry_after=3), Pair(held, None))
    with serve_in_background(app) as url:
        client = _client(url)
        long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True}
        held.hold_after(3)  # the prompt's pass, then two steps: the first text is out
        running = client.completions.create(**long)
        next(iter(running))  # the first slot is generating
        waiting = client.completions.create(**long)
        wait_for(lambda: httpx.get(f"{url}/health").json()["queued"] == 1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(**long)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "3"
        assert refused.value.body["code"] == "rate_limit_exceeded"
        assert "busy" in refused.value.body["message"]

        running.close()
        waiting.close()
        cancelled = ("draftwise_generations_cancelled_total", (("reason", "disconnect"),))
        wait_for(lambda: _metrics(url).get(cancelled, 0) == 1)
        held.release()  # the queued one was counted at its close; the running one ends at its next round

        def all_cancelled() -> bool:
            m = _metrics(url)
            return (
                m.get(cancelled, 0) == 2
                and m[("draftwise_active_generations", ())] == 0
                and m[("draftwise_queue_depth", ())] == 0
            )

        wait_for(all_cancelled)
        m = _metrics(url)
        # Stopped within a block of the disconnect, far from the 2 x 3000 tokens asked for.
        assert m[("draftwise_generated_tokens_total", ())] < 1500
        assert m[("draftwise_requests_rejected_total", ())] == 1
        assert m[("draftwise_requests_total", (("code", "429"), ("endpoint", "/v1/completions")))] == 1
        # The slot is free again.
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        assert again.usage.completion_tokens == 5


def test_request_timeout(tiny_target):
    for url in _serve(tiny_target, request_timeout=0.3):
        client = _client(url)
        with pytest.raises(openai.APIStatusError) as timed_out:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, temperature=0)
        assert timed_out.value.status_code == 504
        assert timed_out.value.body["code"] == "request_timeout"
        with pytest.raises(openai.APIError, match="longer than"):
            for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, temperature=0, stream=True):
                pass
        wait_for(lambda: _metrics(url).get(("draftwise_generations_cancelled_total", (("reason", "timeout"),))) == 2)
        assert _metrics(url)[("draftwise_generated_tokens_total", ())] < 1500


def test_non_streaming_disconnect_cancels(tiny_target):
    for url in _serve(tiny_target):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0},
                timeout=httpx.Timeout(5.0, read=0.5),
            )
        wait_for(lambda: _metrics(url).get(("draftwise_generations_cancelled_total", (("reason", "disconnect"),))) == 1)
        assert _metrics(url)[("draftwise_generated_tokens_total", ())] < 1500


def test_engine_failure_is_reported_not_hidden(tiny_target, monkeypatch):
    """A fault inside generation: 500 in OpenAI's shape, or an error event mid-stream; the
    slot is released either way."""
    from draftwise.api.pool import Slot

    def broken(self, *args, **kwargs):  # whatever Slot.engine takes (a drafter, a prediction...)
        raise RuntimeError("engine exploded")

    for url in _serve(tiny_target, request_timeout=20):
        client = _client(url, timeout=30)
        with monkeypatch.context() as patch:
            patch.setattr(Slot, "engine", broken)
            with pytest.raises(openai.InternalServerError, match="engine exploded"):
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
            with pytest.raises(openai.APIError, match="engine exploded"):
                list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
        assert _metrics(url)[("draftwise_generations_total", (("finish_reason", "error"),))] == 2
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        assert again.usage.completion_tokens == 5


# --- Predicted Outputs ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_prediction_drafts_and_usage_counts_it(client, baseline, stream):
    """The output stays the plain target's; the usage says how many of the prediction's
    tokens were used and how many were thrown away, as the drafting statistics count them."""
    expected = baseline(PROMPT, 40)
    prediction = PROMPT + " there was a prediction that the model may or may not follow."
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stream=stream,
        stream_options={"include_usage": True} if stream else None,
        extra_body={
            "prediction": {"type": "content", "content": [{"type": "text", "text": prediction}]},
            "speculative": {"drafter": "off", "k_policy": "fixed", "k": 4},
        },
    )
    if stream:
        chunks = list(response)
        text, usage = "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage
    else:
        text, usage = response.choices[0].text, response.usage
    assert text == expected.text
    details = usage.completion_tokens_details
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert drafted >= 4  # fixed k: the first step drafts from the prediction
    if not stream:
        stats = response.model_extra["speculative"]
        assert drafted == stats["proposed_by_source"]["prediction"]
        assert details.accepted_prediction_tokens == stats["kept_by_source"]["prediction"]


def test_usage_has_no_prediction_details_without_a_prediction(client):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert response.usage.completion_tokens_details is None


@pytest.mark.parametrize(
    ("prediction", "message"),
    [
        ({"type": "content", "content": "x" * 20_000}, "the prediction holds"),
        ({"type": "text", "content": "x"}, "prediction.type"),
        ({"content": "x"}, "prediction.type"),
        ("def f(): pass", "prediction"),
    ],
)
def test_a_bad_prediction_is_a_400_naming_it(server, prediction, message):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "prediction": prediction}
    answer = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] or message in (error.get("param") or "")
    assert "prediction" in (error.get("param") or error["message"])


# --- structured output --------------------------------------------------------------------


class Record(pydantic.BaseModel):
    """What the OpenAI SDK's ``parse`` sends as a strict JSON schema."""

    name: str = pydantic.Field(max_length=6)
    tag: Literal["red", "green", "blue"]
    ok: bool


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_is_constrained_decoding_of_the_plain_target(client, baseline, stream):
    schema = Record.model_json_schema()
    expected = baseline(
        "user: a record\nassistant:", 60, grammar=GrammarSpec(kind="json_schema", text=json.dumps(schema))
    )
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a record"}],
        max_tokens=60,
        temperature=0,
        stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
        extra_body={"speculative": {"drafter": "hybrid"}},
    )
    if stream:
        chunks = list(response)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish, stats = chunks[-1].choices[0].finish_reason, chunks[-1].speculative
    else:
        text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        stats = response.model_extra["speculative"]
    assert text == expected.text and finish == "stop"
    Record.model_validate_json(text)
    assert stats["proposed_by_source"]["grammar"] > 0


def test_the_sdk_parses_a_structured_answer(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "a record"}], max_tokens=60, response_format=Record
    )
    assert isinstance(completion.choices[0].message.parsed, Record)


def test_json_object_answers_an_object(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "an object"}],
        max_tokens=30,
        temperature=0.7,
        seed=1,
        response_format={"type": "json_object"},
    )
    text = response.choices[0].message.content
    assert text.startswith("{")  # the tiny model seldom closes a free-form object in 30 tokens


@pytest.mark.parametrize(
    ("response_format", "message"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "invalid JSON schema"),
        ({"type": "json_schema"}, "json_schema is required"),
        ({"type": "xml"}, "response_format.type"),
    ],
)
def test_a_bad_response_format_is_a_400_naming_it(server, response_format, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": response_format}
    answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["param"].startswith("response_format")


# --- tool calls ---------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", {"get_weather", "get_time"}), ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
)
def test_a_required_tool_call_follows_its_function_schema(client, choice, names):
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice_ = response.choices[0]
    assert choice_.finish_reason == "tool_calls" and choice_.message.content is None
    (call,) = choice_.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    assert arguments == {"zone": arguments["zone"]} if call.function.name == "get_time" else set(arguments) == {"city"}
    assert response.model_extra["speculative"]["proposed_by_source"]["grammar"] > 0  # the wrapper, drafted


def test_streamed_tool_calls_come_piece_by_piece_with_an_index(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Time?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert len(deltas) >= 2 and {d.index for d in deltas} == {0}  # the arguments come as they are made
    # One entry a call in each chunk (the name and the first arguments come forced together).
    assert all(len(c.choices[0].delta.tool_calls or []) <= 1 for c in chunks if c.choices)
    assert deltas[0].function.arguments  # the forced '{"zone": "' came with the name
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_time"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(arguments)["zone"] in ("utc", "cet")
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no call as text
    # The role alone opens the stream; the calls follow in chunks of their own, without it.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[0].choices[0].delta.tool_calls is None
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_lets_the_model_answer_in_text(client, baseline):
    # The tiny model never opens a call: the answer is its free text, as without tools.
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER],
        max_tokens=12,
        temperature=0,
    )
    assert response.choices[0].finish_reason == "length" and response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content


def test_a_tool_result_goes_back_into_the_conversation(client):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=8)
    assert response.usage.prompt_tokens > 0 and response.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "no tool",
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "required needs tools", "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "same name", "tools"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "not supported", "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "invalid",
            "tools",
        ),
    ],
)
def test_a_bad_tool_request_is_a_400_naming_it(server, extra, message, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["param"] == param


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"role": "tool", "content": "sunny"}, "tool_call_id"),
        ({"role": "user", "content": None}, "Field required"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}],
            },
            "JSON object",
        ),
    ],
)
def test_a_bad_tool_message_is_a_400(server, message, fragment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, message]}
    answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400 and fragment in answer.json()["error"]["message"], answer.text


def test_two_calls_in_one_step_stream_under_their_own_index():
    """A verified block may end one call and open the next: each piece keeps its call's index."""
    from draftwise.api.transcript import Transcript
    from draftwise.api.translate import Plan

    plan = Plan(prompt=[1], config=GenerationConfig(), drafter="off", provenance=False, tools=True)
    transcript = Transcript(plan, None, None)
    first = '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    second = '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call>'
    content, deltas = transcript.stream_pieces(first + second)
    assert content == "" and [d.index for d in deltas] == [0, 1]  # one entry a call in a chunk
    assert [(d.function.name, d.function.arguments) for d in deltas] == [("a", '{"x": 1}'), ("b", '{"y": 2}')]


def test_a_request_takes_the_slot_that_holds_its_prompt(tiny_target):
    """Four slots, one prompt sent three times and another between: each repeat goes to the
    slot that answered it before and prefills only its last token, where taking the slot idle
    longest would have prefilled it whole each time."""

    def ask(client, text):
        return client.completions.create(model=MODEL, prompt=text, max_tokens=2, temperature=0).usage

    prompt = "The lighthouse keeper wrote in his log every night, " * 3
    for url in _serve(tiny_target, slots=4):
        client = _client(url)
        first = ask(client, prompt)
        other = ask(client, "Something else entirely, " * 3)
        again = [ask(client, prompt) for _ in range(2)]
        assert first.prompt_tokens_details.cached_tokens == 0 == other.prompt_tokens_details.cached_tokens
        assert [u.prompt_tokens_details.cached_tokens for u in again] == [first.prompt_tokens - 1] * 2


def _events(response: httpx.Response) -> list[dict]:
    """The JSON chunks of an SSE answer, which must end with [DONE]."""
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


FINGERPRINT = r"^draftwise-\d+\.\d+\.\d+\S*-[0-9a-f]{10}$"
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
TEXT_BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
OFF = {"speculative": {"drafter": "off"}}


@pytest.mark.parametrize(
    ("path", "body", "kind"),
    [("/chat/completions", CHAT_BODY, "chat.completion"), ("/completions", TEXT_BODY, "text_completion")],
)
@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_a_response_has_openais_fields(server, path, body, kind, prefix):
    """As llama.cpp's server tests check an answer: id, object, created, model,
    system_fingerprint, choices and usage, with or without /v1."""
    answer = httpx.post(f"{server}{prefix}{path}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    assert {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"} <= set(reply)
    assert reply["object"] == kind and reply["model"] == MODEL and isinstance(reply["created"], int)
    assert reply["id"].startswith("chatcmpl-" if kind == "chat.completion" else "cmpl-")
    assert re.match(FINGERPRINT, reply["system_fingerprint"]), reply["system_fingerprint"]
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")
    assert reply["usage"]["total_tokens"] == reply["usage"]["prompt_tokens"] + reply["usage"]["completion_tokens"]


@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_a_chat_stream_opens_with_the_role_alone(server, prefix):
    chunks = _events(httpx.post(f"{server}{prefix}/chat/completions", json={**CHAT_BODY, "stream": True}, timeout=60))
    first, *rest = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
    ]
    assert rest[0]["choices"][0]["delta"]["content"]  # the text starts in the next chunk
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    plain = httpx.post(f"{server}/v1/chat/completions", json=CHAT_BODY, timeout=60).json()
    assert rest[-1]["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert rest[-1]["choices"][0]["delta"] == {}
    assert all(c["finish_reason"] is None for chunk in chunks[:-1] for c in chunk["choices"])
    assert len({c["id"] for c in chunks}) == 1 and len({c["system_fingerprint"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert re.match(FINGERPRINT, first["system_fingerprint"])
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        == plain["choices"][0]["message"]["content"]
    )
    assert first["system_fingerprint"] == plain["system_fingerprint"]


def test_a_completion_stream_has_no_role_chunk_and_every_chunk_a_fingerprint(server):
    chunks = _events(
        httpx.post(
            f"{server}/completions",
            # One token a step: a block drafted from an earlier answer may end inside a
            # character, whose bytes then wait for the next chunk.
            json={**TEXT_BODY, "stream": True, "stream_options": {"include_usage": True}, **OFF},
            timeout=60,
        )
    )
    assert chunks[0]["choices"][0]["text"]  # text from the first chunk, as before
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(re.match(FINGERPRINT, c["system_fingerprint"]) for c in chunks)


def test_the_openai_client_works_without_v1(server, client):
    bare = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    ask = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    assert (
        bare.chat.completions.create(messages=messages, **ask).choices[0].message.content
        == client.chat.completions.create(messages=messages, **ask).choices[0].message.content
    )
    streamed = bare.completions.create(prompt=PROMPT, stream=True, **ask)
    assert (
        "".join(c.choices[0].text for c in streamed if c.choices)
        == client.completions.create(prompt=PROMPT, **ask).choices[0].text
    )
    assert [m.id for m in bare.models.list()] == [MODEL] and bare.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        bare.models.retrieve("gpt-4")
    assert client.chat.completions.create(messages=messages, **ask).system_fingerprint.startswith("draftwise-")


def test_the_routes_without_v1_are_documented_once(server):
    paths = httpx.get(f"{server}/openapi.json").json()["paths"]
    for path in ("/completions", "/chat/completions", "/models", "/models/{model}"):
        assert f"/v1{path}" in paths and path not in paths
    assert httpx.get(f"{server}/models").json() == httpx.get(f"{server}/v1/models").json()  # served all the same


def test_the_fingerprint_follows_the_configuration(tiny_target, tiny_near_draft):
    from draftwise import __version__
    from draftwise.api.app import _system_fingerprint

    plain = ServerSettings(target=MODEL)
    one = _system_fingerprint(plain, Pair(tiny_target))
    assert one == _system_fingerprint(plain, Pair(tiny_target.fork()))  # the same configuration, again
    assert one.startswith(f"draftwise-{__version__}-") and re.match(FINGERPRINT, one)
    with_draft = ServerSettings(target=MODEL, draft=MODEL)
    assert _system_fingerprint(with_draft, Pair(tiny_target, tiny_near_draft)) != one
    assert _system_fingerprint(ServerSettings(target=MODEL, drafter="off"), Pair(tiny_target)) != one
