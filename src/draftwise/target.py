"""The target side: score a proposed block in one pass and apply the acceptance rule.

``Target`` is the seam between the decode loop and wherever the target model runs: in this
process (``LocalTarget``) or behind a remote verifier server. Both apply the same
functions from ``draftwise.verify``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from draftwise.config import GenerationConfig
from draftwise.drafters import Proposal
from draftwise.lm import Forward, LanguageModel, Passes, PassInfo, prefill, sync
from draftwise.verify import Verdict, verify


@dataclass(frozen=True)
class Verification:
    verdict: Verdict
    target_token_probs: list[float]  # p(x_i) of each proposed token under the configured distribution
    extra: dict[str, Any] = field(default_factory=dict)  # backend timings, copied into StepEvent.extra
    # The target pass behind the verdict: its rows (other sequences' included, where the
    # backend batches them) and its time; None where unknown (a remote target).
    pass_info: PassInfo | None = None


class Target(Protocol):
    eos_token_ids: tuple[int, ...]

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> Passes[None]:
        """Begin a new sequence (prefill everything but the last prompt token); whoever runs
        the passes may stop between two (the sequence is then abandoned)."""

    def verify(
        self, context: Sequence[int], proposal: Proposal, mask: torch.Tensor | None = None
    ) -> Passes[Verification]:
        """Score ``proposal`` after ``context`` in one pass and decide what to keep; ``mask``
        ``[k + 1, W]`` (an int32 bitmask, ``draftwise.verify.pack_bits``): the tokens allowed at
        each row (a grammar), None for all."""

    def finish(self) -> None:
        """The sequence is over (finished, failed or abandoned): free what ``start`` set up.
        The engine calls it once per run, whatever ended the run."""


class LocalTarget:
    """The target model in this process."""

    def __init__(self, lm: LanguageModel) -> None:
        self.lm = lm
        self.eos_token_ids = lm.eos_token_ids
        self._config = GenerationConfig()
        self._generator: torch.Generator | None = None

    def start(self, prompt: Sequence[int], config: GenerationConfig, generator: torch.Generator | None) -> Passes[None]:
        self._config = config
        self._generator = generator
        return prefill(self.lm, prompt)

    def verify(
        self, context: Sequence[int], proposal: Proposal, mask: torch.Tensor | None = None
    ) -> Passes[Verification]:
        # The newest committed token is never in the cache yet: it is fed together with the
        # block, and row i of the scores judges proposal token i (row k gives the bonus).
        feed = sync(self.lm, context) + proposal.tokens.tolist()
        k = len(proposal)
        started = time.perf_counter()
        logits = yield Forward(self.lm, feed, last=k + 1)  # [k + 1, V]
        info = self.lm.last_pass or PassInfo(len(feed), time.perf_counter() - started)
        s = self._config.sampling
        verdict, token_probs = verify(
            proposal.tokens,
            proposal.probs,
            logits,
            s.temperature,
            s.top_k,
            s.top_p,
            self._generator,
            mask,
            proposal.refused,
        )
        # Keep the accepted tokens; the next token is fed with the next block.
        self.lm.rollback(len(context) + verdict.n_accepted)
        return Verification(
            verdict=verdict,
            target_token_probs=token_probs.tolist(),
            extra={"pass_rows": info.rows},
            pass_info=info,
        )

    def finish(self) -> None:
        pass  # the cache stays: the next start overwrites it, and freeing it would cost a reallocation
