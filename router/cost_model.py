"""Cost models the placement policy predicts time with, fitted online from the nodes' reports.

Pure: plain numbers in, seconds out; no sockets. Three models:

* ``PrefillCost``: seconds to prefill ``new`` tokens on top of ``cached`` ones::

      t = fixed_s + per_token_s * new + attn_s * new * (cached + new / 2)

  The last term is attention: each new token attends over the context before it, on average
  ``cached + new/2`` tokens, so long prompts cost more per token than short ones.
* ``DecodeCost``: seconds per decode step for a batch: ``fixed_s + per_seq_s * batch +
  per_ctx_token_s * context tokens in the batch`` (weights read once per step, KV per token).
* ``TransferCost``: seconds to move KV between a (source, destination) pair over one
  transport (shm, tcp, grpc): ``fixed_s`` per push + bytes / ``bandwidth``, fitted per pair and
  transport by ``TransferFit`` from whole pushes (a push after the prefill, alone on its
  cores); with layer-wise streaming the request waits only for the exposed part, which
  ``CostBook.transfer_s`` predicts from the streamed transfers' exposed share.

``OnlineFit`` fits any such linear model by least squares over an exponentially forgotten
window, started from a prior: the prior enters as a few pseudo-observations at representative
points, so the fit is sane before the first report and converges to the data after enough
of them.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Sequence

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


@dataclass(frozen=True, slots=True)
class TransferCost:
    """Seconds to move KV between two nodes over one transport: ``fixed_s`` per push (a stream
    set up, a header validated, a reply awaited) plus the bytes at ``bandwidth`` (bytes/s)."""
    fixed_s: float
    bandwidth: float

    def seconds(self, num_bytes: float, pushes: int = 1) -> float:
        return self.fixed_s * max(1, pushes) + max(num_bytes, 0.0) / self.bandwidth


# Priors per transport: docs/benchmarks.md "Figures behind constants", the quiet-VM run of 2026-12-01 (grpc 1.12
# GB/s and 1.30 ms fixed; tcp 3.19 GB/s, 0.41 ms; shm 4.18 GB/s, 0.20 ms). A pair's own
# measurements replace them within a few transfers; they matter for the first requests and for
# the split between fixed cost and bandwidth while a pair has only seen one size of prompt.
TRANSPORT_PRIORS: dict[str, TransferCost] = {
    "grpc": TransferCost(1.3e-3, 1.1e9),
    "tcp": TransferCost(0.41e-3, 3.2e9),
    "shm": TransferCost(0.20e-3, 4.2e9),
}
# A report implying more than this is a clock or accounting error, not a transport (HBM itself
# copies at a few TB/s).
MAX_BANDWIDTH = 1e13
# Where the prior is pinned (bytes): one small block of a small model, where a transfer is all
# fixed cost, and 64 MiB, where it is all bandwidth.
_PRIOR_BYTES = (256 * 1024, 64 * 1024 * 1024)
_MB = 1e6  # features in MB: seconds-per-MB and seconds-per-push are both ~1e-3


class TransferFit:
    """One (source, destination, transport)'s ``TransferCost``, fitted online from measured
    transfers ``(bytes, pushes, seconds)`` as ``seconds = fixed_s * pushes + bytes / bandwidth``.

    Why this fit and not an EWMA of bytes/seconds: a 1-block transfer on gRPC is ~75% fixed
    cost (1.3 of 1.78 ms, docs/benchmarks.md), so bytes/seconds over chat-sized prompts reads
    as a bandwidth almost 3x too low, and then charges a long prompt almost 3x too much. Two coefficients need two kinds of evidence, and the
    choices below keep each honest when the evidence is thin:

    * Least squares in *relative* error (each point weighted by 1/predicted^2, predicted by the
      prior's shape): in absolute seconds one 64 MiB transfer outweighs a hundred small ones,
      and the fixed cost, which only small transfers show, would be lost in its noise.
    * The prior enters at its shape, scaled by how much slower than predicted the pair has been
      (``scale``, as ``PrefillCostFit``): reports of one size (every chat prompt 1-3 blocks)
      fix the level and say nothing about the split; the scaled prior supplies the split
      without pulling the level back towards its own. It is not forgotten, so a long run of
      one size cannot let noise decide the split; data of spread sizes outweighs it.
    * Exponential forgetting (``forget``): a pair's path changes (a neighbour's traffic, a
      pod moved to another host).
    * Each report is clipped to ``clip`` times the current prediction either way before it is
      used (``clip`` squared for a fit's first two reports, against a prior that may be far
      off): one absurd figure (a clock step, a transfer that waited behind a GC pause) moves
      the fit by a bounded amount, while a real change still arrives in a few reports.
    * The solution is kept physical: fixed_s >= 0 and bandwidth <= MAX_BANDWIDTH (a negative
      intercept from noise is refitted as a pure bandwidth line, and vice versa).
    """

    def __init__(self, prior: TransferCost, prior_weight: float = 2.0, forget: float = 0.97,
                 clip: float = 20.0) -> None:
        self.prior = prior
        self.forget = forget
        self.clip = clip
        # The prior's normal equations at scale 1 (relative weights: each point counts 1).
        self._pA = [[0.0, 0.0], [0.0, 0.0]]
        self._pb = [0.0, 0.0]
        for nb in _PRIOR_BYTES:
            x, y = (1.0, nb / _MB), prior.seconds(nb)
            w = prior_weight / len(_PRIOR_BYTES) / y ** 2
            _accumulate(self._pA, self._pb, x, y, w)
        self._A = [[0.0, 0.0], [0.0, 0.0]]
        self._b = [0.0, 0.0]
        self._observed = self._predicted = 0.0  # forgotten sums: seconds reported, prior's seconds
        self._model = prior
        self.n = 0

    @property
    def scale(self) -> float:
        return self._observed / self._predicted if self._predicted > 0 else 1.0

    @property
    def model(self) -> TransferCost:
        return self._model

    def add(self, num_bytes: float, seconds: float, pushes: int = 1) -> bool:
        """One measured transfer; False (and nothing learned) when the report is unusable."""
        if not (num_bytes > 0 and seconds > 0 and math.isfinite(num_bytes) and math.isfinite(seconds)):
            return False
        pushes = max(1, pushes)
        now = self._model.seconds(num_bytes, pushes)
        # Looser for the first two: a prior can be far off (a loaded VM, a 100 Gb NIC).
        bound = self.clip if self.n >= 2 else self.clip ** 2
        seconds = min(max(seconds, now / bound), now * bound)
        p = self.prior.seconds(num_bytes, pushes)
        f = self.forget
        for i in range(2):
            self._b[i] *= f
            for j in range(2):
                self._A[i][j] *= f
        _accumulate(self._A, self._b, (float(pushes), num_bytes / _MB), seconds, 1.0 / p ** 2)
        self._observed = f * self._observed + seconds
        self._predicted = f * self._predicted + p
        s = self.scale
        A = [[self._pA[i][j] + self._A[i][j] for j in range(2)] for i in range(2)]
        b = [s * self._pb[i] + self._b[i] for i in range(2)]
        fixed, per_mb = _solve_physical(A, b)
        self._model = TransferCost(fixed, _MB / per_mb)
        self.n += 1
        return True


def _accumulate(A: list[list[float]], b: list[float], x: Sequence[float], y: float, w: float) -> None:
    for i in range(2):
        b[i] += w * x[i] * y
        for j in range(2):
            A[i][j] += w * x[i] * x[j]


def _solve_physical(A: list[list[float]], b: list[float]) -> tuple[float, float]:
    """Least squares for (fixed_s, seconds per MB) from the normal equations, constrained to
    fixed_s >= 0 and seconds per MB >= 1/MAX_BANDWIDTH: the unconstrained solution when it is
    physical, else the better of the two one-coefficient fits on the boundary."""
    min_per_mb = _MB / MAX_BANDWIDTH
    det = A[0][0] * A[1][1] - A[0][1] * A[1][0]
    if abs(det) > 1e-12 * A[0][0] * A[1][1]:
        fixed = (b[0] * A[1][1] - A[0][1] * b[1]) / det
        per_mb = (A[0][0] * b[1] - A[1][0] * b[0]) / det
        if fixed >= 0 and per_mb >= min_per_mb:
            return fixed, per_mb

    def loss(c0: float, c1: float) -> float:  # up to a constant: c^T A c - 2 b^T c
        return A[0][0] * c0 * c0 + 2 * A[0][1] * c0 * c1 + A[1][1] * c1 * c1 - 2 * (b[0] * c0 + b[1] * c1)

    no_fixed = (0.0, max(b[1] / A[1][1], min_per_mb))
    fastest = (max((b[0] - A[0][1] * min_per_mb) / A[0][0], 0.0), min_per_mb)
    return min(no_fixed, fastest, key=lambda c: loss(*c))


def first_transport(sender: Sequence[str], receiver: Sequence[str]) -> str:
    """The transport a prefill node tries first towards a decode node, from what each
    advertises in the index (``NodeInfo.kv_endpoints``), as its ``FallbackKVSender`` walks them
    (kv_transfer/transport.py): the receiver's endpoints in its order, each one the sender has
    a transport for; a shared-memory one only on the sender's own host (same host key); gRPC
    when none is left (also with TLS, where neither end advertises a fast transport).

        sender   (prefill): "shm://<host key>/", "tcp://"      what it sends over, no address
        receiver (decode):  "shm://<host key>/host:port", "tcp://host:port"

    A guess until the pair's first transfer says which one carried it: the receiver may still
    refuse to map the sender's shared memory (another /dev/shm on the same kernel)."""
    sends: dict[str, str] = {}  # scheme -> the sender's host key ("" for tcp)
    for e in sender:
        scheme, _, rest = e.partition("://")
        sends[scheme] = rest.partition("/")[0]
    for e in receiver:
        scheme, sep, rest = e.partition("://")
        if not sep or scheme not in sends:
            continue
        if scheme == "shm":
            key, _, address = rest.partition("/")
            if key and address and key == sends["shm"]:
                return scheme
            continue
        if rest:  # an address to send to
            return scheme
    return "grpc"


@dataclass(slots=True)
class PairTransfers:
    """What the book knows of one directed (source, destination) pair: a fit per transport it
    has pushed whole KV over, the transport of its last successful transfer (a fast transport
    that fell back to gRPC shows as "grpc", and is predicted as such until it works again), and
    how much of a transfer the request waits for when the KV is streamed layer by layer during
    the prefill. A transport the pair has only streamed over has no fit of its own: it is
    predicted by that transport's pooled fit."""
    fits: dict[str, TransferFit]
    transport: str
    # exposed seconds / the fit's one-push seconds for the same bytes, over streamed transfers
    exposed_fraction: float = 1.0
    # share of recent transfers that were streamed (1.0: all, 0.0: none)
    streamed_share: float = 0.0
    transfers: int = 0
    streamed_seen: bool = False

    def exposed_factor(self) -> float:
        """Expected exposed seconds per second of an unstreamed transfer."""
        s = self.streamed_share
        return s * self.exposed_fraction + (1.0 - s)


class CostBook:
    """Per-node prefill fits plus per-pair transfer fits: what a policy consults. A node with
    fewer than ``min_reports`` reports gets the pooled fit of all nodes' reports (the prior before
    any): judging it by the prior while its peers are judged by their measurements would make a
    node that never reported look faster (or slower) than it is and draw (or lose) all traffic.
    Transfers follow the same idea: a pair that never transferred is predicted by the pooled fit
    of the transport the router last saw used, and a pair's fit for a transport starts from that
    transport's pooled fit.
    Step reports come from the router's refresher thread and transfer measurements from its
    event loop; readers get immutable ``PrefillCost`` / ``TransferCost`` values and
    single-attribute reads, so a lookup never sees a half-updated fit."""

    def __init__(self, prior: PrefillCost = PrefillCost(), decode: DecodeCost = DecodeCost(),
                 default_bandwidth: float = 25e9, kv_bytes_per_token: int = 131072,
                 min_reports: int = 8, default_fixed_s: float = 0.0,
                 transport_priors: Mapping[str, TransferCost] | None = None,
                 transfer_forget: float = 0.97, exposed_alpha: float = 0.2) -> None:
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


class TransferFitView(NamedTuple):
    src: str
    dst: str
    transport: str
    bandwidth: float
    fixed_s: float
    transfers: int  # unstreamed transfers fitted (0: the transport's pooled fit or prior)
    current: bool  # the transport the pair's predictions use now
    exposed_factor: float  # expected exposed seconds per raw second (1.0 unless streamed)
