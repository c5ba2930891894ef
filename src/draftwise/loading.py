"""Load a model, or a target and draft pair, from source strings on the right backend.

A source is one of:

* a packaged model's short name (``smollm2-135m``, see ``draftwise.registry``), once pulled;
* a path to a ``.gguf`` file;
* a local folder or a Hugging Face id (``from_pretrained``; the ``hf`` backend);
* ``tiny:SEED``: a tiny random model built in-process (tests, demos; the ``hf`` backend).

``--backend auto`` runs GGUF files (packaged models are GGUF files) on llama.cpp when
llama-cpp-python is installed, and everything else, or GGUF without llama-cpp-python, on
transformers. ``load_pair`` also says how a draft reaches the target: with the target's own
token ids, or through text when its tokenizer is another; every entry point loads through it,
by way of ``draftwise.prepare.prepare_pair`` (which also warms the pair up and calibrates the
cost policy).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from draftwise.config import ModelOptions
from draftwise.errors import ModelLoadError
from draftwise.lm import LanguageModel, Tokenizer
from draftwise.registry import REGISTRY, is_pulled, model_path
from draftwise.tokenizer_compat import draft_mode

Log = Callable[[str], None]
LLAMA_CPP_INSTALL = (
    "pip install llama-cpp-python==0.3.36 (it builds llama.cpp from source, which takes a while), or run `make setup`"
)


def resolve(source: str) -> Path | str:
    """Turn a source into a path (registry name, ``.gguf``, folder) or leave an HF id as is."""
    if source in REGISTRY:
        entry = REGISTRY[source]
        if not is_pulled(entry):
            raise ModelLoadError(
                f"model {source!r} is not pulled yet: run `draftwise pull {source}` "
                f"({entry.size / 1e6:.0f} MB from PyPI)"
            )
        return model_path(entry)
    if source.startswith("tiny:"):
        return source
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.endswith(".gguf") or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise ModelLoadError(f"no such file or folder: {source}")
    if "/" not in source:
        # Not a packaged name, not a path, not an owner/name id: most likely a typo.
        known = ", ".join(sorted(REGISTRY))
        raise ModelLoadError(
            f"unknown model {source!r}: give a packaged name ({known}), a .gguf file, "
            "a model folder, a Hugging Face id owner/name, or tiny:SEED"
        )
    return source


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def choose_backend(location: Path | str, backend: str, log: Log) -> str:
    """The backend that runs ``location``: the one asked for, or for ``auto`` llama.cpp for a
    GGUF file when it is installed (saying so once when it is not)."""
    is_gguf = isinstance(location, Path) and location.suffix == ".gguf"
    if backend == "llamacpp":
        if not is_gguf:
            raise ModelLoadError(f"the llamacpp backend runs .gguf files; {location} is not one (use --backend hf)")
        if not llama_cpp_available():
            raise ModelLoadError(f"--backend llamacpp needs llama-cpp-python: {LLAMA_CPP_INSTALL}")
        return "llamacpp"
    if backend == "hf" or not is_gguf:
        return "hf"
    if llama_cpp_available():
        return "llamacpp"
    log(
        f"llama-cpp-python is not installed, so {Path(location).name} runs on the slower hf backend "
        f"(dequantized in PyTorch); for llama.cpp's kernels: {LLAMA_CPP_INSTALL}"
    )
    return "hf"


def load_lm(
    source: str, options: ModelOptions | None = None, *, draft: bool = False, log: Log | None = None, slots: int = 1
) -> LanguageModel:
    """Load ``source`` as a ``LanguageModel`` with its tokenizer (``draft`` applies the
    options meant for a draft model). On llama.cpp, the model and ``slots - 1`` of its forks
    share one context, where their forward passes are batched (the hf backend runs each
    sequence on its own)."""
    options = options or ModelOptions()
    log = log or (lambda message: None)
    location = resolve(source)
    if choose_backend(location, options.backend, log) == "llamacpp":
        from draftwise.backends.llamacpp import load_llamacpp

        return load_llamacpp(source, Path(location), options, draft=draft, log=log, slots=slots)
    from draftwise.backends.hf_loading import load_hf

    return load_hf(source, location, options, draft=draft, log=log)


def load_tokenizer(source: str, options: ModelOptions | None = None) -> Tokenizer:
    """The tokenizer of ``source`` alone, as ``load_lm`` would give it, without the weights (a
    target that runs elsewhere, behind a verifier, and is drafted for by n-gram lookup here)."""
    location = resolve(source)
    if choose_backend(location, (options or ModelOptions()).backend, lambda message: None) == "llamacpp":
        from draftwise.backends.llamacpp import load_gguf_tokenizer

        return load_gguf_tokenizer(source, Path(location))
    from draftwise.backends.hf_loading import load_hf_tokenizer

    return load_hf_tokenizer(source, location)


def load_pair(
    target: str, draft: str | None, options: ModelOptions | None = None, *, log: Log | None = None, slots: int = 1
) -> tuple[LanguageModel, LanguageModel | None]:
    """Load the target and (unless ``draft`` is None) the draft model, and check how the
    draft reaches the target: with the target's token ids, or through text when it speaks
    another vocabulary (said in the log; ``IncompatibleModelsError`` for a draft that cannot
    write the target's text). A draft never gets a longer context than the target's.

    A draft named like the target is a fork of it: the same weights with a cache of its own,
    a draft that is always right (a check of the loop, and a way to measure its overhead).
    ``slots``: streams run at once, see ``load_lm``; a fork-draft takes a slot of the
    target's context beside each of them.
    """
    options = options or ModelOptions()
    target_lm = load_lm(target, options, log=log, slots=slots * 2 if draft == target else slots)
    if draft is None:
        return target_lm, None
    return target_lm, load_draft(target_lm, target, draft, options, log=log, slots=slots)


def load_draft(
    target_lm: LanguageModel,
    target: str,
    draft: str,
    options: ModelOptions | None = None,
    *,
    log: Log | None = None,
    slots: int = 1,
) -> LanguageModel:
    """The draft half of ``load_pair``, for the target ``target_lm`` loaded from ``target``."""
    options = options or ModelOptions()
    log = log or (lambda message: None)
    if draft == target:
        return target_lm.fork()
    capped = options.model_copy(update={"context": options.context or target_lm.max_context})
    draft_lm = load_lm(draft, capped, draft=True, log=log, slots=slots)
    if target_lm.tokenizer is not None and draft_lm.tokenizer is not None:
        check_draft(target_lm.tokenizer, draft_lm.tokenizer, target, draft, log)
    return draft_lm


def check_draft(target_tokenizer: Tokenizer, draft_tokenizer: Tokenizer, target: str, draft: str, log: Log) -> None:
    """Refuse a draft that cannot write the target's text (``IncompatibleModelsError``), and
    say so in ``log`` when it drafts through text."""
    if draft_mode(target_tokenizer, draft_tokenizer, target, draft) == "text":
        log(
            f"draft {draft} speaks another vocabulary than {target}: it drafts through text, re-encoded in "
            f"{target}'s tokens"
        )
