"""Load a model from a source string: ``tiny:SEED`` (random, in-process), a local folder or
a Hugging Face id.
"""

from __future__ import annotations

from draftwise.model import CausalLM


class ModelLoadError(ValueError):
    """A model source could not be loaded; the message says why, for the user."""


def load_lm(source: str, *, dtype: str = "auto", threads: int | None = None) -> CausalLM:
    """Load ``source`` as a ``CausalLM`` with its tokenizer."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if source.startswith("tiny:"):
        from draftwise.tiny import tiny_lm

        try:
            seed = int(source.split(":", 1)[1])
        except ValueError as exc:
            raise ModelLoadError(f"tiny model source must be 'tiny:SEED', got {source!r}") from exc
        return tiny_lm(seed)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model {source!r}: {exc}") from exc
    return CausalLM(model, tokenizer, name=source)
