"""``draftwise bench``: Spec-Bench (or your prompts) through every decoding method, side by side.

    >>> from draftwise.bench import BenchConfig, run_bench  # doctest: +SKIP
    >>> run_bench(BenchConfig(target="tiny:0", draft="tiny:1", limit=1))  # doctest: +SKIP
"""

from draftwise.bench.config import METHODS, BenchConfig
from draftwise.bench.dataset import DatasetError, Prompt, load_prompts
from draftwise.bench.runner import Bench, BenchError, run_bench

__all__ = ["METHODS", "Bench", "BenchConfig", "BenchError", "DatasetError", "Prompt", "load_prompts", "run_bench"]
