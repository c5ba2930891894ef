"""HTML of a run's tokens, coloured by provenance, and the legend that explains the colours.

Each token is a ``<span class="dw-tok dw-SOURCE">`` whose ``title`` (the hover text) gives
the probabilities that decided it. A correction is preceded by the drafter's proposals it
replaced, struck through (``dw-rejected``). Token text is escaped, and control characters
are drawn as their visible Unicode pictures so that byte-level junk stays visible.
"""

from __future__ import annotations

import html

from draftwise.dashboard.live import (
    ACCEPTED,
    BONUS,
    CORRECTED,
    PREDICTED,
    PREDICTION_SOURCE,
    RECALLED,
    SUFFIX_SOURCE,
    DraftToken,
    LiveRun,
    TokenView,
)

# token backgrounds
COLOURS = {ACCEPTED: "#b7ebc0", PREDICTED: "#e3cdf7", RECALLED: "#fbe7a1", CORRECTED: "#ffc9a8", BONUS: "#b9d9ff"}
LINE_COLOURS = {ACCEPTED: "#2e9e4f", CORRECTED: "#e8743b", BONUS: "#1f6fd1", "other": "#9e9e9e"}  # charts
MEANING = {
    ACCEPTED: "accepted draft token: proposed by the drafter, kept by the target",
    PREDICTED: "accepted prediction token: drafted from the request's prediction, kept by the target",
    RECALLED: "accepted recalled token: drafted from the server's earlier answers, kept by the target",
    CORRECTED: "target correction: the target's own token where it rejected the draft",
    BONUS: "bonus token: the target's next token after it accepted the whole draft (or with nothing drafted)",
    "rejected": "rejected proposal (struck through): drafted, then thrown away",
}

# Accepted tokens of these drafter sources get a colour of their own.
SHOWN_APART = {PREDICTION_SOURCE: PREDICTED, SUFFIX_SOURCE: RECALLED}

STYLE = f"""<style>
.dw-box {{ font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 0.92rem; line-height: 1.9;
  white-space: pre-wrap; word-break: break-word; padding: 0.6rem 0.8rem; border: 1px solid #ddd;
  border-radius: 0.4rem; min-height: 3rem; }}
.dw-tok {{ border-radius: 0.2rem; padding: 0.05rem 0; }}
.dw-accepted {{ background: {COLOURS[ACCEPTED]}; }}
.dw-predicted {{ background: {COLOURS[PREDICTED]}; }}
.dw-recalled {{ background: {COLOURS[RECALLED]}; }}
.dw-corrected {{ background: {COLOURS[CORRECTED]}; }}
.dw-bonus {{ background: {COLOURS[BONUS]}; }}
.dw-rejected {{ color: #c0392b; text-decoration: line-through; opacity: 0.75; font-size: 0.8em; }}
.dw-legend span {{ margin-right: 1rem; white-space: nowrap; }}
</style>"""


def visible(text: str) -> str:
    """Escape for HTML, showing control characters (other than newline and tab) as symbols."""
    shown = "".join(
        chr(0x2400 + ord(c)) if (ord(c) < 32 and c not in "\n\t") else ("\u2421" if ord(c) == 127 else c) for c in text
    )
    return html.escape(shown, quote=True)


def _prob(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _rejected_html(draft: DraftToken) -> str:
    label = draft.text if draft.text is not None else f"#{draft.id}"
    if draft.checked:
        why = f"rejected draft token {draft.id}: draft q={_prob(draft.draft_prob)}, target p={_prob(draft.target_prob)}"
    else:
        why = f"discarded draft token {draft.id} (after the first rejection): draft q={_prob(draft.draft_prob)}"
    return f'<span class="dw-rejected" title="{html.escape(why, quote=True)}">{visible(label)}</span>'


def token_title(token: TokenView) -> str:
    """The hover text of one token."""
    head = f"step {token.step + 1}, token {token.id}: {token.source}"
    if token.drafted_by is not None:
        head += f" (drafted by {token.drafted_by})"
    if token.source == ACCEPTED:
        return f"{head}; draft q={_prob(token.draft_prob)}, target p={_prob(token.target_prob)}"
    if token.source == CORRECTED and token.rejected:
        first = token.rejected[0]
        return (
            f"{head}; replaced draft token {first.id} (draft q={_prob(first.draft_prob)}, "
            f"target p={_prob(first.target_prob)})"
        )
    if token.source == BONUS:
        return f"{head}; the target's own next token"
    return head


def token_html(token: TokenView) -> str:
    rejected = "".join(_rejected_html(d) for d in token.rejected)
    title = html.escape(token_title(token), quote=True)
    shown = SHOWN_APART.get(token.drafted_by or "", token.source) if token.source == ACCEPTED else token.source
    return f'{rejected}<span class="dw-tok dw-{shown}" title="{title}">{visible(token.text)}</span>'


def tokens_html(run: LiveRun, placeholder: str = "") -> str:
    """The whole run's tokens in one box (with the page's style block)."""
    body = "".join(token_html(t) for t in run.tokens) or f'<span style="color:#888">{html.escape(placeholder)}</span>'
    return f'{STYLE}<div class="dw-box">{body}</div>'


def legend_html() -> str:
    items = [
        f'<span><span class="dw-tok dw-{s}" title="{html.escape(MEANING[s])}">&nbsp;{s}&nbsp;</span> '
        f"{html.escape(MEANING[s].split(':')[0])}</span>"
        for s in (ACCEPTED, PREDICTED, RECALLED, CORRECTED, BONUS)
    ]
    items.append(
        f'<span><span class="dw-rejected">&nbsp;rejected&nbsp;</span> {html.escape(MEANING["rejected"])}</span>'
    )
    return (
        f'{STYLE}<div class="dw-legend">{"".join(items)}<span>hover a token for its draft and target '
        "probabilities</span></div>"
    )
