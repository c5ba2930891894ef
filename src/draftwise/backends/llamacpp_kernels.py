"""Which of ggml's CPU kernels run a repacked matrix's products, chosen by timing both.

On x86 llama.cpp repacks Q4_K, Q4_0 and a few other weight types at load into a layout whose
kernels are the fastest for a product over a few rows. On some CPUs ggml's stock kernels, on
the file's own layout, are far faster for many rows (a prompt's pieces), and on others they
are not (docs/speed.md#kernels-chosen-by-timing): no one rule fits every host. Draftwise's
patch 0006 lets ggml keep both layouts (``GgmlSwitch.keep_layouts`` before the first weights
load) and run a product over at least ``GgmlSwitch.stock_from_rows`` rows on the stock
kernels. The choice is left to timing here (``KernelChoice.to_time``); preparing a pair
(``draftwise.costs.choose_kernels``) times the target's prompt pieces both ways once per file,
threads and CPU and sets the rows from which the stock kernels were the faster at every size
timed; where they never were, and until then, every product stays repacked.

Only a pass of prompt pieces runs the stock kernels (``stock_rows_for``): a pass that scores a
token a stream emits from a drafted block or a one-token step (every verified block, every
batch of decoding streams) stays on the repacked kernels, as one-token decoding does, so the
choice cannot turn a near tie that plain decoding resolves one way the other way
(docs/exactness.md#which-kernels-run-which-pass). Plain decoding reads its prompt in the same
pieces on the same kernels, so its first token and its cache agree with a speculative run's.

Not under ``--exact``: its row invariance is the repacked kernels'. Not where the GPU holds the
layers. The user's ``GGML_CPU_REPACK_FROM_ROWS``, where set, stands untimed: empty, ggml keeps
no copy and the repacked kernels run everything, as in stock llama.cpp; a number, the rows
from which prompt pieces run the stock kernels.

The other switches of draftwise's patches live here too (``PatchSwitches``, patch 0007):
``--exact``'s single path for passes of any size, and the KV cells in position order, set
through calls rather than the process's environment.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Protocol

STOCK_FROM_ROWS = "GGML_CPU_REPACK_FROM_ROWS"  # the user's say, read by patch 0006 at the first load


class GgmlSwitch(Protocol):
    """Patch 0006's two switches in ggml's CPU backend."""

    def keep_layouts(self, keep: bool) -> bool:
        """Before the first weights load: whether repacked matrices keep their file layout too.
        Returns the decision in force (a load, or an earlier call, may have made it)."""
        ...

    def stock_from_rows(self, rows: int) -> None:
        """From how many rows the next products run the stock kernels (0: never)."""
        ...


class _LibrarySwitch:
    """``GgmlSwitch`` through ctypes, on the libggml-cpu that llama-cpp-python loaded."""

    def __init__(self, llama: ctypes.CDLL) -> None:
        self._keep = llama.ggml_cpu_repack_keep_layouts
        self._keep.argtypes, self._keep.restype = [ctypes.c_int], ctypes.c_int
        self._rows = llama.ggml_cpu_repack_stock_from_rows
        self._rows.argtypes, self._rows.restype = [ctypes.c_int64], None

    def keep_layouts(self, keep: bool) -> bool:
        return bool(self._keep(int(keep)))

    def stock_from_rows(self, rows: int) -> None:
        self._rows(rows)


def ggml_switch(llama: ctypes.CDLL) -> GgmlSwitch | None:
    """The switches of the libggml-cpu that ``llama`` (the loaded libllama) runs on, or None for
    a build without patch 0006. They are looked up through libllama's own handle: a wheel holds
    each library under several names as copies, not links, and a copy opened by another name
    would be a second library with switches of its own that no pass reads."""
    if not hasattr(llama, "ggml_cpu_repack_stock_from_rows"):
        return None
    return _LibrarySwitch(llama)


@dataclass
class KernelChoice:
    """What this process runs repacked matrices on. ``timed``: draftwise times the target's
    passes to set ``stock_rows`` (None until it has); otherwise ``stock_rows`` is fixed (the
    user's, or 0: every product repacked). ``apart_rows``: from how many rows prompt pieces
    beside other streams' steps go in a pass of their own, to run there (``Batch.apart_from``;
    timed with ``stock_rows``; the user's rows stand for both). ``copies``: whether repacked
    matrices keep their file layout too (memory for a second copy of those weights)."""

    switch: GgmlSwitch | None = None
    timed: bool = False
    stock_rows: int | None = 0
    copies: bool = False
    apart_rows: int = 0

    def to_time(self, key: str) -> PromptKernels | None:
        """The choice as ``draftwise.lm.KernelTiming`` for a target whose file, threads and
        device ``key`` names, while it is left to timing and not yet made."""
        return PromptKernels(self, key) if self.timed and self.stock_rows is None else None

    def stock_rows_for(self, prompt_only: bool) -> int:
        """The rows from which a pass runs the stock kernels: none unless every sequence in it
        feeds prompt pieces (see the module's docstring)."""
        return (self.stock_rows or 0) if prompt_only else 0

    def before_pass(self, prompt_only: bool) -> None:
        if self.switch is not None:
            self.switch.stock_from_rows(self.stock_rows_for(prompt_only))


@dataclass(frozen=True)
class PromptKernels:
    """``draftwise.lm.KernelTiming`` over this process's ``KernelChoice``."""

    choice: KernelChoice
    key: str

    def set_stock_rows(self, rows: int) -> None:
        self.choice.stock_rows = rows

    def set_apart_rows(self, rows: int) -> None:
        self.choice.apart_rows = rows


def keep_layouts(exact: bool, gpu: bool, switch: GgmlSwitch | None) -> KernelChoice:
    """Before the process's first weights load: who chooses the kernels. With ``exact`` (or on
    the ``gpu``) ggml keeps no copy, whatever this process inherited: ``exact``'s row
    invariance is the repacked kernels'. A value of ``STOCK_FROM_ROWS`` the user set stands.
    Otherwise ggml keeps both layouts and draftwise times them (``draftwise.costs.choose_kernels``)."""
    if switch is None:
        return KernelChoice()
    if exact or gpu:
        switch.keep_layouts(False)
        return KernelChoice(switch)
    user = os.environ.get(STOCK_FROM_ROWS)
    if user is not None:
        rows = user.strip()
        stock = int(rows) if rows.isdigit() else 0
        return KernelChoice(switch, stock_rows=stock, copies=bool(rows), apart_rows=stock)
    kept = switch.keep_layouts(True)
    return KernelChoice(switch, timed=kept, stock_rows=None, copies=kept)


# Each sequence's KV cells stay in the order of its positions (patch 0004: attention sums its
# cells in cell order), however the streams of a batched context, a draft model forked from
# the target among them, interleave and roll back. Always, unless the user's LLAMA_KV_ORDERED=0
# says otherwise (not under ModelOptions.exact): it only chooses which free cell a row takes,
# and without it a 2-core AMD EPYC (AVX2) saw the target drafting for itself kept at 78% rather
# than 100%, and a stream beside three others part from its output alone at a 0.34-logit gap.
KV_ORDERED = "LLAMA_KV_ORDERED"


def kv_ordered(exact: bool) -> bool:
    """Whether KV cells are kept in position order: always under ``exact``, else unless the
    user's ``LLAMA_KV_ORDERED`` is ``0`` (as patch 0004 reads the variable)."""
    return exact or os.environ.get(KV_ORDERED, "1") != "0"


class PatchSwitches:
    """Patch 0007's two switches, through ctypes on the libllama llama-cpp-python loaded (whose
    handle finds libggml-cpu's symbols too; see ``ggml_switch``). Each is read
    at every pass, so it may be set after a load."""

    NAMES = (
        "ggml_cpu_row_invariant",
        "ggml_cpu_set_row_invariant",
        "ggml_cpu_get_row_invariant",
        "llama_kv_set_ordered",
        "llama_kv_get_ordered",
    )

    def __init__(self, llama: ctypes.CDLL) -> None:
        self._marker = llama.ggml_cpu_row_invariant
        self._invariant = llama.ggml_cpu_set_row_invariant
        self._invariant.argtypes, self._invariant.restype = [ctypes.c_int], None
        self._is_invariant = llama.ggml_cpu_get_row_invariant
        self._is_invariant.argtypes, self._is_invariant.restype = [], ctypes.c_int
        self._ordered = llama.llama_kv_set_ordered
        self._ordered.argtypes, self._ordered.restype = [ctypes.c_int32], None
        self._is_ordered = llama.llama_kv_get_ordered
        self._is_ordered.argtypes, self._is_ordered.restype = [], ctypes.c_bool

    @classmethod
    def of(cls, llama: ctypes.CDLL) -> PatchSwitches | None:
        """The switches, or None for a llama.cpp built without draftwise's patches."""
        return cls(llama) if all(hasattr(llama, name) for name in cls.NAMES) else None

    def covered(self) -> bool:
        """Whether the patches cover this CPU family (patch 0003's marker)."""
        return bool(self._marker())

    def row_invariant(self, on: bool | None = None) -> bool:
        """Every pass on one path for any number of rows (``--exact``'s kernels: no tiled
        matrix product or attention, no split of one row's attention); sets it where ``on`` is
        given, and returns the setting in force."""
        if on is not None:
            self._invariant(int(on))
        return bool(self._is_invariant())

    def kv_ordered(self, on: bool | None = None) -> bool:
        """Each sequence's KV cells in position order; sets it where ``on`` is given, and
        returns the setting in force."""
        if on is not None:
            self._ordered(int(on))
        return bool(self._is_ordered())
