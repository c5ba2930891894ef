"""draftwise: lossless speculative decoding.

    >>> from draftwise import SpeculativeEngine, GenerationConfig
    >>> from draftwise.backends.tiny import tiny_lm
    >>> engine = SpeculativeEngine.from_models(tiny_lm(0), tiny_lm(0))
    >>> result = engine.generate("Hello", GenerationConfig(max_new_tokens=8))
    >>> len(result.tokens) <= 8
    True

The names below are imported on first use, so that ``import draftwise`` (and every CLI
command, including a one-line error) does not pay for importing torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LanguageModel": "draftwise.lm",
    "ModelOptions": "draftwise.config",
    "CrossVocabDrafter": "draftwise.drafters",
    "DraftConfig": "draftwise.config",
    "Drafter": "draftwise.drafters",
    "GenerationConfig": "draftwise.config",
    "GenerationMetrics": "draftwise.metrics",
    "GenerationResult": "draftwise.engine",
    "HybridDrafter": "draftwise.drafters",
    "LocalTarget": "draftwise.target",
    "ModelDrafter": "draftwise.drafters",
    "NGramDrafter": "draftwise.drafters",
    "Proposal": "draftwise.drafters",
    "SamplingConfig": "draftwise.config",
    "SpeculativeEngine": "draftwise.engine",
    "StepEvent": "draftwise.events",
    "Target": "draftwise.target",
    "TokenSource": "draftwise.verify",
    "Verdict": "draftwise.verify",
    "autoregressive": "draftwise.engine",
    "build_drafter": "draftwise.drafters",
    "load_lm": "draftwise.loading",
    "load_pair": "draftwise.loading",
}

# The one list of public names: ``__all__`` and the lazy lookup below both read it. The typing-only
# imports under TYPE_CHECKING must name the same (tests/test_exports.py checks it).
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    # The names as their modules define them (the `X as X` form marks them as re-exported).
    from draftwise.config import (
        DraftConfig as DraftConfig,
        GenerationConfig as GenerationConfig,
        ModelOptions as ModelOptions,
        SamplingConfig as SamplingConfig,
    )
    from draftwise.drafters import (
        CrossVocabDrafter as CrossVocabDrafter,
        Drafter as Drafter,
        HybridDrafter as HybridDrafter,
        ModelDrafter as ModelDrafter,
        NGramDrafter as NGramDrafter,
        Proposal as Proposal,
        build_drafter as build_drafter,
    )
    from draftwise.engine import (
        GenerationResult as GenerationResult,
        SpeculativeEngine as SpeculativeEngine,
        autoregressive as autoregressive,
    )
    from draftwise.events import (
        StepEvent as StepEvent,
    )
    from draftwise.lm import (
        LanguageModel as LanguageModel,
    )
    from draftwise.loading import (
        load_lm as load_lm,
        load_pair as load_pair,
    )
    from draftwise.metrics import (
        GenerationMetrics as GenerationMetrics,
    )
    from draftwise.target import (
        LocalTarget as LocalTarget,
        Target as Target,
    )
    from draftwise.verify import (
        TokenSource as TokenSource,
        Verdict as Verdict,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'draftwise' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
