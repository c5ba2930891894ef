"""Loading for the ``hf`` backend: transformers models from a folder, a Hugging Face id, a
``.gguf`` file (dequantized by transformers) or ``tiny:SEED``, then packed or quantized.

GGUF files are dequantized by transformers on load, which is slow for a model of any size.
The first load therefore also writes the dequantized weights as safetensors under
``$DRAFTWISE_HOME/converted/``; later loads read those instead.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from draftwise.backends.hf import HFModel, HFTokenizer
from draftwise.backends.quant import DRAFT_PACK_ROWS, TARGET_PACK_ROWS, pack_linears, quantize_weights
from draftwise.config import ModelOptions
from draftwise.cpu import cpu_name
from draftwise.errors import ModelLoadError
from draftwise.registry import derived_path, home


def _quiet_transformers() -> None:
    """transformers' own progress bars and advice would drown the CLI's output."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _bench_linear(torch_dtype, reps: int = 5) -> float:
    """Best-of-``reps`` seconds of a decoder-sized matrix product in ``torch_dtype``, for one
    row (a decoding step) plus eight rows (a verification block); float32 is timed packed,
    as ``load_lm`` runs it."""
    import torch

    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(1536, 4096, bias=False))
    layer[0].weight.data = torch.randn(4096, 1536, generator=generator)
    if torch_dtype == torch.float32:
        pack_linears(layer, TARGET_PACK_ROWS)
    else:
        layer.to(torch_dtype)
    total = 0.0
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, 1536, generator=generator).to(torch_dtype)
            layer(x)  # warm-up: first calls pick kernels
            best = float("inf")
            for _ in range(reps):
                started = time.perf_counter()
                layer(x)
                best = min(best, time.perf_counter() - started)
            total += best
    return total


def pick_dtype(root: Path | None = None) -> tuple[str, str]:
    """Choose float32 or bfloat16 for this CPU by measuring both; return (dtype, why).

    bfloat16 halves the bytes read per token (decoding on CPU is memory-bound) but CPUs
    without native bf16 instructions convert on the fly, which can cost more than it saves:
    only a measurement tells. The decision is cached per CPU, torch version and thread count.
    """
    import torch

    key = f"{cpu_name()}|torch {torch.__version__}|{torch.get_num_threads()} threads|float32 packed for 1+8 rows"
    cache = (root or home()) / "dtype.json"
    try:
        decisions = json.loads(cache.read_text())
    except (OSError, ValueError):
        decisions = {}
    if key in decisions:
        choice = decisions[key]
        return choice["dtype"], f"{choice['why']} (cached in {cache})"

    # Correct first: bf16 results must agree with fp32 to bf16 precision.
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(8, 256, generator=generator), torch.randn(256, 8, generator=generator)
    exact = a @ b
    close = torch.allclose((a.bfloat16() @ b.bfloat16()).float(), exact, rtol=5e-2, atol=0.5)
    fp32 = min(_bench_linear(torch.float32), _bench_linear(torch.float32))
    bf16 = min(_bench_linear(torch.bfloat16), _bench_linear(torch.bfloat16)) if close else float("inf")
    dtype = "bfloat16" if bf16 < fp32 else "float32"
    why = (
        f"auto dtype: {dtype} (decoder matmuls, 1 + 8 rows: float32 {fp32 * 1e3:.2f} ms, "
        f"bfloat16 {'inaccurate' if not close else f'{bf16 * 1e3:.2f} ms'})"
    )
    decisions[key] = {"dtype": dtype, "why": why}
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(decisions, indent=1))
    except OSError:
        pass  # a read-only cache only costs re-measuring next time
    return dtype, why


def _save_dequantized(model, tokenizer, folder: Path) -> None:
    """Write a dequantized GGUF model as a plain safetensors folder, atomically.

    ``save_pretrained`` refuses models loaded through the GGUF quantizer even once they are
    fully dequantized, so the weights are written with safetensors directly.
    """
    from safetensors.torch import save_model

    scratch = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        scratch.mkdir(parents=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (scratch / "config.json").write_text(json.dumps(config, indent=1))
        model.generation_config.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        save_model(model, str(scratch / "model.safetensors"))
        os.replace(scratch, folder)
    except OSError:
        # Out of disk or a read-only cache: this load still works, the next one converts again.
        shutil.rmtree(scratch, ignore_errors=True)


def _load_gguf(path: Path, torch_dtype, dtype: str, log: Callable[[str], None]):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = derived_path(path, dtype)
    if folder.is_dir():
        return _load_pretrained(str(folder), torch_dtype)
    log(f"dequantizing {path.name} to {dtype} (once: the result is cached in {folder.parent})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load GGUF file {path}: {_first_line(exc)}") from exc
    _save_dequantized(model, tokenizer, folder)
    return model, tokenizer


def _load_pretrained(source: str, torch_dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model {source!r}: {_first_line(exc)}") from exc
    return model, tokenizer


def load_hf_tokenizer(source: str, location: Path | str) -> HFTokenizer:
    """The tokenizer ``load_hf`` would give ``location`` (what ``resolve`` made of ``source``),
    without the weights."""
    if source.startswith("tiny:"):
        from draftwise.backends.tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        if isinstance(location, Path) and location.is_file():
            tokenizer = AutoTokenizer.from_pretrained(location.parent, gguf_file=location.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(location))
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {source!r}: {_first_line(exc)}") from exc
    return HFTokenizer(tokenizer)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _device(options: ModelOptions) -> str:
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA device is visible to torch here")
    if options.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return options.device


def choose_dtype(options: ModelOptions, device: str, draft: bool) -> tuple[str, str | None]:
    """The dtype a model loads in, and why where it was not given.

    ``--exact`` keeps a target in float32: in bfloat16 a verified block can score a position
    otherwise than one-token decoding and pick another token (measured on CUDA,
    ``benchmarks/cuda_h200``). A draft's precision cannot change the output, so it is left alone.
    """
    if options.exact and not draft:
        if options.dtype == "bfloat16":
            raise ModelLoadError(
                "--exact runs the hf backend's target in float32: in bfloat16 a verified block can pick "
                "another token than one-token decoding; drop --dtype bfloat16 or --exact"
            )
        return "float32", None if options.dtype == "float32" else "--exact: float32"
    if options.dtype != "auto":
        return options.dtype, None
    return ("bfloat16", "auto dtype on cuda: bfloat16") if device == "cuda" else pick_dtype()


def load_hf(
    source: str,
    location: Path | str,
    options: ModelOptions,
    *,
    draft: bool = False,
    log: Callable[[str], None] | None = None,
    pack: bool | None = None,
    pack_rows: tuple[int, ...] | None = None,
) -> HFModel:
    """Load ``location`` (what ``draftwise.loading.resolve`` made of ``source``) with transformers.

    ``log`` receives one-line notes meant for the user (the dtype decision, a first-time GGUF
    conversion). A draft (``draft=True``) gets ``options.draft_quant``: weight-only int8 or
    int4 layers, whose precision cannot change speculative output (see
    ``draftwise.backends.quant``). ``pack`` stores the remaining float32 linear layers in
    oneDNN's layout (same values; a block of new tokens then costs far less than unpacked);
    None packs real models on the CPU and leaves ``tiny:`` ones as they are. ``pack_rows``
    names the row counts to keep a layout for; by default a target keeps one for one-token
    steps and one for verification blocks, a draft only ``DRAFT_PACK_ROWS``.
    """
    import torch

    log = log or (lambda message: None)
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    device = _device(options)
    # The weight formats of draftwise.backends.quant are CPU kernels.
    quantize = options.draft_quant if draft and device == "cpu" else "none"
    rows = pack_rows or (DRAFT_PACK_ROWS if draft else TARGET_PACK_ROWS)
    if source.startswith("tiny:"):
        from draftwise.backends.tiny import tiny_lm

        try:
            seed = int(source.split(":", 1)[1])
        except ValueError as exc:
            raise ModelLoadError(f"tiny model source must be 'tiny:SEED', got {source!r}") from exc
        return _with_weight_formats(tiny_lm(seed), quantize, bool(pack) and device == "cpu", rows, log)

    dtype, why = choose_dtype(options, device, draft)
    if why:
        log(why)
    torch_dtype = getattr(torch, dtype)
    _quiet_transformers()
    if isinstance(location, Path) and location.is_file():
        if location.suffix != ".gguf":
            raise ModelLoadError(f"{location} is a file but not a .gguf file; give a .gguf file or a model folder")
        model, tokenizer = _load_gguf(location, torch_dtype, dtype, log)
    else:
        model, tokenizer = _load_pretrained(str(location), torch_dtype)
    if device != "cpu":
        model = model.to(device)
    lm = HFModel(model, tokenizer, name=source)
    return _with_weight_formats(lm, quantize, pack is not False and device == "cpu", rows, log)


def _with_weight_formats(
    lm: HFModel, quantize: str, pack: bool, pack_rows: tuple[int, ...], log: Callable[[str], None]
) -> HFModel:
    """Apply the weight formats of ``draftwise.quant``: quantization first, then packing of
    whatever float32 layers are left."""
    if quantize != "none":
        quantize_weights(lm.model, bits=int(quantize.removeprefix("int")))
    if pack:
        pack_linears(lm.model, _affordable(pack_rows, lm.model, log))
    return lm


# Where a container's memory limit is kept (cgroup v2, then v1); "max" or a huge number = none.
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its container's limit if lower;
    None where neither can be read."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = None
    for path in CGROUP_LIMITS:
        try:
            limit = int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
        memory = limit if memory is None else min(memory, limit)
        break
    return memory


def _affordable(pack_rows: tuple[int, ...], model: Any, log: Callable[[str], None]) -> tuple[int, ...]:
    """``pack_rows``, or only its largest count where one layout per count would take more
    than half of the memory this process may use (each layout is a full copy of the float32
    weights)."""
    import torch

    if len(pack_rows) < 2:
        return pack_rows
    weight_bytes = sum(
        m.weight.numel() * 4
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float32
    )
    memory = memory_bytes()
    if memory is None:
        return (max(pack_rows),)
    if weight_bytes * len(pack_rows) <= memory // 2:
        return pack_rows
    log(
        f"packing weights for {max(pack_rows)}-row blocks only: {len(pack_rows)} layouts would take "
        f"{weight_bytes * len(pack_rows) / 2**30:.1f} GiB of {memory / 2**30:.1f} GiB"
    )
    return (max(pack_rows),)
