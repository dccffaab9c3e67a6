"""Cost models the placement policy predicts time with, fitted online from the nodes' reports.

Pure: plain numbers in, seconds out; no sockets. Three models:

* ``PrefillCost``: seconds to prefill ``new`` tokens on top of ``cached`` ones::

      t = fixed_s + per_token_s * new + attn_s * new * (cached + new / 2)

  The last term is attention: each new token attends over the context before it, on average
  ``cached + new/2`` tokens, so long prompts cost more per token than short ones.
* ``DecodeCost``: seconds per decode step for a batch: ``fixed_s + per_seq_s * batch +
  per_ctx_token_s * context tokens in the batch`` (weights read once per step, KV per token).
* ``BandwidthBook``: bytes/second of each (source, destination) node pair, an exponential
  average of measured transfers, falling back to a default.

``OnlineFit`` fits any such linear model by least squares over an exponentially forgotten
window, started from a prior: the prior enters as a few pseudo-observations at representative
points, so the fit is sane before the first report and converges to the data after enough
of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kv_index.nodes import StepReport


@dataclass(frozen=True, slots=True)
class PrefillCost:
    fixed_s: float = 0.015
    per_token_s: float = 8.0e-5
    attn_s: float = 1.0e-9  # per new token per context token

    def predict(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        return (self.fixed_s + self.per_token_s * new_tokens
                + self.attn_s * new_tokens * (cached_tokens + new_tokens / 2))


def prefill_features(new_tokens: int, cached_tokens: int) -> tuple[float, float, float]:
    # Scaled so the normal equations stay well conditioned (1, thousands, millions).
    return 1.0, new_tokens / 1e3, new_tokens * (cached_tokens + new_tokens / 2) / 1e6


def prefill_from_coef(c: Sequence[float]) -> PrefillCost:
    return PrefillCost(max(c[0], 0.0), max(c[1], 0.0) / 1e3, max(c[2], 0.0) / 1e6)


@dataclass(frozen=True, slots=True)
class DecodeCost:
    fixed_s: float = 0.012
    per_seq_s: float = 5.0e-5
    per_ctx_token_s: float = 2.0e-8

    def step_s(self, batch: int, context_tokens: int) -> float:
        return self.fixed_s + self.per_seq_s * batch + self.per_ctx_token_s * context_tokens


class OnlineFit:
    """Exponentially weighted least squares for ``y = coef . x`` with a prior.

    Holds the normal equations (``A = sum w x x^T``, ``b = sum w x y``); each ``add`` scales the
    old sums by ``forget`` first, so the fit follows a node whose speed changes (thermal limits,
    a neighbour on the same host). ``coef`` solves ``A coef = b`` (Gaussian elimination: the
    systems are 3x3).
    """

    def __init__(self, dim: int, forget: float = 0.995) -> None:
        self.dim = dim
        self.forget = forget
        self.A = [[0.0] * dim for _ in range(dim)]
        self.b = [0.0] * dim
        self.n = 0

    def add(self, x: Sequence[float], y: float, weight: float = 1.0, decay: bool = True) -> None:
        if decay:
            self.decay()
        for i in range(self.dim):
            self.b[i] += weight * x[i] * y
            for j in range(self.dim):
                self.A[i][j] += weight * x[i] * x[j]
        self.n += 1

    def decay(self) -> None:
        f = self.forget
        for i in range(self.dim):
            self.b[i] *= f
            for j in range(self.dim):
                self.A[i][j] *= f

    def coef(self) -> list[float]:
        return solve(self.A, self.b)


def solve(A: list[list[float]], b: list[float]) -> list[float]:
    """Solve A x = b by Gaussian elimination with partial pivoting; a singular direction
    gets 0 (it carries no information yet)."""
    n = len(b)
    M = [row[:] + [b[i]] for i, row in enumerate(A)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(M[r][col]))
        if abs(M[piv][col]) < 1e-12:
            continue
        M[col], M[piv] = M[piv], M[col]
        for r in range(n):
            if r != col:
                f = M[r][col] / M[col][col]
                if f:
                    for c in range(col, n + 1):
                        M[r][c] -= f * M[col][c]
    return [M[i][n] / M[i][i] if abs(M[i][i]) >= 1e-12 else 0.0 for i in range(n)]


# Where the prior is pinned: a short, a medium and a long prompt, with and without a cached
# prefix, so all three coefficients are determined before any report arrives.
_PRIOR_POINTS = ((16, 0), (512, 0), (4096, 0), (2048, 8192), (16384, 0))


class PrefillCostFit:
    """One node's prefill cost, fitted from its step reports (``StepReport``).

    The prior is pinned at points spread over prompt lengths, but real reports often cluster
    (a chat workload: every prompt 30-60 tokens), and such data says much about the level and
    nothing about the slope. Pinned at its own values, a prior 10x faster than the machine then
    keeps the fitted slope near its own while the data lifts the intercept: the fit calls tokens
    nearly free, and placement stops valuing a cached prefix. So the prior enters at its shape,
    scaled by how much slower (or faster) than predicted the node's reports have been (``scale``,
    forgotten at the same rate as the reports): clustered data moves the level of every term,
    spread data fits each term."""

    def __init__(self, prior: PrefillCost, prior_weight: float = 2.0, forget: float = 0.995) -> None:
        self.prior = prior
        self._prior_fit = OnlineFit(3, forget)  # the prior's points at scale 1
        for new, cached in _PRIOR_POINTS:
            self._prior_fit.add(prefill_features(new, cached), prior.predict(new, cached), prior_weight, decay=False)
        self._data = OnlineFit(3, forget)
        self._observed = self._predicted = 0.0  # forgotten sums: seconds reported, prior's seconds
        self._model = prior

    @property
    def scale(self) -> float:
        return self._observed / self._predicted if self._predicted > 0 else 1.0

    def add(self, report: StepReport) -> None:
        new = report.new_tokens
        if new <= 0 or report.seconds <= 0:
            return  # a full cache hit measures nothing about compute
        cached = report.context_tokens - new
        f = self._data.forget
        self._prior_fit.decay()
        self._data.add(prefill_features(new, cached), report.seconds)
        self._observed = f * self._observed + report.seconds
        self._predicted = f * self._predicted + self.prior.predict(new, cached)
        s, p, d = self.scale, self._prior_fit, self._data
        # Weight 1/scale on the prior's points: an error there counts relative to the prior's
        # (scaled) size, so a prior that was far off steps aside sooner for spread data.
        A = [[p.A[i][j] / s + d.A[i][j] for j in range(3)] for i in range(3)]
        b = [p.b[i] + d.b[i] for i in range(3)]
        self._model = prefill_from_coef(solve(A, b))

    @property
    def model(self) -> PrefillCost:
        return self._model

    @property
    def num_reports(self) -> int:
        return self._data.n


class CostBook:
    """Per-node prefill fits plus pair bandwidths: what a policy consults. A node with fewer
    than ``min_reports`` reports gets the pooled fit of all nodes' reports (the prior before
    any): judging it by the prior while its peers are judged by their measurements would make a
    node that never reported look faster (or slower) than it is and draw (or lose) all traffic.
    Step reports come from the router's refresher thread and transfer measurements from its
    event loop; readers get immutable ``PrefillCost`` values and single-attribute reads, so a
    lookup never sees a half-updated fit."""

    def __init__(self, prior: PrefillCost = PrefillCost(), decode: DecodeCost = DecodeCost(),
                 default_bandwidth: float = 25e9, kv_bytes_per_token: int = 131072,
                 bandwidth_alpha: float = 0.2, min_reports: int = 8) -> None:
        self.prior = prior
        self.min_reports = min_reports
        self._pooled = PrefillCostFit(prior)
        self.decode = decode
        self.default_bandwidth = default_bandwidth
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth_alpha = bandwidth_alpha
        self._fits: dict[str, PrefillCostFit] = {}
        self._models: dict[str, PrefillCost] = {}
        self._bw: dict[tuple[str, str], float] = {}

    def add_step(self, node_id: str, report: StepReport) -> None:
        fit = self._fits.get(node_id)
        if fit is None:
            fit = self._fits[node_id] = PrefillCostFit(self.prior)
        fit.add(report)
        self._pooled.add(report)
        if fit.num_reports >= self.min_reports:
            self._models[node_id] = fit.model

    def prefill(self, node_id: str) -> PrefillCost:
        return self._models.get(node_id) or self._pooled.model

    def add_transfer(self, src: str, dst: str, num_bytes: int, seconds: float, num_tokens: int = 0) -> None:
        """A measured transfer. With ``num_tokens`` (the token slots the bytes covered) it also
        teaches the book the served model's KV bytes per token: bandwidths are measured in the
        model's bytes, so predictions must count tokens in the same bytes (a tiny test model
        moves ~1 KB a token, a 7B model ~0.5 MB)."""
        if num_bytes <= 0 or seconds <= 0:
            return
        if num_tokens > 0:
            self.kv_bytes_per_token = max(1, round(num_bytes / num_tokens))
        bw = num_bytes / seconds
        old = self._bw.get((src, dst))
        self._bw[(src, dst)] = bw if old is None else old + self.bandwidth_alpha * (bw - old)

    def bandwidth(self, src: str, dst: str) -> float:
        return self._bw.get((src, dst), self.default_bandwidth)

    def transfer_s(self, src: str, dst: str, tokens: int) -> float:
        if tokens <= 0 or src == dst:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.bandwidth(src, dst)

