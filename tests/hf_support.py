"""Loading on the hf backend with its own knobs (packing layouts, quantization), for the tests
of those formats."""

from __future__ import annotations

from draftwise.backends.hf import HFModel
from draftwise.backends.hf_loading import load_hf
from draftwise.config import ModelOptions
from draftwise.loading import resolve


def load_hf_model(
    source: str,
    *,
    dtype: str = "float32",
    quantize: str = "none",
    draft: bool | None = None,
    pack: bool | None = None,
    pack_rows: tuple[int, ...] | None = None,
    log=None,
) -> HFModel:
    """``source`` on the hf backend; ``quantize`` (or ``draft=True``) loads it as a draft model."""
    options = ModelOptions(backend="hf", dtype=dtype, draft_quant=quantize)
    as_draft = quantize != "none" if draft is None else draft
    return load_hf(source, resolve(source), options, draft=as_draft, pack=pack, pack_rows=pack_rows, log=log)
