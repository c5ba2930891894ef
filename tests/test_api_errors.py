"""Bad input to the OpenAI-compatible server: always a 4xx in OpenAI's error shape, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from draftwise.api.app import create_app  # noqa: E402
from draftwise.api.settings import ServerSettings  # noqa: E402
from draftwise.prepare import Pair  # noqa: E402

from server_support import serve_in_background  # noqa: E402

MODEL = "tiny:0"
OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def url(tiny_target) -> Iterator[str]:
    # No draft model, and a context of 64 tokens so oversize prompts are cheap to make.
    app = create_app(ServerSettings(target=MODEL, max_context=64), Pair(tiny_target).fork())
    with serve_in_background(app) as base:
        yield base


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {**OK, "max_tokens": -5}, "max_tokens", "greater than or equal to 1"),
        ("/v1/completions", {**OK, "max_tokens": "ten"}, "max_tokens", "integer"),
        ("/v1/completions", {**OK, "temperature": "hot"}, "temperature", "number"),
        ("/v1/completions", {**OK, "temperature": 3}, "temperature", "less than or equal to 2"),
        ("/v1/completions", {**OK, "top_p": 0}, "top_p", "greater than 0"),
        ("/v1/completions", {**OK, "seed": -1}, "seed", "greater than or equal to 0"),
        ("/v1/completions", {**OK, "n": 2}, "n", "1"),
        # Numbers are JSON numbers, as OpenAI takes them: no strings, no booleans.
        ("/v1/completions", {**OK, "max_tokens": "8"}, "max_tokens", "valid integer"),
        ("/v1/completions", {**OK, "max_tokens": True}, "max_tokens", "valid integer"),
        ("/v1/completions", {**OK, "max_tokens": 8.0}, "max_tokens", "valid integer"),
        ("/v1/completions", {**OK, "seed": "7"}, "seed", "valid integer"),
        ("/v1/completions", {**OK, "seed": True}, "seed", "valid integer"),
        ("/v1/completions", {**OK, "temperature": "0.5"}, "temperature", "valid number"),
        ("/v1/completions", {**OK, "temperature": True}, "temperature", "valid number"),
        ("/v1/completions", {**OK, "top_p": True}, "top_p", "valid number"),
        ("/v1/completions", {**OK, "presence_penalty": False}, "presence_penalty", "valid number"),
        ("/v1/completions", {**OK, "n": True}, "n", "should be 1"),
        ("/v1/completions", {**OK, "prompt": [True, False]}, "prompt", "integers, not booleans"),
        ("/v1/completions", {**OK, "prompt": [1, "a"]}, "prompt", "token ids"),
        ("/v1/completions", {**OK, "speculative": {"k": True}}, "speculative.k", "valid integer"),
        ("/v1/completions", {**OK, "speculative": {"k": "3"}}, "speculative.k", "valid integer"),
        (
            "/v1/completions",
            {**OK, "speculative": {"confidence_threshold": True}},
            "speculative.confidence_threshold",
            "valid number",
        ),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": "8"}, "max_completion_tokens", "valid integer"),
        ("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ("/v1/completions", {**OK, "stop": [""]}, "stop", "empty"),
        ("/v1/completions", {**OK, "frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ("/v1/completions", {**OK, "logit_bias": {"1": 5}}, "logit_bias", "unknown field"),
        ("/v1/completions", {**OK, "logprobs": 2}, "logprobs", "speculative.provenance"),
        ("/v1/completions", {"model": MODEL, "max_tokens": 2}, "prompt", "required"),
        ("/v1/completions", {**OK, "prompt": ""}, "prompt", "empty"),
        ("/v1/completions", {**OK, "prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ("/v1/completions", {**OK, "prompt": [1, -2]}, "prompt", "negative"),
        ("/v1/completions", {**OK, "prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
        ("/v1/completions", {**OK, "speculative": {"bogus": 1}}, "speculative.bogus", "unknown field"),
        ("/v1/completions", {**OK, "speculative": {"k_policy": "magic"}}, "speculative.k_policy", "fixed"),
        ("/v1/completions", {**OK, "speculative": {"k": -1}}, "speculative.k", "greater than or equal to 0"),
        ("/v1/completions", {**OK, "speculative": {"k": 30}}, "speculative", "must not exceed k_max"),
        (
            "/v1/completions",
            {**OK, "speculative": {"k_long": 0}},
            "speculative.k_long",
            "greater than or equal to 1",
        ),
        ("/v1/completions", {**OK, "speculative": {"drafter": "model"}}, "speculative.drafter", "no draft model"),
        ("/v1/completions", {**OK, "speculative": "yes"}, "speculative", "object"),
        ("/v1/completions", {**OK, "stream": "yes"}, "stream", "valid boolean"),
        ("/v1/completions", {**OK, "speculative": {"provenance": "yes"}}, "speculative.provenance", "boolean"),
        ("/v1/completions", {**OK, "speculative": {"cache_prompt": "false"}}, "speculative.cache_prompt", "boolean"),
        ("/v1/completions", {**OK, "speculative": {"cache_prompt": 0}}, "speculative.cache_prompt", "boolean"),
        ("/v1/completions", {**OK, "prompt": "x" * 100}, "prompt", "maximum context length is 64"),
        ("/v1/completions", {**OK, "max_tokens": 100}, "prompt", "maximum context length is 64"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
            "system",
        ),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0.content", "required"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * 200}]},
            "messages",
            "maximum context length",
        ),
    ],
)
def test_bad_input_is_a_400_that_says_why(url, path, body, param, says):
    error = _error(httpx.post(f"{url}{path}", json=body), 400)
    assert error["param"] == param
    assert says in error["message"]
    assert error["type"] == "invalid_request_error"


def test_an_integer_is_a_valid_float(url):
    spec = {"drafter": "ngram", "confidence_threshold": 1}
    body = {**OK, "temperature": 1, "top_p": 1, "presence_penalty": 0, "seed": 3, "speculative": spec}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "the body is not valid JSON: Expecting property name enclosed in double quotes at line 1 column 2"),
        (b'{"model": "tiny:0",\n  "prompt": oops}', "the body is not valid JSON: Expecting value at line 2 column 13"),
    ],
)
def test_malformed_json_is_a_400_that_says_where(url, body, says):
    response = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"})
    error = _error(response, 400)
    assert error["message"] == says
    assert error["param"] is None and error["type"] == "invalid_request_error"


def test_malformed_json_and_unknown_model_and_route(url):
    error = _error(
        httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert "JSON" in error["message"]
    error = _error(httpx.post(f"{url}/v1/completions", json={**OK, "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found" and "tiny:0" in error["message"]
    _error(httpx.get(f"{url}/v1/nowhere"), 404)
    _error(httpx.get(f"{url}/v1/completions"), 405)


def test_openai_client_sees_bad_request(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="speculative.k_polcy: unknown field"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"speculative": {"k_polcy": "fixed"}}
        )
    # The server still answers well-formed requests afterwards.
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens == 3


JUNK = [None, "x", -1, 0, 1.5, [], [None], {}, {"a": 1}, 10**30]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_junk_in_any_field_is_never_a_5xx(url, path):
    from draftwise.api.schemas import ChatCompletionRequest, CompletionRequest

    base = OK if path == "/v1/completions" else CHAT
    fields = (CompletionRequest if path == "/v1/completions" else ChatCompletionRequest).model_fields
    with httpx.Client(base_url=url) as http:
        for field in fields:
            for junk in JUNK:
                response = http.post(path, json={**base, field: junk})
                assert response.status_code < 500, (field, junk, response.text)
                if response.status_code >= 400:
                    assert response.json()["error"]["message"]


@pytest.fixture(scope="module")
def url_with_draft(tiny_target, tiny_near_draft) -> Iterator[str]:
    app = create_app(ServerSettings(target=MODEL, draft=MODEL), Pair(tiny_target, tiny_near_draft).fork())
    with serve_in_background(app) as base:
        yield base


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
def test_junk_in_any_speculative_field_is_never_a_5xx(url_with_draft, drafter):
    from draftwise.api.schemas import SpeculativeOptions

    body = {**OK, "temperature": 0.7, "max_tokens": 4}
    with httpx.Client(base_url=url_with_draft) as http:
        for field in SpeculativeOptions.model_fields:
            for junk in [*JUNK, 2**62, 2**63]:
                spec = {"drafter": drafter, field: junk} if field != "drafter" else {field: junk}
                response = http.post("/v1/completions", json={**body, "speculative": spec})
                assert response.status_code < 500, (field, junk, response.text)


@pytest.fixture(scope="module")
def guarded_url(tiny_target) -> Iterator[str]:
    app = create_app(ServerSettings(target=MODEL, api_key="s3cret", max_body_bytes=2048), Pair(tiny_target).fork())
    with serve_in_background(app) as base:
        yield base


def test_api_key_is_required_on_v1_but_not_on_health_or_metrics(guarded_url):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        error = _error(httpx.post(f"{guarded_url}/v1/completions", json=OK, headers=headers), 401)
        assert error["type"] == "authentication_error" and "API key" in error["message"]
        _error(httpx.get(f"{guarded_url}/v1/models", headers=headers), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded_url}/v1", api_key="wrong", max_retries=0).completions.create(**OK)
    reply = openai.OpenAI(base_url=f"{guarded_url}/v1", api_key="s3cret", max_retries=0).completions.create(**OK)
    assert reply.usage.completion_tokens == 2
    assert httpx.get(f"{guarded_url}/health").status_code == 200
    assert httpx.get(f"{guarded_url}/metrics").status_code == 200


def test_oversize_or_chunked_bodies_are_refused_before_they_are_read(guarded_url):
    headers = {"Authorization": "Bearer s3cret"}
    big = {**OK, "prompt": "x" * 4096}
    error = _error(httpx.post(f"{guarded_url}/v1/completions", json=big, headers=headers), 413)
    assert "max_body_bytes of 2048" in error["message"]
    chunks = (part for part in [b'{"model": "tiny:0", ', b'"prompt": "hi"}'])
    _error(
        httpx.post(
            f"{guarded_url}/v1/completions", content=chunks, headers={**headers, "Content-Type": "application/json"}
        ),
        411,
    )
    # Still serving afterwards.
    assert httpx.post(f"{guarded_url}/v1/completions", json=OK, headers=headers).status_code == 200


def test_dashboard_client_sends_the_api_key(guarded_url):
    from draftwise.dashboard.client import ApiClient, DashboardApiError

    body = {**OK, "stream": True}
    with pytest.raises(DashboardApiError, match="API key"):
        list(ApiClient(guarded_url).stream(body))
    chunks = list(ApiClient(guarded_url, api_key="s3cret").stream(body))
    assert chunks and all(c["object"] == "text_completion" for c in chunks)


def _post_json(url: str, path: str, body: dict, **kwargs) -> httpx.Response:
    """POST ``body`` as JSON with non-ASCII escaped: the only way to send a lone surrogate
    (``"\\ud800"`` is valid JSON but not encodable text)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body), headers={"content-type": "application/json"}, **kwargs)


def _completion_text(response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["text"]
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks  # no error event hidden in a 200
    return "".join(choice["text"] for c in chunks for choice in c["choices"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-40},  # raised to config.MIN_TEMPERATURE
        {"temperature": 5e-324},
        {"temperature": 1.0, "top_p": 1e-46},  # float32 has no such number: the top token is kept
        {"temperature": 1.0, "top_p": 5e-324},
        {"temperature": 1e-40, "top_p": 1e-46},
    ],
)
def test_vanishing_temperature_or_top_p_samples_the_argmax(url, sampling, stream):
    greedy = _completion_text(
        httpx.post(f"{url}/v1/completions", json={**OK, "max_tokens": 6, "temperature": 0}), stream=False
    )
    body = {**OK, "max_tokens": 6, **sampling, "stream": stream}
    assert _completion_text(_post_json(url, "/v1/completions", body), stream) == greedy


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**OK, "prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {**OK, "prompt": "ok \udfff ok"}, "prompt"),
        ("/v1/completions", {**OK, "prompt": ["\ud800"]}, "prompt"),
        ("/v1/completions", {**OK, "stop": "\ud800"}, "stop"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content",
        ),
    ],
)
def test_text_that_is_not_unicode_is_a_400(url, path, body, param):
    error = _error(_post_json(url, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


def test_lone_surrogates_elsewhere_are_4xx_too(url):
    _error(_post_json(url, "/v1/completions", {**OK, "\ud800": 1}), 400)  # as a field name
    assert _error(_post_json(url, "/v1/completions", {**OK, "model": "\ud800"}), 404)["code"] == "model_not_found"


def test_a_401_says_how_to_authenticate(guarded_url):
    for path in ("/v1/models", "/v1/models/tiny:0"):
        response = httpx.get(f"{guarded_url}{path}")
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    response = httpx.post(f"{guarded_url}/v1/completions", json=OK, headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"


def test_docs_and_schema_are_open_as_the_readme_says(guarded_url):
    for path in ("/health", "/metrics", "/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{guarded_url}{path}").status_code == 200, path


def _documented(url: str) -> dict:
    return httpx.get(f"{url}/openapi.json").json()


def test_openapi_lists_every_status_the_api_sends(url):
    schema = _documented(url)
    error_ref = "#/components/schemas/ErrorResponse"
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "411", "413", "429", "500", "504"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        event = responses["200"]["content"]["text/event-stream"]["schema"]["properties"]["data"]
        chunk = event["anyOf"][1]["contentSchema"]["anyOf"][0]["$ref"].rsplit("/", 1)[1]
        assert chunk in schema["components"]["schemas"] and {"const": "[DONE]"} in event["anyOf"]
        assert "Retry-After" in responses["429"]["headers"]
        assert "WWW-Authenticate" in responses["401"]["headers"]
        for status, doc in responses.items():
            if status != "200":
                assert doc["content"]["application/json"]["schema"]["$ref"] == error_ref, (path, status)
    assert set(schema["paths"]["/v1/models/{model}"]["get"]["responses"]) == {"200", "401", "404"}
    assert set(schema["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401"}
    # Invalid input is a 400 in OpenAI's shape, never FastAPI's 422.
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        assert schema["components"]["schemas"][request]["properties"]["model"]["enum"] == [MODEL]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# Past the server's 128 levels but short of Python's recursion limit: the parser would take it.
DEEP = 200
# Past Python's recursion limit too: the parser itself gives up.
DEEPEST = 50_000
PLAIN = json.dumps(OK)


@pytest.mark.parametrize(
    ("body", "content_type", "param", "says"),
    [
        (PLAIN, "text/plain", None, "must be JSON sent with Content-Type: application/json (got 'text/plain')"),
        (PLAIN, "application/x-www-form-urlencoded", None, "(got 'application/x-www-form-urlencoded')"),
        (PLAIN, None, None, "Content-Type: application/json (got none)"),
        ("", "application/json", None, "the body is empty"),
        ("  \n", "application/json", None, "the body is empty"),
        (
            b'{"model": "tiny:0", "prompt": "caf\xe9"}',
            "application/json",
            "prompt",
            "not UTF-8 text: byte 0xe9 at offset 34",
        ),
        (b"\xff\xfe{\x00}\x00", "application/json", None, "not UTF-8 text: byte 0xff at offset 0"),
        ('{"model": "tiny:0", "prompt": "hi", "temperature": NaN}', "application/json", "temperature", "NaN is not"),
        ('{"model": "tiny:0", "prompt": "hi", "top_p": -Infinity}', "application/json", "top_p", "-Infinity is not"),
        ('{"model": "tiny:0", "prompt": ' + _nested(DEEP) + "}", "application/json", "prompt", "deeper than 128"),
        ('{"model": "tiny:0", "prompt": ' + _nested(DEEPEST) + "}", "application/json", "prompt", "deeper than 128"),
        ("[1, 2]", "application/json", None, "the body must be a JSON object, not an array"),
        ('"hi"', "application/json", None, "the body must be a JSON object, not a string"),
        ("null", "application/json", None, "the body must be a JSON object, not null"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/completions"])
def test_a_body_that_is_no_json_object_is_a_400_that_says_why(url, path, body, content_type, param, says):
    headers = {} if content_type is None else {"content-type": content_type}
    error = _error(httpx.post(f"{url}{path}", content=body, headers=headers), 400)
    assert says in error["message"] and "\n" not in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if param is not None:
        assert f"(in '{param}')" in error["message"]  # the field is in the message, not only in param


def test_nesting_up_to_the_limit_is_read(url):
    """128 levels (the body's object, then 127 in its prompt) pass the depth check: the prompt is
    then refused for what it holds, not for its depth; 129 are refused for their depth."""

    def post(levels: int) -> dict:
        body = '{"model": "tiny:0", "prompt": ' + _nested(levels - 1) + "}"
        return _error(
            httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}), 400
        )

    assert "deeper" not in post(128)["message"] and post(128)["param"] == "prompt"
    assert "deeper than 128 levels" in post(129)["message"]


def test_a_chat_body_is_read_as_strictly_and_the_server_keeps_serving(url):
    deep = '{"model": "tiny:0", "messages": [{"role": "user", "content": ' + _nested(DEEPEST) + "}]}"
    for path in ("/v1/chat/completions", "/chat/completions"):
        error = _error(httpx.post(f"{url}{path}", content=deep, headers={"content-type": "application/json"}), 400)
        assert error["param"] == "messages" and "deeper than 128 levels" in error["message"]
        error = _error(
            httpx.post(f"{url}{path}", content=json.dumps(CHAT), headers={"content-type": "text/plain"}), 400
        )
        assert "Content-Type: application/json" in error["message"]
        # A byte-order mark before the JSON is taken, as Python's parser takes it.
        response = httpx.post(
            f"{url}{path}",
            content=b"\xef\xbb\xbf" + json.dumps(CHAT).encode(),
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 200, response.text
    # A JSON type other than application/json (an RFC 6839 +json suffix) is JSON too.
    response = httpx.post(f"{url}/v1/completions", content=PLAIN, headers={"content-type": "application/vnd.api+json"})
    assert response.status_code == 200, response.text


def test_the_routes_without_v1_are_guarded_too(guarded_url):
    for path in ("/completions", "/chat/completions"):
        error = _error(httpx.post(f"{guarded_url}{path}", json=OK if path == "/completions" else CHAT), 401)
        assert error["type"] == "authentication_error"
    for path in ("/models", f"/models/{MODEL}"):
        _error(httpx.get(f"{guarded_url}{path}"), 401)
        assert httpx.get(f"{guarded_url}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    error = _error(httpx.get(f"{guarded_url}/models/gpt-4", headers={"Authorization": "Bearer s3cret"}), 404)
    assert error["code"] == "model_not_found"
