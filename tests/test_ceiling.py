"""The copy ceiling: the most drafting from earlier text could give a workload on a host's curve."""

from __future__ import annotations

import json

import pytest

from draftwise.bench.ceiling import Oracle, copy_ceiling, copyable, fastest, host_limit, suffix_recordings
from draftwise.bench.replay import in_turn, replay
from draftwise.config import DraftConfig, GenerationConfig, SuffixConfig
from draftwise.policies import FixedK
from draftwise.profile import CostProfile

from cli_support import run_cli_here

CURVE = {1: 1.0, 2: 1.5, 3: 1.8, 4: 2.4}


def test_the_docstring_s_example_one_block_and_its_bonus_token():
    assert copyable([1, 2, 3, 9], [[0, 1, 2, 3, 5]], longest=10) == [3, 2, 1, 0]
    assert fastest([3, 2, 1, 0], CURVE.__getitem__) == pytest.approx(2.4)
    assert fastest([0, 0, 0, 0], CURVE.__getitem__) == pytest.approx(4.0)  # nothing to copy: plain steps
    assert fastest([3, 2, 1, 0], lambda rows: float(rows)) == pytest.approx(4.0)  # rows at plain cost: no gain


def test_a_draft_model_always_right_drafts_past_the_copies_at_its_price():
    # Nothing to copy in a b c d: the oracle drafts a b c at 0.1 each, verified in a pass of 4
    # rows whose last gives d, 2.4 + 0.3 against 4 plain steps (2 drafted and a step: 3.0).
    assert fastest([0, 0, 0, 0], CURVE.__getitem__, Oracle(0.1, 8, 63)) == pytest.approx(2.7)
    assert fastest([0, 0, 0, 0], CURVE.__getitem__, Oracle(0.1, 1, 63)) == pytest.approx(1.6 + 1.6)  # blocks of 1
    assert fastest([3, 2, 1, 0], CURVE.__getitem__, Oracle(0.1, 8, 63)) == pytest.approx(2.4)  # the copy is free
    assert fastest([0, 0, 0, 0], CURVE.__getitem__, Oracle(1.0, 8, 63)) == pytest.approx(4.0)  # a step a token: no gain
    assert fastest([0, 0, 0, 0], CURVE.__getitem__, Oracle(0.1, 8, 2)) == pytest.approx(2.0 + 1.0)  # 2 in all a block
    turns = [([1, 2], [7, 8, 9, 10])] * 2 + [([1, 2], [3, 4, 5, 6])]
    found = copy_ceiling(turns, CURVE.__getitem__, longest=3, start=3, oracle=Oracle(0.1, 8, 63))
    assert found.speedup == pytest.approx(1.0) and found.oracle_speedup == pytest.approx(4.0 / 2.7)
    assert copy_ceiling(turns, CURVE.__getitem__, longest=3, start=3).oracle_speedup is None


def test_an_answer_copies_itself_only_from_what_it_has_written():
    # 5 6 5 6 5 6 7: the second "5 6" copies the first; the third copies a "5 6" whose next
    # token, 5, is not the 7 it needs; "6 7" nowhere, a lone 6 earlier.
    assert copyable([5, 6, 5, 6, 5, 6, 7], [], longest=10) == [0, 0, 2, 2, 2, 1, 0]
    assert copyable([5, 6, 5, 6], [[5, 6, 5, 6, 8]], longest=3) == [3, 3, 2, 1]


def test_an_answer_repeated_word_for_word_is_one_block_from_the_third_request_on():
    answer = list(range(10, 20))
    turns = [([1, 2], answer)] * 4
    linear = {rows: 1.0 + 0.25 * (rows - 1) for rows in range(1, 65)}
    found = copy_ceiling(turns, linear.__getitem__, longest=63, start=3)
    assert (found.answers, found.tokens) == (2, 20)
    # Each of the last two: 9 tokens drafted and the tenth the target's own, one pass of 10 rows.
    assert found.seconds == pytest.approx(2 * linear[10]) and found.plain_seconds == pytest.approx(20.0)
    assert found.speedup == pytest.approx(10 / linear[10])
    assert copy_ceiling(turns[:1], linear.__getitem__, 63, start=1).speedup == pytest.approx(1.0)  # nothing earlier


def test_the_host_limit_is_the_best_rows_per_plain_step():
    assert host_limit(CURVE.__getitem__, 4) == pytest.approx(max(2 / 1.5, 3 / 1.8, 4 / 2.4))


def _host(curve: dict[int, float]) -> CostProfile:
    host = CostProfile()
    for rows, seconds in curve.items():
        host.pass_times.add(rows, seconds)
    return host


def test_a_sequence_s_answers_are_walked_with_the_suffix_source_over_the_answers_before_each():
    answer = list(range(100, 140))
    turns = [([1, 2, 3], answer)] * 3
    first, _, third = suffix_recordings(turns, GenerationConfig(max_new_tokens=64), SuffixConfig())
    assert not any(o.source == "suffix" for p in first.positions for o in p.offers)  # nothing written before
    opening = third.positions[0]
    assert [o.source for o in opening.offers] == ["suffix"] and list(opening.blocks["suffix"]) == answer
    assert third.continuation == tuple(answer) and third.budget == 64
    cheap = _host({1: 0.05, 4: 0.06, 16: 0.08, 64: 0.2})
    plain, policy = in_turn([first, _, third], cheap, DraftConfig(), start=3)
    assert plain == pytest.approx(len(answer) / replay(third, FixedK(0), cheap, ()).seconds)
    assert policy > 2 * plain  # the third answer is the first one again: long blocks on a cheap curve


def _load_results(tmp_path, answers: dict[str, str]):
    data = tmp_path / "prompts.jsonl"
    results = tmp_path / "results.jsonl"
    lines, records = [], []
    for n, (pid, text) in enumerate(answers.items(), 1):
        lines.append(json.dumps({"id": pid, "subtask": "template", "turns": [f"Record {n}: write it out."]}))
        for server in ("draftwise-off", "llama-server"):
            request = {"kind": "request", "server": server, "concurrency": 1, "prompt_id": pid, "ok": True}
            records.append(json.dumps(request | {"text": text if server == "draftwise-off" else "other"}))
    data.write_text("\n".join(lines) + "\n")
    results.write_text("\n".join(records) + "\n")
    return data, results


def test_a_load_run_s_answers_through_the_cli_give_each_host_s_ceiling(tmp_path):
    same = '{"type": "function", "function": {"name": "dedent", "parameters": {"type": "object"}}}'
    data, results = _load_results(tmp_path, {f"p{i}": same for i in range(1, 5)})
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"pass_ms": {"1": 50, "4": 60, "16": 120, "64": 400}, "draft_token_ms": {"model": 5}}))
    args = ["replay", "--answers", str(results), "--data", str(data), "--target", "tiny:0", "--hosts", str(host)]
    done = run_cli_here(*args)
    assert done.returncode == 0, done.stderr
    assert "the copy ceiling on host" in done.stdout
    row = next(line for line in done.stdout.splitlines() if "template" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[:2] == ["template", "2"]
    plain, policy, over, ceiling = float(cells[3]), float(cells[4]), cells[5], float(cells[6].rstrip("x"))
    assert plain == pytest.approx(20.0, abs=0.1) and float(over.rstrip("x")) == pytest.approx(policy / plain, abs=0.02)
    assert ceiling > 2.0 and 1.0 < policy / plain <= ceiling + 0.01  # repeated whole: long blocks
    assert len(cells) == 8 and float(cells[7].rstrip("x")) >= ceiling  # the oracle (draft_token_ms) adds to copies
    other = run_cli_here(*args[:-2], "--hosts", str(host), "--answers-of", "draftwise")
    assert other.returncode == 2 and "holds no answer of draftwise at one client" in other.stderr
