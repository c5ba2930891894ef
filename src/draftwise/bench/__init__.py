"""``draftwise bench``: Spec-Bench (or your prompts) through every decoding method, side by side.

    >>> from draftwise.bench.config import BenchConfig  # doctest: +SKIP
    >>> from draftwise.bench.runner import run_bench  # doctest: +SKIP
    >>> run_bench(BenchConfig(target="tiny:0", draft="tiny:1", limit=1))  # doctest: +SKIP

This package's ``__init__`` imports nothing, so the CLI can read ``BenchConfig`` for its
flags without loading torch.
"""
