"""The planner's decode-step fit (``DecodeFit``): a decode step's cost learnt from the decode
nodes' heartbeats, one fit per role mix the cluster ran (why: a node's step costs what the
layout around it makes it cost; ``DecodeFit``'s docstring).
"""
from __future__ import annotations

from collections.abc import Iterable

from kv_index.matmul_curve import MatmulCurve, curve_s
from kv_index.nodes import NodeInfo, Role
from router.cost_model import DecodeCost, OnlineFit, solve

# Heartbeats (with a running batch) before a node's own figures replace the prior: a CPU node's
# step is 5x the prior's, and a prior pinned beside the data would tilt the fit toward itself.
MIN_HEARTBEATS = 8


# The anchor's weight beside the heartbeats: as much as all of them together (their forgotten
# weight). Less, and a fit through loaded steps alone still puts the fixed part anywhere.
ANCHOR_WEIGHT = 1.0


class DecodeFit:
    """A decode step's cost (``DecodeCost``) fitted from the decode nodes' heartbeats (their step
    time at their running batch and context): least squares over an exponentially forgotten window, the
    prior until ``MIN_HEARTBEATS`` came. ``CostBook.decode`` is a prior only: the router's
    placement reads it for the TBT check; the planner needs the nodes' real speed. A direction
    the heartbeats leave open (every step at one batch size) gets 0 (``solve``).

    Anchored on the unloaded TPOT where the router measured one (``observe``'s
    ``unloaded_tpot_s``): a step at batch 1 and the nodes' mean context per sequence, weighted
    as much as the heartbeats. Why: heartbeats come at a few batch sizes whose context grows
    with them, so a line through them leaves its intercept nearly free; over the elastic
    benchmark's 1,186 recorded rounds the fitted fixed part fell under 10 ms in 313 and rose
    over 300 ms in 98 (the unloaded step: ~117 ms), and the model's TPOT is that fixed part over
    the load. A step measured alone pins it where it is."""

    def __init__(self, prior: DecodeCost = DecodeCost(), forget: float = 0.98) -> None:
        self.forget = forget
        self._mixes: dict[tuple[int, int], _MixFit] = {}  # (prefill, decode nodes) -> its fit
        self._seen: dict[str, float] = {}  # node id -> the heartbeat (updated_at) last taken
        self._curve: MatmulCurve = ()  # the decode nodes' matmul curve (the last one registered)
        self.models: dict[tuple[int, int], DecodeCost] = {}  # each role mix's, once fitted
        self.model = prior  # the current mix's; before it has one, the last one fitted (or the prior)

    def observe(self, nodes: Iterable[NodeInfo], unloaded_tpot_s: float = 0.0) -> None:
        """Fold in the decode nodes' new heartbeats, under the role mix the nodes run now
        (``nodes``: the router's view, live and not draining). One fit per mix because a node's
        step costs what its layout makes it cost: in the elastic benchmark's seed-4 run of
        2026-12-03 the colocated nodes' decode-only steps fitted 4.4 ms a sequence beyond their
        matmuls against the 1P+1D decode node's 1.2, on the same engine; the cause is not found,
        and the planner running colocated, pricing 1P+1D at its own figure, ranked the two
        wrongly in 81 of 160 paired rounds. A mix's fit is kept when the cluster leaves it, so
        the planner prices a layout it ran at what it measured there (``PlannerSignals.decode_for``)."""
        nodes = list(nodes)
        mix = (sum(n.role == Role.PREFILL for n in nodes), sum(n.role == Role.DECODE for n in nodes))
        fit = self._mixes.setdefault(mix, _MixFit(self.forget))
        for n in nodes:
            if n.role != Role.DECODE or n.step_s <= 0 or n.running < 1 or self._seen.get(n.node_id) == n.updated_at:
                continue
            self._seen[n.node_id] = n.updated_at
            # Its decode-only average with the batch and context those steps ran, where it
            # reports them (node/step_time.py), else its best recent step at this batch
            # (router/step_history.py): a decode node's average step also carries the chunks
            # of prompts it prefilled itself, which the model counts apart (rho_l). The best
            # step was not enough: on a colocated node the large batches come while a document
            # prefills, so their best steps carry chunks too.
            if n.decode_step_s > 0 and n.decode_step_running >= 1:
                step, batch, context = n.decode_step_s, n.decode_step_running, n.decode_step_tokens
            else:
                step = n.step_best_s if 0 < n.step_best_s < n.step_s else n.step_s
                batch, context = n.running, n.running_tokens
            # The line fits what the node's matmuls leave (its registered curve; kv_index/
            # matmul_curve.py): they jump at some batches, and a line through a colocated
            # node's small batches, where the jump is, prices a sequence higher than one
            # through a decode node's larger ones.
            if n.matmul_ms:
                self._curve = n.matmul_ms
            fit.add(batch, context, step - curve_s(n.matmul_ms, batch))
        if fit.n >= MIN_HEARTBEATS:
            c = fit.solve(unloaded_tpot_s - curve_s(self._curve, 1) if unloaded_tpot_s > 0 else None)
            self.models[mix] = DecodeCost(max(c[0], 1e-4), max(c[1], 0.0) / 1e2, max(c[2], 0.0) / 1e6, self._curve)
            self.model = self.models[mix]

    def by_mix(self) -> tuple[tuple[int, int, DecodeCost], ...]:
        """Every role mix's fit, as ``PlannerSignals.decode_by_mix`` carries them."""
        return tuple((p, d, m) for (p, d), m in sorted(self.models.items()))


class _MixFit:
    """One role mix's heartbeats: the line's normal equations and the mean context per running
    sequence, forgotten alike."""

    def __init__(self, forget: float) -> None:
        self._fit = OnlineFit(3, forget)
        self._ctx = OnlineFit(1, forget)

    @property
    def n(self) -> int:
        return self._fit.n

    def add(self, batch: float, context: float, step_s: float) -> None:
        self._fit.add(_decode_features(batch, context), step_s)
        self._ctx.add((1.0,), context / batch)

    def solve(self, anchor_s: float | None) -> list[float]:
        """``anchor_s``: a step at batch 1 and the mean context (the unloaded TPOT less the
        matmuls), or None."""
        A, b = self._fit.A, self._fit.b
        if anchor_s is not None:
            x = _decode_features(1, round(self._ctx.coef()[0]))
            w = ANCHOR_WEIGHT * A[0][0]  # A[0][0]: the heartbeats' forgotten weight (feature 0 is 1)
            A = [[A[i][j] + w * x[i] * x[j] for j in range(3)] for i in range(3)]
            b = [b[i] + w * x[i] * anchor_s for i in range(3)]
        return nonnegative_fit(A, b)


def nonnegative_fit(A: list[list[float]], b: list[float]) -> list[float]:
    """Least squares from the normal equations ``A c = b`` with the per-sequence and per-token
    costs (``c[1:]``) kept >= 0: the best of the fits over each subset of those terms (the
    others held at 0). Why not clamp the free solution: batch and context grow together in the
    heartbeats, so the free fit often trades a negative cost on one for an inflated one on the
    other, and zeroing the negative one after the fact leaves the inflated one in (a step at
    batch 8 predicted at twice what it was measured)."""
    n = len(b)
    best, best_sse = [0.0] * n, float("inf")
    for mask in range(1 << (n - 1)):
        keep = [0] + [i for i in range(1, n) if mask >> (i - 1) & 1]
        sub = solve([[A[i][j] for j in keep] for i in keep], [b[i] for i in keep])
        c = [0.0] * n
        for i, v in zip(keep, sub):
            c[i] = v
        if any(v < 0 for v in c[1:]):
            continue
        sse = sum(c[i] * A[i][j] * c[j] for i in range(n) for j in range(n)) - 2 * sum(b[i] * c[i] for i in range(n))
        if sse < best_sse:
            best, best_sse = c, sse
    return best


def _decode_features(batch: int, ctx: int) -> tuple[float, float, float]:
    return 1.0, batch / 1e2, ctx / 1e6  # scaled: the normal equations stay well conditioned
