"""draftwise: lossless speculative decoding.

    >>> from draftwise import SpeculativeEngine, GenerationConfig
    >>> from draftwise.tiny import tiny_lm
    >>> engine = SpeculativeEngine.from_models(tiny_lm(0), tiny_lm(0))
    >>> result = engine.generate("Hello", GenerationConfig(max_new_tokens=8))
    >>> len(result.tokens) <= 8
    True
"""

from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.drafters import Drafter, ModelDrafter, NGramDrafter, Proposal
from draftwise.engine import GenerationResult, SpeculativeEngine, autoregressive
from draftwise.events import StepEvent
from draftwise.metrics import GenerationMetrics
from draftwise.model import CausalLM
from draftwise.target import LocalTarget, Target
from draftwise.verify import TokenSource, Verdict

__version__ = "0.1.0"

__all__ = [
    "CausalLM",
    "DraftConfig",
    "Drafter",
    "GenerationConfig",
    "GenerationMetrics",
    "GenerationResult",
    "LocalTarget",
    "ModelDrafter",
    "NGramDrafter",
    "Proposal",
    "SamplingConfig",
    "SpeculativeEngine",
    "StepEvent",
    "Target",
    "TokenSource",
    "Verdict",
    "autoregressive",
]
