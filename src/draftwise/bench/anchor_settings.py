"""How each anchor (another project's decoding loop) is configured from draftwise's own
settings, as data: the anchors use it, and the bench report prints it without loading a model.
"""

from __future__ import annotations

from draftwise.config import GenerationConfig

# transformers has no cost-based draft length; its adaptive schedule is the closest match.
# "heuristic_transient" restarts from k on every call, as draftwise's policies do.
HF_SCHEDULE = {"fixed": "constant", "heuristic": "heuristic_transient", "cost": "heuristic_transient"}


def pld_tokens(config: GenerationConfig) -> int:
    """Tokens a prompt-lookup anchor proposes per step."""
    return max(1, config.draft.k)


def spec_draft_max(config: GenerationConfig) -> int:
    """Most tokens llama.cpp's own speculative loop drafts per step."""
    return max(1, config.draft.k_max if config.draft.k_policy != "fixed" else config.draft.k)


def describe(method: str, config: GenerationConfig) -> str | None:
    """One line on how ``method`` is configured; None for draftwise's own methods."""
    d = config.draft
    notes = {
        "hf-baseline": "transformers' `generate`, greedy or sampling as configured",
        "hf-assisted": f"transformers' `generate(assistant_model=...)`: `num_assistant_tokens={max(1, d.k)}`, schedule "
        f"`{HF_SCHEDULE[d.k_policy]}`, `assistant_confidence_threshold={d.confidence_threshold}`",
        "hf-pld": f"transformers' `generate(prompt_lookup_num_tokens={pld_tokens(config)}, "
        f"max_matching_ngram_size={d.ngram_max})`",
        "llamacpp-plain": "llama-cpp-python's `Llama.generate` on the same GGUF file and threads",
        "llamacpp-pld": f"llama-cpp-python's `Llama.generate` with `LlamaPromptLookupDecoding("
        f"num_pred_tokens={pld_tokens(config)}, max_ngram_size={d.ngram_max})`",
        "llamacpp-spec": f"llama.cpp's `llama-speculative-simple --spec-type draft-simple --spec-draft-n-max "
        f"{spec_draft_max(config)} --spec-draft-n-min 0 --spec-draft-p-min {d.confidence_threshold}` "
        "(a process per prompt): its time is its own encode + decode (model loading excluded; "
        "the decode time prorated to the tokens asked for when its last step drafts past them), "
        "its tokens are its printed text re-tokenized, so its audit compares re-tokenized text",
    }
    return notes.get(method)
