"""``draftwise generate``: run speculation on a prompt and show what it did.

The text streams as it is produced (``SpeculativeEngine.stream``), each token coloured by
where it came from; a table of metrics follows (both drawn by ``draftwise.cli.display``).
``--compare`` also runs the plain target on the same prompt; ``--json`` prints one
machine-readable object instead.

Generation flags (sampling, drafting, stops, length), the verifier client's and the model
flags derive from their config classes (``draftwise.cli.options.with_flags``); the prompt, the
models and the output switches are the command's own.
"""

from __future__ import annotations

import inspect
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import typer

from draftwise.cli.display import LEGEND, TokenColours, report
from draftwise.cli.options import GENERATION_FLAGS, Flags, aliases_of, with_flags, with_model_options
from draftwise.config import DRAFTER_KINDS, NEEDS_DRAFT_MODEL, DrafterKind, GrammarSpec, ModelOptions
from draftwise.errors import ConfigError, ModelLoadError, TargetError
from draftwise.remote.settings import ClientSettings

if TYPE_CHECKING:
    from rich.console import Console

    from draftwise.config import GenerationConfig
    from draftwise.engine import GenerationResult, SpeculativeEngine
    from draftwise.lm import LanguageModel, Tokenizer
    from draftwise.profile import CostProfile
    from draftwise.remote.client import RemoteTarget

# --reconnect-s (ClientSettings): how a run rides out a verifier that goes away.
FLAGS = (*GENERATION_FLAGS, Flags(ClientSettings))
ALIASES = aliases_of(*FLAGS)


def _read_file(file: Path, what: str) -> str:
    try:
        return file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {file}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} file {file} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None


def _with_request_files(
    config: GenerationConfig, prediction: Path | None, json_schema: Path | None, grammar: Path | None
) -> GenerationConfig:
    """``config`` with what the request files add: a prediction, a JSON schema or a grammar
    (Lark, or GBNF where the file name ends in .gbnf), each checked before any model loads."""
    from draftwise.grammar import grammar_text

    update: dict[str, Any] = {}
    if prediction is not None:
        update["prediction"] = _read_file(prediction, "prediction") or None
    if json_schema is not None and grammar is not None:
        raise ConfigError("give --json-schema or --grammar, not both")
    if json_schema is not None:
        update["grammar"] = GrammarSpec(kind="json_schema", text=_read_file(json_schema, "JSON schema"))
    if grammar is not None:
        kind = "gbnf" if grammar.suffix == ".gbnf" else "lark"
        update["grammar"] = GrammarSpec(kind=kind, text=_read_file(grammar, "grammar"))
    if update.get("grammar") is not None:
        grammar_text(update["grammar"])
    return config.model_copy(update=update)


def _read_prompt(prompt: str | None, file: Path | None) -> str:
    if prompt is not None and file is not None:
        raise ConfigError("give the prompt as an argument or with --file, not both")
    if file is not None:
        return _read_file(file, "prompt")
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise ConfigError("no prompt: give it as an argument, with --file PATH, or '-' to read stdin")
    return prompt


def _choose_drafter(target: str, draft: str | None, drafter: str | None) -> tuple[str | None, DrafterKind]:
    """(draft model source, drafter kind): ``draftwise.prepare.choose_drafter``, over the
    drafters that draft (``generate`` has no "off": plain decoding is ``--compare``'s)."""
    from draftwise.prepare import choose_drafter

    if drafter is not None and drafter not in DRAFTER_KINDS:
        kinds = ", ".join(f"'{kind}'" for kind in DRAFTER_KINDS[:-1]) + f" or '{DRAFTER_KINDS[-1]}'"
        raise ConfigError(f"--drafter must be {kinds}, got {drafter!r}")
    chosen, kind = choose_drafter(target, draft, drafter)
    # One drafter a run: a draft named beside n-gram lookup would never draft, and is not loaded.
    return (chosen if kind in NEEDS_DRAFT_MODEL else None), cast(DrafterKind, kind)


@dataclass
class _Models:
    """What ``generate`` loaded: the target (None when a remote verifier runs it), the draft
    model (None for n-gram lookup), and the tokenizer that turns the prompt into ids."""

    target: LanguageModel | None
    draft: LanguageModel | None
    tokenizer: Tokenizer
    profile: CostProfile | None = None  # what drafting costs with the local pair, for the cost policy


@contextmanager
def _connected(verifier: str | None, settings: ClientSettings | None) -> Iterator[RemoteTarget | None]:
    """The remote target at ``verifier`` (None without one), closed when the run is over."""
    if verifier is None:
        yield None
        return
    from draftwise.remote.client import connect

    with connect(verifier, settings=settings) as remote:
        yield remote


def _load_for_remote(
    target: str, draft: str | None, remote: RemoteTarget, models: ModelOptions, console: Console
) -> _Models:
    """What runs here when a verifier runs the target: the draft model, which also supplies the
    tokenizer when it speaks the target's; else (n-gram drafting, or a draft of another
    vocabulary, which drafts through text) the tokenizer of ``target`` is loaded too."""
    from draftwise.loading import check_draft, load_lm

    if draft is None:
        return _Models(None, None, _remote_target_tokenizer(target, remote, models, console, "n-gram drafting"))
    with console.status(f"loading draft {draft}"):
        draft_lm = load_lm(draft, models, draft=True, log=console.print)
    draft_tokenizer = _tokenizer_of(draft_lm, draft)
    if remote.speaks(draft_tokenizer):
        return _Models(None, draft_lm, draft_tokenizer)
    tokenizer = _remote_target_tokenizer(target, remote, models, console, f"draft {draft}, of another vocabulary,")
    check_draft(tokenizer, draft_tokenizer, target, draft, console.print)
    return _Models(None, draft_lm, tokenizer)


def _remote_target_tokenizer(
    target: str, remote: RemoteTarget, models: ModelOptions, console: Console, who: str
) -> Tokenizer:
    """The tokenizer of ``target`` alone, checked against the verifier's."""
    from draftwise.loading import load_tokenizer

    with console.status(f"loading the tokenizer of {target}"):
        try:
            tokenizer = load_tokenizer(target, models)
        except ModelLoadError as exc:
            raise ModelLoadError(
                f"{who} through a verifier encodes the prompt with its target's tokenizer "
                f"(--target names where to load it from): {exc}"
            ) from None
    remote.check_tokenizer(tokenizer, f"{target}'s")
    return tokenizer


def _load(
    target: str,
    draft: str | None,
    remote: RemoteTarget | None,
    models: ModelOptions,
    config: GenerationConfig,
    console: Console,
) -> _Models:
    """The models of a run: through a verifier only what runs here, else the pair prepared as
    every entry point prepares it (warmed up, its costs measured for the cost policy)."""
    from draftwise.prepare import prepare_pair

    if remote is not None:
        return _load_for_remote(target, draft, remote, models, console)
    log = console.print
    with console.status(f"loading {target}" + (f" and draft {draft}" if draft else "")):
        pair = prepare_pair(target, draft, models, config.draft, log=log)
    return _Models(pair.target, pair.draft, _tokenizer_of(pair.target, target), pair.profile)


def _tokenizer_of(lm: LanguageModel, source: str) -> Tokenizer:
    """``lm``'s tokenizer: generate encodes its prompt with it, so a model without one stops here."""
    if lm.tokenizer is None:
        raise ModelLoadError(f"{source!r} has no tokenizer; generate needs one to encode the prompt")
    return lm.tokenizer


def _engine(loaded: _Models, drafter: DrafterKind, remote: RemoteTarget | None) -> SpeculativeEngine:
    """The speculative engine: on the local target, or on a remote verifier."""
    from draftwise.drafters import build_drafter, text_bridge
    from draftwise.engine import SpeculativeEngine

    drafting = build_drafter(drafter, loaded.draft, text_bridge(loaded.tokenizer, loaded.draft))
    if remote is not None:
        return SpeculativeEngine(
            remote, drafting, tokenizer=loaded.tokenizer, grammars=remote.grammars(loaded.tokenizer)
        )
    assert loaded.target is not None  # without a verifier, _load loaded the target here
    return SpeculativeEngine.from_models(loaded.target, drafting, loaded.profile)


class _Interrupt:
    """Ctrl-C during a run. The first is remembered, not raised: the run ends before its next
    pass or at its next event (``check``), where the stream is closed as at its end, so a
    remote verifier's session is freed over a connection in a sound state. Raised wherever it
    lands, it could interrupt httpx inside its connection pool's lock (not re-entrant), and the
    session's close would then wait on that lock for ever; it could also land in a finalizer
    (``__del__``), where Python drops it. A second Ctrl-C is raised at once, wherever the run is
    (a long remote prefill)."""

    def __init__(self) -> None:
        self.seen = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.seen:
            raise KeyboardInterrupt
        self.seen = True

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt


@contextmanager
def _interruptible() -> Iterator[_Interrupt]:
    """Catch Ctrl-C with ``_Interrupt`` where Python's own handler would (the main thread, a
    SIGINT not ignored by whoever started us)."""
    interrupt = _Interrupt()
    main = threading.current_thread() is threading.main_thread()
    ours = main and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, interrupt)
    try:
        yield interrupt
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _speculate(
    engine: SpeculativeEngine, ids: list[int], config: GenerationConfig, tokenizer: Tokenizer, out: Console, show: bool
) -> GenerationResult:
    """Run the engine, printing each step's text coloured by provenance when ``show``."""
    from draftwise.engine import GenerationResult

    colours = TokenColours(tokenizer)
    events = []
    # closing: a Ctrl-C while a step prints ends the stream there too (the engine then frees
    # the target's run, a remote verifier's session), not whenever the stream is collected.
    with _interruptible() as interrupt, closing(engine.stream(ids, config, lambda: interrupt.seen)) as stream:
        for event in stream:
            interrupt.check()
            events.append(event)
            if show:
                colours.push(event.tokens, event.sources)
                out.print(colours.render(event.text), end="")
        interrupt.check()  # a Ctrl-C that ended the stream before a pass ends the run as one
    return GenerationResult.from_events(ids, events)


def _run(
    prompt: str | None,
    file: Path | None,
    prediction: Path | None,
    json_schema: Path | None,
    grammar: Path | None,
    target: str | None,
    draft: str | None,
    drafter: str | None,
    chat: bool,
    compare: bool,
    as_json: bool,
    verifier: str | None,
    models: ModelOptions,
    given: dict[Any, dict[str, Any]],
) -> None:
    from draftwise.cli.options import generation_config, settings_from_flags
    from draftwise.registry import DEFAULT_DRAFT, DEFAULT_TARGET

    config = generation_config(given, ALIASES)  # before any model loads: mistakes fail fast
    config = _with_request_files(config, prediction, json_schema, grammar)
    remote_settings = settings_from_flags(ClientSettings, verifier is not None, given[ClientSettings], "--verifier")
    text = _read_prompt(prompt, file)
    named = target
    if target is None and draft is None and drafter is None:
        target, draft, drafter = DEFAULT_TARGET, DEFAULT_DRAFT, "hybrid" if DEFAULT_DRAFT else "ngram"
    target = target or DEFAULT_TARGET
    draft, drafter = _choose_drafter(target, draft, drafter)
    if verifier is not None and compare:
        raise ConfigError("--verifier cannot --compare: the target is remote")
    with _connected(verifier, remote_settings) as remote:
        if remote is not None and draft is None:
            # n-gram drafting: the prompt is encoded with the target's tokenizer, loaded from
            # --target, else from where the verifier says it loaded its model.
            target = named or remote.info.model
        _generate(text, target, draft, drafter, chat, compare, as_json, remote, models, config)


def _generate(
    text: str,
    target: str,
    draft: str | None,
    drafter: DrafterKind,
    chat: bool,
    compare: bool,
    as_json: bool,
    remote: RemoteTarget | None,
    models: ModelOptions,
    config: GenerationConfig,
) -> None:
    from rich.console import Console

    from draftwise.chat import encode_prompt
    from draftwise.engine import autoregressive

    err, out = Console(stderr=True), Console(highlight=False)
    loaded = _load(target, draft, remote, models, config, err)
    ids = encode_prompt(loaded.tokenizer, text, chat)
    engine = _engine(loaded, drafter, remote)
    label = (
        f"{target} + "
        + {"model": f"{draft} drafter", "ngram": "n-gram drafter", "hybrid": f"n-gram / {draft} hybrid drafter"}[
            drafter
        ]
    )
    if not as_json:
        err.print(f"[bold]{label}[/]   {LEGEND}")
    result = _speculate(engine, ids, config, loaded.tokenizer, out, show=not as_json)
    baseline = None
    if compare and loaded.target:
        loaded.target.reset()  # a prefill from scratch, as the run above had: no prompt left cached
        # Plain decoding: no prediction either.
        baseline = autoregressive(loaded.target).generate(ids, config.model_copy(update={"prediction": None}))
    here = loaded.target or loaded.draft  # None: n-gram drafting through a verifier runs no model here
    run = {
        "target": target,
        "draft": draft,
        "drafter": drafter,
        "backend": here.backend if here is not None else None,
        "dtype": here.dtype if here is not None else None,
    }
    report(result, baseline, config, label, run, as_json, out)
    if result.metrics.finish_reason == "error":  # the verifier refused or went away mid-run
        raise TargetError(
            f"generation stopped early, after {result.metrics.new_tokens} tokens (shown above): "
            f"{result.events[-1].extra['detail']}"
        )


def _model_options() -> list[tuple[str, Any, Any]]:
    """The models of a run, as ``_own_options`` lists them: target, draft and drafter."""
    return [
        (
            "target",
            Optional[str],
            typer.Option(
                None,
                help="target model: a packaged name (see `draftwise models`), a .gguf file, a folder, "
                "a Hugging Face id owner/name, or tiny:SEED; default: the packaged default pair",
            ),
        ),
        (
            "draft",
            Optional[str],
            typer.Option(None, help="draft model (same kinds of source); default: the registry's draft for the target"),
        ),
        (
            "drafter",
            Optional[str],
            typer.Option(
                None,
                help="model, ngram, or hybrid (both: n-gram lookup where the context repeats, the draft model "
                "elsewhere; the cost policy picks per step, or neither); default: hybrid when a draft is known or "
                "given, else ngram",
            ),
        ),
    ]


def _own_options() -> list[tuple[str, Any, Any]]:
    """The command's own parameters, as (name, type, typer default): the prompt, the models and
    the output switches (the other flags derive from config classes, see ``FLAGS``)."""
    return [
        ("prompt", Optional[str], typer.Argument(None, help="the prompt text; '-' reads stdin")),
        ("file", Optional[Path], typer.Option(None, "--file", "-f", help="read the prompt from this file")),
        *_model_options(),
        (
            "prediction",
            Optional[Path],
            typer.Option(
                None,
                help="a file holding the expected output (OpenAI's Predicted Outputs: the file an edit returns); "
                "drafted from wherever the output follows it",
            ),
        ),
        (
            "json_schema",
            Optional[Path],
            typer.Option(None, help="a file holding a JSON schema the output follows (structured output)"),
        ),
        (
            "grammar",
            Optional[Path],
            typer.Option(None, help="a file holding a grammar the output follows: Lark, or GBNF if it ends in .gbnf"),
        ),
        ("chat", bool, typer.Option(False, "--chat/--plain", help="apply the target's chat template")),
        ("compare", bool, typer.Option(False, help="also run the plain target; print speedup and identity")),
        ("as_json", bool, typer.Option(False, "--json", help="print one JSON object instead of coloured text")),
        (
            "verifier",
            Optional[str],
            typer.Option(
                None,
                help="URL of a `draftwise serve-verifier` running the target: only the draft runs here, or "
                "for --drafter ngram only the target's tokenizer, loaded from --target or else from the model "
                "name the verifier reports (API key: $DRAFTWISE_VERIFIER_API_KEY)",
            ),
        ),
    ]


def register(app: typer.Typer) -> None:
    fixed = _own_options()
    names = [name for name, _, _ in fixed]

    def generate(**kwargs: Any) -> None:
        """Generate text with speculative decoding; tokens are coloured by where they came from."""
        kwargs.pop("models_given")
        _run(**{name: kwargs.pop(name) for name in names}, models=kwargs.pop("models"), given=kwargs.pop("given"))

    generate.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d, annotation=t) for n, t, d in fixed]
    )
    app.command()(with_model_options()(with_flags(*FLAGS)(generate)))
