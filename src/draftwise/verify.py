"""Verification: pure functions over tensors.

No model, no cache, no global randomness: the caller passes the target's scores, the
drafter's proposal and (for sampling) a ``torch.Generator``.

Vocabulary of outcomes, defined once here and used everywhere:

* **accepted**: a proposed draft token the target keeps.
* **corrected**: the token the target supplies at the first rejected position, in place of
  the rejected draft token.
* **bonus**: the token the target supplies after every proposed token was accepted (with an
  empty proposal this is simply the target's own next token: plain decoding).

Each verification therefore emits ``n_accepted + 1`` tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from draftwise.config import MIN_TEMPERATURE


class TokenSource(str, enum.Enum):
    ACCEPTED = "accepted"
    CORRECTED = "corrected"
    BONUS = "bonus"


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one proposed block.

    ``n_accepted`` draft tokens are kept, then ``next_token`` (a correction when
    ``n_accepted < n_proposed``, else a bonus). ``refused``: every proposed token was kept, but
    the draft had drawn one more that a grammar refused (cut from the block, see
    ``verify_sampling``), so ``next_token`` corrects that one.
    """

    n_accepted: int
    next_token: int
    n_proposed: int
    refused: bool = False

    @property
    def next_source(self) -> TokenSource:
        corrected = self.n_accepted < self.n_proposed or self.refused
        return TokenSource.CORRECTED if corrected else TokenSource.BONUS


def logits_to_probs(
    logits: torch.Tensor,  # [n, V] raw scores
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [n, V] float32 probabilities, rows sum to 1
    """Turn raw scores into the distribution the user configured.

    ``temperature == 0`` (greedy) returns the plain softmax: greedy decisions are made on
    argmax, the probabilities are only reported. A positive temperature must be at least
    ``MIN_TEMPERATURE`` (``SamplingConfig`` raises smaller ones to it). Top-k keeps exactly
    ``k`` tokens; top-p then keeps the most likely tokens while the mass before them is below
    ``top_p``, and always the most likely one.
    """
    scores = logits.float()
    if temperature <= 0:
        return scores.softmax(-1)
    if temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature:g} is below the floor of {MIN_TEMPERATURE:g} "
            "(scores / temperature would leave float32's range); SamplingConfig raises it to the floor"
        )
    scores = scores / temperature
    if not 0 < top_k < scores.shape[-1]:
        top_k = 0
    if not top_k and top_p >= 1.0:
        return scores.softmax(-1)
    # Only candidates are ordered, never the whole (often 150k-token) vocabulary: topk
    # returns its best already sorted, at a fraction of the cost of a full sort.
    if top_k:
        values, order = torch.topk(scores, top_k, dim=-1)  # [n, top_k], descending
        probs = values.softmax(-1)
    else:
        full = scores.softmax(-1)
        # The nucleus is usually a handful of tokens: grow the sorted candidates until they
        # hold top_p of the mass; every token past them is then dropped anyway.
        size = min(64, full.shape[-1])
        while True:
            probs, order = torch.topk(full, size, dim=-1)  # [n, size], descending
            # (cumsum, as below, so the test agrees exactly with the mass rule applied next)
            if size == full.shape[-1] or bool((probs.cumsum(-1)[..., -1] >= top_p).all()):
                break
            size = min(full.shape[-1], 8 * size)
    if top_p < 1.0:
        # Mass strictly before each token: a token is kept while that mass is < top_p. The
        # most likely token (mass before it: 0) is kept explicitly, because a top_p too small
        # for float32 (below ~1e-45) compares as 0 and would otherwise drop every token.
        drop = probs.cumsum(-1) - probs >= top_p
        drop[..., 0] = False
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(scores).scatter_(-1, order, probs)


def sample(
    probs: torch.Tensor,  # [V] probabilities (need not be normalised)
    generator: torch.Generator | None,
) -> int:
    """Draw one token by inverting the CDF with a single uniform.

    Same law as ``torch.multinomial(probs, 1)`` at a fraction of its fixed cost, which
    dominates for one draw. A zero-probability token is never drawn: its CDF step is flat.
    """
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, u, right=True))
    if index == cdf.shape[0]:  # u rounded up to the total mass: the last possible token
        index = int(torch.nonzero(probs > 0).max())
    return index


def _align_vocab(probs: torch.Tensor, size: int) -> torch.Tensor:
    """Pad (with zero mass) or cut the last dim to ``size``.

    Draft and target may disagree on the padded embedding size (e.g. Qwen pads its
    embedding matrix beyond the tokenizer); the extra ids are never real tokens.
    """
    have = probs.shape[-1]
    if have == size:
        return probs
    if have > size:
        return probs[..., :size]
    return torch.nn.functional.pad(probs, (0, size - have))


def _on_numpy(rows: torch.Tensor) -> bool:
    """Whether ``rows`` can be read as a numpy array: numpy's row-wise reductions run several
    times faster than torch's single thread over a long block of vocabulary-wide rows."""
    return rows.device.type == "cpu" and rows.dtype == torch.float32 and not rows.requires_grad


def row_argmax(rows: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n] long; the first of tied maxima
    if _on_numpy(rows):
        return torch.from_numpy(rows.numpy().argmax(-1))
    return rows.argmax(-1)


def row_logsumexp(rows: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n] float32
    if not _on_numpy(rows) or rows.shape[0] == 0:
        return torch.logsumexp(rows.float(), -1)
    scores = rows.numpy()
    top = scores.max(-1)
    shifted = np.subtract(scores, top[:, None])
    np.exp(shifted, out=shifted)
    return torch.from_numpy(top + np.log(shifted.sum(-1, dtype=np.float64)).astype(np.float32))


def verify_greedy(
    draft_tokens: torch.Tensor,  # [k] long
    target_logits: torch.Tensor,  # [k + 1, V]; row i scores the token after draft_tokens[:i]
    mask: torch.Tensor | None = None,  # [k + 1, W] int32 bitmask of the allowed tokens, or None
) -> Verdict:
    """Accept while the target's argmax (under ``mask``) equals the draft token.

    Example: draft ``[5, 7, 9]``, target argmax per row ``[5, 7, 2, 4]`` -> 2 accepted,
    correction ``2``. With argmax ``[5, 7, 9, 4]`` -> 3 accepted, bonus ``4``.
    """
    k = draft_tokens.shape[0]
    target_choice = masked_argmax(target_logits, mask)  # [k + 1]
    n_accepted = int((target_choice[:k] == draft_tokens).int().cumprod(0).sum()) if k else 0
    return Verdict(n_accepted=n_accepted, next_token=int(target_choice[n_accepted]), n_proposed=k)


def verify_sampling(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, V'] q per position; None = point mass on each draft token
    target_probs: torch.Tensor,  # [k + 1, V] p per position
    generator: torch.Generator | None,
    refused: torch.Tensor | None = None,  # [V'] q of row k, where the draft drew a token the mask refuses
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Token ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``, decided in
    log space. At the first rejection the correction is drawn from ``norm(max(0, p - q))``;
    if all ``k`` are accepted the bonus is drawn from ``p_k``. The emitted tokens are then
    distributed exactly as ``p`` alone would produce them.

    A drafter without probabilities (n-gram lookup) is a point mass ``q = onehot(x)``:
    accept with probability ``p(x)``; on rejection draw from ``p`` with ``x`` removed.

    Example: ``p_0 = [0.5, 0.5]``, ``q_0 = [1, 0]``, draft ``x_0 = 0``: accepted with
    probability 0.5; when rejected the correction is token 1 (``max(0, p - q) = [0, 0.5]``),
    so token 0 and token 1 each come out half the time, as under ``p``.

    Under a grammar a draft is cut before its first token the mask refuses (its ``p`` is 0
    there), which saves a verified row; that token was still drawn from ``q_k``, and is
    rejected as surely as if it were verified, so with ``refused`` (that ``q_k``) the token
    after an accepted block is drawn from ``norm(max(0, p_k - q_k))``, not from ``p_k``.
    Example: masked ``p_0 = [0.5, 0.5, 0]`` (token 2 refused), ``q_0 = [0.5, 0, 0.5]``: half
    the time the draft is token 0, accepted; the other half it is token 2, cut, and the
    correction comes from ``max(0, p - q) = [0, 0.5, 0]``, token 1: ``[0.5, 0.5, 0]``, as
    ``p``. Drawn from ``p_0`` instead, it would be ``[0.75, 0.25, 0]``.
    """
    k = draft_tokens.shape[0]
    vocab = target_probs.shape[-1]
    if k:
        p_x = target_probs[:k].gather(1, draft_tokens[:, None]).squeeze(1)  # [k]
        if draft_probs is None:
            q_x = torch.ones_like(p_x)
        else:
            draft_probs = _align_vocab(draft_probs, vocab)
            q_x = draft_probs.gather(1, draft_tokens[:, None]).squeeze(1)
        u = torch.rand(k, generator=generator, dtype=torch.float64)
        # log u <= log p - log q  <=>  u <= p / q; q(x) > 0 because x was drawn from q.
        accept = torch.log(u) <= (torch.log(p_x.double()) - torch.log(q_x.double()))
        n_accepted = int(accept.int().cumprod(0).sum())
    else:
        n_accepted = 0

    residual: torch.Tensor | None = None  # [V] where a drawn draft token was rejected
    if n_accepted < k:
        x = draft_tokens[n_accepted]
        if draft_probs is None:
            residual = target_probs[n_accepted].clone()
            residual[x] = 0.0
        else:
            residual = (target_probs[n_accepted] - draft_probs[n_accepted]).clamp_min(0.0)
    elif refused is not None:
        residual = (target_probs[k] - _align_vocab(refused, vocab)).clamp_min(0.0)
    if residual is None:
        next_dist = target_probs[k]
    else:
        mass = residual.sum()
        # A rejection implies p(x) < q(x), hence positive residual mass; the guard only
        # covers float round-off, where p itself is the right distribution to fall back on.
        next_dist = residual / mass if mass > 0 else target_probs[n_accepted]
    next_token = sample(next_dist, generator)
    return Verdict(n_accepted, next_token, k, refused=n_accepted == k and refused is not None)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:  # [n, V] bool -> [n, ceil(V / 32)] int32
    """A token mask as a bitmask: bit ``j % 32`` of word ``j // 32`` is set where token ``j`` is
    allowed (llguidance's layout; 32 times smaller than the bool mask)."""
    n, vocab = allowed.shape
    padded = np.zeros((n, 32 * ((vocab + 31) // 32)), dtype=bool)
    padded[:, :vocab] = allowed.numpy()
    return torch.from_numpy(np.packbits(padded, axis=1, bitorder="little").view(np.int32))


def unpack_bits(mask: torch.Tensor, vocab: int) -> torch.Tensor:  # [n, W] int32 -> [n, vocab] bool
    """The bool mask of a bitmask (``pack_bits``), cut or padded (not allowed) to ``vocab``."""
    allowed = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    return torch.from_numpy(allowed.astype(bool))


def apply_mask(
    logits: torch.Tensor,  # [n, V] raw scores
    mask: torch.Tensor,  # [n, W] int32 bitmask (pack_bits); ids past 32 * W are not allowed
) -> torch.Tensor:  # [n, V]: a copy, -inf where not allowed
    """Scores with the disallowed tokens removed: what a constrained step decides on.

    Example: scores ``[[2, 5, 1]]``, mask allowing tokens 0 and 2 -> ``[[2, -inf, 1]]``: greedy
    picks token 0, sampling never draws token 1.
    """
    allowed = unpack_bits(mask, logits.shape[-1])
    return logits.float().masked_fill(~allowed, float("-inf"))


def masked_argmax(
    rows: torch.Tensor,  # [n, V] raw scores
    mask: torch.Tensor | None,  # [n, W] int32 bitmask, or None: every token allowed
) -> torch.Tensor:  # [n] long: each row's best allowed token
    """Each row's argmax under ``mask``. A row whose plain argmax is allowed keeps it (one bit
    read); only the others are masked whole: a grammar mostly agrees with the model, so most
    rows cost nothing more than plain greedy decoding.
    """
    choice = row_argmax(rows)
    if mask is None:
        return choice
    width = 32 * mask.shape[1]
    word = mask[torch.arange(rows.shape[0]), choice.clamp(max=width - 1) // 32]
    allowed = ((word >> (choice % 32)) & 1).bool() & (choice < width)
    for i in torch.nonzero(~allowed).flatten().tolist():
        choice[i] = int(apply_mask(rows[i : i + 1], mask[i : i + 1]).argmax())
    return choice


def verify(
    draft_tokens: torch.Tensor,  # [k] long
    draft_probs: torch.Tensor | None,  # [k, V'] or None
    target_logits: torch.Tensor,  # [k + 1, V]
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    mask: torch.Tensor | None = None,  # [k + 1, W] int32 bitmask (pack_bits) of each row's allowed tokens
    refused: torch.Tensor | None = None,  # [V'] q of row k, whose draw the mask refused (``verify_sampling``)
) -> tuple[Verdict, torch.Tensor]:  # and [k] float32: p(x_i) of each proposed token
    """Apply the configured acceptance rule.

    Returns the verdict and the probability of each proposed token under the configured
    distribution p (the plain softmax under greedy decoding), for reporting. Greedy decoding
    computes only those k probabilities: a plain step (k = 0) normalises nothing at all.

    With a ``mask`` the verdict is that of masked decoding: greedy takes each row's argmax
    among the allowed tokens (``masked_argmax``), sampling masks the target's scores first
    (``apply_mask``). The drafter's q is left as drawn from, which keeps the rejection rule
    exact (every draft token must be allowed: a grammar cuts drafts before they come here, and
    hands the cut row's q as ``refused``). The probabilities reported under greedy decoding stay
    the plain softmax's; greedy decoding needs no ``refused``: the masked argmax is the law.
    """
    k = draft_tokens.shape[0]
    if temperature == 0:
        verdict = verify_greedy(draft_tokens, target_logits, mask)
        if k == 0:
            # A plain step: the argmax and nothing else. Its per-token cost is what a plain
            # stream pays beside the pass, which on a fast pass (a small model, a GPU) shows.
            return verdict, torch.empty(0)  # [0]: no proposed token, no probability
        rows = target_logits[:k].float()  # [k, V]
        chosen = rows.gather(1, draft_tokens[:, None]).squeeze(1)  # [k]
        return verdict, torch.exp(chosen - row_logsumexp(rows))
    if mask is not None:
        target_logits = apply_mask(target_logits, mask)
    target_probs = logits_to_probs(target_logits, temperature, top_k, top_p)
    token_probs = target_probs[:k].gather(1, draft_tokens[:, None]).squeeze(1)
    return verify_sampling(draft_tokens, draft_probs, target_probs, generator, refused), token_probs
