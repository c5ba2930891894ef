"""What one generation has produced so far (``Transcript``): its text, statistics and, where
the request asked for them, each token's provenance; and, where the answer may call tools,
its tool calls, whole (a finished answer) or piece by piece (a stream's deltas).

Both endpoints, streaming or not, keep one; ``draftwise.api.shapes`` dresses it as each
endpoint's response and chunk objects.
"""

from __future__ import annotations

import uuid
from typing import Any

from draftwise.api import responses as r
from draftwise.api.pool import Job
from draftwise.api.tools import CallStream, parse_tool_calls
from draftwise.api.translate import Plan
from draftwise.events import PREDICTION, StepEvent
from draftwise.lm import Tokenizer
from draftwise.metrics import GenerationMetrics
from draftwise.verify import TokenSource

# The engine says why it stopped; OpenAI has two words for it.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _provenance(event: StepEvent, tokenizer: Tokenizer) -> list[r.TokenProvenance]:
    """Where each token of a step came from, with the probabilities that decided it."""
    out = []
    for i, (token, source) in enumerate(zip(event.tokens, event.sources)):
        item = r.TokenProvenance(id=token, text=tokenizer.decode([token]), source=source.value)
        if source is TokenSource.ACCEPTED:
            item.draft_prob, item.target_prob = event.draft_probs[i], event.target_probs[i]
        elif source is TokenSource.CORRECTED and i < len(event.proposed):
            item.rejected = r.RejectedDraft(
                id=event.proposed[i], draft_prob=event.draft_probs[i], target_prob=event.target_probs[i]
            )
        out.append(item)
    return out


def step_info(event: StepEvent, tokenizer: Tokenizer) -> r.StepInfo:
    """The target pass behind a chunk: every proposal (kept or not) and the step's timings."""
    proposed = [
        r.DraftedToken(
            id=token,
            text=tokenizer.decode([token]),
            draft_prob=event.draft_probs[i],
            target_prob=event.target_probs[i] if i < len(event.target_probs) else None,
        )
        for i, token in enumerate(event.proposed)
    ]
    return r.StepInfo(
        index=event.step,
        k=event.k,
        source=event.source,
        proposed=proposed,
        n_accepted=event.n_accepted,
        prefill_seconds=event.prefill_seconds,
        draft_seconds=event.draft_seconds,
        verify_seconds=event.verify_seconds,
        step_seconds=event.step_seconds,
        arms=[r.WeighedArm(source=source, k=k, tokens_per_second=rate) for source, k, rate in event.arms],
    )


class Transcript:
    """What a generation produced so far: text, statistics and (if asked) provenance."""

    def __init__(self, request_plan: Plan, tokenizer: Tokenizer, job: Job) -> None:
        self.plan = request_plan
        self.tokenizer = tokenizer
        self.job = job
        self.metrics = GenerationMetrics()
        self.text: list[str] = []
        self.provenance: list[r.TokenProvenance] = []
        self.calls = CallStream()  # a stream's reading of the tool calls in its text

    def add(self, event: StepEvent) -> list[r.TokenProvenance] | None:
        """Take in a step; return its provenance when the request asked for it."""
        self.metrics.add(event)
        self.text.append(event.text)
        if not self.plan.provenance:
            return None
        step = _provenance(event, self.tokenizer)
        self.provenance.extend(step)
        return step

    def stream_pieces(self, new: str) -> tuple[str, list[r.ToolCallDelta]]:
        """What a stream sends for a step's ``new`` text: content, and where the answer may
        call tools, the calls as they go (``CallStream``: nothing of a call goes as content)."""
        if not self.plan.tools:
            return new, []
        return self._pieces(self.calls.push(new))

    def stream_rest(self) -> tuple[str, list[r.ToolCallDelta]]:
        """What a stream still holds back once the answer has ended."""
        return self._pieces(self.calls.flush()) if self.plan.tools else ("", [])

    def _pieces(self, pieces: list[tuple[str, str]]) -> tuple[str, list[r.ToolCallDelta]]:
        content, deltas = "", []
        # The reader has counted every call these pieces open: number them from the first.
        index = self.calls.calls - sum(kind == "call" for kind, _ in pieces) - 1
        for kind, value in pieces:
            if kind == "content":
                content += value
            elif kind == "call":
                index += 1
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                function = r.FunctionCallDelta(name=value)
                deltas.append(r.ToolCallDelta(index=index, id=call_id, type="function", function=function))
            elif deltas and deltas[-1].index == index:
                # One entry a call in a chunk: clients merge entries across chunks, not within one.
                deltas[-1].function.arguments += value
            else:
                deltas.append(r.ToolCallDelta(index=index, function=r.FunctionCallDelta(arguments=value)))
        return content, deltas

    def tool_calls(self) -> tuple[str, list[r.ToolCall]]:
        """(the content, the tool calls) of a finished answer; without calls, all is content."""
        text = "".join(self.text)
        if not self.plan.tools:
            return text, []
        content, calls = parse_tool_calls(text)
        return content, [
            r.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=r.FunctionCall(name=name, arguments=arguments))
            for name, arguments in calls
        ]

    @property
    def finish_reason(self) -> str | None:
        reason = _FINISH.get(self.metrics.finish_reason or "")
        if reason == "stop" and self.plan.tools and parse_tool_calls("".join(self.text))[1]:
            return "tool_calls"
        return reason

    def usage(self) -> r.Usage:
        prompt = len(self.plan.prompt)
        return r.Usage(
            prompt_tokens=prompt,
            completion_tokens=self.metrics.new_tokens,
            total_tokens=prompt + self.metrics.new_tokens,
            prompt_tokens_details=r.PromptTokensDetails(cached_tokens=self.job.cached_tokens),
            completion_tokens_details=self._prediction_details(),
        )

    def _prediction_details(self) -> r.CompletionTokensDetails | None:
        if self.plan.config.prediction is None:
            return None
        accepted, rejected = self.metrics.prediction_tokens(PREDICTION)
        return r.CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)

    def stats(self) -> dict[str, Any]:
        return {"drafter": self.plan.drafter, **self.metrics.to_dict()}
