"""Constrained decoding: a grammar as a mask on the target and as a free drafter.

A request may carry a grammar (a JSON schema, a Lark or GBNF grammar, a regex). llguidance
compiles it against the target's vocabulary and keeps, for each stream, a matcher that
follows the committed tokens. The matcher gives three things:

* **masks**: the tokens the grammar allows at each verified row of a block, an argument of
  ``draftwise.verify.verify`` (greedy takes the argmax under the mask; sampling masks p);
* **forced tokens**: text the grammar leaves no choice about (keys, quotes, separators, a
  tool call's wrapper), drafted at no cost as the source ``grammar``
  (``draftwise.constrained``);
* **cuts**: another source's draft ends at its first token the grammar forbids, so that no
  verified row is spent on a token the mask would refuse anyway.

Each stream's state under its grammar (masks, forced text, cuts), and the errors a grammar
fails with, are ``draftwise.constraint``'s; this module compiles grammars and keeps them.

The output is what token-by-token masked decoding gives: greedy, the same tokens; sampling,
the same law (the distribution of masked sampling, not the grammar-conditional one, which no
token-level method gives).

JSON is written compactly but readably and always the same way, ``{"a": 1, "b": [2, 3]}``:
no white space outside strings but a space after ``:`` and ``,``. So the grammar forces every
separator, quote and key, where free white space would leave each a choice of the model's.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from draftwise.config import GrammarSpec
from draftwise.constraint import Constraint, GrammarError, Triggered, llguidance_reason
from draftwise.lm import LanguageModel, Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = {"type": "object"}
MAX_GRAMMAR_BYTES = 1 << 20  # a grammar or schema larger than this is refused before compiling
COMPILED_KEPT = 64  # compiled grammars (and failed compiles) a server keeps for the requests that repeat them
CONTROL_MARK = b"\xff"  # llguidance's mark on a token that is markup, never text


KIND_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "lark": "Lark grammar",
    "gbnf": "GBNF grammar",
    "regex": "regular expression",
}


def describe(spec: GrammarSpec) -> str:
    """What messages call ``spec``: its own name ("tool-call grammar"), else its kind's ("JSON
    schema", ...)."""
    return spec.name or KIND_NAMES[spec.kind]


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
            raise GrammarError(f"invalid JSON schema: {llguidance_reason(str(exc))}") from exc
    if spec.kind == "gbnf":
        try:
            lark = _llguidance().gbnf_to_lark(spec.text)
        except Exception as exc:  # its parser raises plain exceptions on bad input
            raise GrammarError(f"invalid GBNF grammar: {llguidance_reason(str(exc))}") from exc
        return str(llg.grammar_from_lark(lark))
    if spec.kind == "regex":
        return str(llg.grammar_from_regex(spec.text))
    return str(llg.grammar_from_lark(spec.text))


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
        self._spelling: list[bytes] = []  # each token's bytes, as llguidance reads them
        self._lock = threading.Lock()
        # Compiled grammars by a hash of their text, each a matcher never advanced (a stream
        # gets a copy), or the GrammarError its compile or check gave. An agent sends the same
        # tools or schema with every request, so each is compiled once (the request's check
        # compiles it, its stream copies it), not once per request; a failure is kept too,
        # since a bad schema can cost seconds of compile (12,000 properties: 3 to 4 s) and a
        # client may send it again and again.
        self._compiled: OrderedDict[bytes, Any] = OrderedDict()
        # The grammar text's hash (the key above) by a hash of the spec's kind and text, what
        # ``grammar_text`` reads: a grammar kept is found without building its text again,
        # work that would otherwise run twice a request, once on the round thread every
        # stream waits on (``constraint``).
        self._texts: OrderedDict[bytes, bytes] = OrderedDict()
        # One lock per spec being compiled: a second request for it waits for the first's
        # result rather than compiling it a second time.
        self._compiling: dict[bytes, threading.Lock] = {}
        # Held by the compile itself, never by a lookup of a kept grammar: compiles take CPU
        # the decode rounds need (a server may have two cores), so they run one at a time
        # whatever their grammars, while a request whose grammar is kept never waits for one.
        self._compile_lock = threading.Lock()

    def vocabulary(self) -> Any:
        with self._lock:
            if self._vocabulary is None:
                llguidance = _llguidance()
                tokens = list(self.tokenizer.token_bytes())
                for text, token in self.tokenizer.control_tokens.items():
                    tokens[token] = CONTROL_MARK + text.encode("utf-8")
                wrapper = llguidance.TokenizerWrapper(_Encoder(self.tokenizer, tokens))
                self._vocabulary = llguidance.LLTokenizer(wrapper, eos_token=self.eos_token_ids or None)
                self._spelling = tokens
            return self._vocabulary

    def check(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` and try its first steps (once: see ``_compiled``), or raise
        ``GrammarError`` saying what is wrong."""
        self._matcher(spec)

    def _matcher(self, spec: GrammarSpec) -> Any:
        """The compiled, checked, never advanced matcher of ``spec``'s grammar."""
        key = _spec_key(spec)
        vocabulary = self.vocabulary()
        with self._lock:
            known = self._kept(key)
            gate = self._compiling.setdefault(key, threading.Lock()) if known is None else None
        if gate is not None:
            known = self._compile_once(key, gate, spec, vocabulary)
        if isinstance(known, GrammarError):
            raise GrammarError(str(known))  # a fresh error: the kept one's traceback stays as it was
        return known

    def _compile_once(self, key: bytes, gate: threading.Lock, spec: GrammarSpec, vocabulary: Any) -> Any:
        """The matcher or failure of ``spec`` (whose ``_spec_key`` is ``key``), compiled here
        unless the request holding ``gate`` compiled it meanwhile."""
        try:
            with gate:
                with self._lock:
                    known = self._kept(key)
                if known is None:
                    grammar = grammar_text(spec)
                    text_key = hashlib.sha256(grammar.encode("utf-8", "surrogatepass")).digest()
                    known = self._compile_text(text_key, spec, grammar, vocabulary)
                    with self._lock:
                        self._texts[key] = text_key
                        while len(self._texts) > COMPILED_KEPT:
                            self._texts.popitem(last=False)
                return known
        finally:
            with self._lock:
                self._compiling.pop(key, None)

    def _compile_text(self, text_key: bytes, spec: GrammarSpec, grammar: str, vocabulary: Any) -> Any:
        """The matcher or failure of ``grammar`` (hashed ``text_key``): kept (another spec may
        give the same text), or compiled once no other compile is running."""
        with self._lock:
            known = self._known(text_key)
        if known is not None:
            return known
        with self._compile_lock:
            with self._lock:  # kept meanwhile by a compile of another spec of the same text
                known = self._known(text_key)
            if known is None:
                known = _compiled(spec, grammar, vocabulary)
                with self._lock:
                    self._keep(text_key, known)
            return known

    def _kept(self, key: bytes) -> Any:
        """The kept matcher or failure of the spec whose ``_spec_key`` is ``key``, None if
        none is kept (call under the lock)."""
        text_key = self._texts.get(key)
        if text_key is None:
            return None
        self._texts.move_to_end(key)
        return self._known(text_key)

    def _known(self, key: bytes) -> Any:
        """The kept matcher or failure of the grammar text hashed ``key``, None if none is kept
        (call under the lock)."""
        known = self._compiled.get(key)
        if known is not None:
            self._compiled.move_to_end(key)
        return known

    def _keep(self, key: bytes, known: Any) -> None:
        """Keep a matcher or a failure, dropping the least recently used past ``COMPILED_KEPT``
        (call under the lock)."""
        self._compiled[key] = known
        while len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)

    def constraint(self, spec: GrammarSpec) -> Constraint | Triggered:
        """A fresh matcher of ``spec`` for one stream (waiting for its trigger, if it has one)."""
        compiled = self._matcher(spec)
        with self._lock:  # copied by one thread at a time, as the table is read
            matcher = compiled.deep_copy()
        constraint = Constraint(matcher, self.vocab_size, describe(spec))
        if spec.trigger is None:
            return constraint
        vocabulary = self.vocabulary()
        return Triggered(constraint, spec.trigger, self._spelling, lambda text: list(vocabulary.tokenize_bytes(text)))


def _spec_key(spec: GrammarSpec) -> bytes:
    """A hash of what ``grammar_text`` reads of ``spec`` (its kind and text), found without
    building the grammar."""
    digest = hashlib.sha256(spec.kind.encode("utf-8"))
    digest.update(b"\0")
    digest.update(spec.text.encode("utf-8", "surrogatepass"))
    return digest.digest()


def _compiled(spec: GrammarSpec, grammar: str, vocabulary: Any) -> Any:
    """llguidance's matcher of ``grammar`` once its first steps are tried, or the
    ``GrammarError`` that says why it cannot be used (returned, to be kept as a matcher is)."""
    llguidance = _llguidance()
    # No parser state or grammar in its messages: only their first line is ever shown.
    limits = llguidance.LLParserLimits(verbose_errors=False)
    matcher = llguidance.LLMatcher(vocabulary, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        return GrammarError(f"invalid {describe(spec)}: {llguidance_reason(matcher.get_error())}")
    problem = _first_steps(matcher.deep_copy(), vocabulary)
    if problem is not None:
        return GrammarError(f"the {describe(spec)} cannot be followed: {problem}")
    return matcher


def _first_steps(matcher: Any, vocabulary: Any) -> str | None:
    """Why ``matcher`` (a copy, advanced here) cannot start an answer, None if it can.

    llguidance compiles some grammars it then cannot follow, and says so only as it walks:
    an object of 3,000 optional properties passes the compile and goes over the parser's
    row limit once its ``{`` is written; a required property that refers to its own object
    forces ``{"a": {"a": ...`` for ever; ``"pattern": "^a{1000000}$"`` is over the lexer's
    limit at its first character; a pure ``$ref`` cycle allows no text at all. Following
    the text the grammar forces from the start and computing the first mask after it finds
    each of these before any answer, so the request is refused rather than answered with a
    broken one.

    The forced text is followed as bytes, in the tokenizer's own tokens: where a vocabulary
    has tokens that run past it (``{"`` beside ``{``), llguidance forces no token at all."""
    forced = matcher.compute_ff_bytes()
    if forced and not matcher.is_error():
        matcher.consume_tokens(list(vocabulary.tokenize_bytes(forced)))
    mask = b"" if matcher.is_error() else matcher.compute_bitmask()
    if matcher.is_error():
        return llguidance_reason(matcher.get_error())
    if not any(mask) and not matcher.is_accepting():
        return "no text can complete it"
    return None


def grammars_of(target: LanguageModel) -> Grammars | None:
    """The grammar compiler of ``target``'s vocabulary; None for a model without a tokenizer."""
    if target.tokenizer is None:
        return None
    return Grammars(target.tokenizer, target.vocab_size, target.eos_token_ids)
