"""A target whose greedy continuation is a fixed script: the loop's logic without model numerics."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftwise.drafters import Proposal
from draftwise.target import Verification
from draftwise.verify import verify_greedy


class ScriptedTarget:
    """A target whose greedy continuation is a fixed script (then EOS forever)."""

    def __init__(self, script: Sequence[int], eos: int = 256) -> None:
        self.script = list(script)
        self.eos_token_ids = (eos,)
        self._prompt_len = 0

    def start(self, prompt, config, generator):
        yield from ()  # no pass
        self._prompt_len = len(prompt)

    def verify(self, context, proposal: Proposal, mask=None):
        yield from ()  # no pass
        done = len(context) - self._prompt_len
        wanted = (self.script[done:] + [self.eos_token_ids[0]] * (len(proposal) + 1))[: len(proposal) + 1]
        logits = torch.full((len(wanted), 257), -10.0)
        logits[torch.arange(len(wanted)), torch.tensor(wanted)] = 10.0
        verdict = verify_greedy(proposal.tokens, logits)
        return Verification(verdict=verdict, target_token_probs=[1.0] * len(proposal))

    def finish(self) -> None:
        pass
