"""Soak test of both servers on tiny models: many concurrent clients for a long while.

Each server runs as the real CLI (``draftwise serve`` / ``draftwise serve-verifier``) in a
child process on 127.0.0.1 (loopback only: there is no flag to change that), so its memory is
its own. The load stops by itself: after ``--duration`` seconds or ``--max-requests``
generations per phase, whichever comes first.

* API phase: ``--clients`` streaming clients, each sending greedy ``/v1/completions`` streams
  one after another (2 workers, a queue of 16: the rest get 429 and wait ``Retry-After``).
  One request in 16 hangs up after its first chunk (the server must cancel it). Every
  finished stream must end with ``data: [DONE]``, carry no error event, and hold the same text
  as the same prompt sent alone before the load.
* Verifier phase: ``--clients`` remote drafters (threads, a tiny draft model each) generating
  through one verifier with fewer session slots than clients, so sessions are evicted all the
  time and clients reopen theirs. Every output must equal the local run's tokens.

Reported per phase: requests by status, 5xx, errors, incomplete streams, time to first token
(p50, p99), and the server's RSS after the warm-up and at the end (growth must stay < 5%).

    python scripts/soak.py --duration 600 --out benchmarks/soak/result.json
    python scripts/soak.py --duration 30 --clients 16        # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
CLI = [sys.executable, "-c", "from draftwise.cli import main; main()"]
PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n",
    "Once upon a time",
    "SELECT * FROM users WHERE",
    "class Stack:\n    def __init__(self):",
    "# TODO: write tests",
    "1, 2, 3, 5, 8,",
]
MAX_TOKENS = 32
DISCONNECT_EVERY = 16  # one request in this many hangs up after its first chunk
RSS_EVERY_S = 5.0


@dataclass
class Tally:
    """What one phase saw; shared by its clients (the API's run on one event loop, the
    verifier's under ``lock``)."""

    statuses: Counter[str] = field(default_factory=Counter)  # HTTP status (or "no answer") -> count
    generations: int = 0  # finished generations (streams read to their end)
    incomplete: int = 0  # 200 streams without [DONE], or with an error event in them
    mismatched: int = 0  # finished outputs that differ from the reference
    disconnects: int = 0  # streams this script hung up on, on purpose
    errors: list[str] = field(default_factory=list)  # the first few failures, for the report
    error_count: int = 0
    ttft: list[float] = field(default_factory=list)
    evicted: int = 0  # verifier: generations whose session was evicted (reopened) on the way
    began: float = field(default_factory=time.monotonic)
    evicted_identical: int = 0  # ... and still gave the reference output
    lock: threading.Lock = field(default_factory=threading.Lock)

    def error(self, message: str) -> None:
        self.error_count += 1
        if len(self.errors) < 10:
            self.errors.append(f"t={time.monotonic() - self.began:.1f}s {message}")

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft)
        fives = sum(n for status, n in self.statuses.items() if status.startswith("5"))
        return {
            "requests_by_status": dict(sorted(self.statuses.items())),
            "requests": sum(self.statuses.values()),
            "status_5xx": fives,
            "generations": self.generations,
            "incomplete_200_streams": self.incomplete,
            "mismatched_outputs": self.mismatched,
            "deliberate_disconnects": self.disconnects,
            "errors": self.error_count,
            "first_errors": self.errors,
            "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p99_s": _percentile(ttft, 99),
            "evicted_generations": self.evicted,
            "evicted_generations_identical": self.evicted_identical,
        }


def _percentile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux: /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler:
    """Samples a process's RSS every few seconds in a thread, until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, int]] = []  # (seconds since start, bytes)
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic() - self._started, rss_bytes(self.pid)))
            self._stop.wait(RSS_EVERY_S)

    def stop(self, warmup_s: float) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.monotonic() - self._started, rss_bytes(self.pid)))
        after_warmup = next((rss for t, rss in self.samples if t >= warmup_s), self.samples[-1][1])
        end = self.samples[-1][1]
        return {
            "rss_idle_mb": self.samples[0][1] / 2**20,
            "rss_after_warmup_mb": after_warmup / 2**20,
            "rss_end_mb": end / 2**20,
            "rss_max_mb": max(r for _, r in self.samples) / 2**20,
            "rss_growth_after_warmup": end / after_warmup - 1,
            "warmup_s": warmup_s,
            "rss_samples_mb": [(round(t, 1), round(r / 2**20, 1)) for t, r in self.samples],
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextmanager
def cli_server(args: list[str], health: str, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``draftwise ARGS`` on a free loopback port, in its own process group; stopped (SIGTERM,
    then SIGKILL after 30 s) on exit."""
    import httpx

    port = _free_port()
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [*CLI, *args, "--host", HOST, "--port", str(port)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start:\n{log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(url + health, timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        yield url, process
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class Budget:
    """At most ``left`` more generations, shared by every client of a phase."""

    def __init__(self, left: int) -> None:
        self.left = left
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            self.left -= 1
            return self.left >= 0


# --- API phase ---------------------------------------------------------------------------


async def _read_stream(response: Any, started: float, hang_up: bool) -> tuple[str, float | None, str]:
    """(text, seconds to the first chunk, how the stream ended: done, error event,
    incomplete, or hung up by this client)."""
    first, text = None, []
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return "".join(text), first, "done"
        chunk = json.loads(data)
        if "error" in chunk:
            return "".join(text), first, f"error event {chunk['error']}"
        first = first if first is not None else time.perf_counter() - started
        text += [choice["text"] for choice in chunk["choices"]]
        if hang_up:
            return "".join(text), first, "hung up"
    return "".join(text), first, "incomplete"


async def _api_request(http: Any, url: str, prompt: str, hang_up: bool, tally: Tally) -> tuple[float, str | None]:
    """One streaming request: (seconds to wait before the next, the text of a complete stream)."""
    import httpx

    body = {"model": "tiny:0", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    started = time.perf_counter()
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            tally.statuses[str(response.status_code)] += 1
            if response.status_code == 429:  # the queue is full: come back when told
                await response.aread()
                return min(float(response.headers.get("retry-after", 1)), 5.0), None
            if response.status_code != 200:
                tally.error(f"{response.status_code}: {(await response.aread())[:300]!r}")
                return 0.0, None
            text, first, end = await _read_stream(response, started, hang_up)
    except httpx.HTTPError as exc:
        tally.statuses["no answer"] += 1
        tally.error(f"{type(exc).__name__}: {exc}")
        return 0.0, None
    if first is not None:
        tally.ttft.append(first)
    if end == "hung up":
        tally.disconnects += 1
        return 0.0, None
    if end != "done":
        tally.incomplete += 1
        tally.error(f"a 200 stream ended with {end}")
        return 0.0, None
    tally.generations += 1
    return 0.0, text


async def _api_client(
    index: int, http: Any, url: str, deadline: float, budget: Budget, tally: Tally, references: dict[str, str]
) -> None:
    n = 0
    while time.monotonic() < deadline and budget.take():
        prompt = PROMPTS[(index + n) % len(PROMPTS)]
        wait, text = await _api_request(http, url, prompt, n % DISCONNECT_EVERY == DISCONNECT_EVERY - 1, tally)
        n += 1
        if text is not None and text != references[prompt]:
            tally.mismatched += 1
            tally.error(f"output for {prompt!r} differs: {text!r} vs {references[prompt]!r}")
        if wait:
            await asyncio.sleep(wait)


def _client(clients: int) -> Any:
    import httpx

    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    return httpx.AsyncClient(timeout=120, limits=limits, trust_env=False)


async def _api_references(url: str) -> dict[str, str]:
    """Each prompt's text when it is the only request: what every loaded answer must equal."""
    references = {}
    async with _client(1) as http:
        for prompt in PROMPTS:
            _, text = await _api_request(http, url, prompt, False, Tally())
            if text is None:
                raise RuntimeError(f"the reference request for {prompt!r} failed")
            references[prompt] = text
    return references


async def _api_load(
    url: str, clients: int, seconds: float, budget: Budget, tally: Tally, references: dict[str, str]
) -> None:
    async with _client(clients) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(_api_client(i, http, url, deadline, budget, tally, references) for i in range(clients)))


def _phase_result(
    flags: list[str], args: argparse.Namespace, wall: float, tally: Tally, memory: dict[str, Any], url: str
) -> dict[str, Any]:
    """One phase's result: the server, its load, what the clients counted, its memory and health."""
    import httpx

    health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
    return {
        "server": " ".join(["draftwise", *flags]),
        "clients": args.clients,
        "wall_s": wall,
        **tally.summary(),
        **memory,
        "health_after": health,
    }


def api_phase(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    flags = ["serve", "--target", "tiny:0", "--draft", "tiny:1", "--workers", "2", "--queue-size", "16"]
    with cli_server(flags, "/health", workdir / "api.log") as (url, process):
        references = asyncio.run(_api_references(url))
        sampler, tally, started = RssSampler(process.pid), Tally(), time.monotonic()
        asyncio.run(_api_load(url, args.clients, args.duration, Budget(args.max_requests), tally, references))
        wall = time.monotonic() - started
        time.sleep(2)  # let the last cancelled generations finish their step
        return _phase_result(flags, args, wall, tally, sampler.stop(args.warmup), url)


# --- verifier phase ----------------------------------------------------------------------


def _counting_target(url: str, tally: Tally) -> Any:
    """A ``RemoteTarget`` that counts the statuses it gets and the sessions it opens."""
    from draftwise.remote.client import RemoteTarget, RemoteVerifierError

    class CountingTarget(RemoteTarget):
        def __init__(self) -> None:
            self.opens = 0
            super().__init__(url)

        def _call(self, method: str, path: str, **kwargs: Any) -> Any:
            try:
                response = super()._call(method, path, **kwargs)
            except RemoteVerifierError as exc:
                with tally.lock:
                    tally.statuses[str(exc.reply_status or "no answer")] += 1
                raise
            with tally.lock:
                tally.statuses[str(response.status_code)] += 1
            return response

        def _open(self, request: Any) -> None:
            self.opens += 1
            super()._open(request)

    return CountingTarget()


def _verifier_generation(engine: Any, target: Any, prompt: str, config: Any, expected: list[int], tally: Tally) -> None:
    """One generation through the verifier, checked against the local tokens."""
    from draftwise.remote.client import RemoteVerifierError

    opens, started, first, tokens, last = target.opens, time.perf_counter(), None, [], None
    try:
        for last in engine.stream(prompt, config):
            first = first if first is not None else time.perf_counter() - started
            tokens += last.tokens
    except RemoteVerifierError as exc:  # opening the session failed: nothing was generated
        with tally.lock:
            tally.error(str(exc))
        return
    evicted = target.opens - opens > 1  # the session was reopened mid-run
    with tally.lock:
        tally.ttft.append(first)
        if last.finish_reason == "error":
            tally.error(last.extra.get("detail", "error"))
            return
        tally.generations += 1
        tally.evicted += evicted
        if tokens == expected:
            tally.evicted_identical += evicted
        else:
            tally.mismatched += 1
            tally.error(f"output for {prompt!r} differs from the local run")


def _verifier_client(
    index: int,
    url: str,
    draft: Any,
    deadline: float,
    budget: Budget,
    tally: Tally,
    references: dict[str, list[int]],
    config: Any,
) -> None:
    from draftwise.drafters import ModelDrafter
    from draftwise.engine import SpeculativeEngine

    with _counting_target(url, tally) as target:
        engine = SpeculativeEngine(target, ModelDrafter(draft.fork()), tokenizer=draft.tokenizer)
        n = 0
        while time.monotonic() < deadline and budget.take():
            prompt = PROMPTS[(index + n) % len(PROMPTS)]
            n += 1
            _verifier_generation(engine, target, prompt, config, references[prompt], tally)


def verifier_phase(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from draftwise.backends.tiny import tiny_lm
    from draftwise.config import DraftConfig, GenerationConfig
    from draftwise.engine import SpeculativeEngine

    torch.set_num_threads(1)  # many client threads: one core each would oversubscribe the CPU
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4))
    target, draft = tiny_lm(0), tiny_lm(1)
    references = {p: SpeculativeEngine.from_models(target, draft).generate(p, config).tokens for p in PROMPTS}
    slots = max(1, args.clients * 3 // 4)  # fewer session slots than clients: evictions all the time
    flags = ["serve-verifier", "--target", "tiny:0", "--max-sessions", str(slots)]
    with cli_server(flags, "/health", workdir / "verifier.log") as (url, process):
        sampler, tally, started = RssSampler(process.pid), Tally(), time.monotonic()
        deadline, budget = started + args.duration, Budget(args.max_requests)
        clients = [
            threading.Thread(target=_verifier_client, args=(i, url, draft, deadline, budget, tally, references, config))
            for i in range(args.clients)
        ]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        wall = time.monotonic() - started
        return _phase_result(flags, args, wall, tally, sampler.stop(args.warmup), url)


# --- report ------------------------------------------------------------------------------


def goals(result: dict[str, Any]) -> dict[str, bool]:
    """The issue's goals, each true or false."""
    out = {}
    if "api" in result:
        api = result["api"]
        out.update(
            api_no_5xx=api["status_5xx"] == 0,
            api_no_incomplete_200_streams=api["incomplete_200_streams"] == 0,
            api_outputs_identical=api["mismatched_outputs"] == 0,
            api_no_errors=api["errors"] == 0,
            api_rss_growth_under_5pct=api["rss_growth_after_warmup"] < 0.05,
        )
    if "verifier" in result:
        ver = result["verifier"]
        evicted = ver["evicted_generations"]
        out.update(
            verifier_no_5xx=ver["status_5xx"] == 0,
            verifier_no_errors=ver["errors"] == 0,
            verifier_outputs_identical=ver["mismatched_outputs"] == 0,
            verifier_evicted_clients_recover_identically=(
                evicted > 0 and ver["evicted_generations_identical"] == evicted
            ),
            verifier_rss_growth_under_5pct=ver["rss_growth_after_warmup"] < 0.05,
        )
    return out


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    import torch

    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load per phase")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients per phase")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before the 'start' RSS is taken; default: a tenth of --duration, at most 60",
    )
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="generations per phase at most")
    parser.add_argument("--phases", default="api,verifier", help="api, verifier, or both (comma-separated)")
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = min(60.0, args.duration / 10)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    with tempfile.TemporaryDirectory(prefix="draftwise-soak-") as workdir:
        for phase in args.phases.split(","):
            print(f"{phase}: {args.clients} clients for {args.duration:g} s ...", file=sys.stderr, flush=True)
            run = {"api": api_phase, "verifier": verifier_phase}[phase.strip()]
            result[phase.strip()] = run(args, Path(workdir))
    result["goals"] = goals(result)
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    summary = {k: v for k, v in result.items() if k not in ("api", "verifier")}
    for phase in ("api", "verifier"):
        if phase in result:
            summary[phase] = {k: v for k, v in result[phase].items() if k != "rss_samples_mb"}
    print(json.dumps(summary, indent=2))
    sys.exit(0 if all(result["goals"].values()) else 1)


if __name__ == "__main__":
    main()
