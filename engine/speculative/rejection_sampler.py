"""Exact speculative sampling (Leviathan et al. 2023): plain tensors in, tokens out, no model."""
from __future__ import annotations

import torch
from torch import Tensor


def verify_drafts(
    draft_ids: list[int],  # [k] draft tokens d_1 .. d_k
    target_probs: Tensor,  # [k + 1, V] p_0 .. p_k: the sampler's distribution at each position
    draft_probs: Tensor | None,  # [k, V] q_1 .. q_k, or None: q_j one-hot at d_j
    uniform: Tensor,  # [2, k + 1] in [0, 1): row 0 accept tests, row 1 the final draw
    greedy: bool,
) -> tuple[int, int]:
    """Accept a prefix of the drafts and pick the token after it -> (num_accepted, next_token).

    Glossary:
      * accepted: d_j is kept with probability min(1, p(d_j) / q(d_j)) (tested with
        uniform[0, j]); the first rejection ends the run.
      * recovered: at the first rejected position j the next token is drawn from the
        residual norm(max(p_j - q_j, 0)), which makes the emitted token exactly p_j-distributed.
      * bonus: when all k drafts are accepted, one more token is drawn from p_k for free.
    The emitted tokens are ``draft_ids[:num_accepted] + [next_token]``.

    ``greedy`` (p one-hot at argmax): keep the longest prefix with d_j == argmax p_j, then
    argmax p at the first mismatch (or the bonus position); no randomness is used.
    Draws from a distribution use the inverse CDF with uniform[1, j], so the result depends
    only on the inputs (seeded requests stay deterministic).
    """
    k = len(draft_ids)
    if greedy:
        best = target_probs.argmax(dim=1).tolist()  # [k + 1]
        n = 0
        while n < k and draft_ids[n] == best[n]:
            n += 1
        return n, best[n]
    p_draft = target_probs[torch.arange(k), torch.tensor(draft_ids, dtype=torch.long)].tolist()  # [k]
    q_draft = [1.0] * k if draft_probs is None else \
        draft_probs[torch.arange(k), torch.tensor(draft_ids, dtype=torch.long)].tolist()
    u = uniform[0].tolist()
    for j in range(k):
        # u < p/q  <=>  u * q < p, which also handles q == 0 (never drawn) without dividing.
        if u[j] * q_draft[j] < p_draft[j]:
            continue
        if draft_probs is None:
            residual = target_probs[j].clone()
            residual[draft_ids[j]] = 0.0
        else:
            residual = (target_probs[j] - draft_probs[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
            residual = target_probs[j]
        return j, sample_inverse_cdf(residual, float(uniform[1, j]))
    return k, sample_inverse_cdf(target_probs[k], float(uniform[1, k]))


def verify_by_target_samples(draft_ids: list[int], target_samples: list[int]) -> tuple[int, int]:
    """Deterministic drafts (q one-hot): accept while the target's own sample equals the draft.

    ``target_samples[j]`` is a token drawn from p_j the way plain decoding draws (for a seeded
    request: from that step's own generator, i.e. the very token plain decoding would draw).
    Draft d_{j+1} is accepted iff ``target_samples[j] == d_{j+1}``, which happens with
    probability p_j(d_{j+1}), the same acceptance as ``verify_drafts`` with one-hot q; at the
    first mismatch, or after all k, the emitted token is the target's sample itself. So every
    emitted token is a draw from p: the output is exactly p-distributed, and a seeded request
    gets the tokens of a run without speculation whatever k the controller picked (up to float
    rounding of p between the two forwards). Greedy is the case where the samples are argmaxes.
    """
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_samples[n]:
        n += 1
    return n, target_samples[n]


def sample_inverse_cdf(weights: Tensor, u: float) -> int:
    """The token whose CDF interval holds ``u`` (weights [V] >= 0, need not sum to 1).

    Tokens with zero weight are never returned, whatever the float rounding of the cumsum.
    """
    cdf = torch.cumsum(weights.to(torch.float64), dim=0)  # [V]
    idx = int(torch.searchsorted(cdf, u * float(cdf[-1]), right=True))
    idx = min(idx, weights.shape[0] - 1)
    if weights[idx] <= 0:  # landed on a zero-width interval at the very end
        idx = int(torch.nonzero(weights > 0)[-1])
    return idx
