"""KV transfer cost: seconds to move KV bytes between two nodes, or between a node's tiers.

Pure: plain numbers in, seconds out. ``TransferCost`` is ``fixed_s`` per push (a stream set up,
a header validated, a reply awaited; a file opened and checksummed) plus bytes at ``bandwidth``;
``TransferFit`` fits one online from measured moves. ``CostBook`` (router/cost_model.py) keeps
one per (source, destination, transport) for pushes between nodes and one per (node, tier) for
bringing a node's host-memory or disk blocks back to its device (onboarding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from kv_index.schema import TIER_DISK, TIER_HOST


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
# dist (a gloo group beside the data port) has no quiet-VM run: its prior is tcp's scaled by
# what dist did against tcp in the same (busy) run of 2026-12-02 (docs/benchmarks.md, dist):
# bandwidth 1.41 / 1.75 GB/s = 0.81x, fixed cost 0.76 / 0.68 ms one-block latency = 1.12x. The
# group's set-up (about 8 ms, once per kept data connection) is amortized and left out.
TRANSPORT_PRIORS: dict[str, TransferCost] = {
    "grpc": TransferCost(1.3e-3, 1.1e9),
    "tcp": TransferCost(0.41e-3, 3.2e9),
    "shm": TransferCost(0.20e-3, 4.2e9),
    "dist": TransferCost(0.41e-3 * 1.12, 3.2e9 * 0.81),
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

        sender   (prefill): "shm://<host key>/", "dist://", "tcp://"      what it sends over, no address
        receiver (decode):  "shm://<host key>/host:port", "dist://host:port", "tcp://host:port"

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


class TransferFitView(NamedTuple):
    src: str
    dst: str
    transport: str
    bandwidth: float
    fixed_s: float
    transfers: int  # unstreamed transfers fitted (0: the transport's pooled fit or prior)
    current: bool  # the transport the pair's predictions use now
    exposed_factor: float  # expected exposed seconds per raw second (1.0 unless streamed)


# The tiers below a node's device pool, by the index's numbering (kv_index/schema.py).
TIER_NAMES: dict[int, str] = {TIER_HOST: "host", TIER_DISK: "disk"}

# Priors for onboarding (a tier's blocks back into the device pool, before the prefill can use
# them), until a node's own reports replace them. Estimates, not measurements yet: host, a
# memcpy on the 2-core VM (9.4 GB/s in docs/benchmarks.md "Figures behind constants"; pinned
# host to HBM over PCIe 4/5 is 20-50 GB/s) with a small fixed cost per run of blocks; disk, a
# sequential read of one file per run plus its checksum (NVMe 2-7 GB/s; 2 GB/s and 0.5 ms
# fixed). `pdserve bench kv-tiers` measures both; its figures belong here once recorded.
ONBOARD_PRIORS: dict[str, TransferCost] = {
    "host": TransferCost(50e-6, 9.0e9),
    "disk": TransferCost(0.5e-3, 2.0e9),
}


def tier_name(tier: int | str) -> str:
    """"host" or "disk" from either a name or the index's tier number; ValueError otherwise
    (the device tier has no onboard cost: its hits are free)."""
    name = TIER_NAMES.get(tier) if isinstance(tier, int) else tier
    if name not in ONBOARD_PRIORS:
        raise ValueError(f"no onboard cost for tier {tier!r}: expected one of {sorted(ONBOARD_PRIORS)}")
    return name


class OnboardFitView(NamedTuple):
    node_id: str  # "" : the pooled fit of every node (what a node without reports is predicted by)
    tier: str
    bandwidth: float
    fixed_s: float
    onboards: int  # reports fitted
