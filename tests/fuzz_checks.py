"""Checks of draftwise's own for the schemathesis runs of ``test_fuzz.py``, which load this
module by name (``SCHEMATHESIS_HOOKS``). Each check knows the server by its document's title."""

from __future__ import annotations

import json
from typing import Any

import schemathesis

VERIFIER_TITLE = "draftwise verifier"


def _title(case: Any) -> str:
    return case.operation.schema.raw_schema["info"]["title"]


@schemathesis.check
def documented_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error has its server's shape: ``{"detail": str}`` on the verifier, OpenAI's
    ``{"error": {"message", "type", "param", "code"}}`` on the API, with a message."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    if _title(case) == VERIFIER_TITLE:
        assert set(body) == {"detail"} and isinstance(body["detail"], str) and body["detail"], body
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return True


@schemathesis.check
def complete_stream(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 200 stream ends with ``data: [DONE]`` and carries no error event (a 5xx in disguise).

    The whole stream must have been read: ``test_fuzz.py`` raises schemathesis's event limit
    above any stream these servers can send, so a stream cut at the limit is a failure too."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code != 200 or not content_type.startswith("text/event-stream"):
        return None
    assert not response.stream_cut_short, "schemathesis stopped reading this stream at its event limit"
    events = [event.removeprefix("data: ") for event in response.content.decode().split("\n\n") if event]
    assert events and events[-1] == "[DONE]", f"the stream ends with {events[-1:]}, not [DONE]"
    errors = [event for event in events[:-1] if "error" in json.loads(event)]
    assert not errors, f"error events in a 200 stream: {errors}"
    return True
