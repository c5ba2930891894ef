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

from draftwise.chat import PromptError

# llama_token_attr bits (llama.h): tokens that are markup rather than text.
_CONTROL = 1 << 3


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
    template: str, messages: list[dict[str, str]], add_generation_prompt: bool, special: dict[str, str]
) -> str:
    """``messages`` through a Jinja chat ``template``; ``special`` names tokens such as
    ``bos_token`` that templates write out."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **special)
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

    def __len__(self) -> int:
        return self.size

    def _text(self, token: int | None) -> str:
        return "" if token is None else self._api.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it are recognised."""
        data = text.encode("utf-8", "surrogatepass")
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (ctypes.c_int32 * capacity)()
            n = self._api.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_special_tokens, True)
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
        self, conversation: list[dict[str, str]], *, tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        if tokenize:
            raise ValueError("apply_chat_template renders text; encode it with encode(text, add_special_tokens=False)")
        if not self.chat_template:
            raise ChatTemplateRenderError("the model has no chat template")
        special = {"bos_token": self._text(self.bos_token_id), "eos_token": self._text(self.eos_token_id)}
        return render_chat(self.chat_template, conversation, add_generation_prompt, special)

    @functools.cached_property
    def _vocab_map(self) -> dict[str, int]:
        return {self._text(i): i for i in range(self.size)}

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, the strings as the GGUF file stores them (``Ġword`` for byte-level BPE)."""
        return dict(self._vocab_map)

    def is_control(self, token: int) -> bool:
        return bool(self._api.llama_vocab_get_attr(self._vocab, token) & _CONTROL)


def _token_or_none(token: int) -> int | None:
    return int(token) if token is not None and token >= 0 else None
