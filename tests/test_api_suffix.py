"""The server drafts from what it wrote for earlier requests (draftwise.suffix): greedy
answers stay the plain target's, scopes keep API keys apart, the store keeps to its cap and
shows in /metrics, and its cache file survives a restart (or costs only an empty store).

Tiny in-process models (target seed 0) on uvicorn in a background thread, as test_api.
The servers price drafting on a recorded host profile (``tests/data/hosts``), held fixed: on
a tiny model's own times, measured beside the other tests, one slow pass can make sure blocks
look dear, and how many tokens the suffix source drafted would hang on the machine's load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.config import GenerationConfig, SuffixConfig  # noqa: E402
from draftwise.engine import autoregressive  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402
from draftwise.profile import read_host  # noqa: E402

from server_support import metric, serve_in_background, wait_for  # noqa: E402

MODEL = "tiny:0"
PROMPT = "Once upon a time"
TOKENS = 24
HOST = Path(__file__).parent / "data" / "hosts" / "intel-xeon.json"  # a host where sure blocks pay


def _serve(target, log=lambda line: None, **suffix) -> Iterator[str]:
    settings = ServerSettings(target=MODEL, suffix=SuffixConfig(**suffix))
    with serve_in_background(create_app(settings, Pair(target.fork(), None, read_host(HOST)), log=log)) as url:
        yield url


def _kept(url: str) -> float:
    return metric(url, "draftwise_draft_tokens_by_source_total", source="suffix", kept="yes")


def _ask(url: str, key: str = "alice", prompt: str = PROMPT) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=TOKENS,
        temperature=0,
        extra_body={"speculative": {"drafter": "ngram"}},
    )
    return response.choices[0].text


@pytest.fixture(scope="module")
def plain(tiny_target) -> str:
    return autoregressive(tiny_target).generate(PROMPT, GenerationConfig(max_new_tokens=TOKENS)).text


def test_a_repeated_request_drafts_from_the_first_and_answers_as_plain_decoding(tiny_target, plain):
    for url in _serve(tiny_target):
        assert _ask(url) == plain and _kept(url) == 0
        # The first answer is kept once it ended (off the rounds): wait for it.
        wait_for(lambda: metric(url, "draftwise_suffix_outputs") == 1)
        assert _ask(url) == plain
        assert _kept(url) > TOKENS / 2
        assert metric(url, "draftwise_suffix_tokens") > TOKENS
        assert metric(url, "draftwise_suffix_cap_tokens") == SuffixConfig().cap_tokens


def test_scopes_keep_api_keys_apart(tiny_target, plain):
    for url in _serve(tiny_target, scope="key"):
        _ask(url, key="alice")
        wait_for(lambda: metric(url, "draftwise_suffix_outputs") == 1)
        assert _ask(url, key="bob") == plain and _kept(url) == 0
        wait_for(lambda: metric(url, "draftwise_suffix_outputs") == 2)
        assert _ask(url, key="alice") == plain and _kept(url) > 0
    for url in _serve(tiny_target, scope="none"):
        _ask(url)
        assert _ask(url) == plain and _kept(url) == 0
        assert metric(url, "draftwise_suffix_tokens") == 0


def test_a_seeded_sampled_answer_does_not_depend_on_earlier_answers(tiny_target):
    def sample() -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0)
        body = {"speculative": {"drafter": "ngram", "k_policy": "fixed", "k": 4}}
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0.9, seed=7, extra_body=body
        )
        return response.choices[0].text

    for url in _serve(tiny_target):
        first = sample()
        _ask(url)  # a greedy answer to the same prompt is kept
        wait_for(lambda: metric(url, "draftwise_suffix_outputs") == 1)
        assert sample() == first and _kept(url) == 0


def test_the_store_keeps_to_its_cap(tiny_target):
    cap = 40
    for url in _serve(tiny_target, cap_tokens=cap, scope="global"):
        for i in range(4):
            _ask(url, prompt=f"{PROMPT} {i}")
            wait_for(lambda: metric(url, "draftwise_suffix_outputs") >= 1)
            assert metric(url, "draftwise_suffix_tokens") <= cap


def test_the_cache_file_survives_a_restart_and_a_broken_one_costs_an_empty_store(tiny_target, plain, tmp_path: Path):
    cache = tmp_path / "suffix.json"
    for url in _serve(tiny_target, cache=cache):
        _ask(url)
        wait_for(lambda: metric(url, "draftwise_suffix_outputs") == 1)
    assert cache.is_file()  # written at shutdown
    for url in _serve(tiny_target, cache=cache):
        assert metric(url, "draftwise_suffix_outputs") == 1
        assert _ask(url) == plain and _kept(url) > TOKENS / 2
    cache.write_text("not a cache")
    lines: list[str] = []
    for url in _serve(tiny_target, log=lines.append, cache=cache):
        assert metric(url, "draftwise_suffix_outputs") == 0
        assert _ask(url) == plain
    assert len(lines) == 1 and "unreadable" in lines[0] and str(cache) in lines[0]
