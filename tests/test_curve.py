"""``draftwise curve``: the pass curve through the real CLI on a tiny model, its JSON record,
and its one-line errors."""

from __future__ import annotations

import json

import pytest

from draftwise.backends.tiny import tiny_lm
from draftwise.bench.curve import CurveConfig, CurvePoint, measure, sure_limit
from draftwise.config import ModelOptions

from cli_support import run_cli, run_cli_here


def test_each_size_is_timed_after_the_context_and_set_against_one_row():
    points = measure(tiny_lm(0), CurveConfig(rows=(4, 2), context=32, repeats=1))
    assert [p.rows for p in points] == [2, 4]  # one row is timed as the unit, not reported
    for p in points:
        assert p.ms > 0 and p.ms_per_row == pytest.approx(p.ms / p.rows)
        assert p.rows_per_s == pytest.approx(1e3 * p.rows / p.ms)


def test_the_model_gets_room_for_the_context_and_the_largest_pass():
    config = CurveConfig(rows=(1, 64), context=1000)
    assert config.model_options(ModelOptions()).context == 1064
    assert config.model_options(ModelOptions(context=4096)).context == 4096


def test_a_curve_through_the_cli_is_tabled_and_recorded(tmp_path):
    out = tmp_path / "curve.json"
    done = run_cli(
        "curve", "--target", "tiny:0", "--rows", "1,2,8", "--context", "16", "--repeats", "1", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert [p["rows"] for p in record["points"]] == [1, 2, 8]
    assert record["points"][0]["steps"] == pytest.approx(1.0)
    assert record["config"]["context"] == 16 and record["cpu"] and record["threads"] >= 1
    assert "plain steps" in done.stdout and f"host profile: {out}" in done.stderr
    assert "sure drafts: at most" in done.stderr and record["sure_drafts"]["rows"] in (1, 2, 8)


def test_the_sure_drafts_limit_is_the_pass_with_the_most_rows_per_step():
    def point(rows: int, steps: float) -> CurvePoint:
        return CurvePoint(rows=rows, ms=steps, ms_per_row=steps / rows, rows_per_s=rows / steps, steps=steps)

    best = sure_limit([point(1, 1.0), point(4, 2.4), point(16, 8.3), point(32, 17.0)])
    assert best is not None and best.rows == 16  # 1.93x, against 1.67x at 4 and 1.88x at 32
    assert sure_limit([]) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--rows", "1,x"], "--rows: expected comma-separated whole numbers"), (["--rows", "0,4"], "between 1 and 512")],
)
def test_bad_sizes_are_one_line(args, message):
    done = run_cli_here("curve", "--target", "tiny:0", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
