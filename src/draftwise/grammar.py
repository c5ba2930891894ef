"""Constrained decoding: a grammar as a mask on the target and as a free drafter.

A request may carry a grammar (a JSON schema, a Lark or GBNF grammar, a regex). llguidance
compiles it against the target's vocabulary and keeps, for each stream, a matcher that
follows the committed tokens. The matcher gives three things:

* **masks**: the tokens the grammar allows at each verified row of a block, an argument of
  ``draftwise.verify.verify`` (greedy takes the argmax under the mask; sampling masks p);
* **forced tokens**: text the grammar leaves no choice about (keys, quotes, separators, a
  tool call's wrapper), drafted at no cost as the source ``grammar``;
* **cuts**: another source's draft ends at its first token the grammar forbids, so that no
  verified row is spent on a token the mask would refuse anyway.

The output is what token-by-token masked decoding gives: greedy, the same tokens; sampling,
the same law (the distribution of masked sampling, not the grammar-conditional one, which no
token-level method gives).

JSON is written compactly but readably and always the same way, ``{"a": 1, "b": [2, 3]}``:
no white space outside strings but a space after ``:`` and ``,``. So the grammar forces every
separator, quote and key, where free white space would leave each a choice of the model's.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from draftwise.config import GrammarSpec
from draftwise.drafters import EMPTY_PROPOSAL, Drafter, Proposal
from draftwise.errors import DraftwiseError
from draftwise.events import FORCED
from draftwise.lm import Passes, Tokenizer
from draftwise.policies import Offer
from draftwise.verify import Verdict

GRAMMAR = FORCED
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
MAX_GRAMMAR_BYTES = 1 << 20  # a grammar or schema larger than this is refused before compiling
COMPILED_KEPT = 64  # compiled grammars a server keeps for the requests that repeat them
CONTROL_MARK = b"\xff"  # llguidance's mark on a token that is markup, never text


KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "lark": "Lark grammar",
    "gbnf": "GBNF grammar",
    "regex": "regular expression",
}


# How Qwen2.5 (and other Hermes-style chat templates) write a tool call: the template lists the
# tools, and the model answers with one or more of these.
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CLOSE), re.DOTALL)


class GrammarError(DraftwiseError, ValueError):
    """A grammar or schema that cannot be compiled; the message says where (one line)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise GrammarError("structured output needs llguidance: pip install llguidance") from exc
    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for ``spec`` (not yet checked against a vocabulary)."""
    llg = _llguidance().LLMatcher
    if len(spec.text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the {KIND_NAMES[spec.kind]} is larger than {MAX_GRAMMAR_BYTES >> 20} MiB")
    if spec.kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec.text) if spec.kind == "json_schema" else ANY_JSON_OBJECT
        except json.JSONDecodeError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be an object")
        try:
            return str(llg.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS)))
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
    if spec.kind == "gbnf":
        try:
            lark = _llguidance().gbnf_to_lark(spec.text)
        except Exception as exc:  # its parser raises plain exceptions on bad input
            raise GrammarError(f"invalid GBNF grammar: {str(exc).splitlines()[0] if str(exc) else exc}") from exc
        return str(llg.grammar_from_lark(lark))
    if spec.kind == "regex":
        return str(llg.grammar_from_regex(spec.text))
    return str(llg.grammar_from_lark(spec.text))


def tool_call_grammar(functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool, required: bool) -> GrammarSpec:
    """The grammar of an answer that calls tools: ``<tool_call>\n{"name": N, "arguments": A}\n
    </tool_call>``, one call or (``parallel``) several on their own lines, where N names one of
    ``functions`` (name, parameters schema) and A follows that function's schema. ``required``:
    the answer is calls from its first token; else (OpenAI's ``auto``) free text until the model
    opens a call. With the JSON layout above, everything up to the first argument's value is
    forced when there is one function: ``<tool_call>\n{"name": "get_weather", "arguments":
    {"city": "``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in functions
    ]
    schema = {"x-guidance": JSON_OPTIONS, "anyOf": calls}
    more = ' ("\\n" call)*' if parallel else ""
    text = f'start: call{more}\ncall: "{TOOL_OPEN}\\n" body "\\n{TOOL_CLOSE}"\nbody: %json {json.dumps(schema)}'
    return GrammarSpec(kind="lark", text=text, trigger=None if required else TOOL_OPEN)


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the text before the first call, [(function name, arguments as a JSON string)]) of an
    answer in the format above; a call that does not parse stays in the text."""
    calls: list[tuple[str, str]] = []
    first = None
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        first = match.start() if first is None else first
    return (text if first is None else text[:first]), calls


def held_back(text: str) -> int:
    """Where streamed text must stop while an answer may still open a tool call: at the call's
    opening tag, or at an end of ``text`` that could be the start of one."""
    at = text.find(TOOL_OPEN)
    if at >= 0:
        return at
    for size in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\}\s*" + re.escape(TOOL_CLOSE))


class CallStream:
    """Reads an answer in the tool-call format as it streams, and says what to send: the text
    before a call as content, then each call as it goes, its name once known and its arguments
    piece by piece (OpenAI's ``delta.tool_calls``).

    Example: pushed ``'Hi <tool_call>\n{"name": "f", "arguments": {"a": '`` then ``'1}}\n</tool_call>'``
    gives ``("content", "Hi ")``, ``("call", "f")``, ``("arguments", '{"a": ')``, then
    ``("arguments", "1}")``: the last ``}`` before the closing tag is the call's own.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.state = "text"  # text -> head (after the opening tag) -> arguments -> text ...
        self.calls = 0  # calls opened so far

    def push(self, text: str) -> list[tuple[str, str]]:
        """The pieces ``text`` completes: (``content``, text), (``call``, name), (``arguments``, text)."""
        self.buffer += text
        pieces: list[tuple[str, str]] = []
        while True:
            piece = getattr(self, f"_{self.state}")()
            if piece is None:
                return pieces
            if piece[1] or piece[0] == "call":
                pieces.append(piece)

    def _text(self) -> tuple[str, str] | None:
        cut = held_back(self.buffer)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        if self.calls and not out.strip():
            out = ""  # the line break between two calls is not content
        if self.buffer.startswith(TOOL_OPEN):
            self.buffer, self.state = self.buffer[len(TOOL_OPEN) :], "head"
            return ("content", out)
        return ("content", out) if out else None

    def _head(self) -> tuple[str, str] | None:
        match = _HEAD.match(self.buffer)
        if match is None:
            return None
        self.buffer, self.state = self.buffer[match.end() :], "arguments"
        self.calls += 1
        return ("call", match.group(1))

    def _arguments(self) -> tuple[str, str] | None:
        match = _TAIL.search(self.buffer)
        if match is not None:
            out, self.buffer, self.state = self.buffer[: match.start()], self.buffer[match.end() :], "text"
            return ("arguments", out)
        keep = self.buffer.rfind("}")  # it may be the call's own closing brace: wait for what follows
        cut = len(self.buffer) if keep < 0 else keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return ("arguments", out) if out else None

    def flush(self) -> list[tuple[str, str]]:
        """What is left once the answer has ended (cut short, or a call that never opened)."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        if self.state == "arguments":
            return [("arguments", rest)]
        return [("content", (TOOL_OPEN if self.state == "head" else "") + rest)]


class _Encoder:
    """The tokenizer as llguidance calls it: text in, ids out, markup read as text."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes]) -> None:
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.special_token_ids = sorted(tokenizer.control_tokens.values())

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # tells llguidance to hand over text, not bytes
            raise TypeError("text only")
        return self.tokenizer.encode(text, add_special_tokens=False, parse_special=False)


class Grammars:
    """Compiles grammars for one target's vocabulary: the vocabulary is read once, on the
    first grammar (it takes about a second for a large one), and shared by every stream;
    safe to use from several threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self._vocabulary: Any = None
        self._lock = threading.Lock()
        # Compiled grammars by their text, each a matcher never advanced: a stream gets a copy.
        # An agent sends the same tools or schema with every request, so each is compiled once
        # (the request's check compiles it, its stream copies it), not once per request.
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def vocabulary(self) -> Any:
        with self._lock:
            if self._vocabulary is None:
                llguidance = _llguidance()
                tokens = list(self.tokenizer.token_bytes())
                for text, token in self.tokenizer.control_tokens.items():
                    tokens[token] = CONTROL_MARK + text.encode("utf-8")
                wrapper = llguidance.TokenizerWrapper(_Encoder(self.tokenizer, tokens))
                self._vocabulary = llguidance.LLTokenizer(wrapper, eos_token=self.eos_token_ids or None)
            return self._vocabulary

    def check(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` (once: see ``_compiled``), or raise ``GrammarError`` saying what is wrong."""
        self._matcher(spec)

    def _matcher(self, spec: GrammarSpec) -> Any:
        """The compiled, never advanced matcher of ``spec``'s grammar."""
        grammar = grammar_text(spec)
        vocabulary = self.vocabulary()
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
                return matcher
        matcher = _llguidance().LLMatcher(vocabulary, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {KIND_NAMES[spec.kind]}: {_one_line(matcher.get_error())}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def constraint(self, spec: GrammarSpec) -> Constraint | Triggered:
        """A fresh matcher of ``spec`` for one stream (waiting for its trigger, if it has one)."""
        compiled = self._matcher(spec)
        with self._lock:  # copied by one thread at a time, as the table is read
            matcher = compiled.deep_copy()
        constraint = Constraint(matcher, self.vocab_size)
        if spec.trigger is None:
            return constraint
        trigger = self.tokenizer.encode(spec.trigger, add_special_tokens=False, parse_special=False)
        return Triggered(constraint, trigger)


def _one_line(message: str) -> str:
    return " ".join(message.split())


class Constraint:
    """One stream's grammar state: what it allows next, given the tokens committed so far.

    The matcher only ever holds committed tokens: a block is walked through (``masks``) and
    rolled back at once.
    """

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (empty where the model has a choice)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    def cut(self, tokens: Sequence[int], after: Sequence[int] = ()) -> int:
        """How many of ``tokens`` the grammar allows in a row from here (once ``after`` is committed too)."""
        if not len(tokens) or not self._enter(after):
            return 0
        try:
            return int(self.matcher.validate_tokens(list(tokens)))
        finally:
            self._leave(after)

    def _enter(self, tokens: Sequence[int]) -> bool:
        """Follow ``tokens`` for a moment (``_leave`` undoes it); whether the grammar took them."""
        return not tokens or bool(self.matcher.consume_tokens([int(t) for t in tokens]))

    def _leave(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.matcher.rollback(len(tokens))

    def masks(self, block: Sequence[int], after: Sequence[int] = ()) -> torch.Tensor:  # [k + 1, W] int32
        """The allowed tokens at each row a verification of ``block`` scores (row i: after
        ``block[:i]``), once ``after`` is committed as well, as a bitmask
        (``draftwise.verify.pack_bits``: bit ``j % 32`` of word ``j // 32`` allows token ``j``).
        Rows past a token the grammar refuses allow nothing (drafts are cut before that).

        Example: grammar ``"ab" | "ac"``, spelt one character a token, nothing committed,
        block ``[a]``: row 0 allows ``a`` only, row 1 allows ``b`` and ``c``.
        """
        bits = np.zeros((len(block) + 1, self.words), dtype=np.int32)
        if not self._enter(after):
            raise GrammarError("the grammar refused its own opening")
        # Only what the grammar takes is walked: a refused token would leave the matcher broken.
        tokens = [int(t) for t in block]
        valid = tokens[: self.matcher.validate_tokens(tokens)] if tokens else []
        for i in range(len(valid) + 1):
            row = bits[i]
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if i < len(valid):
                self.matcher.consume_token(valid[i])
        if valid:
            self.matcher.rollback(len(valid))
        self._leave(after)
        return torch.from_numpy(bits)

    def commit(self, tokens: Sequence[int]) -> None:
        """Follow the committed ``tokens`` (a finished grammar takes nothing more)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(token)):
                raise GrammarError(f"token {token} broke the grammar: {_one_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        """Whether the text so far is complete under the grammar."""
        return bool(self.matcher.is_accepting())


class Triggered:
    """A grammar that applies only from its trigger on: the output is free text until it holds
    the ``trigger`` tokens (a tool call's opening tag, which the grammar itself starts with),
    and follows the grammar from there, the trigger included. Same interface as ``Constraint``.

    Example: trigger ``[T]``, block ``[a, T, b]``: rows 0 and 1 (scoring ``a`` and ``T``) are
    free text; row 2 scores the token after ``a T``, the grammar's first after its opening
    ``T``, and row 3 the one after ``T b``.
    """

    def __init__(self, inner: Constraint, trigger: Sequence[int]) -> None:
        self.inner = inner
        self.trigger = [int(t) for t in trigger]
        self.active = False
        self._tail: list[int] = []  # the last committed tokens, while waiting (a trigger may span commits)

    def _start(self, tokens: Sequence[int]) -> int | None:
        """The index in ``tokens`` just past the trigger's first end, None if it does not end there."""
        seq, n = self._tail + [int(t) for t in tokens], len(self.trigger)
        for end in range(max(n, len(self._tail) + 1), len(seq) + 1):
            if seq[end - n : end] == self.trigger:
                return end - len(self._tail)
        return None

    def forced(self) -> list[int]:
        return self.inner.forced() if self.active else []

    def cut(self, tokens: Sequence[int], after: Sequence[int] = ()) -> int:
        if self.active:
            return self.inner.cut(tokens, after)
        # Forced text (``after``) comes only once the grammar is active.
        start = self._start(tokens)
        return len(tokens) if start is None else start + self.inner.cut(tokens[start:], self.trigger)

    def masks(self, block: Sequence[int]) -> torch.Tensor | None:  # [k + 1, W] int32, None: all allowed
        if self.active:
            return self.inner.masks(block)
        start = self._start(block)
        if start is None:
            return None
        rows = torch.full((len(block) + 1, self.inner.words), -1, dtype=torch.int32)  # every bit: free
        rows[start:] = self.inner.masks(block[start:], self.trigger)
        return rows

    def commit(self, tokens: Sequence[int]) -> None:
        if self.active:
            self.inner.commit(tokens)
            return
        start = self._start(tokens)
        if start is None:
            self._tail = (self._tail + [int(t) for t in tokens])[-len(self.trigger) :]
            return
        self.active = True
        self.inner.commit(self.trigger)
        self.inner.commit(tokens[start:])

    @property
    def finished(self) -> bool:
        return self.active and self.inner.finished


class Constrained:
    """A drafter under a grammar: the grammar's forced tokens wherever it forces some (a
    source that costs nothing and is always grounded), elsewhere ``inner``'s drafts cut at
    their first token the grammar forbids. ``inner`` may be None (plain decoding but for the
    forced text).

    Where the grammar forces text, each of ``inner``'s sources is also offered after it, as
    one block: ``grammar+<source>`` drafts the forced tokens, then what the source drafts
    from the context as it will be once they are committed (forced tokens are the only ones
    the mask allows, so that context is certain).

    Example: an extraction's JSON with ``{"name": "`` committed and a value chosen; the
    grammar forces ``", "raises": [`` (5 tokens); an n-gram copy in progress offers 9
    more. ``grammar+ngram`` drafts all 14 in one pass: the policy prices the forced five as
    sure and the rest at the copy's acceptance (``Offer.sure``). The proposal is the
    n-gram drafter's, with its first five tokens marked ``forced`` (counted as the grammar's).
    """

    def __init__(self, inner: Drafter | None, constraint: Constraint | Triggered) -> None:
        self.inner = inner
        self.constraint = constraint
        self._forced: list[int] = []

    def start(self, prompt: Sequence[int], config: Any, generator: torch.Generator | None) -> None:
        if self.inner is not None:
            self.inner.start(prompt, config, generator)

    def offers(self, context: Sequence[int]) -> tuple[Offer, ...]:
        self._forced = self.constraint.forced()
        if not self._forced:
            return self.inner.offers(context) if self.inner is not None else ()
        sure = len(self._forced)
        own = Offer(GRAMMAR, limit=sure, cost_hint=0.0, grounded=True, sure=sure)
        if self.inner is None:
            return (own,)
        after = self.inner.offers([*context, *self._forced])
        return (own, *(_after_forced(offer, sure) for offer in after))

    def propose(self, context: Sequence[int], k: int, source: str | None = None) -> Passes[Proposal]:
        forced = self._forced[:k]
        if source == GRAMMAR or (source is None and forced) or (forced and len(forced) == k):
            return Proposal(tokens=torch.tensor(forced, dtype=torch.long), source=GRAMMAR, forced=len(forced))
        if self.inner is None:
            return EMPTY_PROPOSAL
        if source is not None and source.startswith(MIXED):
            source = source.removeprefix(MIXED)
        proposal = yield from self.inner.propose([*context, *forced], k - len(forced), source)
        return _joined(forced, _cut(proposal, self.constraint.cut(proposal.tokens.tolist(), forced)))

    def observe(self, context: Sequence[int], verdict: Verdict) -> None:
        if self.inner is not None:
            self.inner.observe(context, verdict)


MIXED = GRAMMAR + "+"  # the prefix of a source drafted after the grammar's forced tokens


def _after_forced(offer: Offer, sure: int) -> Offer:
    """``offer``, made after ``sure`` forced tokens, as a block that drafts them first."""
    return replace(
        offer,
        source=MIXED + offer.source,
        limit=None if offer.limit is None else sure + offer.limit,
        key=MIXED + offer.stats_key,
        sure=sure,
    )


def _cut(proposal: Proposal, keep: int) -> Proposal:
    """The first ``keep`` tokens of ``proposal``."""
    if keep == len(proposal):
        return proposal
    probs = proposal.probs[:keep] if proposal.probs is not None else None
    return replace(proposal, tokens=proposal.tokens[:keep], probs=probs)


def _joined(forced: list[int], proposal: Proposal) -> Proposal:
    """``forced`` tokens, then ``proposal``'s, as one block (the forced ones a point mass)."""
    if not forced:
        return proposal
    head = torch.tensor(forced, dtype=torch.long)  # [f]
    probs = proposal.probs  # [k, V] or None
    if probs is not None:
        point = torch.zeros(len(forced), probs.shape[1], dtype=probs.dtype)  # [f, V]
        point[torch.arange(len(forced)), head] = 1.0
        probs = torch.cat([point, probs])  # [f + k, V]
    return replace(proposal, tokens=torch.cat([head, proposal.tokens]), probs=probs, forced=len(forced))
