"""The ``llamacpp`` backend: GGUF files on llama.cpp's own kernels, through llama-cpp-python's
low-level API, behind the ``LanguageModel`` seam.

The weights are the file itself (memory-mapped, quantized as it is: no dequantization, no
float32 copy), loaded once per process and shared: each sequence (``fork``) is a slot of one
llama.cpp context loaded for a fixed number of them, with its own cells of the KV cache, over
the same ``llama_model``. A forward pass goes through the context's ``Batcher``
(``draftwise.backends.llamacpp_batch``): ``llama_decode`` over a batch, shared with the other
sequences' pending passes, that asks for scores only at the positions the caller needs; those
rows are copied out of llama.cpp's buffer, which the next pass overwrites. Rollback is
bookkeeping: the sequence's cells are cut (``llama_memory_seq_rm``) before its next pass.

llama.cpp picks some kernels by the size of a pass, so a block of tokens can round
differently from one-token steps. draftwise's patches on ggml (patches/llama.cpp) make
one-token steps and blocks of up to 7 rows agree; with ``ModelOptions.exact`` every pass of
any size rounds as one-token decoding, so greedy output is bit-identical to plain decoding
(docs/exactness.md). Without it, output can differ where the target's top two tokens are
nearly tied (the bench audits every such mismatch).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from draftwise.backends.gguf_tokenizer import GGUFTokenizer
from draftwise.backends.llamacpp_batch import ROWS, Batcher, Decoder, Request
from draftwise.backends.llamacpp_kernels import KernelChoice, PatchSwitches, ggml_switch, keep_layouts, kv_ordered
from draftwise.config import Device, ModelOptions
from draftwise.cpu import default_threads
from draftwise.errors import ContextLengthError, ModelLoadError, SlotsFullError
from draftwise.lm import Forward, KernelTiming, PassInfo
from draftwise.registry import derived_path

BATCH = 512  # tokens per llama_decode call of a single sequence; a longer prefill runs in pieces
# File types whose weights ggml repacks on x86 into kernels that draftwise's patches do not
# make row-invariant (patches/llama.cpp covers Q4_K).
NOT_ROW_INVARIANT = frozenset({"Q4_0", "IQ4_NL", "MXFP4_MOE", "Q2_K", "Q2_K_S"})
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
        self.decoder = Decoder()  # every llama_decode of the process runs on its thread
        self.exact: bool | None = None  # whether passes are row-invariant: fixed by the first model loaded
        # Which kernels run repacked matrices (llamacpp_kernels): fixed with the first model
        # loaded, the rows from which prompt pieces run the stock ones timed on the first target.
        self.kernels = KernelChoice()
        self.switches = PatchSwitches.of(llama_cpp.llama_cpp._lib)

    def run_exact(self, exact: bool, gpu: bool = False) -> None:
        """Fix whether this process's passes are row-invariant (``ModelOptions.exact``), and
        whether its repacked matrices keep their file layout too (not with ``exact`` or on the
        ``gpu``); KV cells in position order either way (``kv_ordered``). ggml fixes its
        weights' layouts at the first load, so the first model loaded decides."""
        if self.exact is None:
            if exact:
                missing = self.missing_row_invariance()
                if missing:
                    raise ModelLoadError(f"--exact needs row-invariant kernels: {missing}")
            if self.switches is not None:
                self.switches.row_invariant(exact)
                self.switches.kv_ordered(kv_ordered(exact))
            self.exact = exact
            self.kernels = keep_layouts(exact, gpu, ggml_switch(self.api.llama_cpp._lib))
        elif self.exact != exact:
            raise ModelLoadError(
                f"this process already runs llama.cpp {'with' if self.exact else 'without'} --exact, and ggml "
                "sets its kernels once per process: load every model with the same setting"
            )

    def library_dir(self) -> Path:
        """Where llama-cpp-python loads llama.cpp's libraries from (its own lib/, or
        ``LLAMA_CPP_LIB_PATH``, which it reads too)."""
        return Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(self.api.__file__).parent / "lib")

    def missing_row_invariance(self) -> str | None:
        """What keeps this llama.cpp from row-invariant passes, or None: the switches that
        draftwise's patches add to ggml's CPU backend and to libllama, and the CPU family they
        cover."""
        if self.switches is None:
            return (
                "this llama-cpp-python was built without draftwise's patches (patches/llama.cpp); "
                "reinstall it with scripts/install_llama_cpp.sh (make setup does)"
            )
        if not self.switches.covered():
            return f"draftwise's patches cover x86-64 CPUs, not {platform.machine()}"
        return None

    @functools.cached_property
    def gpu_offload(self) -> bool:
        """Whether this llama.cpp can keep layers on a GPU: built with a GPU backend (CUDA)
        and a device of it visible."""
        return bool(self.api.llama_supports_gpu_offload())

    def missing_gpu(self) -> str:
        """Why this llama.cpp runs no layer on a GPU, for an error message."""
        if any(self.library_dir().glob("*ggml-cuda*")):
            return "llama.cpp was built with CUDA, but sees no GPU here (is the NVIDIA driver loaded?)"
        return (
            "this llama-cpp-python was built for the CPU only; rebuild it with CUDA on a machine with nvcc "
            "(DRAFTWISE_CUDA=1 make setup, docs/models-and-backends.md)"
        )

    def gpu_layers(self, device: Device, exact: bool) -> int:
        """The layers of a model llama.cpp keeps on the GPU: every one (-1) or none (0).
        ``auto`` takes the GPU where this llama.cpp can use one, unless ``exact`` asks for
        the CPU kernels that draftwise's patches make row-invariant (docs/exactness.md)."""
        if device == "cpu":
            return 0
        if device == "cuda":
            if exact:
                raise ModelLoadError(
                    "--exact keeps its promise on llama.cpp's CPU kernels only (docs/exactness.md): "
                    "drop --exact, or run on --device cpu"
                )
            if not self.gpu_offload:
                raise ModelLoadError(f"--device cuda: {self.missing_gpu()}")
            return -1
        return -1 if self.gpu_offload and not exact else 0

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

    def __init__(self, path: Path, name: str, vocab_only: bool = False, gpu_layers: int = 0) -> None:
        api = library().api
        library().lines.clear()
        params = api.llama_model_default_params()
        params.n_gpu_layers = gpu_layers  # -1: every layer on the GPU
        params.vocab_only = vocab_only  # the vocabulary and metadata, not a byte of the weights
        model = api.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ModelLoadError(f"llama.cpp cannot load {path.name}: {library().reason()}")
        self._free = weakref.finalize(self, api.llama_model_free, model)
        self.api = api
        self.ptr = model
        self.path = path
        self.name = name
        self.gpu_layers = gpu_layers
        if api.llama_model_is_recurrent(model) or api.llama_model_is_hybrid(model):
            raise ModelLoadError(
                f"{path.name} has recurrent layers, whose state cannot be rolled back; "
                "speculative decoding needs a cache that can (use a transformer model)"
            )
        self.vocab = api.llama_model_get_vocab(model)
        self.n_vocab = int(api.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(api.llama_model_n_ctx_train(model))
        self.file_type = _file_type_name(api, int(api.llama_model_ftype(model)))
        self.decoder = library().decoder
        self.kernels = library().kernels  # the pass's kernels are set just before it runs
        # The tokenizer keeps the model alive: it may be kept after every sequence is gone.
        self.tokenizer = GGUFTokenizer(api, model, self.vocab, owner=self)

    @property
    def device(self) -> str:
        """Where its layers run: ``cuda`` (every one on the GPU) or ``cpu``."""
        return "cpu" if self.gpu_layers == 0 else "cuda"

    @functools.cached_property
    def kv_bytes_per_position(self) -> int:
        """F16 keys and values (llama.cpp's default cache types) of every layer, per position
        (asked only of a model loaded whole: a vocabulary-only load has no layers)."""
        api, model = self.api, self.ptr
        head = int(api.llama_model_n_embd(model)) // max(1, int(api.llama_model_n_head(model)))
        return 2 * 2 * int(api.llama_model_n_layer(model)) * int(api.llama_model_n_head_kv(model)) * head

    def reason(self) -> str:
        """What llama.cpp last said went wrong (see ``_Library.reason``)."""
        return library().reason()


class LlamaCppModel:
    """One sequence (a slot of a llama.cpp context and its KV cache) over shared
    ``LlamaCppWeights``. The context may hold other sequences too: their forward passes can
    go into one ``llama_decode`` (its ``batch``, ``draftwise.backends.llamacpp_batch``)."""

    backend = "llamacpp"

    def __init__(self, batcher: Batcher, seq: int) -> None:
        self.batcher = batcher
        self.seq = seq
        self.weights = batcher.weights
        self.name = self.weights.name
        self.tokenizer = self.weights.tokenizer
        self.tokens: list[int] = []
        self.threads = batcher.threads
        self.n_ctx = batcher.n_ctx
        self.last_pass: PassInfo | None = None
        self._free = weakref.finalize(self, batcher.release, seq)  # the slot goes back with the sequence

    @property
    def batch(self) -> Batcher:
        return self.batcher

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
        return (
            f"{self._weights_key()}|{self.n_ctx} positions|exact {library().exact}|{self.weights.device}|"
            f"prompts stock from {library().kernels.stock_rows}"
        )

    def _weights_key(self) -> str:
        """The weights file (its place, size and time) and the threads that run it."""
        stat = self.weights.path.stat()
        return f"llamacpp|{self.weights.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{self.threads} threads"

    @property
    def kernel_timing(self) -> KernelTiming | None:
        return library().kernels.to_time(f"{self._weights_key()}|{self.weights.device}")

    def fork(self) -> LlamaCppModel:
        """A new sequence over the same weights: a free slot of this context, batched with
        the others; nothing is loaded again. ``SlotsFullError`` when every slot is taken: a
        context serves the streams it was loaded for (``load_lm(slots=...)``), never a
        context of its own beside it, whose passes would run apart from everybody's."""
        seq = self.batcher.claim()
        if seq is None:
            raise SlotsFullError(
                f"all {self.batcher.slots} slots of {self.name}'s context are in use: it was loaded for "
                f"{self.batcher.slots} streams at once"
            )
        return LlamaCppModel(self.batcher, seq)

    def reset(self) -> None:
        self.tokens = []  # the cache is cut at the next pass's start (see Batcher.step)

    def rollback(self, length: int) -> None:
        if length < 0 or length > len(self.tokens):
            raise ValueError(f"cannot roll back a sequence of length {len(self.tokens)} to {length}")
        del self.tokens[length:]

    def forward(self, tokens: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``tokens`` and return float32 scores ``[last or n, V]`` of the final positions
        (a copy: the pass that made them may have served other sequences too). Run alone: its
        own passes, one after the other."""
        forward = Forward(self, tokens, last)
        while not forward.done:
            self.batcher.step([forward])
        if forward.error is not None:
            raise forward.error
        assert forward.scores is not None
        return forward.scores

    def begin(self, forward: Forward) -> Request:
        """The batcher's request for ``forward``: from this sequence's end (whatever it held
        past that is cut before the first piece is fed)."""
        n = len(forward.tokens)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if len(self.tokens) + n > self.n_ctx:
            raise ContextOverflowError(
                f"{len(self.tokens) + n} tokens do not fit in {self.name}'s context of {self.n_ctx} positions "
                "(--context sets it, up to the model's own)"
            )
        want = n if not forward.last else min(forward.last, n)
        return Request(self.seq, [int(t) for t in forward.tokens], len(self.tokens), want, after=forward.after)

    def end(self, request: Request) -> torch.Tensor:  # [want, V]
        """``request`` was fed whole: the sequence holds its tokens; its scores."""
        self.last_pass = PassInfo(request.pass_rows, request.pass_seconds, request.pass_sequences)
        self.tokens.extend(request.tokens)
        return request.result()


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
    source: str,
    path: Path,
    options: ModelOptions,
    *,
    draft: bool = False,
    log: Callable[[str], None] | None = None,
    slots: int = 1,
) -> LlamaCppModel:
    """Load the GGUF file ``path`` (named ``source`` by the user) on llama.cpp; a draft is
    requantized first as ``options.draft_quant`` says. The model's context holds ``slots``
    sequences of ``options.context`` positions each: this one and ``slots - 1`` forks, whose
    forward passes are batched together."""
    log = log or (lambda message: None)
    threads = options.threads or default_threads()
    # The cores are llama.cpp's. torch only checks a block's few score rows between passes,
    # and its own thread team, spinning for a while after each of those, stalled ggml's
    # threads in the next pass (a one-row pass took a quarter longer while drafting).
    torch.set_num_threads(1)
    gpu_layers = library().gpu_layers(options.device, options.exact)
    library().run_exact(options.exact, gpu=gpu_layers != 0)
    if draft and options.draft_quant != "none":
        path = requantized(path, options.draft_quant, threads, log)
    weights = LlamaCppWeights(path, source, gpu_layers=gpu_layers)
    if options.exact and not draft and weights.file_type in NOT_ROW_INVARIANT:
        # The draft's kernels cannot change the output: the target's must be row-invariant.
        raise ModelLoadError(
            f"--exact: {path.name} holds {weights.file_type} weights, which llama.cpp repacks on this CPU into "
            "kernels that are not row-invariant; use a K-quant file (Q4_K_M, Q5_K_M, Q6_K, Q8_0) or drop --exact"
        )
    n_ctx = options.context or min(weights.n_ctx_train or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    if draft and weights.n_ctx_train:
        n_ctx = min(n_ctx, weights.n_ctx_train)  # a draft that runs out of context stops drafting
    if weights.n_ctx_train and n_ctx > weights.n_ctx_train:
        raise ModelLoadError(f"--context {n_ctx} is over {path.name}'s own context of {weights.n_ctx_train} positions")
    check_kv_memory(weights, n_ctx, slots)
    batcher = Batcher(weights, n_ctx, slots, threads, BATCH if slots == 1 else ROWS)
    seq = batcher.claim()
    assert seq is not None  # a new batcher has every slot free
    model = LlamaCppModel(batcher, seq)
    return model


def check_kv_memory(weights: LlamaCppWeights, n_ctx: int, slots: int) -> None:
    """Refuse a context whose KV cache cannot fit in the memory this machine has available:
    read once the weights are loaded, so their repacked matrices and, where the layouts are kept
    (``KernelChoice.copies``), the file layout beside them are already out of what is left."""
    need = weights.kv_bytes_per_position * n_ctx * slots
    available = _available_memory()
    if available is not None and need > available:
        per_slot = weights.kv_bytes_per_position * n_ctx
        raise ModelLoadError(
            f"{slots} slot(s) of {n_ctx} positions need {need / 2**30:.1f} GiB of KV cache for {weights.path.name} "
            f"({per_slot / 2**20:.0f} MiB per slot), and {available / 2**30:.1f} GiB is available: "
            "use fewer --slots or a smaller --context"
        )


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
