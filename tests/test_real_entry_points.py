"""Every server entry point, end to end, on a real model loaded exactly as a user loads it:
the real ``draftwise`` command in a child process, SmolLM2-135M from its GGUF file, the
official ``openai`` client over loopback.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cli_support import cli_server, run_cli, stop
from real_support import PROMPT, SMOL, needs_llama_cpp, needs_smol, require_module
from server_support import metric

pytestmark = [pytest.mark.slow, pytest.mark.one_core, needs_smol]
openai = require_module("openai")

# One thread in every command (the one_core mark): these tests run beside the tests on tiny models.
ONE = ["--threads", "1"]
# Drafting priced on a recorded host profile, held fixed, where a test counts the tokens a source
# kept: priced on times measured beside other tests, one slow pass can make blocks look dear.
FIXED_COSTS = ["--costs", str(Path(__file__).parent / "data" / "hosts" / "intel-xeon.json")]
GREEDY = ["--max-new-tokens", "24", "--temperature", "0", "--ignore-eos", *ONE]
# Each test runs on both backends. On hf, float32 weights are packed for oneDNN (what `--dtype
# auto` picks on most CPUs; the layout the servers once crashed on), pinned so the test covers
# it whatever this CPU would pick.
BACKENDS = {"hf": ["--backend", "hf", "--dtype", "float32"], "llamacpp": ["--backend", "llamacpp"]}
backends = pytest.mark.parametrize(
    "backend",
    [pytest.param(BACKENDS["hf"], id="hf"), pytest.param(BACKENDS["llamacpp"], id="llamacpp", marks=needs_llama_cpp)],
)


@backends
def test_serve_answers_the_openai_client_and_stops_cleanly(tmp_path, backend):
    args = ["serve", "--target", SMOL, "--drafter", "ngram", *ONE, *backend]
    with cli_server(args, "/health", tmp_path / "serve.log") as (url, process):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0
        )
        assert chat.choices[0].message.content.strip()
        assert chat.usage.completion_tokens > 0

        pieces = []
        reasons = []
        for chunk in client.completions.create(model=SMOL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True):
            for choice in chunk.choices:
                pieces.append(choice.text)
                reasons.append(choice.finish_reason)
        assert "".join(pieces).strip()
        assert reasons[-1] in ("length", "stop")

        # Ctrl-C: uvicorn shuts down, the worker pool closes, the process exits 0.
        assert stop(process, signal.SIGINT) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


@backends
def test_remote_verifier_gives_the_local_greedy_text(tmp_path, backend):
    local = run_cli(
        "generate", PROMPT, "--target", SMOL, "--draft", SMOL, "--draft-quant", "none", "--json", *backend, *GREEDY
    )
    assert local.returncode == 0, local.stderr
    args = ["serve-verifier", "--target", SMOL, *ONE, *backend]
    with cli_server(args, "/health", tmp_path / "verifier.log") as (url, _process):
        remote = run_cli(
            "generate",
            PROMPT,
            "--target",
            SMOL,
            "--draft",
            SMOL,
            "--draft-quant",
            "none",
            "--verifier",
            url,
            "--json",
            *backend,
            *GREEDY,
        )
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["tokens"] == json.loads(local.stdout)["tokens"]
    assert json.loads(remote.stdout)["text"] == json.loads(local.stdout)["text"]


@needs_llama_cpp
def test_a_prediction_drafts_locally_and_through_a_verifier(tmp_path):
    """generate --prediction on the real model: the plain text as the prediction is drafted and
    kept whole, and the output is still plain decoding's (--exact: bit for bit), here and with
    the target behind a verifier. The block length is fixed: how long a block the cost policy
    dares depends on this machine's timings, which a busy test machine makes noisy (one stall of
    the first block shut the prediction out for the rest of a run); tests/test_prediction.py
    covers that policy's long blocks in closed form."""
    greedy = ["--backend", "llamacpp", "--exact", "--drafter", "ngram", "--json", *GREEDY[2:], "--max-new-tokens", "64"]
    plain = run_cli("generate", PROMPT, "--target", SMOL, *greedy, "--k-policy", "fixed", "--k", "0")
    assert plain.returncode == 0, plain.stderr
    expected = json.loads(plain.stdout)
    prediction = tmp_path / "prediction.txt"
    prediction.write_text(expected["text"])
    greedy += ["--k-policy", "fixed", "--k", "8"]
    local = run_cli("generate", PROMPT, "--target", SMOL, *greedy, "--prediction", str(prediction), "--compare")
    assert local.returncode == 0, local.stderr
    result = json.loads(local.stdout)
    assert result["tokens"] == expected["tokens"] and result["compare"]["identical"]
    # Blocks of 8 from the plain text, every token kept: 7 steps of 9 tokens (56 kept), then the
    # last one; less only where the text splits into other tokens than the output did.
    assert result["metrics"]["kept_by_source"]["prediction"] >= 48
    args = ["serve-verifier", "--target", SMOL, *ONE, "--backend", "llamacpp", "--exact"]
    with cli_server(args, "/health", tmp_path / "verifier.log") as (url, _process):
        remote = run_cli(
            "generate", PROMPT, "--target", SMOL, *greedy, "--prediction", str(prediction), "--verifier", url
        )
    assert remote.returncode == 0, remote.stderr
    assert json.loads(remote.stdout)["tokens"] == expected["tokens"]
    missing = run_cli("generate", PROMPT, "--target", SMOL, *ONE, "--prediction", str(tmp_path / "nowhere.txt"))
    assert missing.returncode == 2 and "cannot read prediction file" in missing.stderr
    assert "Traceback" not in missing.stderr


@needs_llama_cpp
def test_a_json_schema_constrains_the_real_model_and_its_keys_are_drafted(tmp_path):
    """generate --json-schema on the real model's own vocabulary: a record that follows the
    schema, identical (--exact) to token-by-token constrained decoding, with the keys and
    separators drafted from the grammar; a bad schema is one line, exit status 2."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number"},
            "capital": {"type": "boolean"},
        },
        "required": ["city", "country", "population_millions", "capital"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    prompt = "Describe Paris as a JSON record."
    greedy = ["--backend", "llamacpp", "--exact", "--drafter", "ngram", "--json", "--chat", "--temperature", "0"]
    greedy += [*ONE, *FIXED_COSTS]
    result = run_cli(
        "generate", prompt, "--target", SMOL, *greedy, "--max-new-tokens", "96", "--json-schema", str(path), "--compare"
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["compare"]["identical"]
    assert answer["metrics"]["finish_reason"] in ("eos", "stop")
    record = json.loads(answer["text"])
    assert set(record) == set(schema["properties"]) and isinstance(record["capital"], bool)
    assert answer["metrics"]["kept_by_source"]["grammar"] >= 8  # the four keys, their quotes and colons
    path.write_text('{"type": "objet"}')
    bad = run_cli("generate", prompt, "--target", SMOL, *ONE, "--json-schema", str(path))
    assert bad.returncode == 2 and "invalid JSON schema" in bad.stderr and "Traceback" not in bad.stderr


def test_serve_drafts_from_its_earlier_answers_and_keeps_them_across_a_restart(tmp_path):
    import time

    cache = tmp_path / "suffix.json"
    args = ["serve", "--target", SMOL, "--drafter", "ngram", "--suffix-cache", str(cache), *ONE, *FIXED_COSTS]
    args += BACKENDS["hf"]
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    kept = ("draftwise_draft_tokens_by_source_total", {"source": "suffix", "kept": "yes"})

    def ask(url: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=32, temperature=0)
        return reply.choices[0].message.content

    with cli_server(args, "/health", tmp_path / "serve.log") as (url, process):
        first = ask(url)
        deadline = time.monotonic() + 60  # the answer is kept off the rounds, just after it ends
        while metric(url, "draftwise_suffix_outputs") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ask(url) == first and metric(url, kept[0], **kept[1]) > 0
        assert stop(process, signal.SIGINT) == 0
    assert cache.is_file()
    with cli_server(args, "/health", tmp_path / "again.log") as (url, process):
        assert metric(url, "draftwise_suffix_outputs") == 2
        assert ask(url) == first and metric(url, kept[0], **kept[1]) > 0
        assert stop(process, signal.SIGINT) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text() + (tmp_path / "again.log").read_text()
