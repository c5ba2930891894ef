"""The ``llamacpp`` backend: GGUF files on llama.cpp's own kernels, through llama-cpp-python's
low-level API, behind the ``LanguageModel`` seam.

The weights are the file itself (memory-mapped, quantized as it is: no dequantization, no
float32 copy), loaded once per process and shared: each sequence (``fork``) is a llama.cpp
context of its own, with its own KV cache, over the same ``llama_model``. A forward pass is
one ``llama_decode`` over a batch that asks for scores only at the positions the caller
needs; the scores come back as a view of llama.cpp's own buffer (no copy); rollback is
``llama_memory_seq_rm``.

llama.cpp picks its matrix kernels by batch size, so a block of tokens can round
differently from one-token steps: greedy output matches one-token decoding except where the
target's top two tokens are nearly tied (the bench audits every such mismatch).
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from draftwise.backends.gguf_tokenizer import GGUFTokenizer
from draftwise.config import ModelOptions
from draftwise.errors import ContextLengthError, ModelLoadError
from draftwise.registry import derived_path

BATCH = 512  # tokens per llama_decode call; a longer prefill runs in pieces
OUTPUTS_MAX = 64  # score rows per llama_decode call (sizes the context's output buffer)
DEFAULT_CONTEXT = 8192  # KV cache positions when the user names none (capped by the model's own)
_LOG_WARN = 3  # ggml log levels (ggml.h): 3 = warning, 4 = error, 5 = continuation of the previous line
_LOG_CONT = 5


class ContextOverflowError(ContextLengthError, ValueError):
    """More tokens than one sequence of this model may hold (mid-generation, the engine ends
    the run with finish reason "length")."""


class _Library:
    """llama.cpp, initialised once per process. Its log lines are kept (the last warnings and
    errors explain a failed load in one line) rather than printed over the CLI's output."""

    def __init__(self) -> None:
        import llama_cpp

        self.api = llama_cpp
        self.lines: deque[str] = deque(maxlen=16)
        level = [0]

        @llama_cpp.llama_log_callback
        def on_log(kind: int, text: bytes, _user: Any) -> None:
            if kind != _LOG_CONT:
                level[0] = kind
            if level[0] >= _LOG_WARN and text and text.strip():
                self.lines.append(text.decode("utf-8", "replace").strip())

        self._on_log = on_log  # ctypes calls it for as long as the process lives
        llama_cpp.llama_log_set(on_log, None)
        llama_cpp.llama_backend_init()

    def reason(self) -> str:
        """What llama.cpp said went wrong, for an error message: its last line that names an
        error with a cause (``error loading model: unknown model architecture: 'x'``)."""
        for line in reversed(self.lines):
            if "error" in line and ": " in line:
                return line.split("error", 1)[1].split(": ", 1)[-1]
        return self.lines[-1] if self.lines else "no reason given"


@functools.cache
def library() -> _Library:
    return _Library()


class LlamaCppWeights:
    """One ``llama_model`` (a GGUF file, memory-mapped) shared by every sequence over it."""

    def __init__(self, path: Path, name: str, vocab_only: bool = False) -> None:
        api = library().api
        library().lines.clear()
        params = api.llama_model_default_params()
        params.n_gpu_layers = 0
        params.vocab_only = vocab_only  # the vocabulary and metadata, not a byte of the weights
        model = api.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelLoadError(f"llama.cpp cannot load {path.name}: {library().reason()}")
        self._free = weakref.finalize(self, api.llama_model_free, model)
        self.api = api
        self.ptr = model
        self.path = path
        self.name = name
        if api.llama_model_is_recurrent(model) or api.llama_model_is_hybrid(model):
            raise ModelLoadError(
                f"{path.name} has recurrent layers, whose state cannot be rolled back; "
                "speculative decoding needs a cache that can (use a transformer model)"
            )
        self.vocab = api.llama_model_get_vocab(model)
        self.n_vocab = int(api.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(api.llama_model_n_ctx_train(model))
        self.file_type = _file_type_name(api, int(api.llama_model_ftype(model)))
        # Loaded for the tokenizer alone, this is held by nothing else: the tokenizer keeps it.
        self.tokenizer = GGUFTokenizer(api, model, self.vocab, owner=self if vocab_only else None)


class LlamaCppModel:
    """One sequence (a llama.cpp context and its KV cache) over shared ``LlamaCppWeights``."""

    backend = "llamacpp"

    def __init__(self, weights: LlamaCppWeights, n_ctx: int, threads: int) -> None:
        api = weights.api
        self.api = api
        self.weights = weights
        self.name = weights.name
        self.tokenizer = weights.tokenizer
        self.tokens: list[int] = []
        self.threads = threads
        params = api.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = min(BATCH, n_ctx)
        params.n_seq_max = 1
        params.n_outputs_max = OUTPUTS_MAX
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        params.swa_full = True  # sliding-window layers keep every position, so any rollback works
        ctx = api.llama_init_from_model(weights.ptr, params)
        if not ctx:
            raise ModelLoadError(
                f"llama.cpp cannot make a context of {n_ctx} positions for {weights.path.name}: {library().reason()}"
            )
        self.ctx = ctx
        self.n_ctx = int(api.llama_n_ctx(ctx))
        self._memory = api.llama_get_memory(ctx)
        size = min(BATCH, n_ctx)
        batch = api.llama_batch_init(size, 0, 1)
        # Freed in this order when the sequence goes: the batch, then the context. The
        # weights stay alive until then (they are an argument of the finalizer).
        self._free = weakref.finalize(self, _free_context, api, ctx, batch, weights)
        self._batch = batch
        for i in range(size):  # one sequence: set once, never changes
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
        self._batch_tokens = np.ctypeslib.as_array(batch.token, shape=(size,))
        self._batch_pos = np.ctypeslib.as_array(batch.pos, shape=(size,))
        self._batch_out = np.ctypeslib.as_array(batch.logits, shape=(size,))
        self._batch_size = size

    @property
    def vocab_size(self) -> int:
        return self.weights.n_vocab

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.end_of_generation

    @property
    def max_context(self) -> int:
        return self.n_ctx

    @property
    def dtype(self) -> str:
        return self.weights.file_type

    @property
    def fingerprint(self) -> str:
        stat = self.weights.path.stat()
        return (
            f"llamacpp|{self.weights.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{self.threads} threads|"
            f"{self.n_ctx} positions"
        )

    def fork(self) -> LlamaCppModel:
        """A new sequence over the same weights: a context of its own, nothing loaded again."""
        return LlamaCppModel(self.weights, self.n_ctx, self.threads)

    def reset(self) -> None:
        self.api.llama_memory_clear(self._memory, True)
        self.tokens = []

    def rollback(self, length: int) -> None:
        if length < 0 or length > len(self.tokens):
            raise ValueError(f"cannot roll back a sequence of length {len(self.tokens)} to {length}")
        if length < len(self.tokens):
            if not self.api.llama_memory_seq_rm(self._memory, 0, length, -1):
                raise RuntimeError(f"llama.cpp could not roll {self.name} back to {length} positions")
            del self.tokens[length:]

    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``tokens`` and return float32 scores ``[last or n, V]`` of the final positions.

        The result is a view of llama.cpp's output buffer when one ``llama_decode`` call
        produced it (the usual case), valid until this sequence's next call.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + n} tokens do not fit in {self.name}'s context of {self.n_ctx} positions "
                "(--context sets it, up to the model's own)"
            )
        want = n if not last else min(last, n)
        pieces: list[torch.Tensor] = []
        start = 0
        done = len(self.tokens)
        try:
            while start < n:
                first_out = max(start, n - want)  # first position of this piece that returns scores
                end = min(n, start + self._batch_size, max(first_out, start) + OUTPUTS_MAX)
                rows = self._decode(tokens[start:end], done + start, max(0, end - first_out))
                if rows is not None:
                    # The next piece's decode reuses llama.cpp's buffer: keep a copy if one follows.
                    pieces.append(rows if end == n else rows.clone())
                start = end
        except BaseException:
            self.api.llama_memory_seq_rm(self._memory, 0, done, -1)
            raise
        self.tokens.extend(int(t) for t in tokens)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _decode(self, tokens: Sequence[int], position: int, outputs: int) -> torch.Tensor | None:
        """One ``llama_decode``; scores ``[outputs, V]`` of its last ``outputs`` positions."""
        m = len(tokens)
        batch = self._batch
        batch.n_tokens = m
        self._batch_tokens[:m] = tokens
        self._batch_pos[:m] = np.arange(position, position + m, dtype=np.int32)
        self._batch_out[:m] = 0
        if outputs:
            self._batch_out[m - outputs : m] = 1
        status = self.api.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status}) on {self.name}: {library().reason()}")
        if not outputs:
            return None
        scores = np.ctypeslib.as_array(self.api.llama_get_logits(self.ctx), shape=(outputs, self.weights.n_vocab))
        return torch.from_numpy(scores)


def _file_type_name(api: Any, file_type: int) -> str:
    """``Q4_K_M`` for llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M, and so on."""
    names = {
        value: name
        for name, value in vars(api).items()
        if name.startswith("LLAMA_FTYPE_") and isinstance(value, int) and name != "LLAMA_FTYPE_GUESSED"
    }
    name = names.get(file_type & ~1024)  # 1024: the type was guessed from the tensors
    return (
        name.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_") if name else f"type {file_type}"
    )


def _free_context(api: Any, ctx: Any, batch: Any, weights: LlamaCppWeights) -> None:
    api.llama_batch_free(batch)
    api.llama_free(ctx)


def default_threads() -> int:
    """One thread per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# llama.cpp file types a draft is requantized to (draft_quant): Q4_0 and Q8_0 run on
# llama.cpp's repacked CPU kernels; every tensor, the output layer included, takes the type.
_DRAFT_FILE_TYPES = {"int4": ("Q4_0", 2), "int8": ("Q8_0", 7)}


def requantized(path: Path, quant: str, threads: int, log: Callable[[str], None]) -> Path:
    """``path`` requantized for drafting (made once with llama.cpp's own quantizer, cached).

    A draft's precision cannot change the output (the target checks every token), only how
    often it is right and how fast it drafts.
    """
    name, file_type = _DRAFT_FILE_TYPES[quant]
    out = derived_path(path, name.lower(), ".gguf")
    if out.is_file():
        return out
    api = library().api
    log(f"requantizing draft {path.name} to {name} (once: cached in {out.parent})")
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = out.with_name(f"{out.name}.tmp{os.getpid()}")
    params = api.llama_model_quantize_default_params()
    params.nthread, params.ftype, params.allow_requantize, params.pure = threads, file_type, True, True
    try:
        if api.llama_model_quantize(str(path).encode(), str(scratch).encode(), ctypes.byref(params)) != 0:
            raise ModelLoadError(f"llama.cpp could not requantize {path.name} to {name}: {library().reason()}")
        os.replace(scratch, out)
    finally:
        scratch.unlink(missing_ok=True)
    return out


def load_gguf_tokenizer(source: str, path: Path) -> GGUFTokenizer:
    """The tokenizer of the GGUF file ``path`` (named ``source``) alone: no weights are read."""
    return LlamaCppWeights(path, source, vocab_only=True).tokenizer


def load_llamacpp(
    source: str, path: Path, options: ModelOptions, *, draft: bool = False, log: Callable[[str], None] | None = None
) -> LlamaCppModel:
    """Load the GGUF file ``path`` (named ``source`` by the user) on llama.cpp; a draft is
    requantized first as ``options.draft_quant`` says."""
    log = log or (lambda message: None)
    threads = options.threads or default_threads()
    if draft and options.draft_quant != "none":
        path = requantized(path, options.draft_quant, threads, log)
    weights = LlamaCppWeights(path, source)
    n_ctx = options.context or min(weights.n_ctx_train or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if weights.n_ctx_train and n_ctx > weights.n_ctx_train:
        raise ModelLoadError(f"--context {n_ctx} is over {path.name}'s own context of {weights.n_ctx_train} positions")
    return LlamaCppModel(weights, n_ctx, threads)
