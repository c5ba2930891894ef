"""Schemas llguidance compiles but cannot follow, shared by the grammar tests and the server's."""

from __future__ import annotations

from typing import Any


def optional_properties(n: int) -> dict[str, Any]:
    """An object of ``n`` optional integer properties: over llguidance's row limit once its
    ``{`` is written, from about 500 of them (each adds 4 items to the row; the limit is 2,000)."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


# Schemas that compile but that no answer can follow to its end.
UNFINISHABLE: dict[str, dict[str, Any]] = {
    "required self-$ref": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    "$ref cycle": {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    "huge pattern": {"type": "string", "pattern": "^a{1000000}$"},
}

# A choice first ("a" or "b"), then, whichever is chosen, an object llguidance cannot follow:
# it passes the check, which walks only to the first choice, and dead-ends mid-answer.
LATE_DEAD_END: dict[str, Any] = {
    "type": "object",
    "properties": {"k": {"enum": ["a", "b"]}, "o": optional_properties(3000)},
    "required": ["k", "o"],
    "additionalProperties": False,
}


def count_compiles(monkeypatch: Any) -> list[Any]:
    """Make llguidance's matcher count the grammars it is built with; returns the list each
    build appends its grammar to."""
    import llguidance

    built: list[Any] = []
    matcher = llguidance.LLMatcher

    class Counting:  # llguidance's matcher, counting the grammars compiled
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            built.append(args[1])
            return matcher(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(matcher, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    return built
