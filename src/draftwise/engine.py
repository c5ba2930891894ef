"""The decode loop: one generation as a generator that yields the model passes it needs
(``Forward``s, each sent back its scores) and a ``StepEvent`` per speculation step.

``SpeculativeEngine.steps`` is that generator, and whoever runs it batches its passes:
``stream`` runs one generation alone and yields only its events, a server's scheduler runs
many at once (``draftwise.scheduler``). ``generate`` is a thin wrapper that drains ``stream``.
With no drafter the same loop is plain autoregressive decoding (every step proposes nothing
and the target adds one token), which is the baseline draftwise compares against.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from draftwise.config import GenerationConfig
from draftwise.constrained import Constrained
from draftwise.constraint import Constraint, Triggered
from draftwise.drafters import EMPTY_PROPOSAL, Drafter, Proposal, model_drafter, text_bridge
from draftwise.errors import ContextLengthError, TargetError
from draftwise.events import NO_TOKEN, StepEvent
from draftwise.grammar import Grammars, grammars_of
from draftwise.lm import Forward, LanguageModel, Tokenizer, run_alone
from draftwise.metrics import GenerationMetrics
from draftwise.offers import PLAIN, Choice, Outcome
from draftwise.policies import DraftPolicy, FixedK, make_policy
from draftwise.prediction import EncodedPrediction, with_prediction
from draftwise.profile import CostProfile
from draftwise.stopping import TextStream, first_eos
from draftwise.target import LocalTarget, Target, Verification
from draftwise.verify import TokenSource, Verdict


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    metrics: GenerationMetrics
    events: list[StepEvent] = field(default_factory=list)

    @classmethod
    def from_events(cls, prompt_ids: list[int], events: list[StepEvent]) -> GenerationResult:
        """Everything a finished stream of events says: tokens, text and metrics."""
        return cls(
            prompt_ids=prompt_ids,
            tokens=[t for e in events for t in e.tokens],
            text="".join(e.text for e in events),
            metrics=GenerationMetrics.from_events(events),
            events=events,
        )


class _Run:
    """Bookkeeping of one generation: context, budget, stops, timings."""

    def __init__(
        self,
        prompt: list[int],
        config: GenerationConfig,
        eos_ids: tuple[int, ...],
        tokenizer: Tokenizer | None,
        policy: DraftPolicy,
        constraint: Constraint | Triggered | None = None,
    ) -> None:
        self.config = config
        self.constraint = constraint
        self.context = list(prompt)
        self.prompt_len = len(prompt)
        self.eos_ids = set() if config.ignore_eos else set(config.eos_token_ids or eos_ids)
        self.text = TextStream(tokenizer, config.stop) if tokenizer is not None else None
        self.policy = policy
        self.step = 0
        self.prefill_seconds = 0.0
        self.finished = False
        self.arms: list[tuple[str, int, float]] = []  # what the policy weighed for the step under way

    @property
    def generated(self) -> int:
        return len(self.context) - self.prompt_len

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - self.generated

    def choose(self, drafter: Drafter | None) -> Choice:
        """What the policy drafts next from the drafter's offers; never past the token budget
        (the target adds a token of its own)."""
        offers = drafter.offers(self.context) if drafter is not None else ()
        choice = self.policy.choose(offers, self.remaining)
        self.arms = [arm.describe() for arm in self.policy.weighed]
        return Choice(choice.offer, min(choice.k, self.remaining - 1)) if choice.k else PLAIN

    def masks(self, proposal: Proposal) -> torch.Tensor | None:  # [k + 1, W] int32 bitmask, or None: all allowed
        """What the grammar allows at each row the verification of ``proposal`` scores."""
        return self.constraint.masks(proposal.tokens.tolist()) if self.constraint is not None else None

    def truncate(self, tokens: list[int]) -> tuple[list[int], str, str | None]:
        """Cut a step's tokens at the first stop; return (kept tokens, new text, finish reason)."""
        reason = None
        budget = self.config.max_new_tokens - self.generated
        if len(tokens) >= budget:
            tokens, reason = tokens[:budget], "length"
        eos_at = first_eos(tokens, self.eos_ids)
        if eos_at >= 0:
            tokens, reason = tokens[: eos_at + 1], "eos"
        text = ""
        if self.text is not None:
            keep, text, hit = self.text.push(tokens)
            if hit:
                tokens, reason = tokens[:keep], "stop"
            elif reason is not None:
                text += self.text.flush()
        return tokens, text, reason

    def commit(
        self,
        choice: Choice,
        proposal: Proposal,
        check: Verification,
        draft_seconds: float,
        verify_seconds: float,
        step_started: float,
        observe: Callable[[list[int], Verdict], None] | None = None,
    ) -> StepEvent:
        verdict = check.verdict
        raw = proposal.tokens[: verdict.n_accepted].tolist() + [verdict.next_token]
        tokens, text, reason = self.truncate(raw)
        sources = [TokenSource.ACCEPTED] * verdict.n_accepted + [verdict.next_source]
        self.context.extend(tokens)
        self.finished = reason is not None
        if self.constraint is not None and not self.finished:
            self.constraint.commit(tokens)
        if observe is not None and not self.finished:
            observe(self.context, verdict)  # before the step's clock stops: it is loop work too
        self.policy.update(
            Outcome(
                choice,
                n_proposed=len(proposal),
                n_accepted=verdict.n_accepted,
                draft_seconds=draft_seconds - proposal.catchup_seconds,
                verify_seconds=verify_seconds,
                catchup_seconds=proposal.catchup_seconds,
                catchup_tokens=proposal.catchup_tokens,
                pass_info=check.pass_info,
                draft_pass_seconds=proposal.pass_seconds,
            )
        )
        event = StepEvent(
            step=self.step,
            k=choice.k,
            source=proposal.source,
            proposed=proposal.tokens.tolist(),
            draft_probs=proposal.token_probs(),
            target_probs=check.target_token_probs,
            n_accepted=verdict.n_accepted,
            next_token=verdict.next_token,
            tokens=tokens,
            sources=sources[: len(tokens)],
            text=text,
            prefill_seconds=self.prefill_seconds if self.step == 0 else 0.0,
            draft_seconds=draft_seconds,
            verify_seconds=verify_seconds,
            step_seconds=time.perf_counter() - step_started,
            finished=self.finished,
            finish_reason=reason,
            extra=dict(check.extra),
            forced=proposal.forced,
            arms=self.arms,
        )
        self.step += 1
        return event

    def end(self, refusal: TargetError) -> StepEvent:
        """The closing event of a run the target cannot take further: no target pass, no new
        token, only the text still held back for stop matching, and why it ended."""
        self.finished = True
        return StepEvent(
            step=self.step,
            k=0,
            source=None,
            proposed=[],
            draft_probs=[],
            target_probs=[],
            n_accepted=0,
            next_token=NO_TOKEN,
            tokens=[],
            sources=[],
            text=self.text.flush() if self.text is not None else "",
            prefill_seconds=self.prefill_seconds if self.step == 0 else 0.0,
            draft_seconds=0.0,
            verify_seconds=0.0,
            step_seconds=0.0,
            finished=True,
            finish_reason="length" if isinstance(refusal, ContextLengthError) else "error",
            extra={"detail": str(refusal)},
        )


# A generation as it runs: the passes it asks for (sent their scores) and its step events.
Steps = Generator[Forward | StepEvent, torch.Tensor, None]


@dataclass(frozen=True)
class PreparedRun:
    """A generation set up by ``SpeculativeEngine.prepare``: its bookkeeping (prompt, config,
    policy, constraint), the drafter stack that has read the prompt (None: plain decoding)
    and the target's random stream. Run it once, with ``SpeculativeEngine.steps``."""

    run: _Run
    drafter: Drafter | None
    target_generator: torch.Generator | None


def seeded_generators(seed: int | None) -> tuple[torch.Generator | None, torch.Generator | None]:
    """The (target, drafter) random streams of a seeded run; (None, None) without a seed.

    Target and drafter draw from separate streams, so a target running elsewhere (a remote
    verifier seeded with the same seed) makes the same draws as the local one.
    """
    if seed is None:
        return None, None
    return torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)


class SpeculativeEngine:
    """Speculative decoding with any ``Target`` and any ``Drafter`` (or none).

    ``profile`` holds what drafting costs with these models on this machine, learnt as steps
    run; it carries over from one generation to the next (pass one in to share it).
    """

    def __init__(
        self,
        target: Target,
        drafter: Drafter | None = None,
        tokenizer: Tokenizer | None = None,
        profile: CostProfile | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.profile = profile or CostProfile()
        # Compiles a request's grammar (structured output) for the target's vocabulary.
        self.grammars = grammars

    @classmethod
    def from_models(
        cls, target: LanguageModel, draft: LanguageModel | Drafter | None = None, profile: CostProfile | None = None
    ) -> SpeculativeEngine:
        if isinstance(draft, LanguageModel):  # its ids, or through text where it speaks another vocabulary
            draft = model_drafter(draft, text_bridge(target.tokenizer, draft))
        return cls(
            LocalTarget(target), draft, tokenizer=target.tokenizer, profile=profile, grammars=grammars_of(target)
        )

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            ids: list[int] = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Generator[StepEvent, None, None]:
        """Generate alone, yielding one event per target pass. The consumer may stop between
        events; ``cancelled`` also reaches between the passes of a step and into the prefill
        (a long prompt is fed in pieces): once it is true there, the stream ends with no
        further event."""
        return run_alone(self.steps(prompt, config), cancelled)

    def prepare(
        self,
        prompt: str | Sequence[int],
        config: GenerationConfig | None = None,
        prediction: EncodedPrediction | None = None,
    ) -> PreparedRun:
        """One generation set up with nothing left for the rounds but its passes (no model
        pass, no KV cache touched here, so a server runs this off the rounds every stream
        waits on): the prompt's ids, the drafter stack, which has read the prompt, the
        policy with its tables, the grammar's constraint and the random streams.
        ``prediction``: the config's prediction encoded ahead (``encode_prediction``), in its
        place; without it the config's is encoded here."""
        config = config or GenerationConfig()
        ids = self.encode(prompt)
        # A request's prediction is a source of its own, preferred to the engine's drafter's.
        # Its grammar masks every step; where there is a drafter, the grammar's forced text
        # is one more source and the others' drafts are cut to what it allows (plain
        # decoding stays token-by-token constrained decoding, the baseline).
        drafter = with_prediction(self.drafter, self.tokenizer, prediction or config.prediction)
        constraint = None
        if config.grammar is not None:
            if self.grammars is None:
                raise ValueError("a grammar needs the target's tokenizer (SpeculativeEngine(grammars=...))")
            constraint = self.grammars.constraint(config.grammar)
        if constraint is not None and drafter is not None:
            drafter = Constrained(drafter, constraint)
        policy = make_policy(config.draft, self.profile) if drafter is not None else FixedK(0)
        target_generator, drafter_generator = seeded_generators(config.sampling.seed)
        if drafter is not None:
            drafter.start(ids, config, drafter_generator)
        run = _Run(ids, config, self.target.eos_token_ids, self.tokenizer, policy, constraint)
        return PreparedRun(run, drafter, target_generator)

    def steps(self, prompt: str | Sequence[int] | PreparedRun, config: GenerationConfig | None = None) -> Steps:
        """One generation as the passes it needs and the events it makes, in order: it
        yields each pass (a ``Forward``) and is sent its scores, and yields each step's
        event (and is sent nothing). ``prompt``: a run ``prepare`` set up (then ``config`` is
        its own), or a prompt to prepare now. ``stream`` runs it alone; a server's scheduler
        runs many at once, their passes batched in rounds (``draftwise.scheduler``)."""
        prepared = prompt if isinstance(prompt, PreparedRun) else self.prepare(prompt, config)
        try:
            yield from self._steps(prepared.run, prepared.drafter, prepared.target_generator)
        finally:
            # 7. Whatever ended the run (its end, an error, Ctrl-C, a consumer that stopped
            # reading): the target frees what the run held (a remote verifier's session).
            self.target.finish()

    def _steps(self, run: _Run, drafter: Drafter | None, target_generator: torch.Generator | None) -> Steps:
        # 1. Prefill the target with the prompt (the drafter read it when the run was
        # prepared; a draft model feeds it lazily, on its first proposal).
        started = time.perf_counter()
        yield from self.target.start(run.context, run.config, target_generator)
        run.prefill_seconds = time.perf_counter() - started

        while not run.finished:
            step_started = time.perf_counter()
            # 2. Choose what to draft: a source the drafter offers and a length, or nothing.
            choice = run.choose(drafter)
            try:
                # 3. Draft.
                proposal = (
                    (yield from drafter.propose(run.context, choice.k, choice.source))
                    if drafter is not None and choice.k > 0
                    else EMPTY_PROPOSAL
                )
                drafted = time.perf_counter()
                # 4. Verify the whole block in one target pass (under the grammar's masks).
                check = yield from self.target.verify(run.context, proposal, run.masks(proposal))
            except TargetError as refusal:
                # A full context (target's or draft's) or a verifier gone away: end with the
                # text so far and a finish reason instead of raising it away.
                yield run.end(refusal)
                return
            # A grammar's dead end (``GrammarDeadEnd``, from the masks above or the commit
            # below) is raised out of the run, unlike the target's refusals: no text can
            # complete the answer under its grammar, so no finish reason fits (a "stop" would
            # pass the broken text off as complete).
            verified = time.perf_counter()
            # 5. Commit what was kept (stops, budget), tell the drafter and the policy.
            observe = drafter.observe if drafter is not None else None
            event = run.commit(
                choice, proposal, check, drafted - step_started, verified - drafted, step_started, observe
            )
            # 6. Hand the step to whoever runs the stream.
            yield event

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> GenerationResult:
        """Generate to the end and return tokens, text and metrics."""
        prompt_ids = self.encode(prompt)
        return GenerationResult.from_events(prompt_ids, list(self.stream(prompt_ids, config)))


def autoregressive(target: LanguageModel) -> SpeculativeEngine:
    """The plain-decoding baseline: the same loop and model wrapper, with no drafter."""
    return SpeculativeEngine.from_models(target, None)
