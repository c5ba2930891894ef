"""Send the load bench's 14 prompts to a running draftwise server at C clients, not streamed,
and sum each answer's speculative.proposed_by_source / kept_by_source."""
import asyncio, collections, sys
import httpx
from draftwise.loadbench.config import LoadConfig
from draftwise.loadbench.prompts import load_prompts

URL, C = sys.argv[1], int(sys.argv[2])
PROBE = int(sys.argv[3]) if len(sys.argv) > 3 else None
import time
MODEL = httpx.get(URL + "/v1/models").json()["data"][0]["id"]
prompts = load_prompts(LoadConfig(servers=("draftwise",), limit=2))
proposed, kept, steps = collections.Counter(), collections.Counter(), collections.Counter()

async def main():
    queue = list(prompts)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=URL, timeout=900) as http:
        async def client():
            while queue:
                p = queue.pop(0)
                body = p.body(MODEL, 128)
                body["stream"] = False
                body["speculative"] = {"probe_every": PROBE or 16, "noise_margin": float(sys.argv[4]) if len(sys.argv) > 4 else 2.0}
                body.pop("stream_options", None)
                path = "/v1/chat/completions" if p.chat else "/v1/completions"
                resp = await http.post(path, json=body)
                r = resp.json()
                if resp.status_code != 200: print(resp.status_code, resp.text[:200])
                s = r.get("speculative") or {}
                proposed.update(s.get("proposed_by_source", {}))
                kept.update(s.get("kept_by_source", {}))
                steps["passes"] += s.get("target_passes", 0)
                steps["tokens"] += s.get("new_tokens", 0)
        await asyncio.gather(*(client() for _ in range(C)))
    steps["wall"] = round(time.perf_counter() - t0, 1)
    print("probe", PROBE, "proposed", dict(proposed), "kept", dict(kept), dict(steps))

asyncio.run(main())
