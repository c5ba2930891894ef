"""The Streamlit page: a live run (with its plain-target twin and charts) and a bench report view.

Only layout and widgets live here; parsing, HTML and chart tables are in the sibling modules.
The page is a client of a running draftwise API (``DRAFTWISE_API_URL``, editable in the
sidebar); ``draftwise dashboard`` starts one when not given a URL.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, get_args

import streamlit as st

from draftwise.config import DRAFTER_NAMES, NEEDS_DRAFT_MODEL, DraftConfig, GenerationConfig, KPolicyName
from draftwise.dashboard import charts
from draftwise.dashboard.client import API_URL_ENV, DEFAULT_API_URL, ApiClient, DashboardApiError, RunRequest
from draftwise.dashboard.live import ACCEPTED, BONUS, CORRECTED, LiveRun, compare
from draftwise.dashboard.render import LINE_COLOURS, legend_html, tokens_html
from draftwise.dashboard.report import ReportError, load_bench, method_table, record_table
from draftwise.scale import API_KEY_ENV

BENCH_DIR_ENV = "DRAFTWISE_BENCH_DIR"
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."
DRAFTERS = DRAFTER_NAMES
K_POLICIES: tuple[str, ...] = get_args(KPolicyName)
CHART_EVERY_S = 0.5  # redraw charts at most this often while tokens stream in (tokens redraw every step)
DEFAULT_MAX_TOKENS = 96  # short enough to watch a plain-target twin finish too on a small CPU


def _bounds(model: Any, name: str) -> tuple[Any, Any]:
    """(ge, le) of a pydantic field: widget ranges come from the config, not restated here."""
    low = high = None
    for rule in model.model_fields[name].metadata:
        low = getattr(rule, "ge", low)
        high = getattr(rule, "le", high)
    return low, high


def _default(model: Any, name: str) -> Any:
    return model.model_fields[name].default


@dataclass
class Slots:
    """Where one run is drawn: header metrics and the token box."""

    metrics: Any
    tokens: Any


def _draw_metrics(slot: Any, run: LiveRun) -> None:
    with slot.container():
        a, b, c, d = st.columns(4)
        a.metric("tokens", len(run.tokens))
        b.metric("target passes", run.passes)
        rate = run.acceptance_rate
        c.metric("acceptance", "n/a" if rate is None else f"{rate:.0%}")
        d.metric("tokens/s", f"{run.tokens_per_second:.1f}")


def _draw_run(slots: Slots, run: LiveRun, placeholder: str) -> None:
    _draw_metrics(slots.metrics, run)
    slots.tokens.markdown(tokens_html(run, placeholder), unsafe_allow_html=True)


def _draw_charts(slot: Any, run: LiveRun) -> None:
    if not run.steps:
        return
    with slot.container():
        left, right = st.columns(2)
        with left:
            st.caption("Draft length asked (k), proposed and accepted, per target pass")
            # Accepted last, so it is drawn on top where every proposal was kept.
            st.line_chart(
                charts.per_step(run)[["k", "proposed", "accepted"]],
                height=220,
                color=[LINE_COLOURS["other"], LINE_COLOURS[CORRECTED], LINE_COLOURS[ACCEPTED]],
            )
            st.caption("Tokens produced vs target passes")
            st.line_chart(charts.tokens_vs_passes(run), height=220, color=[LINE_COLOURS[BONUS], LINE_COLOURS["other"]])
        with right:
            st.caption("Acceptance by position in the draft block")
            st.bar_chart(charts.acceptance_by_position(run)[["acceptance"]], height=220, color=LINE_COLOURS[ACCEPTED])
            st.caption("Running tokens/s (prefill included)")
            st.line_chart(charts.running_rate(run), height=220)
        why = charts.policy_view(run)
        if why["arm taken"].notna().any():
            st.caption("Why each block: expected tokens/s of the arm the policy took, and of plain decoding")
            st.line_chart(why, height=200, color=[LINE_COLOURS[ACCEPTED], LINE_COLOURS["other"]])


def _stream_into(client: ApiClient, body: dict[str, Any], run: LiveRun, slots: Slots, chart_slot: Any | None) -> None:
    """Generate, drawing every step as it arrives; errors end up in ``run.error``."""
    started = time.perf_counter()
    last_chart = 0.0
    try:
        for chunk in client.stream(body):
            run.add_chunk(chunk, time.perf_counter() - started)
            _draw_run(slots, run, "waiting for the first tokens ...")
            if chart_slot is not None and time.perf_counter() - last_chart > CHART_EVERY_S:
                _draw_charts(chart_slot, run)
                last_chart = time.perf_counter()
    except DashboardApiError as exc:
        run.error = str(exc)
    _draw_run(slots, run, "no tokens")
    if chart_slot is not None:
        _draw_charts(chart_slot, run)


def _drafting_settings(health: dict[str, Any] | None) -> dict[str, Any]:
    """The sidebar's drafting settings: the drafters the server offers, and the draft policy."""
    sb = st.sidebar
    offered = [d for d in DRAFTERS if d not in NEEDS_DRAFT_MODEL or (health or {}).get("draft")]
    server_default = (health or {}).get("drafter")
    drafter = sb.selectbox(
        "Drafter",
        offered,
        index=offered.index(server_default) if server_default in offered else 0,
        key="drafter",
        help="model: the server's draft model; ngram: prompt lookup; hybrid: lookup "
        "where the context repeats, the model elsewhere; off: plain decoding",
    )
    k_policy = sb.selectbox(
        "k policy",
        K_POLICIES,
        index=K_POLICIES.index(_default(DraftConfig, "k_policy")),
        key="k_policy",
        help=DraftConfig.model_fields["k_policy"].description,
    )
    k_low, k_high = _bounds(DraftConfig, "k")
    k = sb.number_input(
        "k (draft length; start for adaptive policies)", k_low, k_high, _default(DraftConfig, "k"), key="k"
    )
    km_low, km_high = _bounds(DraftConfig, "k_max")
    k_max = sb.number_input("k max", km_low, km_high, _default(DraftConfig, "k_max"), key="k_max")
    threshold = sb.slider(
        "Confidence threshold",
        0.0,
        1.0,
        float(_default(DraftConfig, "confidence_threshold")),
        0.05,
        key="threshold",
        help=DraftConfig.model_fields["confidence_threshold"].description,
    )
    return {
        "drafter": drafter,
        "k_policy": k_policy,
        "k": int(k),
        "k_max": int(k_max),
        "confidence_threshold": float(threshold),
    }


def _settings(health: dict[str, Any] | None) -> dict[str, Any]:
    """The sidebar's generation settings; defaults come from the config classes and the server."""
    sb = st.sidebar
    sb.subheader("Generation")
    drafting = _drafting_settings(health)
    temperature = sb.slider("Temperature (0 = greedy)", 0.0, 2.0, 0.0, 0.05, key="temperature")
    seed = sb.number_input("Seed", 0, 2**31 - 1, 0, key="seed", help="sampling seed (temperature > 0)")
    max_tokens = sb.number_input(
        "Max tokens", *_bounds(GenerationConfig, "max_new_tokens"), DEFAULT_MAX_TOKENS, key="max_tokens"
    )
    prompt_format = sb.radio(
        "Prompt format",
        ("chat", "completion"),
        key="format",
        horizontal=True,
        help="chat: the target's chat template; completion: the raw text",
    )
    side_by_side = sb.checkbox("Also run the plain target (side by side)", True, key="side_by_side")
    return {
        **drafting,
        "temperature": float(temperature),
        "seed": int(seed),
        "max_tokens": int(max_tokens),
        "chat": prompt_format == "chat",
        "side_by_side": side_by_side,
    }


def _comparison(spec: LiveRun, plain: LiveRun, greedy: bool) -> None:
    result = compare(spec, plain)
    a, b, c, d = st.columns(4)
    a.metric(f"speculative ({spec.drafter}) tokens/s", f"{result.speculative_rate:.1f}")
    b.metric("plain target tokens/s", f"{result.plain_rate:.1f}")
    c.metric("speedup", "n/a" if result.speedup is None else f"{result.speedup:.2f}x")
    d.metric("outputs identical", "yes" if result.identical else f"no (from token {result.first_difference})")
    note = "Rates are the engine's own (server-side, no HTTP). "
    if greedy and not result.identical:
        note += (
            "Greedy outputs should match; a difference at a near-tie of the target's top-2 probabilities comes "
            "from float rounding in different matrix shapes."
        )
    elif not greedy:
        note += "Sampling is lossless in distribution, not token for token: different tokens are expected."
    st.caption(note)


def _server(client: ApiClient) -> dict[str, Any] | None:
    """The server's /health, shown in the sidebar; None (and the reason, on the page) if it cannot be had."""
    try:
        health = client.health()
    except DashboardApiError as exc:
        st.error(str(exc))
        return None
    st.sidebar.caption(
        f"serving **{health.get('model')}**, draft **{health.get('draft') or 'none'}**, "
        f"default drafter **{health.get('drafter')}**"
    )
    return health


def _generate(
    client: ApiClient,
    model: str,
    prompt: str,
    prediction: str,
    options: dict[str, Any],
    spec_slots: Slots,
    plain_slots: Slots,
    chart_slot: Any,
) -> bool:
    """Run the prompt speculatively, then (if asked) on the plain target; keep both runs for reruns.
    False when the settings were refused (the reason is on the page)."""
    try:
        settings = {k: v for k, v in options.items() if k != "side_by_side"}
        request = RunRequest.build(prompt=prompt, prediction=prediction, **settings)
    except DashboardApiError as exc:
        st.error(str(exc))
        return False
    spec = LiveRun(drafter=request.drafter)
    plain = LiveRun(drafter="off") if options["side_by_side"] else None
    st.session_state["runs"] = (spec, plain, request.temperature == 0)
    if plain is not None:
        _draw_run(plain_slots, plain, "runs once the speculative run has finished")
    _stream_into(client, request.body(model), spec, spec_slots, chart_slot)
    if plain is not None and spec.error is None:
        _stream_into(client, request.body(model, drafter="off"), plain, plain_slots, None)
    return True


def live_view() -> None:
    st.title("draftwise: watch speculation happen")
    st.markdown(legend_html(), unsafe_allow_html=True)
    api_url = st.sidebar.text_input("API URL", os.environ.get(API_URL_ENV, DEFAULT_API_URL), key="api_url")
    client = ApiClient(api_url, api_key=os.environ.get(API_KEY_ENV))
    health = _server(client)
    options = _settings(health)
    prompt = st.text_area("Prompt", DEFAULT_PROMPT, key="prompt", height=90)
    prediction = st.text_area(
        "Prediction (optional)",
        "",
        key="prediction",
        height=68,
        help="the expected output, such as the file an edit sends back (OpenAI's Predicted Outputs): drafted "
        "from wherever the output follows it; its accepted tokens show in their own colour",
    )
    go = st.button("Generate", type="primary", disabled=health is None, key="generate")

    spec_col, plain_col = st.columns(2)
    spec_col.subheader("Speculative")
    plain_col.subheader("Plain target")
    spec_slots = Slots(spec_col.empty(), spec_col.empty())
    plain_slots = Slots(plain_col.empty(), plain_col.empty())
    compare_slot = st.container()
    st.subheader("This run, step by step")
    chart_slot = st.empty()

    if go and health is not None:
        if not _generate(
            client, str(health["model"]), prompt, prediction, options, spec_slots, plain_slots, chart_slot
        ):
            return

    runs = st.session_state.get("runs")
    if runs is None:
        spec_slots.tokens.markdown(tokens_html(LiveRun("none"), "press Generate to start"), unsafe_allow_html=True)
        return
    spec, plain, greedy = runs
    if not go:  # a rerun (a widget changed): redraw the last run as it ended
        _draw_run(spec_slots, spec, "no tokens")
        if plain is not None:
            _draw_run(plain_slots, plain, "no tokens")
        _draw_charts(chart_slot, spec)
    spec_col.caption(
        f"drafter **{spec.drafter}**: {spec.count(ACCEPTED)} accepted, {spec.count(CORRECTED)} "
        f"corrected, {spec.count(BONUS)} bonus; finish: {spec.finish_reason or 'n/a'}"
    )
    for run in (spec, plain):
        if run is not None and run.error:
            st.error(run.error)
    with compare_slot:
        if plain is not None and spec.tokens and plain.tokens and not plain.error:
            _comparison(spec, plain, greedy)


def report_view() -> None:
    st.title("draftwise bench report")
    path = st.text_input(
        "Bench output folder (or its results.jsonl / summary.json)",
        os.environ.get(BENCH_DIR_ENV, "draftwise-bench"),
        key="bench_path",
    )
    try:
        results = load_bench(path)
    except ReportError as exc:
        st.info(f"{exc}. Run `draftwise bench --quick` to make one.")
        return
    st.caption(results.headline())
    group = st.selectbox("Subtask", results.groups, key="bench_group")
    if group is None:  # no results to group
        return
    st.dataframe(method_table(results, group), width="stretch")
    method = st.selectbox("Method", results.methods, key="bench_method")
    if method is None:
        return
    st.dataframe(record_table(results, group, method), width="stretch", hide_index=True)
    if results.plots:
        st.subheader("Plots (whole run)")
        for column, plot in zip(st.columns(len(results.plots)), results.plots, strict=True):
            column.image(str(plot), caption=plot.stem)
    if results.report_md:
        with st.expander("report.md"):
            st.markdown(results.report_md)


def main() -> None:
    st.set_page_config(page_title="draftwise dashboard", layout="wide")
    view = st.sidebar.radio("View", ("Live run", "Bench report"), key="view", horizontal=True)
    if view == "Live run":
        live_view()
    else:
        report_view()
