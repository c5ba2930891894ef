"""The device check of draftwise on llama.cpp's CUDA kernels: one call on a machine with a GPU
and no network, from what travels with the tree, writing one JSON.

What travels is a pack (``scripts/cuda_check_pack.sh`` makes it): llama.cpp's libraries and
programs built for the GPU, llama-cpp-python's Python package, the wheels of draftwise's
dependencies that the machine lacks, and the Qwen tokenizer. The models are made there: the
default pair's shapes with random weights built to walk (``scripts/random_gguf.py``): a pass
costs what its shape costs, whatever the weights, and the output is known in advance, so
acceptance is set by construction. The draft walks as the target on 80% of tokens; the edit's
prediction is the plain answer with a quarter cut from its middle.

Steps, each timed, the JSON rewritten after each (a run cut short keeps what it measured):

1. ``setup``: the pack's libraries and tokenizer unpacked, the wheels into a folder of their
   own, both on the paths;
2. ``models``: the random target and draft, quantized to Q4_K_M by the build's ``llama-quantize``;
3. ``curve``: ``draftwise curve``, a target pass of 1 to 64 rows after 512 tokens;
4. ``plain``: ``draftwise load`` with ``--drafter off`` on one chat prompt, whose answer becomes
   the edit's prediction;
5. ``edit``: the edit at 1 client: draftwise with and without the prediction, plain, and
   llama-server plain, ``ngram-simple``, ``ngram-mod`` and ``draft-simple``;
6. ``load``: 16 raw prompts at each ``--concurrency`` on draftwise, plain and the same
   llama-servers.

Then ``goals``: the ratios the issue asks for, and whether draftwise's greedy answers are its
own plain answers. Rehearse on the CPU with a CPU pack and ``--device cpu``.

    python3 scripts/cuda_check.py --pack build/cuda-pack --out check.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"target": "qwen2.5-1.5b", "draft": "qwen2.5-0.5b"}
DRAFT_AGREES = 0.8  # the draft walks as the target on this share of tokens (scripts/random_gguf.py)
LLAMA_SERVERS = ["llama-server", "llama-server-ngram-simple", "llama-server-ngram-mod", "llama-server-spec"]
EDIT_SERVERS = ["draftwise", "draftwise-noprediction", "draftwise-off", *LLAMA_SERVERS]
LOAD_SERVERS = ["draftwise", "draftwise-off", *LLAMA_SERVERS]
# The steps after setup, in order, and the method of Check that runs each.
STEPS = {"models": "models", "curve": "curve", "plain": "plain", "edit": "edit", "load": "load_levels"}
LAST_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
DRAFTWISE = [sys.executable, "-c", "from draftwise.cli import main; main()"]


class Check:
    """The check's state: where things are, what was measured, and the JSON it keeps."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.pack = args.pack.resolve()
        self.work = args.work.resolve()
        self.out = args.out.resolve()
        self.result: dict[str, Any] = {"device": args.device, "steps": {}, "settings": _settings(args)}
        self.env = dict(os.environ)

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def step(self, name: str, work) -> None:
        """Run one step, timed; its result (or its error) goes into the JSON at once."""
        start = time.monotonic()
        entry: dict[str, Any] = {}
        try:
            entry["result"] = work()
        except (subprocess.CalledProcessError, OSError, ValueError, KeyError) as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        entry["seconds"] = round(time.monotonic() - start, 1)
        self.result["steps"][name] = entry
        self.save()
        print(f"{name}: {entry['seconds']} s{' (failed)' if 'error' in entry else ''}", flush=True)
        if "error" in entry:
            raise SystemExit(f"error: step {name} failed: {entry['error'][-600:]}")

    def run(self, argv: list[str], log: str) -> None:
        """A command of the check, its output kept in the work folder (the tail shown if it fails)."""
        path = self.work / f"{log}.log"
        with path.open("w") as sink:
            done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        if done.returncode != 0:
            tail = path.read_text(errors="replace")[-3000:]
            raise subprocess.CalledProcessError(done.returncode, argv[:4], output=tail, stderr=tail)

    # 1. setup ------------------------------------------------------------------------------
    def setup(self) -> dict[str, Any]:
        site = self.work / "site"
        wheels = sorted((self.pack / "wheels").glob("*.whl")) if self.args.wheels else []
        if wheels:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            self.run([*pip, "--upgrade", "--target", str(site), *map(str, wheels)], "setup")
        with tarfile.open(self.pack / "llama.tar.xz", "r:xz") as packed:
            packed.extractall(self.work, filter="data")  # bin/ and vocab.gguf
        paths = [str(ROOT / "src"), str(site), str(self.pack / "python")]
        bin_dir = str(self.work / "bin")
        self.env.update(
            PYTHONPATH=os.pathsep.join(paths),
            LD_LIBRARY_PATH=os.pathsep.join([bin_dir, *_cuda_library_dirs(), os.environ.get("LD_LIBRARY_PATH", "")]),
            LLAMA_CPP_LIB_PATH=bin_dir,
            DRAFTWISE_HOME=str(self.work / "home"),
            PYTHONUNBUFFERED="1",
        )
        made = self.pack / "pack.json"
        pack = json.loads(made.read_text()) if made.is_file() else None
        return {"pack": pack, "wheels": [w.name for w in wheels], "machine": _machine(), "gpu": _gpu()}

    # 2. models -----------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        made: dict[str, Any] = {}
        for role, shape in SHAPES.items():
            f16 = self.work / f"{role}-f16.gguf"
            model = self.work / f"{role}.gguf"
            start = time.monotonic()
            script = [
                sys.executable,
                str(ROOT / "scripts" / "random_gguf.py"),
                "--vocab",
                str(self.work / "vocab.gguf"),
            ]
            draft = ["--seed", "1", "--agree", str(DRAFT_AGREES)] if role == "draft" else []
            self.run([*script, "--shape", shape, "--out", str(f16), *draft], role)
            written = time.monotonic() - start
            quantize = [str(self.work / "bin" / "llama-quantize"), str(f16), str(model), "Q4_K_M", str(os.cpu_count())]
            self.run(quantize, f"{role}-quantize")
            f16.unlink()
            made[role] = {
                "shape": shape,
                "bytes": model.stat().st_size,
                "write_s": round(written, 1),
                "quantize_s": round(time.monotonic() - start - written, 1),
            }
        return made

    def model(self, role: str) -> str:
        return str(self.work / f"{role}.gguf")

    # 3. curve ------------------------------------------------------------------------------
    def curve(self) -> dict[str, Any]:
        path = self.work / "curve.json"
        argv = [*DRAFTWISE, "curve", "--target", self.model("target"), "--device", self.args.device]
        self.run([*argv, "--rows", "1,2,4,8,16,32,64", "--context", "512", "--out", str(path)], "curve")
        return json.loads(path.read_text())

    # 4-6. the load runs --------------------------------------------------------------------
    def load(self, name: str, servers: list[str], levels: str, sources: list[str], tokens: int) -> Path:
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        argv = [*DRAFTWISE, "load", "--target", self.model("target"), "--draft", self.model("draft")]
        argv += ["--device", self.args.device, "--servers", ",".join(servers), "--concurrency", levels]
        argv += ["--max-tokens", str(tokens), "--limit", "16"]
        argv += ["--llama-cpp-bin", str(self.work / "bin"), "--no-audit", "--no-progress", "--out", str(out)]
        self.run([*argv, *sources], name)
        return out

    def plain(self) -> dict[str, Any]:
        chat = self.work / "chat.jsonl"
        first = (ROOT / "benchmarks" / "data" / "chat_short.jsonl").read_text(encoding="utf-8").splitlines()[0]
        chat.write_text(first + "\n")
        sources = ["--code", "none", "--data", str(chat)]
        out = self.load("plain", ["draftwise-off"], "1", sources, self.args.edit_tokens)
        (answer,) = [r for r in _records(out) if r.get("kind") == "request" and r["ok"]]
        task = edit_task(json.loads(first), answer["text"])
        (self.work / "edit.jsonl").write_text(json.dumps(task) + "\n")
        return {"answer_chars": len(answer["text"]), "prediction_chars": len(task["prediction"])}

    def edit(self) -> dict[str, Any]:
        sources = ["--code", "none", "--data", "none", "--edit", str(self.work / "edit.jsonl")]
        out = self.load("edit", EDIT_SERVERS, "1", sources, self.args.edit_tokens)
        return {"summary": _rows(out), "same_as_plain": same_as_plain(_records(out))}

    def load_levels(self) -> dict[str, Any]:
        prompts = self.work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in load_prompts(ROOT / "benchmarks" / "data")))
        sources = ["--code", str(prompts), "--data", "none"]
        out = self.load("load", LOAD_SERVERS, self.args.concurrency, sources, self.args.max_tokens)
        return {"summary": _rows(out), "same_as_plain": same_as_plain(_records(out))}


def edit_task(prompt: dict[str, Any], answer: str) -> dict[str, Any]:
    """The edit: ``prompt`` with its plain ``answer`` as the prediction, a quarter of it cut
    from the middle (the answer keeps what the prediction lost: as when code is edited)."""
    cut = answer[: len(answer) * 3 // 8] + answer[len(answer) * 5 // 8 :]
    return {"id": f"{prompt['id']}-edited", "subtask": "edited", "prompt": prompt["prompt"], "prediction": cut}


def load_prompts(data: Path) -> list[dict[str, Any]]:
    """The code and chat prompts as raw completions, 16 in all (so that 16 clients are all
    busy at once), each ending with a word of its own: the random models' answer follows from
    the last token alone, so prompts that end alike would get the same answer, and llama.cpp's
    ngram-mod, whose table all requests share, would have seen it."""
    texts = []
    for name in ("code_completion.jsonl", "chat_short.jsonl"):
        texts += [json.loads(line)["prompt"] for line in (data / name).read_text(encoding="utf-8").splitlines() if line]
    return [
        {"id": f"p{i:02d}", "subtask": "load", "prompt": f"{text.rstrip()}\n{word}"}
        for i, (text, word) in enumerate(zip(texts, LAST_WORDS, strict=False))
    ]


def same_as_plain(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How many of each draftwise server's answers equal draftwise-off's answer to the same
    prompt (greedy: speculation must not change the output)."""
    requests = [r for r in records if r.get("kind") == "request" and r["ok"]]
    plain = {r["prompt_id"]: r["text"] for r in requests if r["server"] == "draftwise-off" and r["concurrency"] == 1}
    counts: dict[str, dict[str, int]] = {}
    for r in requests:
        if r["server"].startswith("draftwise") and r["prompt_id"] in plain:
            count = counts.setdefault(f"{r['server']}@{r['concurrency']}", {"compared": 0, "identical": 0})
            count["compared"] += 1
            count["identical"] += r["text"] == plain[r["prompt_id"]]
    return counts


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals as ratios within this run, from the steps' summaries (None where a
    step is missing)."""
    steps = result["steps"]

    def rows(step: str) -> list[dict[str, Any]]:
        return steps.get(step, {}).get("result", {}).get("summary", [])

    def best(step: str, servers: list[str], level: int, field: str) -> float | None:
        found = [r[field] for r in rows(step) if r["server"] in servers and r["concurrency"] == level and r[field]]
        return max(found) if found else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out: dict[str, Any] = {
        "plain_vs_llama_server_c1": ratio(
            best("load", ["draftwise-off"], 1, "decode_tok_s"), best("load", ["llama-server"], 1, "decode_tok_s")
        ),
        "edit_decode_vs_llama_server_best": ratio(
            best("edit", ["draftwise"], 1, "decode_tok_s"), best("edit", LLAMA_SERVERS, 1, "decode_tok_s")
        ),
    }
    for level in sorted({r["concurrency"] for r in rows("load")} - {1}):
        out[f"c{level}_vs_llama_server_best"] = ratio(
            best("load", ["draftwise"], level, "tok_s"), best("load", LLAMA_SERVERS, level, "tok_s")
        )
    same = [
        c for step in ("edit", "load") for c in steps.get(step, {}).get("result", {}).get("same_as_plain", {}).values()
    ]
    out["identical_to_plain"] = f"{sum(c['identical'] for c in same)}/{sum(c['compared'] for c in same)}"
    return out


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _rows(out: Path) -> list[dict[str, Any]]:
    keep = ("server", "concurrency", "requests", "errors", "completion_tokens", "tok_s", "decode_tok_s", "ttft_p50_s")
    extra = ("accepted_prediction_tokens", "rejected_prediction_tokens")
    rows = json.loads((out / "summary.json").read_text())["rows"]
    return [{k: r.get(k) for k in (*keep, *extra) if k in keep or r.get(k) is not None} for r in rows]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "edit_tokens": args.edit_tokens,
        "concurrency": args.concurrency,
        "shapes": SHAPES,
        "draft_agrees": DRAFT_AGREES,
    }


def _machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _cuda_library_dirs() -> list[str]:
    """Where CUDA's runtime and cuBLAS may be, which a CUDA build of llama.cpp loads: the
    toolkit's lib64, and the lib folders of NVIDIA's Python packages (where PyTorch finds them)."""
    found = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"]
    spec = importlib.util.find_spec("nvidia")
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        found += sorted(Path(root).glob("*/lib"))
    return [str(path) for path in found if path.is_dir()]


def _gpu() -> str | None:
    """nvidia-smi's name, driver and memory of each GPU; None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = [smi, "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, required=True, help="what scripts/cuda_check_pack.sh made")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda-check"), help="models, logs and runs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the rehearsal")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request")
    parser.add_argument("--edit-tokens", type=int, default=256, help="max_tokens of the edit (and of its plain answer)")
    parser.add_argument("--concurrency", default="1,4,16", help="clients of the code prompts' runs")
    parser.add_argument(
        "--no-wheels",
        dest="wheels",
        action="store_false",
        help="use this Python's own packages, not the pack's wheels (the rehearsal, in draftwise's .venv)",
    )
    parser.add_argument("--steps", default=",".join(STEPS), help="the steps to run, after setup")
    args = parser.parse_args(argv)
    if not (args.pack / "llama.tar.xz").is_file():
        print(
            f"error: {args.pack} is no pack: no llama.tar.xz (scripts/cuda_check_pack.sh makes one)",
            file=sys.stderr,
        )
        return 2
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        print(f"error: --steps: no step {unknown[0]}; the steps are {','.join(STEPS)}", file=sys.stderr)
        return 2
    check = Check(args)
    check.work.mkdir(parents=True, exist_ok=True)
    check.step("setup", check.setup)
    for name in steps:
        check.step(name, getattr(check, STEPS[name]))
    check.result["goals"] = goals(check.result)
    check.save()
    print(json.dumps(check.result["goals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
