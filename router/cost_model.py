"""Cost models the placement policy predicts time with, fitted online from the nodes' reports.

Pure: plain numbers in, seconds out; no sockets. The models:

* ``PrefillCost``: seconds to prefill ``new`` tokens on top of ``cached`` ones::

      t = fixed_s + per_token_s * new + attn_s * new * (cached + new / 2)

  The last term is attention: each new token attends over the context before it, on average
  ``cached + new/2`` tokens, so long prompts cost more per token than short ones.
* ``DecodeCost``: seconds per decode step for a batch: ``fixed_s + per_seq_s * batch +
  per_ctx_token_s * context tokens in the batch`` (weights read once per step, KV per token).
* ``TransferCost`` (router/transfer_cost.py): ``fixed_s`` per push + bytes / ``bandwidth``, for
  two kinds of moves: KV between a (source, destination) pair over one transport (shm, tcp,
  grpc), fitted per pair and transport from whole pushes (with layer-wise streaming the
  request waits only for the exposed part, which ``CostBook.transfer_s`` predicts from the
  streamed transfers' exposed share); and a node's host-memory or disk blocks brought back to
  its device (onboarding), fitted per (node, tier).

``OnlineFit`` fits any such linear model by least squares over an exponentially forgotten
window, started from a prior: the prior enters as a few pseudo-observations at representative
points, so the fit is sane before the first report and converges to the data after enough
of them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

from kv_index.matmul_curve import MatmulCurve, curve_s
from kv_index.nodes import StepReport
from router.transfer_cost import (
    MAX_BANDWIDTH,
    ONBOARD_PRIORS,
    TIER_NAMES,
    TRANSPORT_PRIORS,
    OnboardFitView,
    PairTransfers,
    TransferCost,
    TransferFit,
    TransferFitView,
    first_transport,
    tier_name,
)

# Re-exported: callers and tests name the transfer models through this module, as before the split.
__all__ = [
    "CostBook", "DecodeCost", "MAX_BANDWIDTH", "ONBOARD_PRIORS", "OnboardFitView", "OnlineFit", "PrefillCost",
    "PrefillCostFit", "TIER_NAMES", "TRANSPORT_PRIORS", "TransferCost", "TransferFit", "TransferFitView",
    "first_transport", "prefill_features", "prefill_from_coef", "solve", "tier_name",
]


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
    """A decode step: a line in the batch and its context, plus the nodes' matmul curve where
    they registered one (``matmul``; kv_index/matmul_curve.py): on CPU the matmuls jump at
    some batch sizes, which no line through a few batches follows."""

    fixed_s: float = 0.012
    per_seq_s: float = 5.0e-5
    per_ctx_token_s: float = 2.0e-8
    matmul: MatmulCurve = ()

    def __post_init__(self) -> None:  # a recording's JSON gives lists
        object.__setattr__(self, "matmul", tuple((int(r), float(ms)) for r, ms in self.matmul))

    @property
    def base_s(self) -> float:
        """A step's part that does not grow with the batch: the line's fixed part and one
        row's matmuls."""
        return self.fixed_s + curve_s(self.matmul, 1.0)

    def step_s(self, batch: float, context_tokens: float) -> float:
        return (self.fixed_s + curve_s(self.matmul, batch) + self.per_seq_s * batch
                + self.per_ctx_token_s * context_tokens)

    def secant(self, batch: float) -> DecodeCost:
        """The line (no curve) through this cost's steps at batch 1 and at ``batch`` (the
        matmul curve's slope over [1, 2] at or under 1): what a queueing model that is linear
        in the batch (router/planner/model.py) runs at a node whose batch is ``batch``."""
        if not self.matmul:
            return self
        hi = batch if batch > 1 else 2.0
        at_1 = curve_s(self.matmul, 1.0)
        slope = (curve_s(self.matmul, hi) - at_1) / (hi - 1.0)
        return DecodeCost(max(self.fixed_s + at_1 - slope, 1e-4), self.per_seq_s + slope, self.per_ctx_token_s)


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
    """Per-node prefill fits, per-pair transfer fits and per-(node, tier) onboard fits: what a
    policy consults. A node with fewer than ``min_reports`` reports gets the pooled fit of all
    nodes' reports (the prior before any): judging it by the prior while its peers are judged by
    their measurements would make a node that never reported look faster (or slower) than it is
    and draw (or lose) all traffic. Transfers follow the same idea: a pair that never
    transferred is predicted by the pooled fit of the transport the router last saw used, and a
    pair's fit for a transport starts from that transport's pooled fit; so do onboards, per tier.

    What feeds it (the router's refresher thread and its event loop):

    * ``add_step(node, StepReport)``: a prefill's compute alone (new tokens over a context);
    * ``add_transfer(src, dst, bytes, seconds, ...)``: a KV push that landed, prefill -> decode,
      and also a fetch: a prefill node that pulled a prefix from the node holding it reports
      it as a transfer from the holder to itself (``src`` = holder), over the transport used,
      unstreamed; ``raw_transfer_s(holder, node, tokens)`` is then what placement charges;
    * ``add_onboard(node, tier, bytes, seconds, runs)``: blocks a node brought back from its
      host memory ("host" / ``TIER_HOST``) or disk ("disk" / ``TIER_DISK``) into its device
      pool, ``runs`` separate reads (files, or contiguous runs of blocks) in ``seconds``
      summed; fitted like a transport (``TransferFit``: a fixed cost per run plus bytes at a
      bandwidth) from ``ONBOARD_PRIORS``; ``onboard_s(node, tier, tokens)`` predicts.

    Readers get immutable ``PrefillCost`` / ``TransferCost`` values and single-attribute reads,
    so a lookup never sees a half-updated fit."""

    def __init__(self, prior: PrefillCost = PrefillCost(), decode: DecodeCost = DecodeCost(),
                 default_bandwidth: float = 25e9, kv_bytes_per_token: int = 131072,
                 min_reports: int = 8, default_fixed_s: float = 0.0,
                 transport_priors: Mapping[str, TransferCost] | None = None,
                 transfer_forget: float = 0.97, exposed_alpha: float = 0.2,
                 onboard_priors: Mapping[str, TransferCost] | None = None) -> None:
        self.prior = prior
        self.min_reports = min_reports
        self._pooled = PrefillCostFit(prior)
        self.decode = decode
        self.default_bandwidth = default_bandwidth
        self.kv_bytes_per_token = kv_bytes_per_token
        # "" is a transfer whose transport nobody named (the replay simulator, tests): the
        # book's defaults, which is also what a pair is predicted at before any transfer.
        self.transport_priors = {"": TransferCost(default_fixed_s, default_bandwidth),
                                 **(TRANSPORT_PRIORS if transport_priors is None else transport_priors)}
        self.transfer_forget = transfer_forget
        self.exposed_alpha = exposed_alpha
        self._fits: dict[str, PrefillCostFit] = {}
        self._models: dict[str, PrefillCost] = {}
        self._pairs: dict[tuple[str, str], PairTransfers] = {}
        self._pooled_transfers: dict[str, TransferFit] = {}
        self._last_transport: str | None = None
        # node id -> NodeInfo.kv_endpoints of the live nodes (note_endpoints); replaced whole.
        self._endpoints: Mapping[str, Sequence[str]] = {}
        self.onboard_priors = dict(ONBOARD_PRIORS if onboard_priors is None else onboard_priors)
        self._onboard: dict[tuple[str, str], TransferFit] = {}  # (node, tier) -> its fit
        self._pooled_onboard: dict[str, TransferFit] = {}  # tier -> all nodes' fit

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

    def reference_prefill(self) -> PrefillCost:
        """The pooled fit of every node's reports: the cluster's typical node."""
        return self._pooled.model

    # -- onboarding: a node's lower tiers back to its device -------------------------------------
    def add_onboard(self, node_id: str, tier: int | str, num_bytes: float, seconds: float, runs: int = 1) -> None:
        """``num_bytes`` of KV brought from ``tier`` ("host"/"disk" or ``TIER_HOST``/``TIER_DISK``)
        into ``node_id``'s device pool in ``seconds``, as ``runs`` separate reads. Unusable
        reports (zero, negative or non-finite) teach nothing; outliers move the fit a bounded
        step (``TransferFit``'s clipping). ValueError for a tier without an onboard cost."""
        name = tier_name(tier)
        if not (num_bytes > 0 and seconds > 0 and math.isfinite(num_bytes) and math.isfinite(seconds)):
            return
        pooled = self._pooled_onboard.get(name)
        if pooled is None:
            pooled = self._pooled_onboard[name] = TransferFit(self.onboard_priors[name], forget=self.transfer_forget)
        fit = self._onboard.get((node_id, name))
        if fit is None:
            # A node's first fit starts from what the other nodes showed, as a pair's does.
            fit = self._onboard[(node_id, name)] = TransferFit(pooled.model, forget=self.transfer_forget)
        if fit.add(num_bytes, seconds, runs):
            pooled.add(num_bytes, seconds, runs)

    def onboard_model(self, node_id: str, tier: int | str) -> TransferCost:
        """The node's own fit for the tier, else the tier's pooled fit, else its prior."""
        name = tier_name(tier)
        fit = self._onboard.get((node_id, name)) or self._pooled_onboard.get(name)
        return fit.model if fit is not None else self.onboard_priors[name]

    def onboard_s(self, node_id: str, tier: int | str, tokens: int) -> float:
        """Seconds ``node_id`` takes to bring ``tokens`` tokens' KV back from ``tier`` (one run)."""
        if tokens <= 0:
            return 0.0
        return self.onboard_model(node_id, tier).seconds(tokens * self.kv_bytes_per_token)

    def onboard_fits(self) -> list[OnboardFitView]:
        """Every fit, pooled ones under node "" (plain data for ``stats()`` and metrics)."""
        rows = [(("", t), f) for t, f in list(self._pooled_onboard.items())] + list(self._onboard.items())
        return sorted((OnboardFitView(nid, t, f.model.bandwidth, f.model.fixed_s, f.n)
                       for (nid, t), f in rows), key=lambda v: (v.node_id, v.tier))

    # -- transfers -------------------------------------------------------------------------------
    def _transfer_fit(self, fits: dict[str, TransferFit], transport: str, prior: TransferCost) -> TransferFit:
        fit = fits.get(transport)
        if fit is None:
            fit = fits[transport] = TransferFit(prior, forget=self.transfer_forget)
        return fit

    def add_transfer(self, src: str, dst: str, num_bytes: int, seconds: float, num_tokens: int = 0,
                     transport: str = "", exposed_s: float = 0.0, streamed: bool = False,
                     pushes: int = 0) -> None:
        """A measured, successful transfer of ``num_bytes`` over ``transport`` in ``seconds``
        (with ``pushes`` > 1, the pushes' summed wall time).

        With ``num_tokens`` (the token slots the bytes covered) it also teaches the book the
        served model's KV bytes per token: transfers are fitted in the model's bytes, so
        predictions must count tokens in the same bytes (a tiny test model moves ~1 KB a token,
        a 7B model ~0.5 MB). ``streamed``: the KV went out layer by layer during the prefill,
        and the request waited only ``exposed_s`` for it after the compute (0: the last push
        landed before the compute ended). Unstreamed, the whole transfer counts as waited for.

        Only unstreamed transfers teach the fits (fixed cost and bandwidth): streamed pushes
        ran beside the prefill's compute, sharing its cores and memory bandwidth, and their
        ``seconds`` say how fast bytes move under that load, not what a push alone costs (a
        fetch, an unstreamed prefill). A streamed transfer teaches the exposed share, relative
        to the pair's unstreamed prediction, which is what ``transfer_s`` multiplies."""
        if not (num_bytes > 0 and seconds > 0 and math.isfinite(seconds)):
            return
        if num_tokens > 0:
            self.kv_bytes_per_token = max(1, round(num_bytes / num_tokens))
        prior = self.transport_priors.get(transport, self.transport_priors[""])
        pooled = self._transfer_fit(self._pooled_transfers, transport, prior)
        pair = self._pairs.get((src, dst))
        if pair is None:
            pair = self._pairs[(src, dst)] = PairTransfers({}, transport)
        if not streamed:
            fit = self._transfer_fit(pair.fits, transport, pooled.model)
            if not fit.add(num_bytes, seconds, pushes):
                return
            pooled.add(num_bytes, seconds, pushes)
        pair.transport = self._last_transport = transport
        a = self.exposed_alpha
        share = 1.0 if streamed else 0.0
        pair.streamed_share = share if pair.transfers == 0 else pair.streamed_share + a * (share - pair.streamed_share)
        pair.transfers += 1
        if streamed and exposed_s >= 0 and math.isfinite(exposed_s):  # 0: all of it hidden
            # Relative to the pair's one-push time for these bytes, so that fraction x that
            # time is the expected wait whatever the number of pushes. Capped at 2: the last
            # push can queue behind earlier ones, but more is a misreport.
            frac = min(exposed_s / self._pair_model(pair, transport).seconds(num_bytes), 2.0)
            pair.exposed_fraction = frac if not pair.streamed_seen else (
                pair.exposed_fraction + a * (frac - pair.exposed_fraction))
            pair.streamed_seen = True

    def note_endpoints(self, endpoints: Mapping[str, Sequence[str]]) -> None:
        """What the live nodes advertise in the index (node id -> ``NodeInfo.kv_endpoints``),
        from the router's node view on each refresh: a pair that has not transferred yet is
        predicted by the transport its sender would pick first (``first_transport``)."""
        self._endpoints = dict(endpoints)

    def _transport_model(self, transport: str) -> TransferCost:
        """A transport's pooled fit over every pair, or its prior before any transfer."""
        pooled = self._pooled_transfers.get(transport)
        if pooled is not None:
            return pooled.model
        return self.transport_priors.get(transport, self.transport_priors[""])

    def _pair_model(self, pair: PairTransfers, transport: str) -> TransferCost:
        fit = pair.fits.get(transport)
        return fit.model if fit is not None else self._transport_model(transport)

    def transfer_model(self, src: str, dst: str) -> TransferCost:
        """The raw transfer cost of the pair over the transport it last used successfully;
        before its first transfer, over the transport its sender would try first, when both
        nodes' advertisements are known (``note_endpoints``), else the transport the router
        last saw used anywhere (the book's default before any)."""
        pair = self._pairs.get((src, dst))
        if pair is not None:
            return self._pair_model(pair, pair.transport)
        ends = self._endpoints
        if src in ends and dst in ends:
            return self._transport_model(first_transport(ends[src], ends[dst]))
        if self._last_transport is not None:
            return self._pooled_transfers[self._last_transport].model
        return self.transport_priors[""]

    def bandwidth(self, src: str, dst: str) -> float:
        return self.transfer_model(src, dst).bandwidth

    def raw_transfer_s(self, src: str, dst: str, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens' KV in one push, none of it hidden (a fetch of
        cached blocks before the compute, or the bandwidth a transfer is charged)."""
        if tokens <= 0 or src == dst:
            return 0.0
        return self.transfer_model(src, dst).seconds(tokens * self.kv_bytes_per_token)

    def transfer_s(self, src: str, dst: str, tokens: int) -> float:
        """Expected seconds the request waits for its KV after the prefill's compute: the raw
        transfer, times the pair's exposed fraction as far as its transfers are streamed."""
        raw = self.raw_transfer_s(src, dst, tokens)
        pair = self._pairs.get((src, dst))
        return raw * pair.exposed_factor() if pair is not None and raw > 0 else raw

    def transfer_fits(self) -> list[TransferFitView]:
        """Every pair's fits, for metrics and ``stats()``: plain data, sorted. Called from the
        metrics server's thread: the dicts are copied in one C-level step (no Python code runs
        in between, so the event loop cannot insert mid-iteration)."""
        out = []
        for (src, dst), pair in sorted(list(self._pairs.items()), key=lambda kv: kv[0]):
            fits = dict(pair.fits)
            current = pair.transport
            views = [(t, f.model, f.n) for t, f in fits.items()]
            if current not in fits:  # only streamed over it so far: predicted by the pooled fit
                views.append((current, self._transport_model(current), 0))
            for transport, m, n in sorted(views, key=lambda v: v[0]):
                out.append(TransferFitView(src, dst, transport, m.bandwidth, m.fixed_s, n,
                                           transport == current, pair.exposed_factor()))
        return out


