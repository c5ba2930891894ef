"""``draftwise load``: servers under concurrent clients, draftwise's against llama.cpp's own.

Each server runs as a child process on 127.0.0.1 (or is given by ``--url``); C streaming
clients share one list of prompts at each concurrency C, and every answer is compared with
the same request run alone.

    >>> from draftwise.loadbench.config import LoadConfig  # doctest: +SKIP
    >>> from draftwise.loadbench.runner import run_load  # doctest: +SKIP
    >>> run_load(LoadConfig(target="tiny:0", servers=("draftwise",), data="none"))  # doctest: +SKIP

This package's ``__init__`` imports nothing, so the CLI can read ``LoadConfig`` for its
flags without loading torch.
"""
