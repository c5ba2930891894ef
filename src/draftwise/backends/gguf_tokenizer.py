"""The tokenizer stored in a GGUF file, through llama.cpp: the seam's ``Tokenizer`` for the
``llamacpp`` backend.

Encoding and decoding are llama.cpp's own (``llama_tokenize``, ``llama_detokenize``), so the
ids are exactly those the model was built for. The chat template is the file's
``tokenizer.chat_template``, rendered with Jinja the way transformers renders templates
(trimmed blocks, a sandbox, ``raise_exception`` and ``strftime_now``), so a prompt gets the
same text, and the same ids, whichever backend runs it.
"""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from draftwise.chat import PromptError, split_markup

# llama_token_attr bits (llama.h). Control and unknown tokens are markup: written in text,
# they are read as such only when special tokens are parsed. User-defined tokens are words
# the vocabulary added: llama.cpp reads them out of any text.
_UNKNOWN = 1 << 0
_CONTROL = 1 << 3
_USER_DEFINED = 1 << 4
_LSTRIP = 1 << 7  # the token eats the white space before it
_RSTRIP = 1 << 8  # ... and after it
_WHITESPACE = " \t\n\v\f\r"  # C's isspace, as llama.cpp strips


class ChatTemplateRenderError(PromptError):
    """The chat template refused the messages (it raised, or it is broken)."""


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateRenderError(message)

    def tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    special: dict[str, str],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """``messages`` through a Jinja chat ``template``; ``special`` names tokens such as
    ``bos_token`` that templates write out; ``tools``: the functions the model may call."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, **special
        )
    except TemplateError as exc:
        raise ChatTemplateRenderError(str(exc)) from exc


class GGUFTokenizer:
    """Token ids <-> text with a GGUF file's vocabulary (llama.cpp calls; safe from any thread)."""

    def __init__(self, api: Any, model: Any, vocab: Any, owner: object = None) -> None:
        self._api = api
        self._vocab = vocab
        # What frees the vocabulary when it goes: kept alive here when nothing else holds it
        # (a model loaded for its tokenizer alone).
        self._owner = owner
        self.size = int(api.llama_vocab_n_tokens(vocab))
        template = api.llama_model_chat_template(model, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None
        self.eos_token_id = _token_or_none(api.llama_vocab_eos(vocab))
        self.bos_token_id = _token_or_none(api.llama_vocab_bos(vocab))
        self.pad_token_id = _token_or_none(api.llama_vocab_pad(vocab))
        # Every end-of-generation token (EOS, end of turn, ...), as llama.cpp's own loop stops on.
        self.end_of_generation = tuple(t for t in range(self.size) if api.llama_vocab_is_eog(vocab, t))
        self._attrs = {t: a for t in range(self.size) if (a := int(api.llama_vocab_get_attr(vocab, t))) & ~0b100}
        control = {t for t, a in self._attrs.items() if a & (_CONTROL | _UNKNOWN)}
        words = {t for t, a in self._attrs.items() if a & _USER_DEFINED and t not in control}
        self.control_tokens: dict[str, int] = {self._text(t): t for t in sorted(control) if self._text(t)}
        self._words = {self._text(t): t for t in sorted(words) if self._text(t)}
        self._markup = {**self._words, **self.control_tokens}
        # What llama_tokenize adds with add_special: a BOS first, an EOS last, for some models.
        self._bos = [self.bos_token_id] if api.llama_vocab_get_add_bos(vocab) and self.bos_token_id is not None else []
        self._eos = [self.eos_token_id] if api.llama_vocab_get_add_eos(vocab) and self.eos_token_id is not None else []

    def __len__(self) -> int:
        return self.size

    def _text(self, token: int | None) -> str:
        return "" if token is None else self._api.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = True, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``; with ``parse_special``, control tokens written in it are read
        as such (llama.cpp's ``parse_special``), else they are text.

        The text is cut at markup here, in one linear scan, and llama.cpp tokenizes only the
        plain pieces between: its own search for special tokens grows with the square of
        their count. The ids are llama.cpp's own (its tokenizer cuts the text the same way).
        """
        pieces = list(split_markup(text, self._markup if parse_special else self._words))
        _strip_around_markup(pieces, self._attrs)
        known: dict[str, list[int]] = {}  # each llama_tokenize call has a fixed cost: reuse
        ids = list(self._bos) if add_special_tokens else []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            elif piece:
                if piece not in known:
                    known[piece] = self._tokenize(piece)
                ids.extend(known[piece])
        return ids + self._eos if add_special_tokens else ids

    def _tokenize(self, text: str) -> list[int]:
        """llama.cpp's ids of ``text``, which holds no markup, with nothing added."""
        data = text.encode("utf-8", "surrogatepass")
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (ctypes.c_int32 * capacity)()
            n = self._api.llama_tokenize(self._vocab, data, len(data), buffer, capacity, False, False)
            if n >= 0:
                return list(buffer[:n])
            capacity = -n
        raise RuntimeError("llama_tokenize asked for more room twice")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence at the end comes out as U+FFFD."""
        if not ids:
            return ""
        tokens = (ctypes.c_int32 * len(ids))(*ids)
        capacity = 16 * len(ids) + 16
        for _ in range(2):
            buffer = ctypes.create_string_buffer(capacity)
            n = self._api.llama_detokenize(
                self._vocab, tokens, len(ids), buffer, capacity, False, not skip_special_tokens
            )
            if n >= 0:
                return buffer.raw[:n].decode("utf-8", "replace")
            capacity = -n
        raise RuntimeError("llama_detokenize asked for more room twice")

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if tokenize:
            raise ValueError("apply_chat_template renders text; encode it with encode(text, add_special_tokens=False)")
        if not self.chat_template:
            raise ChatTemplateRenderError("the model has no chat template")
        special = {"bos_token": self._text(self.bos_token_id), "eos_token": self._text(self.eos_token_id)}
        return render_chat(self.chat_template, conversation, add_generation_prompt, special, tools)

    @functools.cached_property
    def _vocab_map(self) -> dict[str, int]:
        return {self._text(i): i for i in range(self.size)}

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, the strings as the GGUF file stores them (``Ġword`` for byte-level BPE)."""
        return dict(self._vocab_map)

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes as llama.cpp writes it out (markup tokens as their text)."""
        buffer = ctypes.create_string_buffer(256)
        pieces = []
        for token in range(self.size):
            n = self._api.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            if n < 0:  # longer than the buffer: make room and write it again
                buffer = ctypes.create_string_buffer(-n)
                n = self._api.llama_token_to_piece(self._vocab, token, buffer, len(buffer), 0, True)
            pieces.append(buffer.raw[:n])
        return pieces


def _strip_around_markup(pieces: list[str | int], attrs: dict[int, int]) -> None:
    """Strip the white space that markup tokens with llama.cpp's lstrip / rstrip attribute eat
    from the text pieces beside them (in place; a piece may become empty)."""
    for i, piece in enumerate(pieces):
        if not isinstance(piece, int):
            continue
        attr = attrs.get(piece, 0)
        if attr & _LSTRIP and i > 0 and isinstance(pieces[i - 1], str):
            pieces[i - 1] = str(pieces[i - 1]).rstrip(_WHITESPACE)
        if attr & _RSTRIP and i + 1 < len(pieces) and isinstance(pieces[i + 1], str):
            pieces[i + 1] = str(pieces[i + 1]).lstrip(_WHITESPACE)


def _token_or_none(token: int) -> int | None:
    return int(token) if token is not None and token >= 0 else None
