"""Token sampler: penalties, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The pipeline for one batch of logits, each row with its own ``SamplingParams``::

    logits [N, V] --apply_penalties--> penalized [N, V] --+--> argmax          (greedy rows)
                                          |               |
                                          |               +--> / temperature -> top-k -> top-p
                                          |                    -> min-p -> softmax = probs [N, V]
                                          |                    -> exponential race  (random rows)
                                          +--> log_softmax -> logprobs / top-n logprobs

``processed_probs`` returns exactly the distribution the sampler draws from, so the
speculative-decoding rejection sampler can use the same target distribution.

Logprobs are taken from the log-softmax of the *penalized* logits, before temperature and
the truncation filters: they describe the model (as steered by the penalties the user asked
for), not the sampling knobs, and stay finite for every token. vLLM's default is the raw
logits before penalties; the difference only shows for requests that set penalties.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tokens.sampling_params import SamplingParams

# Below this, logits / temperature can overflow float32 (inf - inf = nan in softmax). At
# 1e-5 the distribution is already indistinguishable from greedy for real logit gaps.
_MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """One row of the logits batch and what the sampler needs to know about its request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Seeded requests: derived per step from (seed, sample index, step) by the model runner;
    # None -> the sampler's own generator (batched draw).
    generator: torch.Generator | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Logprob of each chosen token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row, the top-n (token, logprob) pairs, best first; [] for rows that did not ask
    # (params.logprobs None or 0); None when no row asked for n > 0.
    top_logprobs: list[list[tuple[int, float]]] | None


def _padded(seqs: list[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Ragged token lists -> (ids [N, L] long, valid [N, L] bool); padding points at id 0."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    valid = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            valid[i, : len(s)] = True
    return ids.to(device), valid.to(device)


def _token_counts(seqs: list[Sequence[int]], vocab_size: int, device: torch.device) -> Tensor:
    """How often each token occurs in each row's list: [N, V] float32."""
    ids, valid = _padded(seqs, device)  # [N, L]
    counts = torch.zeros((len(seqs), vocab_size), dtype=torch.float32, device=device)
    return counts.scatter_add_(1, ids, valid.to(torch.float32))


def apply_penalties(
    logits: Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int] = ()
) -> Tensor:
    """Return penalized logits [N, V]; the input is not modified.

    - repetition_penalty (HF/CTRL): every token seen in prompt + output has its logit divided
      by the penalty when positive and multiplied by it when negative (both push it down
      for penalty > 1).
    - presence / frequency penalty (OpenAI): logit -= presence * [count > 0] + frequency *
      count, counting output tokens only.
    - min_tokens: while len(output) < min_tokens, EOS and stop_token_ids get -inf, so the
      request cannot end early. ignore_eos masks EOS at every step (it would end the
      request otherwise); stop_token_ids stay allowed then, as the user asked for them.
    """
    _, vocab = logits.shape
    device = logits.device
    out = logits.clone()  # [N, V]

    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        # Only penalized rows pay for turning their (possibly long) prompt into a tensor.
        history = [
            list(r.prompt_token_ids) + list(r.output_token_ids) if p != 1.0 else []
            for r, p in zip(rows, rep)
        ]
        seen = _token_counts(history, vocab, device) > 0  # [N, V]
        penalty = torch.tensor(rep, dtype=out.dtype, device=device).unsqueeze(1)  # [N, 1]
        scaled = torch.where(out > 0, out / penalty, out * penalty)
        out = torch.where(seen, scaled, out)

    presence = [r.params.presence_penalty for r in rows]
    frequency = [r.params.frequency_penalty for r in rows]
    if any(presence) or any(frequency):
        outputs = [
            r.output_token_ids if p or f else [] for r, p, f in zip(rows, presence, frequency)
        ]
        counts = _token_counts(outputs, vocab, device)  # [N, V]
        pres = torch.tensor(presence, dtype=out.dtype, device=device).unsqueeze(1)  # [N, 1]
        freq = torch.tensor(frequency, dtype=out.dtype, device=device).unsqueeze(1)  # [N, 1]
        out = out - pres * (counts > 0).to(out.dtype) - freq * counts

    # Banned (row, token) pairs are few: build them as lists and mask with one index_put.
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    for i, r in enumerate(rows):
        banned: set[int] = set()
        if r.params.ignore_eos or len(r.output_token_ids) < r.params.min_tokens:
            banned.update(eos_token_ids)
        if len(r.output_token_ids) < r.params.min_tokens:
            banned.update(r.params.stop_token_ids)
        ban_rows.extend([i] * len(banned))
        ban_cols.extend(sorted(banned))
    if ban_rows:
        idx = (torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device))
        out.index_put_(idx, torch.tensor(-math.inf, dtype=out.dtype, device=device))
    return out


def probs_from_penalized(penalized: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Penalized logits [N, V] -> the exact sampling distribution [N, V] float32.

    Order: temperature, top-k, top-p (on the top-k-renormalized distribution), min-p
    (relative to the most likely token, which every filter keeps, so its place in the
    order does not matter). Greedy rows are one-hot at argmax of the penalized logits.

    top-p keeps the shortest prefix of tokens sorted by probability whose mass reaches
    top_p: a token stays when the mass strictly before it is < top_p. Ties in the sort are
    broken by lowest token id (stable sort), so top-k keeps exactly k tokens.
    """
    _, vocab = penalized.shape
    device = penalized.device
    # Disabled filters get neutral values, so one vectorized pass serves every row.
    temp = [1.0 if r.params.greedy else max(r.params.temperature, _MIN_TEMPERATURE) for r in rows]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    k_col = torch.tensor(top_k, device=device).unsqueeze(1)  # [N, 1]
    p_col = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)  # [N, 1]
    minp_col = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(1)  # [N, 1]
    temp_col = torch.tensor(temp, dtype=torch.float32, device=device).unsqueeze(1)  # [N, 1]
    scaled = penalized.to(torch.float32) / temp_col  # [N, V]

    need_sort = any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p)
    if need_sort:
        # Work in sorted order, where top-k and top-p are prefixes, then scatter back.
        sorted_logits, order = torch.sort(scaled, dim=1, descending=True, stable=True)  # [N, V]
        rank = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
        keep = rank < k_col  # [N, V]
        top_k_logits = sorted_logits.masked_fill(~keep, -math.inf)
        probs_k = torch.softmax(top_k_logits, dim=1)  # [N, V]
        mass_before = torch.cumsum(probs_k, dim=1) - probs_k  # [N, V]
        # Rows with top_p == 1 skip the test: float rounding of the cumsum could otherwise
        # drop the tail of the vocabulary.
        keep &= (mass_before < p_col) | (p_col >= 1.0)
        if any(m > 0.0 for m in min_p):
            # probs / max prob is the same before or after renormalization.
            keep &= probs_k >= minp_col * probs_k[:, :1]
        keep[:, 0] = True  # the most likely token always survives
        sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=1)
        probs = torch.zeros_like(scaled).scatter_(1, order, sorted_probs)
    else:
        probs = torch.softmax(scaled, dim=1)  # [N, V]
        if any(m > 0.0 for m in min_p):
            keep = probs >= minp_col * probs.max(dim=1, keepdim=True).values
            probs = torch.softmax(scaled.masked_fill(~keep, -math.inf), dim=1)

    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        g = torch.tensor(greedy, device=device)
        one_hot = torch.zeros((len(greedy), vocab), dtype=probs.dtype, device=device)
        one_hot.scatter_(1, penalized[g].argmax(dim=1, keepdim=True), 1.0)
        probs[g] = one_hot
    return probs


def processed_probs(
    logits: Tensor, rows: list[SamplingRow], eos_token_ids: Sequence[int] = ()
) -> Tensor:
    """Raw logits [N, V] -> the distribution [N, V] the sampler draws each row from."""
    return probs_from_penalized(apply_penalties(logits, rows, eos_token_ids), rows)


def exponential_noise(like: Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator) -> Tensor:
    """Exp(1) noise shaped like ``like`` [N, V] for an exponential race: row j from its own
    generator when it has one (a seeded request: the draw depends only on seed and step), the
    rows without one from one batched draw of ``default``."""
    noise = torch.empty_like(like)  # [N, V]
    shared = [j for j, g in enumerate(generators) if g is None]
    if shared:
        draw = torch.empty_like(like[: len(shared)])  # [S, V]
        draw.exponential_(generator=default)
        noise[torch.tensor(shared, device=like.device)] = draw
    for j, g in enumerate(generators):
        if g is not None:
            noise[j].exponential_(generator=g)
    return noise


def exponential_race(probs: Tensor, noise: Tensor) -> Tensor:
    """Draw one token per row: argmax(probs / noise) with noise ~ Exp(1), i.i.d.

    P(argmax = i) = probs_i / sum(probs) (the minimum of independent exponentials with
    rates probs_i). Zero-probability tokens are excluded explicitly: exponential_ can return
    0, and 0 / 0 = nan would win argmax. probs [N, V], noise [N, V] -> token ids [N].
    """
    tiny = torch.finfo(noise.dtype).tiny
    score = probs / noise.clamp_min(tiny)  # [N, V]
    score = score.masked_fill(probs <= 0, -1.0)
    return score.argmax(dim=1)


class Sampler:
    """Turns one step's logits into one token per row.

    Holds only the EOS ids and the default generators (one per device) used for rows without
    their own; everything per request arrives in ``SamplingRow``.
    """

    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def default_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from (speculative verification shares it)."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] float32, one SamplingRow per row -> one token per row."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} SamplingRows")
        penalized = apply_penalties(logits, rows, self.eos_token_ids)  # [N, V]
        tokens = penalized.argmax(dim=1)  # [N]; final for greedy rows

        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = probs_from_penalized(penalized[idx], [rows[i] for i in random_rows])
            # Seeded rows draw from their own generator, so the token depends only on the
            # seed, the step and the row's logits, not on its batch neighbours.
            noise = exponential_noise(probs, [rows[i].generator for i in random_rows],
                                      self.default_generator(probs.device))  # [R, V]
            tokens[idx] = exponential_race(probs, noise)

        return SamplerOutput(tokens.tolist(), *self._logprobs(penalized, tokens, rows))

    @staticmethod
    def _logprobs(penalized: Tensor, tokens: Tensor, rows: list[SamplingRow]):
        asked = [r.params.logprobs for r in rows]
        if all(a is None for a in asked):
            return None, None
        logp = torch.log_softmax(penalized.to(torch.float32), dim=1)  # [N, V]
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()  # [N]
        max_n = max((a or 0) for a in asked)
        if max_n == 0:
            return chosen, None
        # [N, max_n]; the order among exactly tied logprobs is whatever topk returns.
        vals, ids = logp.topk(min(max_n, logp.shape[1]), dim=1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
        # Tokens masked to -inf (a grammar's refusals, banned EOS) are no alternatives: a
        # choice between two tokens lists at most two, and -inf never reaches JSON.
        top = [
            [(t, v) for t, v in zip(ids_l[i][: a or 0], vals_l[i][: a or 0]) if v != -math.inf]
            for i, a in enumerate(asked)
        ]
        return chosen, top
