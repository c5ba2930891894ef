import sys, time, collections, json
from draftwise.config import ModelOptions, GenerationConfig, SamplingConfig
from draftwise.loading import load_pair
from draftwise.api.pool import build_workers
from draftwise.scheduler import run_together, Scheduler
n = int(sys.argv[1]); drafter = sys.argv[2]
target, draft = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", ModelOptions(backend="llamacpp", threads=2, context=2048), slots=n)
workers = build_workers(target, draft, n, own=True)
rows = [json.loads(l) for l in open("src/draftwise/data/spec_bench/question.jsonl")]
prompts = [r["turns"][0] for r in rows if r["category"] in ("coding", "rag", "summarization", "qa")][: 2 * n]
tok = target.tokenizer
cfg = GenerationConfig(max_new_tokens=96, sampling=SamplingConfig(temperature=0))
def batch(ps):
    streams = [w.engine(drafter).steps(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)), cfg) for w, p in zip(workers, ps)]
    t = time.perf_counter(); ev = run_together(streams); return ev, time.perf_counter() - t
total_t, toks, src = 0.0, 0, collections.Counter()
for i in range(0, len(prompts), n):
    ev, dt = batch(prompts[i:i+n]); total_t += dt
    for es in ev:
        for e in es:
            toks += len(e.tokens); src[(e.source, e.k > 0)] += 1; src[("accepted", e.source)] += e.n_accepted
print(drafter, n, f"{toks/total_t:.1f} tok/s", toks, f"{total_t:.1f}s", dict(src))
