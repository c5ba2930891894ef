"""A draft policy replayed offline, on any host's costs, against every fixed configuration.

Under greedy decoding what a block keeps is a function of the text alone: the target's own
continuation, and what each source proposes at each position of it. So ``record`` decodes a
prompt once with the target (plain decoding) and asks the drafter, at every position, what
each of its sources offers and the longest block it would propose; a ``Recording`` holds
both. ``replay`` then runs any policy over a recording on any host's
costs (``draftwise.profile.read_host``, or what this machine calibrated): at each step the
policy chooses from the recorded offers, the block keeps the tokens it shares with the
continuation, and the step costs what the host's passes and drafts cost. Seconds, not
minutes, for a policy over a data set, on a host the replay does not run on.

``compare`` replays plain decoding, the cost policy from a cold start, and every fixed
configuration (each source alone and all of them, the drafter's first offer, at k = 1 to
``FIXED_K``): the best fixed one in hindsight is computed, not assumed. Sampling is not
replayable this way (a draw, not the text, decides what is kept); the bench's end-to-end
runs cover it.

A draft model that has not read the context pays a catch-up: the replay counts the tokens it
is behind (the whole prompt at first, and whatever other sources and plain steps emitted
since it last drafted) at the host's catch-up price, as ``ModelDrafter`` feeds them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from draftwise.bench.config import SPEC_BENCH, with_paired_draft
from draftwise.bench.dataset import load_prompts
from draftwise.bench.runner import PromptBuilder
from draftwise.config import CostPolicyConfig, DraftConfig, GenerationConfig, ModelOptions
from draftwise.drafters import Drafter, HybridDrafter, ModelDrafter
from draftwise.engine import autoregressive
from draftwise.errors import ConfigError
from draftwise.lm import LanguageModel, drive
from draftwise.loading import load_pair
from draftwise.offers import Offer, Outcome
from draftwise.policies import CostAwareK, DraftPolicy, FixedK
from draftwise.profile import CostProfile, read_host
from draftwise.verify import Verdict

FIXED_K = 8  # fixed configurations replayed: k = 1 to this


class ReplayConfig(BaseModel):
    """What ``draftwise replay`` records and replays; its flags derive from these fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    record: Path | None = Field(None, description="decode the prompts with the models and write the recording here")
    recording: Path | None = Field(None, description="replay this recording (default: the one --record writes)")
    hosts: tuple[Path, ...] = Field((), description="host profiles to replay on (JSON, as tests/data/hosts)")
    target: str = Field("qwen2.5-coder-1.5b", description="target model, for --record")
    draft: str | None = Field(
        None,
        description="draft model, for --record (the hybrid drafter's); default: the registry's draft for the target",
    )
    data: str = Field(SPEC_BENCH, description="'spec_bench' (packaged) or a JSONL file of prompts, for --record")
    limit: int | None = Field(None, ge=1, description="prompts per subtask, for --record")
    max_new_tokens: int = Field(128, ge=1, le=4096, description="tokens decoded per prompt, for --record")
    vary: str | None = Field(
        None,
        description="NAME=V1,V2,...: replay the cost policy with each value of one of its settings "
        "(DraftConfig.cost: allowance, opening, growth, ...) beside plain and the best fixed configuration",
    )
    answers: Path | None = Field(
        None,
        description="a draftwise load run's results.jsonl: instead of a replay, the copy ceiling of its answers "
        "(--data: the prompts it sent) from the third request of each subtask on, on each host",
    )
    answers_of: str = Field("draftwise-off", description="the server whose answers at one client --answers reads")

    @model_validator(mode="before")
    @classmethod
    def _paired_draft(cls, data: Any) -> Any:
        return with_paired_draft(data, cls)

    @field_validator("vary")
    @classmethod
    def _one_setting(cls, vary: str | None) -> str | None:
        if vary is not None:
            varied(vary)
        return vary


def varied(vary: str) -> tuple[str, list[CostPolicyConfig]]:
    """``NAME=V1,V2,...`` read: the setting's name and the cost policy's settings at each value
    (ValueError, one line, for a name the cost policy lacks or a value it refuses)."""
    name, _, listed = vary.partition("=")
    name = name.strip().replace("-", "_")
    if name not in CostPolicyConfig.model_fields:
        raise ValueError(f"--vary {name}: the cost policy's settings are {', '.join(CostPolicyConfig.model_fields)}")
    values = [value.strip() for value in listed.split(",") if value.strip()]
    if not values:
        raise ValueError(f"--vary {name}=V1,V2,...: give the values to replay")
    try:
        return name, [CostPolicyConfig(**{name: float(value)}) for value in values]
    except ValidationError as exc:
        raise ValueError(f"--vary {name}: {exc.errors()[0]['msg']}") from None
    except ValueError:
        raise ValueError(f"--vary {name}: {listed!r} is not a list of numbers") from None


@dataclass(frozen=True)
class Position:
    """What the drafter offered after the context up to here, and each source's block."""

    offers: tuple[Offer, ...]
    blocks: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class Recording:
    """One prompt decoded plainly, with what every source would have drafted along the way:
    ``positions[i]`` follows the prompt and ``continuation[:i]``. ``budget`` is the run's
    ``max_new_tokens``: a policy is told the tokens left in it, as the engine tells it, not
    where the answer will end, which only hindsight knows (None: the continuation's length)."""

    prompt_id: str
    subtask: str
    prompt_tokens: int
    continuation: tuple[int, ...]
    positions: tuple[Position, ...]
    budget: int | None = None

    def to_json(self) -> str:
        positions = [{"offers": [asdict(o) for o in p.offers], "blocks": p.blocks} for p in self.positions]
        return json.dumps({**asdict(self), "positions": positions})

    @classmethod
    def from_json(cls, line: str) -> Recording:
        data = json.loads(line)
        positions = tuple(
            Position(tuple(Offer(**o) for o in p["offers"]), {source: tuple(b) for source, b in p["blocks"].items()})
            for p in data["positions"]
        )
        continuation, budget = tuple(data["continuation"]), data.get("budget")
        budget = None if budget is None else int(budget)  # a foreign value: one line (``read_recordings``)
        return cls(data["prompt_id"], data["subtask"], data["prompt_tokens"], continuation, positions, budget)


def record(
    target: LanguageModel,
    drafter: Drafter,
    prompt: Sequence[int],
    config: GenerationConfig,
    *,
    prompt_id: str = "",
    subtask: str = "",
) -> Recording:
    """Decode ``prompt`` plainly with ``target`` (greedy, ``config``'s budget and stops), then
    walk the continuation with ``drafter``: at each position its offers, and each offered
    source's longest block: ``config.draft.k_long`` tokens of a source that drafts for free
    (the cost policy may give such a copy long blocks), ``k_max`` of one that runs a model."""
    greedy = config.model_copy(update={"sampling": config.sampling.model_copy(update={"temperature": 0.0})})
    continuation = tuple(autoregressive(target).generate(list(prompt), greedy).tokens)
    return walk(drafter, prompt, continuation, greedy, prompt_id=prompt_id, subtask=subtask)


def walk(
    drafter: Drafter,
    prompt: Sequence[int],
    continuation: Sequence[int],
    config: GenerationConfig,
    *,
    prompt_id: str = "",
    subtask: str = "",
) -> Recording:
    """What ``drafter`` offers and proposes at each position of ``continuation`` after
    ``prompt`` (``record``'s walk, for a continuation already known)."""
    drafter.start(prompt, config, None)
    positions = []
    for i in range(len(continuation)):
        context = [*prompt, *continuation[:i]]
        offers = drafter.offers(context)
        blocks = {
            o.source: tuple(drive(drafter.propose(context, _longest(o, config.draft), o.source)).tokens.tolist())
            for o in offers
        }
        positions.append(Position(offers, blocks))
        # Whatever was drafted, the next position follows the continuation's own token.
        drafter.observe([*context, continuation[i]], Verdict(0, continuation[i], 0))
    return Recording(prompt_id, subtask, len(prompt), tuple(continuation), tuple(positions), config.max_new_tokens)


def _longest(offer: Offer, draft: DraftConfig) -> int:
    return offer.sure + (draft.k_max if offer.passes else max(draft.k_max, draft.k_long))


@dataclass(frozen=True)
class Replayed:
    tokens: int
    seconds: float
    steps: int


def _kept(block: Sequence[int], truth: Sequence[int]) -> int:
    kept = 0
    while kept < len(block) and kept < len(truth) and block[kept] == truth[kept]:
        kept += 1
    return kept


def replay(rec: Recording, policy: DraftPolicy, host: CostProfile, sources: Iterable[str] | None = None) -> Replayed:
    """Run ``policy`` over ``rec`` on ``host``'s costs, offered only ``sources`` (None: all)."""
    allowed = None if sources is None else frozenset(sources)
    total = len(rec.continuation)
    budget = rec.budget or total
    i, behind, seconds, steps = 0, rec.prompt_tokens, 0.0, 0
    while i < total:
        here = rec.positions[i]
        offers = [o for o in here.offers if allowed is None or o.source in allowed]
        choice = policy.choose([replace(o, behind=behind) if o.passes else o for o in offers], budget - i)
        block = here.blocks.get(choice.source or "", ())[: choice.k]
        kept = _kept(block, rec.continuation[i : i + len(block)])
        passes = choice.offer is not None and choice.offer.passes and bool(block)
        fed = behind if passes and behind > ModelDrafter.CATCHUP else 0  # a few ride in the first draft pass
        draft, catchup, verify = host.price(
            Outcome(
                choice,
                n_proposed=len(block),
                n_accepted=kept,
                draft_seconds=0.0,
                verify_seconds=0.0,
                catchup_tokens=fed,
            )
        )
        fed = fed if catchup else 0
        policy.update(
            Outcome(
                choice,
                n_proposed=len(block),
                n_accepted=kept,
                draft_seconds=draft,
                verify_seconds=verify,
                catchup_seconds=catchup,
                catchup_tokens=fed,
            )
        )
        emitted = min(kept + 1, total - i)
        seconds, steps, i = seconds + catchup + draft + verify, steps + 1, i + emitted
        behind = 0 if passes else behind + emitted
    return Replayed(total, seconds, steps)


@dataclass(frozen=True)
class Comparison:
    """Tokens per second over a set of recordings: plain decoding, the cost policy from a cold
    start, and each fixed configuration (named ``source k=N``, ``all k=N``)."""

    plain: float
    policy: float
    fixed: dict[str, float]

    @property
    def best_fixed(self) -> tuple[str, float]:
        name = max(self.fixed, key=self.fixed.__getitem__)
        return (name, self.fixed[name]) if self.fixed[name] > self.plain else ("plain", self.plain)


def _rate(runs: Iterable[Replayed]) -> float:
    runs = list(runs)
    seconds = sum(r.seconds for r in runs)
    return sum(r.tokens for r in runs) / seconds if seconds > 0 else 0.0


def compare(recordings: Sequence[Recording], host: CostProfile, draft: DraftConfig | None = None) -> Comparison:
    """Replay plain decoding, the cost policy (a fresh, cold one per recording, on ``host``'s
    calibrated costs and no acceptance) and every fixed configuration over ``recordings``."""
    draft = draft or DraftConfig()

    def over(make: Callable[[], DraftPolicy], sources: Iterable[str] | None = None) -> float:
        return _rate(replay(r, make(), host, sources) for r in recordings)

    def fixed_k(k: int) -> Callable[[], DraftPolicy]:
        return lambda: FixedK(k)

    sources = sorted({o.source for r in recordings for p in r.positions for o in p.offers})
    names = [*sources, "all"] if len(sources) > 1 else sources
    fixed = {
        f"{name} k={k}": over(fixed_k(k), None if name == "all" else (name,))
        for name in names
        for k in range(1, FIXED_K + 1)
    }
    return Comparison(plain=over(fixed_k(0), ()), policy=policy_rate(recordings, host, draft), fixed=fixed)


def policy_rate(recordings: Sequence[Recording], host: CostProfile, draft: DraftConfig) -> float:
    """Tokens per second of the cost policy over ``recordings``, a fresh, cold one per recording."""
    return _rate(replay(r, CostAwareK(draft, copy.deepcopy(host)), host) for r in recordings)


def in_turn(recordings: Sequence[Recording], host: CostProfile, draft: DraftConfig, start: int) -> tuple[float, float]:
    """(plain decoding's, the cost policy's) tokens per second over ``recordings`` from the
    ``start``-th (1-based) on, the policy replayed over all of them in order with one profile,
    as a server's requests share theirs: what it learnt of each source carries to the next."""
    profile = copy.deepcopy(host)
    runs = [replay(r, CostAwareK(draft, profile), host) for r in recordings]
    plain = [replay(r, FixedK(0), host, ()) for r in recordings[start - 1 :]]
    return _rate(plain), _rate(runs[start - 1 :])


@dataclass(frozen=True)
class Swept:
    """The cost policy at one value of a setting, over each subtask: its tokens per second over
    plain decoding's, and over the best fixed configuration's."""

    value: float
    over_plain: dict[str, float]
    over_best: dict[str, float]


def sweep(
    groups: dict[str, list[Recording]], host: CostProfile, name: str, settings: Sequence[CostPolicyConfig]
) -> list[Swept]:
    """The cost policy replayed at each of ``settings`` (``name`` varied) on ``host``."""
    compared = {subtask: compare(recordings, host) for subtask, recordings in groups.items()}
    rows = []
    for cost in settings:
        draft = DraftConfig(cost=cost)
        rates = {subtask: policy_rate(recordings, host, draft) for subtask, recordings in groups.items()}
        rows.append(
            Swept(
                getattr(cost, name),
                {subtask: rate / compared[subtask].plain for subtask, rate in rates.items()},
                {subtask: rate / compared[subtask].best_fixed[1] for subtask, rate in rates.items()},
            )
        )
    return rows


def read_recordings(path: Path) -> list[Recording]:
    """The recordings of a file ``record_prompts`` wrote; a missing or foreign file is one line."""
    try:
        return [Recording.from_json(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"--recording {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--recording {path}: not a recording written by draftwise replay --record ({exc})") from None


def read_hosts(paths: Sequence[Path]) -> dict[str, CostProfile]:
    """Each host profile by its file's name; a missing or foreign file is one line."""
    return {path.stem: read_host(path) for path in paths}


def record_prompts(config: ReplayConfig, models: ModelOptions, log: Callable[[str], None]) -> Path:
    """Decode the first turn of each of ``config``'s prompts with its pair (greedy, in the
    target's chat template) and write their recordings to ``config.record``, one per line."""
    assert config.record is not None
    prompts = load_prompts(config.data, None, config.limit)
    target, draft = load_pair(config.target, config.draft, models, log=log)
    if draft is None or target.tokenizer is None:
        raise ConfigError(
            f"replay --record needs a draft model (none is known for {config.target}: name one with --draft) "
            "and a target with a tokenizer"
        )
    builder = PromptBuilder(target.tokenizer, True)
    generation = GenerationConfig(max_new_tokens=config.max_new_tokens)
    with config.record.open("w") as out:
        for n, prompt in enumerate(prompts, 1):
            log(f"recording {n}/{len(prompts)}: {prompt.id} ({prompt.subtask})")
            ids = builder.ids(prompt.turns[:1], [])
            drafter = HybridDrafter(ModelDrafter(draft))
            rec = record(target, drafter, ids, generation, prompt_id=prompt.id, subtask=prompt.subtask)
            out.write(rec.to_json() + "\n")
            out.flush()
    return config.record


def by_subtask(recordings: Sequence[Recording]) -> dict[str, list[Recording]]:
    """The recordings of each subtask, in the order first seen, and all of them (``"all"``)."""
    groups: dict[str, list[Recording]] = {}
    for rec in recordings:
        groups.setdefault(rec.subtask or "all", []).append(rec)
    if len(groups) > 1:
        groups["all"] = list(recordings)
    return groups
