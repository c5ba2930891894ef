"""``draftwise replay``: what every source would draft along the target's own answers, and the
cost policy and every fixed configuration replayed over it on host profiles.

Flags derive from ``ReplayConfig`` (``draftwise.bench.replay``) through
``draftwise.cli.options.with_flags``; the model flags (``--threads``, ``--backend``, ...) are
``ModelOptions``', for ``--record``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from draftwise.bench.replay import ReplayConfig
from draftwise.cli.options import Flags, aliases_of, built, note, split, with_flags, with_model_options
from draftwise.config import ModelOptions
from draftwise.errors import ConfigError

if TYPE_CHECKING:
    from draftwise.bench.replay import Recording
    from draftwise.profile import CostProfile

FLAGS = (Flags(ReplayConfig, parse={"hosts": lambda value: tuple(Path(p) for p in split(value))}),)
ALIASES = aliases_of(*FLAGS)


@with_model_options()
@with_flags(*FLAGS)
def replay(given: dict[Any, dict[str, Any]], models: ModelOptions = ModelOptions(), models_given: dict | None = None):
    """Record what the draft model and n-gram lookup would draft at every position of the
    target's greedy answers (--record FILE), or read such a recording (--recording FILE), and
    replay plain decoding, the cost policy from a cold start and every fixed configuration over
    it on each host profile (--hosts a.json,b.json): tokens per second by subtask, and the
    best fixed configuration in hindsight; with --vary NAME=V1,V2, the cost policy at each
    value of one of its settings. With --answers RESULTS (a draftwise load run's), the most
    that drafting from earlier text could give its answers on each host instead."""
    from rich.console import Console
    from rich.table import Table

    from draftwise.bench.replay import by_subtask, compare, read_hosts, read_recordings, record_prompts

    config = built(ReplayConfig, aliases=ALIASES, **given[ReplayConfig])
    source = config.recording or config.record
    if source is None and config.answers is None:
        raise ConfigError(
            "--record FILE (decode the prompts now), --recording FILE (replay one) or --answers FILE "
            "(a load run's copy ceiling): give one"
        )
    hosts = read_hosts(config.hosts)
    if not hosts:
        raise ConfigError("--hosts: name at least one host profile (JSON with pass_ms, as tests/data/hosts)")
    if config.answers is not None:
        _ceilings(config, models, hosts)
        return
    assert source is not None
    if config.record is not None:
        note(f"recording to {record_prompts(config, models, note)}")
    groups = by_subtask(read_recordings(source))
    if config.vary is not None:
        _sweep(config.vary, groups, hosts)
        return
    for name, host in hosts.items():
        table = Table(
            "subtask",
            "prompts",
            "plain tok/s",
            "policy tok/s",
            "best fixed",
            "policy / plain",
            "policy / best",
            title=f"replayed on {name}",
        )
        for subtask, recordings in groups.items():
            result = compare(recordings, host)
            best, rate = result.best_fixed
            table.add_row(
                subtask,
                str(len(recordings)),
                f"{result.plain:.1f}",
                f"{result.policy:.1f}",
                f"{best} ({rate:.1f})",
                f"{result.policy / result.plain:.2f}x",
                f"{result.policy / rate:.2f}",
            )
        Console(width=max(120, Console().width)).print(table)


def _sweep(vary: str, groups: dict[str, list[Recording]], hosts: dict[str, CostProfile]) -> None:
    """``--vary``: a table per host, a column per value of the setting, the policy over plain
    decoding and over the best fixed configuration in each subtask, and the worst of each."""
    from rich.console import Console
    from rich.table import Table

    from draftwise.bench.replay import sweep, varied
    from draftwise.config import CostPolicyConfig

    name, settings = varied(vary)
    default = getattr(CostPolicyConfig(), name)
    for host_name, host in hosts.items():
        rows = sweep(groups, host, name, settings)
        heads = [f"{name} {row.value:g}{' (default)' if row.value == default else ''}" for row in rows]
        table = Table("subtask", *heads, title=f"the cost policy on {host_name}: over plain, over the best fixed")
        for group in groups:
            table.add_row(group, *(f"{row.over_plain[group]:.2f}x, {row.over_best[group]:.2f}" for row in rows))
        worst = (f"{min(row.over_plain.values()):.2f}x, {min(row.over_best.values()):.2f}" for row in rows)
        table.add_row("worst", *worst)
        Console(width=max(120, Console().width)).print(table)


def _ceilings(config: ReplayConfig, models: ModelOptions, hosts: dict[str, CostProfile]) -> None:
    """``--answers``: per host, each subtask's answers from its third request on, decoded plainly,
    by the cost policy drafting from prompt lookup and the earlier answers (one profile over the
    sequence, as a server's), and at the copy ceiling; the host's limit for sure drafts in the
    title (``draftwise.bench.ceiling``)."""
    from rich.console import Console
    from rich.table import Table

    from draftwise.bench.ceiling import CEILING_FROM, Oracle, answered, copy_ceiling, host_limit, suffix_recordings
    from draftwise.bench.dataset import load_prompts
    from draftwise.bench.replay import in_turn
    from draftwise.config import MAX_BLOCK, DraftConfig, GenerationConfig, SuffixConfig
    from draftwise.events import MODEL
    from draftwise.loading import load_tokenizer

    assert config.answers is not None
    answers = answered(config.answers, config.answers_of)
    tokenizer = load_tokenizer(config.target, models)

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    sequences: dict[str, list[tuple[list[int], list[int]]]] = {}
    for prompt in load_prompts(config.data):
        if prompt.id in answers:
            sequences.setdefault(prompt.subtask, []).append((ids("\n".join(prompt.turns)), ids(answers[prompt.id])))
    if not sequences:
        raise ConfigError(f"--answers: none of its answers is to a prompt of {config.data} (--data)")
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens)
    recorded = {subtask: suffix_recordings(turns, generation, SuffixConfig()) for subtask, turns in sequences.items()}
    heads = ("subtask", "answers", "tokens", "plain tok/s", "policy tok/s", "policy / plain", "copy ceiling")
    draft = DraftConfig()
    for name, host in hosts.items():

        def seconds(rows: int, host: CostProfile = host) -> float:
            return host.pass_times.at(rows) or 0.0

        model = host.draft_token_seconds.get(MODEL)
        oracle = None if model is None else Oracle(model, draft.k_max, MAX_BLOCK - 1)
        title = f"the copy ceiling on {name} (the most drafting can give there: {host_limit(seconds, MAX_BLOCK):.2f}x)"
        table = Table(*heads, *(("copies + a model always right",) if oracle else ()), title=title)
        for subtask, turns in sequences.items():
            found = copy_ceiling(turns, seconds, MAX_BLOCK - 1, CEILING_FROM, oracle)
            plain, policy = in_turn(recorded[subtask], host, draft, CEILING_FROM)
            table.add_row(
                subtask,
                str(found.answers),
                str(found.tokens),
                f"{plain:.1f}",
                f"{policy:.1f}",
                f"{policy / plain:.2f}x",
                f"{found.speedup:.2f}x",
                *((f"{found.oracle_speedup:.2f}x",) if found.oracle_speedup is not None else ()),
            )
        Console(width=max(120, Console().width)).print(table)


def register(app: typer.Typer) -> None:
    app.command()(replay)
