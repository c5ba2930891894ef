import sys, time
from draftwise.config import ModelOptions, GenerationConfig, SamplingConfig
from draftwise.loading import load_lm
from draftwise.engine import SpeculativeEngine
from draftwise.target import LocalTarget
from draftwise.scheduler import run_together, Scheduler
from draftwise.backends import llamacpp
n = int(sys.argv[1])
lm = load_lm("qwen2.5-coder-1.5b", ModelOptions(backend="llamacpp", threads=2, context=1024), slots=n)
lib = llamacpp.library()
dec = lib.decoder
spent = [0.0, 0]
orig = dec.run
def timed(fn, *a):
    t = time.perf_counter(); r = orig(fn, *a); spent[0] += time.perf_counter() - t; spent[1] += 1; return r
dec.run = timed
prompts = ["def quicksort(arr):", "import os\nimport sys\n\ndef main():", "class LinkedList:\n    def __init__(self):",
           "# Compute the nth prime number\ndef nth_prime(n):", "def merge_sort(items):", "SELECT name, COUNT(*) FROM orders",
           "function debounce(fn, ms) {", "The three laws of thermodynamics are"]
seqs = [lm] + [lm.fork() for _ in range(n - 1)]
cfg = GenerationConfig(max_new_tokens=64, ignore_eos=True, sampling=SamplingConfig(temperature=0))
streams = [SpeculativeEngine(LocalTarget(s), None, s.tokenizer).steps(s.tokenizer.encode(p), cfg) for s, p in zip(seqs, prompts)]
sch = Scheduler()
t = time.perf_counter()
ev = run_together(streams, sch)
wall = time.perf_counter() - t
toks = sum(len(e.tokens) for es in ev for e in es)
print(f"n={n} wall {wall:.2f}s tokens {toks} tok/s {toks/wall:.1f} decode {spent[0]:.2f}s in {spent[1]} passes; other {wall-spent[0]:.2f}s rounds {sch.stats.rounds}")
