"""Draft/target compatibility: which way a draft model's tokens reach the target.

A draft whose token ids mean the same strings as the target's proposes its own ids (the
``shared`` vocabulary). Any other draft drafts through text (``text``, see
``draftwise.drafters.CrossVocabDrafter``), which needs a draft that can write every
character: one that reads some back as something else (a SentencePiece vocabulary without
byte fallback, which has ``<unk>`` for what it lacks) is refused.

The embedding (output) sizes may differ: Qwen pads its embedding matrix beyond the real
vocabulary, and ids past the tokenizer's vocabulary are never produced by either side, so only
the vocabularies themselves are compared. ``verify`` aligns distributions of different widths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from draftwise.errors import IncompatibleModelsError
from draftwise.retokenize import round_trip_loss

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer

DraftMode = Literal["shared", "text"]


def shares_vocabulary(target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer) -> bool:
    """Whether both tokenizers map the same strings to the same ids."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def draft_mode(
    target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer, target_name: str = "target", draft_name: str = "draft"
) -> DraftMode:
    """``shared`` when the draft speaks the target's vocabulary, ``text`` when it drafts
    through text; ``IncompatibleModelsError`` when it cannot write the target's text."""
    if shares_vocabulary(target_tokenizer, draft_tokenizer):
        return "shared"
    loss = round_trip_loss(draft_tokenizer)
    if loss is not None:
        raise IncompatibleModelsError(
            f"draft {draft_name!r} speaks another vocabulary than target {target_name!r} and cannot write every "
            f"character of its text ({loss}); use a draft with byte fallback, one from the target's family, "
            "or --drafter ngram"
        )
    return "text"
