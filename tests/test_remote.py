"""The remote verifier, against a real uvicorn server on loopback with tiny models."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import weakref

import httpx
import numpy as np
import pytest
import torch

from draftwise.backends.tiny import tiny_lm, tiny_tokenizer
from draftwise.config import DraftConfig, GenerationConfig, GrammarSpec, SamplingConfig
from draftwise.constraint import REASON_CHARS, GrammarDeadEnd
from draftwise.drafters import ModelDrafter, NGramDrafter, Proposal
from draftwise.engine import SpeculativeEngine, autoregressive
from draftwise.errors import SlotsFullError
from draftwise.events import GRAMMAR
from draftwise.grammar import Grammars
from draftwise.lm import drive
from draftwise.remote.client import RemoteTarget, RemoteVerifierError, connect
from draftwise.remote.protocol import OpenSession, decode_verify_response, encode_verify_request, tokenizer_fingerprint
from draftwise.remote.server import create_app
from draftwise.remote.settings import ClientSettings, VerifierSettings
from draftwise.target import LocalTarget
from grammar_support import LATE_DEAD_END

from cli_support import run_cli_here
from server_support import serve_in_background

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
DRAFTWISE = [sys.executable, "-c", "from draftwise.cli import main; main()"]  # the real entry point
FIXED = DraftConfig(k_policy="fixed", k=4)  # timing-independent block sizes, so runs are comparable


@pytest.fixture(scope="module")
def target_lm(tiny_target):
    return tiny_target


def _server(target_lm, **overrides):
    return serve_in_background(create_app(VerifierSettings(target="tiny:0", **overrides), lm=target_lm.fork()))


@pytest.fixture(scope="module")
def url(target_lm):
    with _server(target_lm) as base:
        yield base


@pytest.fixture()
def http(url):
    with httpx.Client(base_url=url) as client:
        yield client


def _open(http: httpx.Client, prompt=(1, 2, 3), **sampling) -> str:
    response = http.post("/v1/sessions", json={"prompt": list(prompt), "sampling": sampling})
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def _verify(http: httpx.Client, session: str, tokens=(5, 6), keep=3, append=(), q=None, headers=None):
    body = encode_verify_request(keep, list(append), list(tokens), *(q or (None, None)))
    return http.post(f"/v1/sessions/{session}/verify", content=body, headers=headers)


def _local_and_remote(url: str, target, draft, config: GenerationConfig, ngram: bool = False):
    """The same generation in one process and through the server (models are reset per run)."""

    def drafter():
        return NGramDrafter() if ngram else ModelDrafter(draft)

    local = SpeculativeEngine(LocalTarget(target), drafter(), tokenizer=target.tokenizer).generate(PROMPT, config)
    with connect(url, tokenizer=draft.tokenizer) as remote_target:
        remote = SpeculativeEngine(remote_target, drafter(), tokenizer=draft.tokenizer).generate(PROMPT, config)
    return local, remote


@pytest.mark.parametrize("draft_name", ["tiny_same_draft", "tiny_random_draft", "tiny_near_draft"])
def test_remote_greedy_is_token_identical_to_local(url, target_lm, draft_name, request):
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True, draft=FIXED)
    local, remote = _local_and_remote(url, target_lm, request.getfixturevalue(draft_name), config)
    assert remote.tokens == local.tokens
    assert [e.n_accepted for e in remote.events] == [e.n_accepted for e in local.events]
    assert remote.metrics.acceptance_rate == local.metrics.acceptance_rate
    if draft_name == "tiny_same_draft":  # draft == target: everything is accepted
        assert remote.metrics.acceptance_rate == 1.0
    for event in remote.events:
        assert event.extra["server_seconds"] > 0 and event.extra["network_seconds"] >= 0
        # greedy: 20-byte header + 4 bytes per proposed token; no context is re-sent
        assert event.extra["request_bytes"] == 20 + 4 * len(event.proposed)
        assert event.extra["response_bytes"] == 12 + 4 * len(event.proposed)
    np.testing.assert_allclose(
        [p for e in remote.events for p in e.target_probs], [p for e in local.events for p in e.target_probs], rtol=1e-5
    )


@pytest.mark.parametrize(
    "sampling, draft, ngram",
    [
        (SamplingConfig(temperature=1.0, seed=7), FIXED, False),  # full q (257 entries)
        (SamplingConfig(temperature=0.8, top_p=0.9, seed=11), FIXED.model_copy(update={"proposal_top": 8}), False),
        (SamplingConfig(temperature=1.0, top_k=20, seed=3), DraftConfig(k_policy="heuristic", k=3), False),
        (SamplingConfig(temperature=1.0, seed=5), FIXED, True),  # point-mass q: no q sent at all
    ],
)
def test_seeded_sampling_gives_the_same_tokens_remotely(url, target_lm, tiny_near_draft, sampling, draft, ngram):
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True, sampling=sampling, draft=draft)
    local, remote = _local_and_remote(url, target_lm, tiny_near_draft, config, ngram=ngram)
    assert remote.tokens == local.tokens
    assert [e.n_accepted for e in remote.events] == [e.n_accepted for e in local.events]
    assert remote.metrics.proposed > 0
    if not ngram:  # a real mix of acceptances and rejections was exercised
        assert 0 < remote.metrics.acceptance_rate < 1
    if draft.proposal_top:
        widths = {
            (e.extra["request_bytes"] - 20 - 4 * len(e.proposed)) // (8 * len(e.proposed))
            for e in remote.events
            if e.proposed
        }
        assert max(widths) <= draft.proposal_top


def test_proposal_top_limits_the_draft_distribution(tiny_random_draft):
    drafter = ModelDrafter(tiny_random_draft)
    config = GenerationConfig(sampling=SamplingConfig(temperature=1.0, seed=1), draft=DraftConfig(proposal_top=5))
    drafter.start([1, 2, 3], config, torch.Generator().manual_seed(0))
    proposal = drive(drafter.propose([1, 2, 3], 3))
    assert ((proposal.probs > 0).sum(-1) <= 5).all()
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(len(proposal)))


def test_handshake_refuses_a_different_tokenizer(url, target_lm):
    tokenizer = tiny_tokenizer()
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(target_lm.tokenizer)
    tokenizer.hf.add_tokens(["<extra>"])
    with pytest.raises(RemoteVerifierError, match="tokenizer differs"):
        connect(url, tokenizer=tokenizer)


def test_unreachable_verifier_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RemoteVerifierError, match="cannot reach"):
        connect(f"http://127.0.0.1:{port}")
    with pytest.raises(RemoteVerifierError, match="http://"):
        connect(f"127.0.0.1:{port}")


def test_info_health_and_docs(url, http, target_lm):
    info = http.get("/info").json()
    assert info["model"] == "tiny:0"
    assert info["vocab_size"] == target_lm.vocab_size
    assert info["tokenizer_fingerprint"] == tokenizer_fingerprint(target_lm.tokenizer)
    assert info["limits"]["max_block"] == VerifierSettings(target="x").max_block
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/docs").status_code == 200
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/health", "/info", "/v1/sessions", "/v1/sessions/{session_id}/verify"} <= set(paths)


def test_auth(target_lm):
    with _server(target_lm, api_key="s3cret") as base, httpx.Client(base_url=base) as http:
        assert http.get("/health").status_code == 200  # probes need no key
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
            response = http.get("/info", headers=headers)
            assert response.status_code == 401 and "API key" in response.json()["detail"]
            assert http.post("/v1/sessions", json={"prompt": [1]}, headers=headers).status_code == 401
        with pytest.raises(RemoteVerifierError, match="401"):
            connect(base)
        good = {"authorization": "Bearer s3cret"}
        assert http.get("/info", headers=good).status_code == 200
        with connect(base, api_key="s3cret") as target:
            drive(target.start([1, 2, 3], GenerationConfig(), None))
            assert drive(target.verify([1, 2, 3], Proposal(torch.tensor([4])))).verdict.n_proposed == 1


def test_lru_eviction(target_lm):
    with _server(target_lm, max_sessions=2) as base, httpx.Client(base_url=base) as http:
        first, second = _open(http), _open(http)
        assert _verify(http, second).status_code == 200
        assert _verify(http, first).status_code == 200  # first is now the most recently used
        third = _open(http)  # evicts second, the least recently used
        assert _verify(http, second).status_code == 404
        assert _verify(http, first).status_code == 200  # keep=3: rewinds to the prompt
        assert _verify(http, third).status_code == 200
        assert http.get("/health").json()["sessions"] == 2


def test_a_session_not_yet_verified_is_evicted_last(target_lm):
    # Under churn (more active clients than slots) a reopened session could otherwise be
    # evicted before its first verify: its prefill wasted, its client failing again.
    with _server(target_lm, max_sessions=2) as base, httpx.Client(base_url=base) as http:
        used, fresh = _open(http), _open(http)
        assert _verify(http, used).status_code == 200  # fresh is now the least recently used
        newest = _open(http)  # evicts used, the least recently used that has been verified
        assert _verify(http, fresh).status_code == 200
        assert _verify(http, used).status_code == 404
        # With every slot unverified, the least recently used goes after all.
        newer = _open(http), _open(http)
        assert _verify(http, newest).status_code == 404 and _verify(http, newer[1]).status_code == 200


class Slotted:
    """A model whose forks take slots of a fixed pool and give them back when dropped, as
    llama.cpp's sequences of one context do (``LlamaCppModel.fork``)."""

    def __init__(self, lm, free: list[int]) -> None:
        self.lm = lm
        self.free = free  # the pool's free slots, shared by the model and its forks

    def __getattr__(self, name):
        return getattr(self.lm, name)

    def fork(self) -> Slotted:
        if not self.free:
            raise SlotsFullError("all 2 slots of tiny:0's context are in use")
        fork = Slotted(self.lm.fork(), self.free)
        weakref.finalize(fork, self.free.append, self.free.pop())
        return fork


def test_a_session_past_the_slots_evicts_one_that_is_not_verifying(target_lm):
    free = [1]  # two slots: the loaded model's and one more
    app = create_app(VerifierSettings(target="tiny:0", max_sessions=8), lm=Slotted(target_lm.fork(), free))
    with serve_in_background(app) as base, httpx.Client(base_url=base) as http:
        first, second = _open(http), _open(http)
        assert free == []  # the first session runs on the loaded model itself, the second on a fork
        assert _verify(http, first).status_code == 200
        third = _open(http)  # no slot is free: evicts first, the least recently used verified one
        assert _verify(http, first).status_code == 404
        assert _verify(http, second).status_code == 200 and _verify(http, third).status_code == 200
        assert http.get("/health").json()["sessions"] == 2
        http.delete(f"/v1/sessions/{second}").raise_for_status()
        assert free == [1]  # the fork's slot came back with it
        _open(http)  # takes the slot the closed session gave back, evicting nobody
        assert _verify(http, third).status_code == 200


def test_a_session_past_the_slots_while_each_verifies_is_a_503(target_lm):
    from draftwise.remote.sessions import VerifierError, VerifierService

    service = VerifierService(VerifierSettings(target="tiny:0"), Slotted(target_lm.fork(), [1]))
    try:
        request = OpenSession(prompt=[1, 2, 3], sampling=SamplingConfig(temperature=0))
        held = [service.open(request).session_id for _ in range(2)]
        for session_id in held:  # each in a verify, as far as the table can tell
            service._sessions[session_id].lock.acquire()
        with pytest.raises(VerifierError, match="all 2 slots .* each in a verify now") as refused:
            service.open(request)
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert service.session_count == 2  # nobody was evicted mid-verify
        service._sessions[held[0]].lock.release()
        assert service.open(request).session_id not in held  # the idle one made room
        assert service.session_count == 2 and held[1] in service._sessions
    finally:
        service.scheduler.close()


def test_idle_sessions_expire_without_traffic(target_lm):
    with _server(target_lm, idle_timeout_s=0.3, sweep_interval_s=0.05) as base, httpx.Client(base_url=base) as http:
        session = _open(http)
        assert http.get("/health").json()["sessions"] == 1
        deadline = time.monotonic() + 5
        while http.get("/health").json()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.get("/health").json()["sessions"] == 0  # the vanished client leaked nothing
        response = _verify(http, session)
        assert response.status_code == 404 and "unknown session" in response.json()["detail"]


def test_client_reopens_an_evicted_session(target_lm, tiny_near_draft):
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, draft=FIXED)
    expected = SpeculativeEngine.from_models(target_lm, tiny_near_draft).generate(PROMPT, config).tokens
    with _server(target_lm, max_sessions=1) as base, connect(base) as target:
        drafter = ModelDrafter(tiny_near_draft)
        stream = SpeculativeEngine(target, drafter, tokenizer=target_lm.tokenizer).stream(PROMPT, config)
        tokens = list(next(stream).tokens)
        with httpx.Client(base_url=base) as http:
            _open(http)  # takes the only slot
        tokens += [t for event in stream for t in event.tokens]
    assert tokens == expected


def test_limits(target_lm):
    with (
        _server(target_lm, max_context=16, max_block=4, max_q_entries=3, max_body_bytes=2048) as base,
        httpx.Client(base_url=base) as http,
    ):
        assert http.post("/v1/sessions", json={"prompt": list(range(17))}).status_code == 422
        session = _open(http, range(10), temperature=1.0)
        too_long = _verify(http, session, tokens=(1, 2, 3, 4, 5), keep=10)
        assert too_long.status_code == 422 and "max_block" in too_long.json()["detail"]
        context = _verify(http, session, tokens=(1, 2, 3, 4), keep=10, append=(1, 2))
        assert context.status_code == 422 and "max_context" in context.json()["detail"]
        wide = (np.array([[5, 6, 7, 8]]), np.full((1, 4), 0.25, dtype=np.float32))
        response = _verify(http, session, tokens=(5,), keep=10, q=wide)
        assert response.status_code == 422 and "max_q_entries" in response.json()["detail"]
        big = http.post("/v1/sessions", json={"prompt": [1] * 2000})
        assert big.status_code == 413 and "max_body_bytes" in big.json()["detail"]
        chunked = http.post("/v1/sessions", content=iter([b'{"prompt": [1]}']))
        assert chunked.status_code == 411
        narrow = (np.array([[5, 6, 7]]), np.array([[0.5, 0.25, 0.25]], dtype=np.float32))
        assert _verify(http, session, tokens=(5,), keep=10, q=narrow).status_code == 200


def test_malformed_json_is_a_400_that_says_where(http):
    response = http.post("/v1/sessions", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json() == {
        "detail": "the body is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"
    }


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("body", "content_type", "says"),
    [
        # Past Python's recursion limit: the parser itself gives up (this was a 500).
        (b'{"prompt": ' + _nested(50_000) + b"}", "application/json", "deeper than 128 levels (in 'prompt')"),
        # Past the server's 128 levels, short of Python's limit.
        (
            b'{"prompt": [1], "sampling": ' + _nested(200) + b"}",
            "application/json",
            "deeper than 128 levels (in 'sampling')",
        ),
        (
            b'{"prompt": [1], "grammar": {"kind": "regex", "text": "caf\xe9"}}',
            "application/json",
            "not UTF-8 text: byte 0xe9 at offset 57 (in 'grammar')",
        ),
        (
            b'{"prompt": [1], "sampling": {"temperature": NaN}}',
            "application/json",
            "NaN is not a JSON number (in 'sampling')",
        ),
        (b'{"prompt": [1]}', "text/plain", "Content-Type: application/json (got 'text/plain')"),
        (b'{"prompt": [1]}', None, "Content-Type: application/json (got none)"),
        (b"", "application/json", "the body is empty"),
        (b"[1, 2]", "application/json", "the body must be a JSON object, not an array"),
        (
            b'{"prompt": [1] oops',
            "application/json",
            "the body is not valid JSON: Expecting ',' delimiter at line 1 column 16",
        ),
    ],
)
def test_a_body_that_is_no_json_object_is_a_400_that_says_why(http, body, content_type, says):
    headers = {} if content_type is None else {"content-type": content_type}
    response = http.post("/v1/sessions", content=body, headers=headers)
    assert response.status_code == 400, response.text
    detail = response.json()["detail"]
    assert says in detail and "\n" not in detail and "Traceback" not in detail
    _open(http)  # still serving


def test_a_session_body_as_deep_as_the_limit_is_read(http):
    """128 levels (the object, a sampling object, then 126 more) pass the depth check, and
    are refused for what they hold; 129 for their depth."""

    def detail(levels: int) -> tuple[int, str]:
        body = b'{"prompt": [1], "sampling": {"seed": ' + _nested(levels - 2) + b"}}"
        response = http.post("/v1/sessions", content=body, headers={"content-type": "application/json"})
        return response.status_code, response.json()["detail"]

    status, message = detail(128)
    assert status == 422 and "sampling.seed" in message
    assert detail(129) == (400, "the body nests arrays and objects deeper than 128 levels (in 'sampling')")


def _bad_requests(http: httpx.Client, session: str, vocab: int):
    def raw(body: bytes, sid: str = session):
        return http.post(f"/v1/sessions/{sid}/verify", content=body)

    yield (
        "malformed JSON",
        http.post("/v1/sessions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"}),
    )
    yield "prompt not a list", http.post("/v1/sessions", json={"prompt": "hello"})
    yield (
        "temperature not a number",
        http.post("/v1/sessions", json={"prompt": [1], "sampling": {"temperature": "hot"}}),
    )
    yield "unknown key", http.post("/v1/sessions", json={"prompt": [1], "speed": "fast"})
    yield "empty prompt", http.post("/v1/sessions", json={"prompt": []})
    yield "out-of-vocabulary prompt", http.post("/v1/sessions", json={"prompt": [1, vocab]})
    yield "negative token in prompt", http.post("/v1/sessions", json={"prompt": [-1]})
    yield "huge token in prompt", http.post("/v1/sessions", json={"prompt": [10**30]})
    yield "out-of-vocabulary proposal", _verify(http, session, tokens=(5, vocab))
    yield "out-of-vocabulary append", _verify(http, session, append=(10**6,))
    yield "negative block size", raw(np.array([3, 0, -2, 0], dtype="<i4").tobytes())
    yield "huge block size", raw(np.array([3, 0, 2**31 - 1, 0], dtype="<i4").tobytes())
    yield "truncated body", raw(encode_verify_request(3, [], [5, 6])[:-2])
    yield "empty body", raw(b"")
    yield "keep past the context", _verify(http, session, keep=99)
    yield "empty context", _verify(http, session, keep=0)
    yield "unknown session", _verify(http, "no-such-session")
    yield "unknown session delete", http.delete("/v1/sessions/no-such-session")
    yield "oversize body", raw(b"\0" * (VerifierSettings(target="x").max_body_bytes + 1))
    yield "unknown route", http.get("/v2/nothing")
    yield "wrong method", http.get("/v1/sessions")


def test_bad_input_is_a_4xx_with_a_message_and_the_server_keeps_serving(http, target_lm):
    session = _open(http, temperature=1.0)
    for what, response in _bad_requests(http, session, target_lm.vocab_size):
        assert 400 <= response.status_code < 500, (what, response.status_code, response.text)
        assert response.json()["detail"], what
    bad_q = [
        ("q misses the token", (np.array([[7, 8]]), np.array([[0.5, 0.5]], dtype=np.float32))),
        ("q is negative", (np.array([[5, 8]]), np.array([[1.5, -0.5]], dtype=np.float32))),
        ("q is NaN", (np.array([[5, 8]]), np.array([[np.nan, 0.5]], dtype=np.float32))),
        ("q sums past 1", (np.array([[5, 8]]), np.array([[0.9, 0.9]], dtype=np.float32))),
        ("q id out of vocabulary", (np.array([[5, 10**6]]), np.array([[0.5, 0.5]], dtype=np.float32))),
    ]
    for what, q in bad_q:
        response = _verify(http, session, tokens=(5,), q=q)
        assert response.status_code == 422 and response.json()["detail"], what
    good = _verify(http, session, tokens=(5, 6), q=(np.array([[5], [6]]), np.ones((2, 1), dtype=np.float32)))
    assert good.status_code == 200
    answer = decode_verify_response(good.content, 2)
    assert 0 <= answer.n_accepted <= 2 and 0 <= answer.next_token < target_lm.vocab_size


def test_a_client_sees_server_refusals_as_clear_errors(url):
    target = RemoteTarget(url)
    with pytest.raises(RemoteVerifierError, match="before start"):
        drive(target.verify([1], Proposal(torch.tensor([2]))))
    config = GenerationConfig(sampling=SamplingConfig(temperature=1.0))
    drive(target.start([1, 2], config, None))
    vocab = target.info.vocab_size
    with pytest.raises(RemoteVerifierError, match="422.*vocabulary"):
        drive(target.verify([1, 2], Proposal(torch.tensor([vocab]), torch.full((1, vocab + 1), 1.0 / (vocab + 1)))))
    target.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_cli_serves_and_shuts_down_cleanly():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRAFTWISE_VERIFIER_API_KEY": "k"}
    process = subprocess.Popen(
        [*DRAFTWISE, "serve-verifier", "--target", "tiny:0", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"{base}/health").status_code == 200
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
                time.sleep(0.2)
        assert httpx.get(f"{base}/info").status_code == 401  # key taken from the environment
        with connect(base, api_key="k") as target:
            assert target.info.model == "tiny:0"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_cli_rejects_bad_settings_in_one_line():
    result = subprocess.run(
        [*DRAFTWISE, "serve-verifier", "--target", "tiny:0", "--max-sessions", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--max-sessions" in result.stderr and "Traceback" not in result.stderr


def test_generate_cli_with_a_remote_verifier(url, target_lm):
    """``draftwise generate --verifier`` through the real entry point gives the local tokens."""
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True, draft=FIXED)
    expected = SpeculativeEngine.from_models(target_lm, tiny_lm(1)).generate("Hello", config).tokens
    flags = [
        "--draft",
        "tiny:1",
        "--verifier",
        url,
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--k-policy",
        "fixed",
        "--k",
        "4",
        "--json",
        "Hello",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*DRAFTWISE, "generate", *flags], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == expected
    refused = subprocess.run(
        [*DRAFTWISE, "generate", *flags, "--compare"], capture_output=True, text=True, timeout=120, env=env
    )
    assert refused.returncode == 2 and "--verifier" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 1e-40},
        {"temperature": 5e-324, "top_k": 1},
    ],
)
def test_vanishing_sampling_settings_verify_like_greedy(http, sampling):
    greedy = decode_verify_response(_verify(http, _open(http), tokens=(5, 6)).content, 2)
    response = _verify(http, _open(http, **sampling), tokens=(5, 6))
    assert response.status_code == 200, response.text
    answer = decode_verify_response(response.content, 2)
    assert (answer.n_accepted, answer.next_token) == (greedy.n_accepted, greedy.next_token)


def test_a_prompt_that_leaves_no_room_is_refused_when_the_session_opens(target_lm):
    with _server(target_lm, max_context=64) as base, httpx.Client(base_url=base) as http:
        full = http.post("/v1/sessions", json={"prompt": [1] * 64})
        assert full.status_code == 422 and "max_context of 64" in full.json()["detail"]
        session = _open(http, [1] * 63)  # room for exactly one more token
        assert _verify(http, session, tokens=(), keep=63).status_code == 200
        refused = _verify(http, session, tokens=(), keep=64)
        assert refused.status_code == 422 and "max_context" in refused.json()["detail"]


def test_max_context_is_capped_at_the_models_own(target_lm):
    own = target_lm.max_context
    with _server(target_lm) as base, httpx.Client(base_url=base) as http:  # default setting: 32768
        assert VerifierSettings(target="x").max_context > own
        assert http.get("/info").json()["limits"]["max_context"] == own
        too_long = http.post("/v1/sessions", json={"prompt": [1] * (own + 10)})
        assert too_long.status_code == 422 and f"max_context of {own}" in too_long.json()["detail"]
    with _server(target_lm, max_context=100) as base, httpx.Client(base_url=base) as http:
        assert http.get("/info").json()["limits"]["max_context"] == 100  # a smaller setting stays


def test_a_401_says_how_to_authenticate_and_docs_are_open(target_lm):
    with _server(target_lm, api_key="s3cret") as base, httpx.Client(base_url=base) as http:
        for method, path in (
            ("GET", "/info"),
            ("POST", "/v1/sessions"),
            ("DELETE", "/v1/sessions/x"),
            ("POST", "/v1/sessions/x/verify"),
        ):
            response = http.request(method, path)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer", path
        for path in ("/health", "/docs", "/redoc", "/openapi.json"):
            assert http.get(path).status_code == 200, path


def test_openapi_lists_every_status_the_verifier_sends(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    expected = {
        ("/v1/sessions", "post"): {"201", "400", "401", "411", "413", "422", "500"},
        ("/v1/sessions/{session_id}", "delete"): {"204", "401", "404", "500"},
        ("/v1/sessions/{session_id}/verify", "post"): {"200", "401", "404", "409", "411", "413", "422", "500"},
        ("/info", "get"): {"200", "401", "500"},
    }
    for (path, method), statuses in expected.items():
        responses = paths[path][method]["responses"]
        assert set(responses) == statuses, (path, method)
        for status in statuses - {"200", "201", "204"}:
            body = responses[status]["content"]["application/json"]["schema"]
            assert body["$ref"] == "#/components/schemas/ErrorDetail", (path, status)
    assert schema["components"]["schemas"]["ErrorDetail"]["properties"]["detail"]["type"] == "string"
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # FastAPI's array of detail: never sent


def test_an_unexpected_fault_is_a_json_500(target_lm, monkeypatch):
    from draftwise.remote import sessions

    with _server(target_lm) as base, httpx.Client(base_url=base) as http:
        session = _open(http)

        def broken(*args, **kwargs):
            raise RuntimeError("a bug")

        monkeypatch.setattr(sessions.LocalTarget, "verify", broken)
        response = _verify(http, session)
        assert response.status_code == 500 and "a bug" in response.json()["detail"]


def _remote_run(base: str, draft, prompt, config: GenerationConfig):
    with connect(base, tokenizer=draft.tokenizer) as target:
        return SpeculativeEngine(target, ModelDrafter(draft), tokenizer=draft.tokenizer).generate(prompt, config)


def test_a_remote_run_ends_at_max_context_with_length_and_keeps_its_text(target_lm, tiny_near_draft):
    config = GenerationConfig(max_new_tokens=100, ignore_eos=True, draft=FIXED)
    local = SpeculativeEngine.from_models(target_lm, tiny_near_draft).generate(PROMPT, config)
    with _server(target_lm, max_context=48) as base:
        remote = _remote_run(base, tiny_near_draft, PROMPT, config)
    assert remote.metrics.finish_reason == "length"
    # Blocks shrink to fit, so the session fills up exactly; every token is the local one.
    assert len(remote.prompt_ids) + len(remote.tokens) == 48
    assert remote.tokens == local.tokens[: len(remote.tokens)]


def test_a_verifier_that_disappears_mid_run_leaves_the_text_and_a_reason(target_lm, tiny_near_draft):
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, draft=FIXED)
    local = SpeculativeEngine.from_models(target_lm, tiny_near_draft).generate(PROMPT, config)
    server = _server(target_lm)
    base = server.__enter__()
    # reconnect_s=0: gives up at once (tests/test_remote_reliability.py covers the retries).
    with connect(base, tokenizer=tiny_near_draft.tokenizer, settings=ClientSettings(reconnect_s=0)) as target:
        stream = SpeculativeEngine(target, ModelDrafter(tiny_near_draft), tokenizer=target_lm.tokenizer).stream(
            PROMPT, config
        )
        events = [next(stream), next(stream)]
        server.__exit__(None, None, None)  # the verifier goes away mid-generation
        events += list(stream)
    tokens = [t for e in events for t in e.tokens]
    assert events[-1].finish_reason == "error" and "cannot reach the verifier" in events[-1].extra["detail"]
    assert 0 < len(tokens) < len(local.tokens) and tokens == local.tokens[: len(tokens)]


def test_generate_cli_keeps_the_text_when_the_verifier_context_fills(target_lm):
    with _server(target_lm, max_context=24) as base:
        flags = ["--draft", "tiny:1", "--verifier", base, "--max-new-tokens", "50", "--ignore-eos", "--json", "Hello"]
        result = subprocess.run(
            [*DRAFTWISE, "generate", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["metrics"]["finish_reason"] == "length" and out["prompt_tokens"] + len(out["tokens"]) == 24


def test_generate_cli_reports_a_verifier_refusal_after_printing_what_it_has(target_lm):
    with _server(target_lm, max_q_entries=1) as base:  # a full draft distribution is over this limit
        flags = [
            "--draft",
            "tiny:1",
            "--verifier",
            base,
            "--max-new-tokens",
            "8",
            "--temperature",
            "1",
            "--seed",
            "1",
            "--k-policy",
            "fixed",
            "--k",
            "4",
            "--json",
            "Hi",
        ]
        result = subprocess.run(
            [*DRAFTWISE, "generate", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "stopped early" in result.stderr and "over the verifier's limit of 1" in result.stderr
    assert json.loads(result.stdout)["metrics"]["finish_reason"] == "error"


# --- structured output: the grammar travels with the session -------------------------------------

# A bounded record: every answer a model can give under it ends within a few dozen tokens.
RECORD = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "tag"],
    "additionalProperties": False,
}
RECORD_SPEC = GrammarSpec(kind="json_schema", text=json.dumps(RECORD))
RECORD_PROMPT = "Give me a record: "


def _remote_engine(remote: RemoteTarget, drafter, tokenizer) -> SpeculativeEngine:
    return SpeculativeEngine(remote, drafter, tokenizer=tokenizer, grammars=remote.grammars(tokenizer))


@pytest.mark.parametrize("ngram", [False, True])
def test_a_grammar_travels_with_the_session_and_gives_constrained_decoding(url, target_lm, tiny_near_draft, ngram):
    config = GenerationConfig(max_new_tokens=60, grammar=RECORD_SPEC, draft=FIXED)
    plain = autoregressive(target_lm).generate(RECORD_PROMPT, config)
    with connect(url, tokenizer=target_lm.tokenizer) as remote:
        drafter = NGramDrafter() if ngram else ModelDrafter(tiny_near_draft)
        result = _remote_engine(remote, drafter, target_lm.tokenizer).generate(RECORD_PROMPT, config)
    assert result.tokens == plain.tokens and plain.metrics.finish_reason == "eos"
    assert json.loads(result.text.removesuffix("<|eos|>"))["tag"] in ("red", "green", "blue")
    assert result.metrics.proposed_by_source.get(GRAMMAR, 0) > 0  # the keys drafted from the grammar


def test_a_sampled_draft_the_grammar_cut_gives_the_same_tokens_remotely(url, target_lm, tiny_near_draft):
    # The row of the token the grammar refused after a block travels (refused=1), and the
    # verifier corrects it from max(0, p - q) as a local run does (draftwise.verify.verify_sampling).
    grammars = Grammars(target_lm.tokenizer, target_lm.vocab_size, target_lm.eos_token_ids)
    cut = 0
    for seed in range(6):
        sampling = SamplingConfig(temperature=1.0, seed=seed)
        config = GenerationConfig(max_new_tokens=60, grammar=RECORD_SPEC, draft=FIXED, sampling=sampling)
        engine = SpeculativeEngine(
            LocalTarget(target_lm), ModelDrafter(tiny_near_draft), tokenizer=target_lm.tokenizer, grammars=grammars
        )
        local = engine.generate(RECORD_PROMPT, config)
        with connect(url, tokenizer=target_lm.tokenizer) as remote:
            result = _remote_engine(remote, ModelDrafter(tiny_near_draft), target_lm.tokenizer).generate(
                RECORD_PROMPT, config
            )
        assert result.tokens == local.tokens
        cut += sum(
            e.source == "model" and e.n_accepted == len(e.proposed) and e.sources[-1] == "corrected"
            for e in local.events
        )
    assert cut > 0  # some block was cut at a token the grammar refused


def test_a_refused_row_needs_the_sessions_grammar(http):
    session = _open(http, temperature=1.0)
    q = (np.array([[5], [6], [7]]), np.array([[1.0], [1.0], [1.0]], dtype=np.float32))
    response = _verify(http, session, tokens=(5, 6), q=q)
    assert response.status_code == 422 and "this session has none" in response.json()["detail"]


def test_the_verifier_masks_every_row_with_the_sessions_grammar(target_lm):
    a, b, c, d = (target_lm.tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "abcd")
    # A grammar's text has commas of its own: they do not count against the prompt's room.
    pattern = "(" * 40 + "a" + "){1,1}" * 40 + "(b|c)d"  # "a(b|c)d", with 40 commas
    with _server(target_lm, max_context=16) as base, httpx.Client(base_url=base) as http:
        opened = http.post("/v1/sessions", json={"prompt": [1, 2, 3], "grammar": {"kind": "regex", "text": pattern}})
        assert opened.status_code == 201, opened.text
        session = opened.json()["session_id"]

        def verify(tokens, keep, append=()):
            response = _verify(http, session, tokens=tokens, keep=keep, append=append)
            assert response.status_code == 200, response.text
            return decode_verify_response(response.content, len(tokens))

        assert verify((), keep=3).next_token == a  # the only token the grammar allows first
        refused = verify((d,), keep=4)  # d is not allowed after a: refused, corrected to b or c
        assert refused.n_accepted == 0 and refused.next_token in (b, c)
        again = verify((), keep=4, append=(c,))  # the client rewrote the answer: walked again
        assert again.next_token == d
        assert verify((), keep=6).next_token in target_lm.eos_token_ids  # complete: only the end
        rewrite = _verify(http, session, tokens=(), keep=2, append=(5,))  # another prompt
        assert rewrite.status_code == 409 and "keeps its prompt" in rewrite.json()["detail"]


def test_a_session_reopened_mid_answer_follows_its_grammar_from_the_answers_start(target_lm, tiny_near_draft):
    config = GenerationConfig(max_new_tokens=60, grammar=RECORD_SPEC, draft=FIXED)
    expected = autoregressive(target_lm).generate(RECORD_PROMPT, config).tokens
    with _server(target_lm, max_sessions=1) as base, connect(base) as remote:
        engine = _remote_engine(remote, ModelDrafter(tiny_near_draft), target_lm.tokenizer)
        stream = engine.stream(RECORD_PROMPT, config)
        tokens = list(next(stream).tokens) + list(next(stream).tokens)
        with httpx.Client(base_url=base) as http:
            _open(http)  # takes the only slot: the run's session is evicted
        tokens += [t for event in stream for t in event.tokens]
        assert remote.reopens == 1
    assert tokens == expected


def test_a_bad_grammar_is_refused_when_the_session_opens(http, url):
    bad = {"prompt": [1, 2], "grammar": {"kind": "json_schema", "text": '{"type": "strin"}'}}
    response = http.post("/v1/sessions", json=bad)
    assert response.status_code == 422 and "invalid JSON schema" in response.json()["detail"]
    assert "\n" not in response.json()["detail"]
    with RemoteTarget(url) as remote, pytest.raises(RemoteVerifierError, match="invalid JSON schema"):
        config = GenerationConfig(grammar=GrammarSpec(kind="json_schema", text='{"type": "strin"}'))
        drive(remote.start([1, 2], config, None))


def test_generate_cli_follows_a_json_schema_through_a_remote_verifier(url, target_lm, tmp_path):
    config = GenerationConfig(max_new_tokens=60, grammar=RECORD_SPEC)
    expected = autoregressive(target_lm).generate(RECORD_PROMPT, config).tokens
    schema_file = tmp_path / "record.json"
    schema_file.write_text(json.dumps(RECORD))
    flags = ["--draft", "tiny:1", "--verifier", url, "--max-new-tokens", "60", "--json-schema", str(schema_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*DRAFTWISE, "generate", *flags, "--json", RECORD_PROMPT], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == expected


# --- a grammar's dead end mid-answer: an error, never a normal answer ------------------------------

LATE_SPEC = GrammarSpec(kind="json_schema", text=json.dumps(LATE_DEAD_END))
DEAD_END_SAYS = "the output reached a point the JSON schema cannot go past: too many alternatives"


def _assert_one_short_line(message: str) -> None:
    assert "\n" not in message and len(message) < 150 + REASON_CHARS, message
    assert "<state>" not in message and "panic" not in message and "internal error" not in message


def test_a_dead_end_mid_answer_is_a_422_with_its_code_never_an_answer(http, target_lm):
    """A block that walks into llguidance's limit (the choice made, then an object of 3,000
    optional properties): the verify is refused with the dead end's code, and so is every
    later one, since no text can complete the answer."""
    opened = http.post("/v1/sessions", json={"prompt": [1, 2, 3], "grammar": LATE_SPEC.model_dump(mode="json")})
    assert opened.status_code == 201, opened.text
    session = opened.json()["session_id"]
    block = target_lm.tokenizer.encode('{"k": "a", "o": {', add_special_tokens=False)
    for tokens in (block, ()):
        response = _verify(http, session, tokens=tokens, keep=3)
        assert response.status_code == 422, response.text
        assert response.json()["code"] == "grammar_dead_end"
        assert response.json()["detail"].startswith(DEAD_END_SAYS)
        _assert_one_short_line(response.json()["detail"])


def test_a_dead_end_the_verifier_meets_raises_grammar_dead_end_on_the_client(url, target_lm):
    """No drafter: the verifier's grammar meets the dead end first (committing the target's
    pick), and the client raises it as a local run does, never ending the run as if complete."""
    with connect(url, tokenizer=target_lm.tokenizer) as remote:
        engine = _remote_engine(remote, None, target_lm.tokenizer)
        events = []
        with pytest.raises(GrammarDeadEnd) as caught:
            for event in engine.stream("A record: ", GenerationConfig(max_new_tokens=60, grammar=LATE_SPEC)):
                events.append(event)
    assert str(caught.value).startswith(DEAD_END_SAYS)
    _assert_one_short_line(str(caught.value))
    text = "".join(event.text for event in events)
    assert text.startswith('{"k": "') and not any(event.finished for event in events)


def test_generate_cli_ends_a_remote_dead_end_with_one_error_line_and_exit_2(url, tmp_path):
    """As a local ``generate --json-schema`` does: the last line says the grammar's dead end."""
    schema_file = tmp_path / "late.json"
    schema_file.write_text(json.dumps(LATE_DEAD_END))
    flags = ["--drafter", "ngram", "--verifier", url, "--max-new-tokens", "60", "--json-schema", str(schema_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [*DRAFTWISE, "generate", *flags, "A record: "], capture_output=True, text=True, timeout=120, env=env
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.returncode == 2 and errors == lines[-1:], result.stderr[:2000]
    assert errors[0].startswith(f"error: {DEAD_END_SAYS}") and "Traceback" not in result.stderr
    _assert_one_short_line(errors[0])


def test_generate_cli_raises_a_dead_end_only_the_verifier_meets(url, tmp_path, monkeypatch):
    """The verifier's grammar meets a dead end the client's copy does not (a client whose copy
    follows a looser grammar here, as one on another llguidance version, with other limits,
    could): the verifier's 422 ends the run with the same one line and exit 2, not as a
    verifier that failed (exit 1) nor as a complete answer."""
    loose = GrammarSpec(kind="json_schema", text=json.dumps({"type": "object"}))

    class LooserCopy:
        """The client's grammars, following any JSON object whatever the run's grammar."""

        def __init__(self, real: Grammars) -> None:
            self.real = real

        def __getattr__(self, name: str):
            return getattr(self.real, name)

        def constraint(self, spec: GrammarSpec):
            return self.real.constraint(loose)

    real_grammars = RemoteTarget.grammars
    monkeypatch.setattr(RemoteTarget, "grammars", lambda self, tokenizer: LooserCopy(real_grammars(self, tokenizer)))
    schema_file = tmp_path / "late.json"
    schema_file.write_text(json.dumps(LATE_DEAD_END))
    done = run_cli_here(
        *("generate", "--drafter", "ngram", "--verifier", url, "--max-new-tokens", "60"),
        *("--json-schema", str(schema_file), "A record: "),
        env={"DRAFTWISE_HOME": str(tmp_path / "home")},
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert done.returncode == 2 and errors == lines[-1:], done.stderr[:2000]
    assert errors[0].startswith(f"error: {DEAD_END_SAYS}")
    _assert_one_short_line(errors[0])
