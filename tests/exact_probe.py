"""Probes of ``--exact`` on llama.cpp, each run in a process of its own by ``test_exact.py``
(ggml fixes its kernels once per process, so these cannot share the test session's).

    python tests/exact_probe.py PROBE TARGET_GGUF DRAFT_GGUF THREADS

prints one JSON object: what the probe compared and every difference it found.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from draftwise.backends import llamacpp
from draftwise.config import DraftConfig, GenerationConfig, ModelOptions, SamplingConfig
from draftwise.drafters import build_drafter
from draftwise.engine import SpeculativeEngine
from draftwise.target import LocalTarget

CONTEXTS = (10, 600, 2000)  # 600 and 2000: past the 512 cells where one-row attention used to split
BLOCKS = range(2, 17)
GREEDY = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=SamplingConfig(temperature=0))
TEXT = (
    "The committee met on Tuesday to review the budget. Each department presented its figures, and the "
    "chair asked how the new hires would be paid for. def total(items):\n    return sum(i.price for i in items)\n"
)


def _load(path: str, threads: int, *, draft: bool = False, slots: int = 1) -> Any:
    options = ModelOptions(backend="llamacpp", threads=threads, context=4096, exact=True)
    return llamacpp.load_llamacpp(Path(path).stem, Path(path), options, draft=draft, slots=slots)


def rows(target: str, threads: int) -> dict[str, Any]:
    """Scores of each position fed alone, then in blocks of 2 to 16 rows, after contexts of
    10 to 2,000 tokens: every row bit for bit. The contexts are starts of one sequence, each fed
    after the one before, so that the prefill (most of the probe's time) is paid once."""
    lm = _load(target, threads)
    rng = random.Random(0)
    sequence = [rng.randrange(100, lm.vocab_size) for _ in range(max(CONTEXTS))]
    differences, fed = [], 0
    for length in CONTEXTS:
        block = [rng.randrange(100, lm.vocab_size) for _ in range(max(BLOCKS))]
        lm.rollback(fed)  # drop the last context's blocks, keep the context
        lm.forward(sequence[fed:length], last=1)
        fed = length
        alone = [lm.forward([token], last=1)[0].clone() for token in block]
        for n in BLOCKS:
            lm.rollback(length)
            scores = lm.forward(block[:n])
            differences += [[length, n, i] for i in range(n) if not torch.equal(scores[i], alone[i])]
    return {"compared": len(CONTEXTS) * sum(BLOCKS), "differences": differences}


def _generate(
    target: Any, draft: Any, drafter: str, prompt: list[int], keep: bool = False
) -> tuple[list[int], torch.Tensor]:
    """The greedy output, and the scores of its second-to-last token fed again alone over the
    cache the generation left: any cache entry written differently shows there, bit for bit,
    even where the tokens agree. ``keep``: reuse what the cache holds of the prompt's start."""
    config = GREEDY.model_copy(update={"draft": DraftConfig(k_policy="fixed", k=9)})
    chosen = None if drafter == "off" else build_drafter(drafter, draft)
    engine = SpeculativeEngine(LocalTarget(target), chosen, target.tokenizer)
    if not keep:
        target.reset()  # a prefill from scratch: nothing reused of an earlier prompt
    tokens = engine.generate(prompt, config if chosen else GREEDY).tokens
    sequence = prompt + tokens
    target.rollback(len(sequence) - 2)
    return tokens, target.forward([sequence[-2]], last=1)[0].clone()


def _same(a: tuple[list[int], torch.Tensor], b: tuple[list[int], torch.Tensor]) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1])


def _long_prompt(lm: Any, tokens: int) -> list[int]:
    ids = lm.tokenizer.encode(TEXT * 40)
    return ids[:tokens]


def speculative(target: str, draft: str, threads: int) -> dict[str, Any]:
    """Greedy speculative output against plain decoding on prompts over 512 tokens, with the
    model, n-gram and hybrid drafters (blocks of 10 rows). The plain run prefills the prompt;
    the speculative ones reuse it from the cache (``reuse`` checks that a reused start scores
    as a fresh prefill), so the prompt is paid once, not four times."""
    lm, small = _load(target, threads), _load(draft, threads, draft=True)
    differences = []
    for tokens in (600, 1100):
        prompt = _long_prompt(lm, tokens)
        plain = _generate(lm, None, "off", prompt)
        for drafter in ("model", "ngram", "hybrid"):
            if not _same(_generate(lm, small, drafter, prompt, keep=True), plain):
                differences.append([tokens, drafter])
    return {"compared": 6, "differences": differences}


def chunks(target: str, threads: int) -> dict[str, Any]:
    """Plain decoding after the same prompt prefilled in pieces of 512, 64 and 7 tokens."""
    outputs = {}
    for batch in (512, 64, 7):
        llamacpp.BATCH = batch  # the most tokens one pass of a lone sequence takes
        lm = _load(target, threads)
        outputs[batch] = _generate(lm, None, "off", _long_prompt(lm, 700))
    return {"compared": 2, "differences": [b for b in (64, 7) if not _same(outputs[b], outputs[512])]}


def reuse(target: str, threads: int) -> dict[str, Any]:
    """Prompts that start as the cache does (what a server's slot left, see ``prefill``): the
    cached start reused, the rest fed after it, against each prompt prefilled from scratch."""
    lm = _load(target, threads, slots=2)
    other = lm.fork()  # a second sequence holding cells too, as in a server
    other.forward(_long_prompt(lm, 300), last=1)
    base = _long_prompt(lm, 700)
    prompts = [base[:400], base[:650], base[:200] + base[500:700], base[:700]]
    expected = [_generate(lm, None, "off", prompt) for prompt in prompts]
    lm.reset()
    reused = [_generate(lm, None, "off", prompt, keep=True) for prompt in prompts]
    differences = [i for i in range(len(prompts)) if not _same(reused[i], expected[i])]
    return {"compared": len(prompts), "differences": differences}


def batched(target: str, draft: str, threads: int) -> dict[str, Any]:
    """Four streams of mixed prompt lengths and drafters sharing one batched context, each
    starting when the one before has run a while (so that cells freed by one are refilled by
    another): every output as the same request alone."""
    lm, small = _load(target, threads), _load(draft, threads, draft=True)
    jobs = [
        (_long_prompt(lm, n), drafter) for n, drafter in ((40, "off"), (700, "ngram"), (90, "model"), (300, "hybrid"))
    ]
    expected = [_generate(lm, small, drafter, prompt) for prompt, drafter in jobs]
    shared, shared_draft = _load(target, threads, slots=4), _load(draft, threads, draft=True, slots=4)
    targets = [shared, *(shared.fork() for _ in jobs[1:])]
    drafts = [shared_draft, *(shared_draft.fork() for _ in jobs[1:])]
    outputs: dict[int, tuple[list[int], torch.Tensor]] = {}

    def run(i: int) -> None:
        outputs[i] = _generate(targets[i], drafts[i], jobs[i][1], jobs[i][0])

    threads_ = []
    for i in range(len(jobs)):
        threads_.append(threading.Thread(target=run, args=(i,)))
        threads_[-1].start()
        threads_[-1].join(timeout=0.5 + i)  # staggered starts; the earlier streams keep going
    for thread in threads_:
        thread.join()
    differences = [i for i in range(len(jobs)) if i not in outputs or not _same(outputs[i], expected[i])]
    return {"compared": len(jobs), "differences": differences}


def holes(target: str, threads: int, ordered: bool) -> dict[str, Any]:
    """Two sequences of one context: the first rolls back 200 tokens, freeing cells below every
    cell of the second, which then decodes a block. Its rows' scores against the same sequence
    alone (``ordered=False``: llama.cpp's usual cell search, which puts the block in the freed
    cells, to show that the probe sees the difference)."""
    rng = random.Random(1)
    first, second, block = ([rng.randrange(100, 10_000) for _ in range(n)] for n in (300, 300, 8))
    lm = _load(target, threads, slots=2)
    switches = llamacpp.library().switches
    assert switches is not None and switches.kv_ordered()  # --exact orders them
    switches.kv_ordered(ordered)  # read at every pass: off, llama.cpp's usual search
    other = lm.fork()
    lm.forward(first, last=1)
    other.forward(second, last=1)
    lm.rollback(100)
    lm.forward(first[100:101], last=1)  # its cache is cut at this pass: 199 cells below the second's come free
    shared = other.forward(block)
    alone = _load(target, threads)
    alone.forward(second, last=1)
    expected = alone.forward(block)
    differences = [i for i in range(len(block)) if not torch.equal(shared[i], expected[i])]
    return {"compared": len(block), "differences": differences}


def switches(target: str, threads: int, exact: bool) -> dict[str, Any]:
    """What loading a model sets in ggml and libllama (patch 0007's switches), and what it
    changed in this process's environment."""
    before = dict(os.environ)
    options = ModelOptions(backend="llamacpp", threads=threads, context=512, exact=exact)
    llamacpp.load_llamacpp(Path(target).stem, Path(target), options)
    switch = llamacpp.library().switches
    assert switch is not None
    changed = sorted(set(os.environ.items()) ^ set(before.items()))
    return {"row_invariant": switch.row_invariant(), "kv_ordered": switch.kv_ordered(), "environment": changed}


def main() -> None:
    probe, target, draft, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    runs = {
        "rows": lambda: rows(target, threads),
        "speculative": lambda: speculative(target, draft, threads),
        "chunks": lambda: chunks(target, threads),
        "batched": lambda: batched(target, draft, threads),
        "reuse": lambda: reuse(target, threads),
        "holes": lambda: holes(target, threads, ordered=True),
        "holes-unordered": lambda: holes(target, threads, ordered=False),
        "switches": lambda: switches(target, threads, exact=False),
        "switches-exact": lambda: switches(target, threads, exact=True),
    }
    print(json.dumps(runs[probe]()))


if __name__ == "__main__":
    main()
