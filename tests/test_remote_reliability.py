"""The remote verifier's reliability (issue 24): a run's session ends with the run, the client
rides out a verifier that goes away, n-gram drafting works through a verifier, and open-session
bodies are bounded before they are parsed. Tiny models on real uvicorn servers on loopback; no
assertion depends on how long anything takes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import httpx
import pytest
from starlette.responses import PlainTextResponse

from draftwise.backends.tiny import tiny_lm, tiny_tokenizer
from draftwise.config import DraftConfig, GenerationConfig, SamplingConfig
from draftwise.drafters import ModelDrafter, NGramDrafter
from draftwise.engine import SpeculativeEngine
from draftwise.remote.client import connect
from draftwise.remote.server import create_app
from draftwise.remote.settings import ClientSettings, VerifierSettings
from draftwise.target import LocalTarget

from cli_support import cli_server, free_port, run_cli
from real_support import PROMPT as REAL_PROMPT, SMOL, needs_smol
from server_support import serve_in_background

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
DRAFTWISE = [sys.executable, "-c", "from draftwise.cli import main; main()"]  # the real entry point
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
GREEDY = GenerationConfig(max_new_tokens=40, ignore_eos=True, draft=DraftConfig(k_policy="fixed", k=4))
# A restart on a slow, busy machine is waited for as long as it takes; nothing here is timed.
PATIENT = ClientSettings(reconnect_s=600)


def _app(lm, **overrides):
    return create_app(VerifierSettings(target=lm.name, **overrides), lm=lm.fork())


def _sessions(base: str) -> int:
    return httpx.get(f"{base}/health").json()["sessions"]


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.tokens]


@pytest.fixture(scope="module")
def local(tiny_target, tiny_near_draft):
    """The greedy run every remote one must reproduce, token for token."""
    return SpeculativeEngine.from_models(tiny_target, tiny_near_draft).generate(PROMPT, GREEDY).tokens


# --- 1. a session ends with its run ---------------------------------------------------------


class _Watching:
    """A drafter that looks at the verifier's open sessions at its first proposal (the run is
    under way), and stops the run there the way Ctrl-C does when ``interrupt``."""

    def __init__(self, drafter, base: str, interrupt: bool = False) -> None:
        self.drafter, self.base, self.interrupt = drafter, base, interrupt
        self.calls, self.seen = 0, None

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, context, k, source=None):
        self.calls += 1
        if self.calls == 1:
            self.seen = _sessions(self.base)
            if self.interrupt:
                raise KeyboardInterrupt
        return self.drafter.propose(context, k, source)


@pytest.mark.parametrize("ending", ["finished", "refused", "abandoned", "interrupted"])
def test_a_run_closes_its_session_however_it_ends(tiny_target, tiny_near_draft, ending):
    sampled = GREEDY.model_copy(update={"sampling": SamplingConfig(temperature=1.0, seed=1)})
    with serve_in_background(_app(tiny_target, max_q_entries=1)) as base, connect(base, settings=PATIENT) as target:
        drafter = _Watching(ModelDrafter(tiny_near_draft), base, interrupt=ending == "interrupted")
        # "refused": a full draft distribution is over max_q_entries: the first verify fails.
        stream = SpeculativeEngine(target, drafter, tokenizer=tiny_target.tokenizer).stream(
            PROMPT, sampled if ending == "refused" else GREEDY
        )
        if ending == "interrupted":
            with pytest.raises(KeyboardInterrupt):
                list(stream)
        elif ending == "abandoned":  # the consumer stops reading (a client that went away)
            next(stream), next(stream)
            stream.close()
        else:
            events = list(stream)
            assert events[-1].finish_reason == ("error" if ending == "refused" else "length")
        assert drafter.seen == 1  # the run held a session
        assert _sessions(base) == 0


def _generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DRAFTWISE, "generate", *flags], capture_output=True, text=True, timeout=300, env=ENV)


def test_generate_cli_leaves_no_session_behind(tiny_target):
    with serve_in_background(_app(tiny_target, max_q_entries=1)) as base:
        flags = ["--draft", "tiny:1", "--verifier", base, "--max-new-tokens", "12", "--json", "Hi"]
        finished = _generate(*flags)
        assert finished.returncode == 0, finished.stderr
        assert _sessions(base) == 0
        refused = _generate(*flags, "--temperature", "1", "--seed", "1", "--k-policy", "fixed", "--k", "4")
        assert refused.returncode == 1 and "over the verifier's limit" in refused.stderr
        assert _sessions(base) == 0


def test_ctrl_c_in_generate_closes_its_session(tiny_target):
    with serve_in_background(_app(tiny_target)) as base:
        flags = ["--draft", "tiny:1", "--verifier", base, "--max-new-tokens", "3000", "--ignore-eos", "Hello"]
        process = subprocess.Popen(
            [*DRAFTWISE, "generate", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
            # As a terminal starts it: a child inherits an ignored SIGINT (a Ray test of this
            # process may have left it so), and Python then never raises KeyboardInterrupt.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            assert process.stdout.read(1)  # the run is under way: its first text is out
            assert _sessions(base) == 1
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        # Interrupted (3000 tokens take far longer than a signal), and said so without a traceback.
        assert process.returncode != 0 and b"Traceback" not in stderr, stderr
        assert _sessions(base) == 0


# --- 2. the client rides out a verifier that goes away --------------------------------------


class _Restartable:
    """A verifier on a port of its own, which can be stopped and started again (a restart)."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._running = ExitStack()

    def start(self, lm=None) -> None:
        self._running.enter_context(serve_in_background(_app(lm or self.lm), port=self.port))

    def stop(self) -> None:
        self._running.close()


def _restart_once_missed(verifier: _Restartable, target, done: threading.Event, lm=None) -> threading.Thread:
    """Start ``verifier`` again, in a thread, once ``target`` has failed to reach it: the run
    meanwhile retries in the test's own thread."""

    def restart() -> None:
        while target.retries == 0 and not done.is_set():
            time.sleep(0.01)
        if not done.is_set():
            verifier.start(lm)

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread


def _run_across_a_restart(tiny_target, tiny_near_draft, settings: ClientSettings, restart_with=None):
    """A greedy run whose verifier stops after two steps, and (unless ``restart_with`` is False)
    comes back on the same port once the client has missed it, serving ``restart_with`` (by
    default the same model). Returns (events, target, sessions left on the verifier at the end)."""
    verifier, done = _Restartable(tiny_target), threading.Event()
    verifier.start()
    try:
        with connect(verifier.url, tokenizer=tiny_near_draft.tokenizer, settings=settings) as target:
            engine = SpeculativeEngine(target, ModelDrafter(tiny_near_draft), tokenizer=tiny_target.tokenizer)
            stream = engine.stream(PROMPT, GREEDY)
            events = [next(stream), next(stream)]
            verifier.stop()  # the verifier goes away mid-generation
            if restart_with is not False:
                restarted = _restart_once_missed(verifier, target, done, restart_with)
            events += list(stream)
            done.set()  # a client that never retried would otherwise keep the restart waiting
            if restart_with is not False:
                restarted.join()
        left = _sessions(verifier.url) if restart_with is not False else None
        return events, target, left
    finally:
        done.set()
        verifier.stop()


def test_a_restarted_verifier_is_reconnected_and_the_output_is_unchanged(tiny_target, tiny_near_draft, local):
    events, target, left = _run_across_a_restart(tiny_target, tiny_near_draft, PATIENT)
    assert _tokens(events) == local
    assert target.retries >= 1 and target.reconnects >= 1
    assert target.reopens == 1  # the restarted verifier held no session: one was opened with the context
    assert sum(e.extra.get("reopened", 0) for e in events) == 1
    assert left == 0


def test_a_verifier_that_stays_away_ends_the_run_after_reconnect_s(tiny_target, tiny_near_draft, local):
    events, target, _ = _run_across_a_restart(
        tiny_target, tiny_near_draft, ClientSettings(reconnect_s=0.5), restart_with=False
    )
    assert events[-1].finish_reason == "error"
    detail = events[-1].extra["detail"]
    assert "cannot reach the verifier" in detail and "gave up after retrying for 0.5 s" in detail
    assert target.retries >= 1 and target.reconnects == 0
    tokens = _tokens(events)
    assert 0 < len(tokens) < len(local) and tokens == local[: len(tokens)]


def test_a_verifier_that_comes_back_with_another_model_ends_the_run(tiny_target, tiny_near_draft, local):
    events, target, _ = _run_across_a_restart(tiny_target, tiny_near_draft, PATIENT, restart_with=tiny_lm(1))
    assert events[-1].finish_reason == "error"
    assert "came back serving 'tiny:1'" in events[-1].extra["detail"]
    tokens = _tokens(events)
    assert 0 < len(tokens) < len(local) and tokens == local[: len(tokens)]


class _Unavailable:
    """ASGI middleware that answers ``status`` to the first ``count`` verifies, in plain text,
    as a proxy does while the verifier behind it restarts."""

    def __init__(self, app, status: int, count: int) -> None:
        self.app, self.status, self.left = app, status, count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/verify") and self.left > 0:
            self.left -= 1
            await PlainTextResponse("no healthy upstream", status_code=self.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)


@pytest.mark.parametrize("status", [502, 503])
def test_a_proxy_that_says_the_verifier_is_unavailable_is_retried(tiny_target, tiny_near_draft, local, status):
    with (
        serve_in_background(_Unavailable(_app(tiny_target), status, count=3)) as base,
        connect(base, tokenizer=tiny_near_draft.tokenizer, settings=PATIENT) as target,
    ):
        engine = SpeculativeEngine(target, ModelDrafter(tiny_near_draft), tokenizer=tiny_target.tokenizer)
        result = engine.generate(PROMPT, GREEDY)
    assert result.tokens == local
    assert target.retries == 3 and target.reconnects == 3
    assert target.reopens == 0  # the session was there all along


def test_reconnect_flag_is_derived_from_the_settings_and_checked():
    from typer.testing import CliRunner

    from draftwise.cli import build_app

    app = build_app()
    helped = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    assert "--reconnect-s" in helped.output
    alone = CliRunner().invoke(app, ["generate", "hi", "--reconnect-s", "5"])
    assert alone.exit_code == 2 and "--reconnect-s only applies with --verifier" in alone.output
    negative = CliRunner().invoke(app, ["generate", "hi", "--verifier", "http://127.0.0.1:9", "--reconnect-s", "-1"])
    assert negative.exit_code == 2 and "--reconnect-s: Input should be greater than or equal to 0" in negative.output


# --- 3. n-gram drafting through a verifier --------------------------------------------------


def test_generate_drafts_by_ngram_through_a_verifier(tiny_target):
    config = GREEDY.model_copy(update={"max_new_tokens": 24})
    expected = SpeculativeEngine(LocalTarget(tiny_target), NGramDrafter(), tokenizer=tiny_target.tokenizer).generate(
        PROMPT, config
    )
    with serve_in_background(_app(tiny_target)) as base:
        # No --target: the tokenizer is loaded from the model name the verifier reports (tiny:0).
        flags = ["--drafter", "ngram", "--verifier", base, "--max-new-tokens", "24", "--ignore-eos"]
        result = _generate(*flags, "--k-policy", "fixed", "--k", "4", "--json", PROMPT)
        assert result.returncode == 0, result.stderr
        assert _sessions(base) == 0
    out = json.loads(result.stdout)
    assert out["tokens"] == expected.tokens and out["drafter"] == "ngram" and out["target"] == "tiny:0"
    assert out["metrics"]["proposed"] > 0  # the n-gram drafter did draft


def test_ngram_through_a_verifier_refuses_another_tokenizer_in_one_line(tiny_target, tmp_path):
    odd = tiny_tokenizer()  # only a tokenizer in the folder: nothing else is loaded
    odd.hf.add_tokens(["<odd>"])
    odd.hf.save_pretrained(tmp_path)
    with serve_in_background(_app(tiny_target)) as base:
        result = _generate("--drafter", "ngram", "--verifier", base, "--target", str(tmp_path), "hi")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "whose tokenizer differs from" in lines[0], result.stderr


# --- 4. open-session bodies, bounded before they are parsed ---------------------------------


def test_open_session_bodies_are_bounded_by_max_context_before_parsing(tiny_target):
    with serve_in_background(_app(tiny_target, max_context=64)) as base, httpx.Client(base_url=base) as http:
        sampling = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "seed": 1}  # every field: the most commas
        fits = http.post("/v1/sessions", json={"prompt": [1] * 63, "sampling": sampling})
        assert fits.status_code == 201, fits.text
        # Most of max_body_bytes, a million numbers: refused unparsed, as one that fits in the
        # limit would be after parsing.
        huge = http.post("/v1/sessions", json={"prompt": [1] * 1_300_000})
        assert huge.status_code == 422 and "max_context of 64" in huge.json()["detail"]
        assert http.post("/v1/sessions", json={"prompt": [1] * 64}).status_code == 422
        assert http.post("/v1/sessions", content=b"\xff\xfe").status_code == 400  # not UTF-8
        schema = http.get("/openapi.json").json()
        body = schema["paths"]["/v1/sessions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/OpenSession"}
        assert "prompt" in schema["components"]["schemas"]["OpenSession"]["properties"]
        assert "SamplingConfig" in schema["components"]["schemas"]


# --- on a real model --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.one_core
@needs_smol
def test_ngram_through_a_real_verifier_gives_the_local_text_and_leaves_no_session(tmp_path):
    greedy = ["--max-new-tokens", "24", "--temperature", "0", "--ignore-eos", "--drafter", "ngram", "--json"]
    greedy += ["--threads", "1"]
    local = run_cli("generate", REAL_PROMPT, "--target", SMOL, *greedy)
    assert local.returncode == 0, local.stderr
    args = ["serve-verifier", "--target", SMOL, "--threads", "1"]
    with cli_server(args, "/health", tmp_path / "verifier.log") as (url, _process):
        # No --target: only the tokenizer of the model the verifier names loads here.
        remote = run_cli("generate", REAL_PROMPT, "--verifier", url, *greedy)
        left = _sessions(url)
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["tokens"] == json.loads(local.stdout)["tokens"]
    assert json.loads(remote.stdout)["metrics"]["proposed"] > 0
    assert left == 0
