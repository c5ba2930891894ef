"""Draft/target compatibility: a draft model is only useful if its token ids mean the same
strings as the target's.

The embedding (output) sizes may differ: Qwen pads its embedding matrix beyond the real
vocabulary, and ids past the tokenizer's vocabulary are never produced by either side, so only
the vocabularies themselves are compared. ``verify`` aligns distributions of different widths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftwise.errors import IncompatibleModelsError

if TYPE_CHECKING:
    from draftwise.lm import Tokenizer


def _vocab(tokenizer: Tokenizer) -> dict[str, int]:
    return dict(tokenizer.get_vocab())


def check_compatible(
    target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer, target_name: str = "target", draft_name: str = "draft"
) -> None:
    """Raise ``IncompatibleModelsError`` unless both tokenizers map the same strings to the same ids."""
    target_vocab, draft_vocab = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    if target_vocab == draft_vocab:
        return
    pair = f"draft {draft_name!r} and target {target_name!r}"
    if len(target_vocab) != len(draft_vocab):
        only = sorted(set(draft_vocab) - set(target_vocab))[:3] or sorted(set(target_vocab) - set(draft_vocab))[:3]
        raise IncompatibleModelsError(
            f"{pair} have different tokenizers: {len(draft_vocab)} vs {len(target_vocab)} tokens "
            f"(e.g. {', '.join(map(repr, only))} is in one only); use a draft from the same model "
            "family, or --drafter ngram"
        )
    by_id_target = {i: t for t, i in target_vocab.items()}
    token, draft_id = next(
        (t, i) for t, i in sorted(draft_vocab.items(), key=lambda item: item[1]) if target_vocab.get(t) != i
    )
    raise IncompatibleModelsError(
        f"{pair} have different tokenizers: id {draft_id} is {token!r} in the draft but "
        f"{by_id_target.get(draft_id)!r} in the target; use a draft from the same model family, "
        "or --drafter ngram"
    )
