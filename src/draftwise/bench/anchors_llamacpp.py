"""Anchors on the ``llamacpp`` backend: llama.cpp's own decoding loops on the same GGUF files,
timed like draftwise's methods (see ``draftwise.bench.methods``).

* ``llamacpp-plain``: llama-cpp-python's ``Llama.generate``, one token per target pass.
* ``llamacpp-pld``: the same loop with its ``LlamaPromptLookupDecoding`` draft model.
* ``llamacpp-spec``: llama.cpp's ``llama-speculative-simple`` binary with the draft model.

Each anchor is built once and reused for every prompt; the Python ones load their model once.
The binary is a process per prompt (it has no other interface), so it loads both models for
every prompt: its times are the ones it reports itself, which leave loading out.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from draftwise.backends.llamacpp import BATCH, LlamaCppModel
from draftwise.bench.anchor_settings import pld_tokens, spec_draft_max
from draftwise.bench.config import BenchConfig, BenchError
from draftwise.bench.trace import Method, Trace
from draftwise.config import GenerationConfig, SamplingConfig
from draftwise.lm import Tokenizer

SPEC_BINARY = "llama-speculative-simple"
_SEED_RANGE = 2**32  # llama.cpp's samplers take a 32-bit seed
_DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp draws a random seed
# What llama-speculative-simple logs on stderr once it is done (its own timers).
_TIMING = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([0-9.]+) seconds")
# It prints two blank lines before the prompt echo, and two after the generated text twice.
_ECHO_HEAD = b"\n\n"
_ECHO_TAIL = b"\n\n\n\n"


def _eos_ids(config: GenerationConfig, target: LlamaCppModel) -> set[int]:
    return set(config.eos_token_ids if config.eos_token_ids is not None else target.eos_token_ids)


def _seed(sampling: SamplingConfig) -> int:
    return _DEFAULT_SEED if sampling.seed is None else sampling.seed % _SEED_RANGE


class _PassCounter:
    """Counts ``Llama.eval`` calls (target passes) of one ``Llama`` instance.

    ``generate`` yields tokens one at a time; the count tells which tokens one pass produced,
    so a prompt-lookup step shows up as one delivery of several tokens, as draftwise's do.
    Only this instance's bound method is wrapped (no class is patched).
    """

    def __init__(self, llm: Any) -> None:
        self.count = 0
        inner = llm.eval

        def counted_eval(tokens: Sequence[int]) -> None:
            self.count += 1
            inner(tokens)

        llm.eval = counted_eval


class LlamaCppPythonMethod:
    """llama-cpp-python's own ``Llama.generate`` loop on the target's GGUF file."""

    def __init__(self, name: str, target: LlamaCppModel, generation: GenerationConfig) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft_model = None
        if name == "llamacpp-pld":
            # llama-cpp-python then computes logits at every position (logits_all): its own
            # price for prompt lookup, which its users pay too, so it stays in the measurement.
            draft_model = LlamaPromptLookupDecoding(
                num_pred_tokens=pld_tokens(generation), max_ngram_size=generation.draft.ngram_max
            )
        self.name = name
        self.target = target
        # logits_all is forced on with a draft model, but Llama sizes its score buffer from the
        # argument (n_batch rows without it), so a prompt past n_batch tokens would overflow it.
        self.llm = Llama(
            model_path=str(target.weights.path),
            n_ctx=target.n_ctx,
            n_batch=BATCH,
            n_threads=target.threads,
            n_threads_batch=target.threads,
            n_gpu_layers=target.weights.gpu_layers,
            draft_model=draft_model,
            logits_all=draft_model is not None,
            verbose=False,
        )
        self.passes = _PassCounter(self.llm)

    def _options(self, sampling: SamplingConfig) -> dict[str, Any]:
        if sampling.greedy:
            return {"temp": 0.0}
        # min_p and typical_p default to active values in Llama.generate: off, as in draftwise.
        return {
            "temp": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
        }

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        # Without a reset, generate would reuse the KV cache of a previous call's common
        # prefix and skip part of the prefill, which draftwise's methods never do.
        self.llm.reset()
        self.llm.set_seed(_seed(config.sampling))
        eos = _eos_ids(config, self.target)
        tokens: list[int] = []
        arrivals: list[float] = []
        step_tokens: list[int] = []
        passes_seen = self.passes.count
        started = time.perf_counter()
        generator = self.llm.generate(list(prompt_ids), reset=True, **self._options(config.sampling))
        try:
            for token in generator:
                if self.passes.count != passes_seen:  # the first token of a new target pass
                    passes_seen = self.passes.count
                    arrivals.append(time.perf_counter() - started)
                    step_tokens.append(0)
                step_tokens[-1] += 1
                tokens.append(int(token))
                if token in eos or len(tokens) >= config.max_new_tokens:
                    break
        finally:
            generator.close()
        wall = time.perf_counter() - started
        reason = "eos" if tokens and tokens[-1] in eos else "length"
        return Trace(tokens=tokens, arrivals=arrivals, step_tokens=step_tokens, wall_seconds=wall, finish_reason=reason)


class LlamaCppSpecMethod:
    """llama.cpp's ``llama-speculative-simple``, one process per prompt.

    The binary prints text, not token ids, and reports no per-token times, so its ``Trace``
    differs from the others in three ways:

    * tokens: the generated text re-tokenized with the target's tokenizer (plus the target's
      EOS token when it stopped at an end-of-generation token, which it does not print). The
      losslessness audit of this method therefore compares re-tokenized text: a string the
      model produced with a non-canonical tokenization shows up as a mismatch.
    * wall_seconds: the binary's own encode + decode times (model loading excluded); when its
      last step overshoots ``max_new_tokens`` (see ``spec_trace``), the decode time is
      prorated to the tokens kept.
    * arrivals: one delivery of every token at ``wall_seconds``, marked ``timed_deliveries=False``:
      time to first token, per-token latency and tokens per pass are unknown, not zero.
    """

    name = "llamacpp-spec"

    def __init__(self, config: BenchConfig, target: LlamaCppModel, draft: LlamaCppModel) -> None:
        if config.llama_cpp_bin is None:
            raise BenchError("method llamacpp-spec needs --llama-cpp-bin DIR (`make llama-cpp-bin` builds it)")
        self.binary = Path(config.llama_cpp_bin) / SPEC_BINARY
        if not self.binary.is_file():
            raise BenchError(
                f"method llamacpp-spec: no {SPEC_BINARY} in {config.llama_cpp_bin} (`make llama-cpp-bin` builds it)"
            )
        self.target = target
        self.draft = draft

    def _command(self, prompt_file: Path, n_prompt: int, config: GenerationConfig) -> list[str]:
        d, s = config.draft, config.sampling
        batch = str(max(BATCH, n_prompt))  # the binary decodes the whole prompt in one batch
        threads = str(self.target.threads)
        command = [
            str(self.binary),
            "-m",
            str(self.target.weights.path),
            "-md",
            str(self.draft.weights.path),
            # --no-escape: by default the binary turns the two characters backslash-t of a prompt
            # into a tab (backslash-n, backslash-backslash, ... likewise), so a prompt quoting
            # LaTeX or code would reach the model as other tokens.
            "-f",
            str(prompt_file),
            "--no-escape",
            "-c",
            str(self.target.n_ctx),
            "-b",
            batch,
            "-ub",
            batch,
            "-t",
            threads,
            "-tb",
            threads,
            "--spec-type",
            "draft-simple",
            "--spec-draft-n-max",
            str(spec_draft_max(config)),
            "--spec-draft-n-min",
            "0",
            "--spec-draft-p-min",
            str(d.confidence_threshold),
            # It stops once it has sampled more than -n tokens: n - 1 yields at least n.
            "-n",
            str(config.max_new_tokens - 1),
        ]
        if self.target.weights.gpu_layers:
            command += ["-ngl", "all", "-ngld", "all"]  # every layer on the GPU, as draftwise's models
        if s.greedy:
            return [*command, "--temp", "0"]
        return [
            *command,
            "--temp",
            str(s.temperature),
            "--top-k",
            str(s.top_k),
            "--top-p",
            str(s.top_p),
            "--min-p",
            "0",
            "--seed",
            str(_seed(s)),
        ]

    def _prompt_text(self, prompt_ids: Sequence[int]) -> str:
        """The prompt as text the binary tokenizes back into ``prompt_ids`` (it adds BOS itself)."""
        tokenizer = self.target.tokenizer
        added = tokenizer.encode("", add_special_tokens=True)  # what its tokenizer adds: BOS or nothing
        ids = list(prompt_ids)
        body = ids[len(added) :] if added and ids[: len(added)] == added else ids
        text = tokenizer.decode(body, skip_special_tokens=False)
        if tokenizer.encode(text, add_special_tokens=True) != ids:
            raise BenchError(
                "method llamacpp-spec: the prompt does not survive a round trip through text, "
                "so the binary would see other tokens"
            )
        return text

    def run(self, prompt_ids: Sequence[int], config: GenerationConfig) -> Trace:
        if config.eos_token_ids is not None:
            raise BenchError(
                "method llamacpp-spec stops on the model's own end-of-generation tokens: leave eos_token_ids unset"
            )
        text = self._prompt_text(prompt_ids)
        with tempfile.TemporaryDirectory(prefix="draftwise-spec-") as folder:
            prompt_file = Path(folder) / "prompt.txt"
            # -f drops one trailing newline from the file (chat prompts end with one): add it back.
            prompt_file.write_text(text + "\n", encoding="utf-8")
            done = _run_binary(self._command(prompt_file, len(prompt_ids), config))
        echo = _ECHO_HEAD + self.target.tokenizer.decode(list(prompt_ids), skip_special_tokens=False).encode()
        generated = parse_generated(done.stdout, echo)
        timings = parse_timings(done.stderr.decode("utf-8", "replace"))
        return spec_trace(generated, timings, self.target.tokenizer, config.max_new_tokens)


def _run_binary(command: list[str]) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, check=False)
    except OSError as exc:
        raise BenchError(f"method llamacpp-spec: cannot run {command[0]}: {exc.strerror}") from None
    if done.returncode != 0:
        lines = [x for x in done.stderr.decode("utf-8", "replace").splitlines() if x.strip()]
        reason = lines[-1].strip() if lines else "no message"
        raise BenchError(f"method llamacpp-spec: {SPEC_BINARY} exited with status {done.returncode}: {reason}")
    return done


def parse_generated(stdout: bytes, echo: bytes) -> str:
    """The generated text in the binary's stdout: what follows the prompt echo ``echo``."""
    if not stdout.startswith(echo):
        raise BenchError(f"method llamacpp-spec: {SPEC_BINARY}'s output does not start with the prompt")
    body = stdout[len(echo) :]
    return (body[: -len(_ECHO_TAIL)] if body.endswith(_ECHO_TAIL) else body).decode("utf-8", "replace")


def spec_trace(
    generated: str, timings: dict[str, tuple[int, float]], tokenizer: Tokenizer, max_new_tokens: int
) -> Trace:
    """The ``Trace`` of one binary run (see ``LlamaCppSpecMethod``) from its text and timings."""
    decoded = timings["decoded"][0]  # every token it sampled, an end-of-generation one included
    printed = tokenizer.encode(generated, add_special_tokens=False)
    tokens = printed[:max_new_tokens]
    # It prints every token before an end-of-generation one, which it counts but does not print.
    eos_id = tokenizer.eos_token_id
    eos = len(printed) < decoded and len(printed) < max_new_tokens and eos_id is not None
    if eos and eos_id is not None:
        tokens.append(eos_id)
    # Its last step drafts without limit (llama.cpp reads a remaining budget of 0 as none), so
    # it may sample up to its draft length more than asked: the trace keeps the tokens asked
    # for and their share of the decode time, rather than charging the anchor for the rest.
    share = 1.0 if eos or not decoded else min(1.0, len(tokens) / decoded)
    wall = timings["encoded"][1] + share * timings["decoded"][1]
    return Trace(
        tokens=tokens,
        arrivals=[wall],
        step_tokens=[len(tokens)],
        wall_seconds=wall,
        finish_reason="eos" if eos else "length",
        timed_deliveries=False,
    )


def parse_timings(stderr: str) -> dict[str, tuple[int, float]]:
    """``{"encoded": (tokens, seconds), "decoded": (tokens, seconds)}`` from the binary's log."""
    found = {kind: (int(n), float(seconds)) for kind, n, seconds in _TIMING.findall(stderr)}
    if set(found) != {"encoded", "decoded"}:
        raise BenchError(f"method llamacpp-spec: {SPEC_BINARY} did not report its encode and decode times")
    return found


def build_llamacpp_anchor(name: str, config: BenchConfig, target: LlamaCppModel, draft: LlamaCppModel | None) -> Method:
    """The anchor ``name`` over the already loaded target (and draft, for ``llamacpp-spec``)."""
    if name == "llamacpp-spec":
        if draft is None:
            raise BenchError("method llamacpp-spec needs a draft model (--draft)")
        return LlamaCppSpecMethod(config, target, draft)
    if name in ("llamacpp-plain", "llamacpp-pld"):
        try:
            return LlamaCppPythonMethod(name, target, config.generation)
        except ValueError as exc:  # Llama raises ValueError when it cannot load the file
            raise BenchError(f"method {name}: llama-cpp-python cannot load {target.weights.path.name}: {exc}") from None
    raise BenchError(f"unknown llama.cpp anchor {name}")
