"""Both servers against a hostile client, on tiny models on 127.0.0.1.

1. schemathesis, as its CLI runs (``schemathesis run``), against each server's own
   ``/openapi.json``: valid and invalid requests for every operation (examples, coverage,
   fuzzing and stateful phases), with every check it has but two (below) and two of ours
   (``fuzz_checks.py``). So every answer must be: no 5xx; a status, content type, headers and
   body the document lists for that operation (SSE events included); an error in its server's
   shape; a 401 without the key (``ignored_auth``: the servers run with one); a complete
   200 stream.
2. hypothesis where a document cannot reach: structured verify bodies on real sessions, and
   the API's sampling fields and prompt text at their extremes (subnormal floats, lone
   surrogates).

Bounded and repeatable: a fixed seed, a fixed number of examples, no example database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import (  # noqa: E402
    HealthCheck,
    given,
    settings,
    strategies as st,
)

from draftwise.api.app import create_app as create_api  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.backends.tiny import tiny_lm, tiny_tokenizer  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402
from draftwise.remote.protocol import decode_verify_response, encode_verify_request  # noqa: E402
from draftwise.remote.server import create_app as create_verifier  # noqa: E402
from draftwise.remote.settings import VerifierSettings  # noqa: E402

from server_support import serve_in_background  # noqa: E402

pytestmark = pytest.mark.fuzz

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SEED = 15  # any fixed value: the same requests on every run
CONTEXT = 64  # both servers' max_context: every generation and session stays small
# positive_data_acceptance: a valid request may still be refused (over max_context, say);
# what is promised is a documented 4xx, which the other checks hold the servers to.
# negative_data_rejection: pydantic's lax mode accepts a few values a JSON type forbids
# (false for an integer is 0); such a request is answered as its coerced value would be.
NOT_CHECKED = "positive_data_acceptance,negative_data_rejection"
# schemathesis reads 20 events of a stream by default and cuts the rest; every stream here
# (at most CONTEXT tokens) is read whole, so ``complete_stream`` sees its end.
MAX_STREAM_EVENTS = 4 * CONTEXT
HYPOTHESIS = settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    # With a draft model, so every drafter a request may name exists.
    settings_ = ServerSettings(target="tiny:0", draft="tiny:1", api_key=KEY, max_context=CONTEXT, request_timeout=60)
    with serve_in_background(create_api(settings_, Pair(tiny_lm(0), tiny_lm(1)))) as base:
        yield base


@pytest.fixture(scope="module")
def verifier_url() -> Iterator[str]:
    # Fewer session slots than the stateful phase opens sessions: evictions happen too.
    settings_ = VerifierSettings(target="tiny:0", api_key=KEY, max_context=CONTEXT, max_sessions=4)
    with serve_in_background(create_verifier(settings_, lm=tiny_lm(0))) as base:
        yield base


def _schemathesis(url: str, workdir: Path) -> None:
    """``schemathesis run`` on ``url``'s document; fails with its report unless all passed."""
    config = workdir / "schemathesis.toml"
    config.write_text(f"max-stream-events = {MAX_STREAM_EVENTS}\n")
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        NOT_CHECKED,
        "--max-examples",
        "40",
        "--seed",
        str(SEED),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--suppress-health-check",
        "all",
        "--request-timeout",
        "120",
        "--no-color",
        "--output-truncate",
        "false",
    ]
    tests = str(Path(__file__).parent)
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "fuzz_checks",
        "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p),
    }
    # Run in a scratch folder: schemathesis keeps a cache in its working directory.
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=workdir, env=env)
    report = result.stdout[-12000:] + result.stderr[-3000:]
    assert result.returncode == 0, report


def test_api_keeps_its_document_under_schemathesis(api_url, tmp_path):
    _schemathesis(api_url, tmp_path)


def test_verifier_keeps_its_document_under_schemathesis(verifier_url, tmp_path):
    _schemathesis(verifier_url, tmp_path)


# --- hypothesis: what the documents cannot describe ----------------------------------------

VOCAB = len(tiny_tokenizer())  # the tiny models' vocabulary: 256 bytes and EOS
# Mostly valid values, so requests reach the model; the hostile ones mixed in.
valid_token = st.integers(0, VOCAB - 1)
token = valid_token | st.sampled_from([-1, VOCAB, 2**31 - 1, -(2**31)])
ids = st.lists(valid_token, max_size=6) | st.lists(token, max_size=6)
# Floats at every extreme a JSON number allows: subnormals, 0, the bounds and past them.
tiny = st.sampled_from([5e-324, 1e-300, 1e-46, 1e-40, 1e-7])
valid_sampling = st.fixed_dictionaries(
    {"temperature": st.floats(0, 100) | tiny, "top_p": st.floats(0, 1, exclude_min=True) | tiny | st.just(1.0)},
    optional={"top_k": st.integers(0, VOCAB + 5), "seed": st.integers(0, 2**63 - 2)},
)
invalid_sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([-1e-300, 101.0]),
        "top_p": st.sampled_from([0.0, 1.5]),
        "top_k": st.just(-1),
        "seed": st.sampled_from([-1, 2**63]),
    },
)
sampling = valid_sampling | invalid_sampling
prompts = st.lists(valid_token, min_size=1, max_size=CONTEXT + 1) | st.lists(token, max_size=4)


@st.composite
def draft_q(draw: st.DrawFn, tokens: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """None (point masses), a q that holds each token (valid), or any ids and float32 values."""
    n_top = draw(st.integers(0, 3))
    if not n_top or not tokens:
        return None
    shape = (len(tokens), n_top)
    if draw(st.booleans()):
        holds = np.array([[t] * n_top for t in tokens], dtype=np.int64)
        return holds, np.full(shape, 1.0 / n_top, dtype=np.float32)
    size = shape[0] * n_top
    wild_ids = draw(st.lists(token, min_size=size, max_size=size))
    probs = draw(st.lists(st.floats(width=32), min_size=size, max_size=size))
    return np.array(wild_ids, dtype=np.int64).reshape(shape), np.array(probs, dtype=np.float32).reshape(shape)


@st.composite
def verify_bodies(draw: st.DrawFn, held: int) -> bytes:
    """A verify body for a session holding ``held`` tokens: in the wire format with hostile
    values (keep, ids, q), and now and then with broken framing."""
    tokens = draw(ids)
    keep = draw(st.sampled_from([held, held, 0, held + 1]) | st.integers(0, CONTEXT + 2))
    q = draw(draft_q(tokens))
    append = draw(st.just([]) | ids)
    body = encode_verify_request(keep, append, tokens, *(q or (None, None)))
    cut = draw(st.sampled_from([None] * 6 + [0, 3, -1]))
    return body if cut is None else body[:cut]


def _assert_refusal_or(response: httpx.Response, ok: int) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != ok:
        body = response.json()
        assert set(body) == {"detail"} and body["detail"], body


@HYPOTHESIS
@given(prompt=prompts, sampling=sampling, data=st.data())
def test_verify_never_answers_5xx(verifier_url, prompt, sampling, data):
    with httpx.Client(base_url=verifier_url, headers=AUTH) as http:
        opened = http.post("/v1/sessions", json={"prompt": prompt, "sampling": sampling})
        _assert_refusal_or(opened, 201)
        if opened.status_code != 201:
            return
        session = opened.json()["session_id"]
        body = data.draw(verify_bodies(len(prompt)))
        response = http.post(f"/v1/sessions/{session}/verify", content=body)
        _assert_refusal_or(response, 200)
        if response.status_code == 200:
            k = int(np.frombuffer(body[8:12], dtype="<i4")[0])
            answer = decode_verify_response(response.content, k)
            assert 0 <= answer.n_accepted <= k and 0 <= answer.next_token < VOCAB
        http.delete(f"/v1/sessions/{session}")


# Any text, and text with a lone surrogate in it (JSON's "\ud800" escape carries one): rare
# among all code points, so drawn on purpose.
text = st.text(st.characters(codec=None), max_size=12)
any_text = text | st.builds("".join, st.tuples(text, st.characters(categories=["Cs"]), text))


api_fields = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 2) | tiny | st.sampled_from([-0.0, 2.5]),
        "top_p": st.floats(0, 1) | tiny,
        "seed": st.integers(0, 2**63 - 2),
        "max_tokens": st.integers(-1, 8),
    },
)


@HYPOTHESIS
@given(fields=api_fields, prompt=any_text, stream=st.booleans(), chat=st.booleans())
def test_generation_never_answers_5xx(api_url, fields, prompt, stream, chat):
    body = {"model": "tiny:0", "max_tokens": 4, **fields, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # json.dumps escapes what is not ASCII, so a lone surrogate travels as "\ud800".
    response = httpx.post(
        f"{api_url}{path}", content=json.dumps(body), timeout=120, headers={**AUTH, "content-type": "application/json"}
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif stream:
        events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
        assert events[-1] == "[DONE]" and not [e for e in events[:-1] if "error" in json.loads(e)], events
