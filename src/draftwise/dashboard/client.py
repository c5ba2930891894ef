"""The dashboard's side of the HTTP API: request bodies from settings, and the SSE stream.

Every failure a user can cause or meet (server not running, model or drafter missing, a
setting out of range) becomes a ``DashboardApiError`` whose message is one readable line; the page
shows it instead of a stack trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from draftwise.config import DraftConfig
from draftwise.errors import DraftwiseError, validation_message

DEFAULT_API_URL = "http://127.0.0.1:8000"
API_URL_ENV = "DRAFTWISE_API_URL"


class DashboardApiError(DraftwiseError):
    """Something the dashboard's user should read: the server is unreachable, or refused or failed
    a request, or a setting on the page cannot work. (Not the server's own ``api.errors.APIError``:
    this is the client's side.)"""

    exit_code = 1  # the server may be down or busy: not necessarily the user's mistake
    status = 502


def unreachable(url: str, reason: str) -> DashboardApiError:
    return DashboardApiError(
        f"cannot reach the draftwise API at {url} ({reason}). Start one with `draftwise serve`, or run "
        "`draftwise dashboard` without --api-url to have it started for you."
    )


@dataclass(frozen=True)
class RunRequest:
    """What the page asks for: one prompt, how to draft, how to sample."""

    prompt: str
    chat: bool  # send as a chat message (the target's chat template) or as a raw completion prompt
    drafter: str  # model | ngram | off
    draft: DraftConfig
    temperature: float
    seed: int | None
    max_tokens: int
    prediction: str | None = None  # the expected output (Predicted Outputs); the plain run leaves it out

    @classmethod
    def build(
        cls,
        *,
        prompt: str,
        chat: bool,
        drafter: str,
        k_policy: str,
        k: int,
        k_max: int,
        confidence_threshold: float,
        temperature: float,
        seed: int | None,
        max_tokens: int,
        prediction: str | None = None,
    ) -> RunRequest:
        """Validate the drafting knobs with ``DraftConfig`` itself, so the page rejects what the
        server would, with the same rule and a one-line message."""
        if not prompt.strip():
            raise DashboardApiError("the prompt is empty: type something to generate from")
        try:
            draft = DraftConfig(k_policy=k_policy, k=k, k_max=k_max, confidence_threshold=confidence_threshold)
        except ValidationError as exc:
            raise DashboardApiError(validation_message(exc, "invalid drafting settings: ")) from None
        return cls(
            prompt=prompt,
            chat=chat,
            drafter=drafter,
            draft=draft,
            temperature=temperature,
            seed=seed,
            max_tokens=max_tokens,
            prediction=prediction or None,
        )

    def body(self, model: str, drafter: str | None = None) -> dict[str, Any]:
        """The OpenAI-shaped streaming request, with provenance on; ``drafter`` overrides the
        run's own (the side-by-side plain run uses ``off``). Both runs prefill their whole
        prompt: the run after the other must not find it cached, or their rates differ by it."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "speculative": {
                "drafter": drafter or self.drafter,
                "provenance": True,
                "cache_prompt": False,
                **self.draft.model_dump(include={"k_policy", "k", "k_max", "confidence_threshold"}),
            },
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.prediction is not None and drafter is None:
            body["prediction"] = {"type": "content", "content": self.prediction}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


def _refusal(response: httpx.Response) -> str:
    """The server's own error message (OpenAI shape), or the status line."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text.strip()[:300] or response.reason_phrase
    return f"the server refused the request (HTTP {response.status_code}): {message}"


class ApiClient:
    """A client of one draftwise API server."""

    def __init__(self, base_url: str, timeout: float = 900.0, api_key: str | None = None) -> None:
        self.base_url = base_url.strip().rstrip("/")
        self.timeout = timeout
        self.api_key = api_key  # for a server started with --api-key

    def _http(self, read_timeout: float) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # trust_env=False: the server is local; a proxy from the environment must not intercept it.
        return httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(read_timeout, connect=5.0), headers=headers, trust_env=False
        )

    def health(self) -> dict[str, Any]:
        """The server's /health: served model, draft model, default drafter, load."""
        if not self.base_url.startswith(("http://", "https://")):
            raise DashboardApiError(f"the API URL {self.base_url!r} must start with http:// or https://")
        try:
            with self._http(10.0) as http:
                response = http.get("/health")
        except httpx.HTTPError as exc:
            raise unreachable(self.base_url, type(exc).__name__) from None
        if response.status_code != 200:
            raise DashboardApiError(
                f"{self.base_url} answered /health with HTTP {response.status_code}: is it a draftwise server?"
            )
        try:
            return dict(response.json())
        except ValueError:
            raise DashboardApiError(f"{self.base_url}/health did not answer JSON: is it a draftwise server?") from None

    def stream(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST a streaming request and yield each SSE chunk as a dict, until ``[DONE]``."""
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            with self._http(self.timeout) as http, http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise DashboardApiError(_refusal(response))
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:  # a failure after the stream began comes as an error chunk
                        raise DashboardApiError(f"the generation failed on the server: {chunk['error'].get('message')}")
                    yield chunk
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise unreachable(self.base_url, type(exc).__name__) from None
        except httpx.HTTPError as exc:
            raise DashboardApiError(
                f"the connection to {self.base_url} broke during generation ({type(exc).__name__}: {exc})"
            ) from None
