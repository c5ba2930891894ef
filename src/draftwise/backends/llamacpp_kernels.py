"""Which of ggml's CPU kernels run a repacked matrix's products, chosen by timing both.

On x86 llama.cpp repacks Q4_K, Q4_0 and a few other weight types at load into a layout whose
kernels are the fastest for a product over a few rows. On some CPUs ggml's stock kernels, on
the file's own layout, are far faster for many rows (a prompt's pieces, a long block to
verify), and on others they are not (docs/speed.md#kernels-chosen-by-timing): no one rule
fits every host. Draftwise's patch 0006 lets ggml keep both layouts (``STOCK_FROM_ROWS`` set
before the first weights load) and run a product over at least that variable's rows on the
stock kernels. ``choose_stock_rows`` times the target's passes both ways once per model and
CPU (cached with the cost policy's curve) and sets the rows from which the stock kernels were
the faster at every size timed; where they never were, every product stays repacked.

Not under ``--exact``, whatever the variable says: its row invariance is the repacked
kernels' (docs/exactness.md). Not where the GPU holds the layers. A value the user set stands,
untimed; set empty, ggml keeps no copy and the repacked kernels run everything, as in stock
llama.cpp.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from draftwise.costs import CONTEXT, CostCache, plausible, time_curve
from draftwise.lm import LanguageModel

STOCK_FROM_ROWS = "GGML_CPU_REPACK_FROM_ROWS"  # read by patch 0006; 0: never the stock kernels
# Pass sizes timed on each layout: a one-token step, the policy's blocks, a prompt's pieces.
KERNEL_SIZES = (1, 2, 4, 8, 16, 32, 64)


def keep_layouts(exact: bool, gpu: bool) -> bool:
    """Before the process's first weights load: whether draftwise chooses the kernels, in which
    case ggml is told to keep each repacked matrix's file layout (none used yet). With ``exact``
    no copy is kept, whatever value this process inherited: its row invariance is the repacked
    kernels'."""
    if exact:
        os.environ[STOCK_FROM_ROWS] = ""
        return False
    if gpu or STOCK_FROM_ROWS in os.environ:
        return False
    os.environ[STOCK_FROM_ROWS] = "0"
    return True


def crossover(repacked: Mapping[int, float], stock: Mapping[int, float]) -> int:
    """The fewest rows from which the stock kernels were faster at that size and at every
    larger one timed; 0 where the largest size was faster repacked.

    >>> crossover({1: 0.037, 16: 0.238, 32: 0.391, 64: 0.706}, {1: 0.051, 16: 0.268, 32: 0.304, 64: 0.517})
    32
    >>> crossover({1: 0.030, 64: 0.500}, {1: 0.040, 64: 0.520})
    0
    """
    rows = 0
    for n in sorted(repacked, reverse=True):
        if n not in stock or stock[n] >= repacked[n]:
            break
        rows = n
    return rows


def choose_stock_rows(target: LanguageModel, log: Callable[[str], None]) -> int:
    """Time ``target``'s passes over ``KERNEL_SIZES`` rows on the repacked kernels and on the
    stock ones (or read the choice from the cache), set ``STOCK_FROM_ROWS`` to the
    ``crossover`` and return it (0 for a context too short to time them in, which keeps every
    product repacked). Call once, with the layouts kept and no pass under way."""
    if (target.max_context or 0) < CONTEXT + max(KERNEL_SIZES):
        return 0
    cache = CostCache()
    key = cache.key(target, f"stock rows {','.join(map(str, KERNEL_SIZES))}")
    rows = cache.get(key)
    if rows is None:
        log(f"timing {target.name}'s passes on ggml's two kernel layouts (once on this machine; cached)")
        os.environ[STOCK_FROM_ROWS] = "0"
        repacked = time_curve(target, KERNEL_SIZES)
        os.environ[STOCK_FROM_ROWS] = "1"
        stock = time_curve(target, KERNEL_SIZES)
        rows = crossover(repacked, stock)
        if plausible(repacked) and plausible(stock):
            cache.put(key, rows)
    os.environ[STOCK_FROM_ROWS] = str(int(rows))
    return int(rows)
