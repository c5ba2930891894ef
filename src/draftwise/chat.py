"""Prompt text -> token ids, plain or through the target's chat template.

Every entry point (generate, the API server, the bench) goes through ``encode_messages``
for chat prompts, so one conversation gets the same ids wherever it is sent.
"""

from __future__ import annotations

from typing import Any

from draftwise.errors import DraftwiseError


class PromptError(DraftwiseError, ValueError):
    """A prompt that cannot be turned into token ids (empty, no chat template...)."""


class ChatTemplateError(PromptError):
    """The tokenizer has no chat template to apply."""


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ending with the
    assistant's turn opening, so the model answers rather than continues."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS, role markers): add none twice.
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def encodable(text: str) -> str:
    """``text`` itself, if it is valid Unicode; else a ``PromptError`` saying where it is not.

    A Python string may hold a lone surrogate: JSON's ``"\\ud800"`` decodes to one, and so
    does a command-line byte that is not UTF-8. No tokenizer takes such text.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"the text is not valid Unicode: it holds a lone surrogate ({text[exc.start]!r}) at character {exc.start}"
        ) from None
    return text


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``; with ``chat``, as a single user turn followed by the assistant's
    turn opening, so the model answers rather than continues the user's text."""
    if not text.strip():
        raise PromptError("the prompt is empty")
    encodable(text)
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the target model has no chat template; drop --chat to use a plain prompt")
    return encode_messages(tokenizer, [{"role": "user", "content": text}])
