"""No request stalls the server: prompt text is worked off the event loop, and a cancel
reaches into a long prefill (tiny in-process models; the real-model cases are in
tests/test_markup.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from draftwise.config import GenerationConfig
from draftwise.engine import SpeculativeEngine
from draftwise.lm import PREFILL_CHUNK
from draftwise.target import LocalTarget

httpx = pytest.importorskip("httpx")

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.monitoring import ServerMetrics  # noqa: E402
from draftwise.api.pool import SlotPool, build_slots  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402

from server_support import serve_in_background  # noqa: E402

LONG_PROMPT = [t % 250 + 1 for t in range(5 * PREFILL_CHUNK + 7)]


class CountingLM:
    """A model whose forward passes are counted, and that may call ``hook`` after each."""

    def __init__(self, lm, hook=lambda calls: None) -> None:
        self.lm = lm
        self.calls: list[int] = []
        self.hook = hook

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def forward(self, tokens, last=None):
        scores = self.lm.forward(tokens, last)
        self.calls.append(len(tokens))
        self.hook(self.calls)
        return scores


def test_a_cancel_during_the_prefill_ends_the_stream_with_no_event(tiny_target):
    lm = CountingLM(tiny_target.fork())
    engine = SpeculativeEngine(LocalTarget(lm), tokenizer=tiny_target.tokenizer)
    events = list(engine.stream(LONG_PROMPT, GenerationConfig(max_new_tokens=4), cancelled=lambda: len(lm.calls) >= 2))
    assert events == []
    assert lm.calls == [PREFILL_CHUNK, PREFILL_CHUNK]  # it stopped between chunks, 3 chunks early


def test_a_long_prompt_is_prefilled_in_chunks(tiny_target):
    lm = CountingLM(tiny_target.fork())
    engine = SpeculativeEngine(LocalTarget(lm), tokenizer=tiny_target.tokenizer)
    tokens = engine.generate(LONG_PROMPT, GenerationConfig(max_new_tokens=8)).tokens
    assert lm.calls[:6] == [PREFILL_CHUNK] * 5 + [7 - 1]  # the last prompt token comes with the first step
    assert len(tokens) == 8


def test_a_request_cancelled_in_its_prefill_frees_its_slot_at_once(tiny_target):
    async def scenario() -> tuple[list, SlotPool, CountingLM]:
        metrics = ServerMetrics()
        (slot,) = build_slots(tiny_target, None, 1)
        pool = SlotPool([slot], queue_size=0, timeout=120, metrics=metrics)
        job = pool.admit()
        # The client goes away while the first chunk of the prompt is being fed.
        slot.target = CountingLM(slot.target, hook=lambda calls: job.close("disconnect"))
        events = [e async for e in pool.run(job, LONG_PROMPT, GenerationConfig(max_new_tokens=4), "off")]
        for _ in range(200):  # the slot is handed back by a callback of the finished thread
            if pool.running == 0:
                break
            await asyncio.sleep(0.05)
        pool.close()
        return events, pool, slot.target

    events, pool, lm = asyncio.run(scenario())
    assert events == []
    assert lm.calls == [PREFILL_CHUNK]  # one chunk fed, none after the cancel
    assert pool.running == 0 and pool.waiting == 0
    assert pool.metrics.cancelled.labels("disconnect")._value.get() == 1


def test_prompt_text_is_tokenized_off_the_event_loop(tiny_target, monkeypatch):
    threads: list[str] = []
    tokenizer = tiny_target.tokenizer
    original = type(tokenizer).encode

    def encode(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode", encode)
    app = create_app(ServerSettings(target="tiny:0", drafter="off"), Pair(tiny_target).fork())
    body = {"model": "tiny:0", "max_tokens": 2, "temperature": 0}
    with serve_in_background(app) as url:
        raw = httpx.post(f"{url}/v1/completions", json={**body, "prompt": "Once upon"}, timeout=60)
        chat = httpx.post(
            f"{url}/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}, timeout=60
        )
    assert raw.status_code == chat.status_code == 200
    assert threads and all(name.startswith("draftwise-text") for name in threads), threads


def test_a_text_longer_than_the_context_could_hold_is_refused_from_its_size(tiny_target, monkeypatch):
    tokenizer = tiny_target.tokenizer
    monkeypatch.setattr(type(tokenizer), "encode", lambda *a, **k: pytest.fail("tokenized a hopeless prompt"))
    app = create_app(ServerSettings(target="tiny:0", drafter="off", max_context=64), Pair(tiny_target).fork())
    with serve_in_background(app) as url:
        answer = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny:0", "max_tokens": 2, "prompt": "a" * 100_000}, timeout=60
        )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "100000 bytes" in error["message"]
