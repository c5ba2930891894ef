"""What a server drafted in a run, read from what it says of itself.

A speculative configuration that drafts nothing is plain decoding under another name, and the
gap between it and plain decoding is the host's drift, not speculation: on a 2-core host whose
speed wanders by tens of percent within minutes, a report must say which configurations drafted
at all before it ranks them. draftwise counts its draft tokens in ``/metrics`` (read before and
after the run's requests); llama-server writes, as each request ends, a line of the tokens it
drafted and kept for it (read from its log once it has stopped).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Drafted:
    """Draft tokens a server proposed and the target kept, over some requests."""

    proposed: int
    kept: int

    def __sub__(self, other: Drafted) -> Drafted:
        return Drafted(self.proposed - other.proposed, self.kept - other.kept)

    def record(self) -> dict[str, int]:
        return {"proposed": self.proposed, "kept": self.kept}


# llama-server's slot lines: "slot print_timing: id  0 | task 13 | <what>"; as a request ends,
# its prompt's timing, then (where it drafted) "draft acceptance = 0.5 (  12 accepted /  24 generated)".
_TASK = re.compile(r"\| task (\d+) \| (.*)$")
_TIMED = re.compile(r"prompt eval time =")
_ACCEPTANCE = re.compile(r"draft acceptance = [0-9.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


def from_llama_log(text: str, skip_first: bool) -> Drafted:
    """The draft tokens of every request a llama-server log reports, with ``skip_first``
    without the first request timed (the benchmark's warm-up, alone before the others)."""
    first: str | None = None
    proposed = kept = 0
    for line in text.splitlines():
        found = _TASK.search(line)
        if found is None:
            continue
        task, said = found.groups()
        if first is None and _TIMED.search(said):
            first = task
        acceptance = _ACCEPTANCE.search(said)
        if acceptance is not None and not (skip_first and task == first):
            kept += int(acceptance.group(1))
            proposed += int(acceptance.group(2))
    return Drafted(proposed, kept)


_COUNTER = re.compile(r"^draftwise_draft_tokens_(proposed|accepted)_total ([0-9.eE+-]+)$", re.MULTILINE)


def from_metrics(text: str) -> Drafted | None:
    """draftwise's counts of draft tokens in a ``/metrics`` page; None where it has none (a
    server that is not draftwise)."""
    values = {name: float(value) for name, value in _COUNTER.findall(text)}
    if "proposed" not in values:
        return None
    return Drafted(int(values["proposed"]), int(values.get("accepted", 0)))
