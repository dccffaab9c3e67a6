"""The planner's queueing estimate: how a layout (prefill nodes, decode nodes, short-prompt
threshold) would serve the requests of the last window, from the fitted costs alone.

Every request of the window is replayed against the layout at the window's arrival rate
``lam``. A prompt with ``u`` uncached tokens goes to the prefill pool when the layout has one and
``u >= threshold``, else its decode node prefills it ("local"); traffic is spread evenly over
a pool's nodes. ``S(u)`` = the prefill fit, ``X(u)`` = the KV transfer fit.

    prefill pool (per node)   rho_p = lam_p E[S]          M/G/1, Pollaczek-Khinchine:
                              Wq_p  = lam_p E[S^2] / (2 (1 - rho_p))
    decode pool (per node)    a     = lam_d E[output]      tokens per second to produce
                              rho_l = lam_l E[S_local]     time its local prefills take
                              U_d   = rho_l + a (per_seq_s + per_ctx_token_s * ctx)
                              tpot  = fixed_s / (1 - U_d)  (Little's law on the batch: the
                                      per-step cost is paid once per step, the rest per token)
                              kv    = a tpot ctx / its KV pool's tokens   (Little: a tpot running)
    remote request            ttft  = Wq_p + S(u) + X(u)
    local request             ttft  = lam_l E[S_l^2] / (2 (1 - U_d)) + S(u) + tpot

A request meets its SLO when ``ttft <= min(class budget, ttft_slo_factor x S(u))`` and its
TPOT does: ``tpot_target = min(class TBT, tpot_slo_factor x the unloaded TPOT)`` (the one the
router measured, ``PlannerSignals.unloaded_tpot_s``, else the fit's step at batch 1). Its TPOT is
the decode-only one, ``tpot0 = fixed_s / (1 - a (per_seq_s + per_ctx_token_s * ctx))``, plus the
local prefills that land on its node while it decodes: the colocated layout's tail (a running
decode waits behind every chunk of a long document its node prefills; docs/benchmarks.md,
serve: p99 TPOT 3.5-7x the disaggregated one). Each stalls it for ``S' = k_l S / (1 - U_dec)``,
``U_dec = U_d - rho_l``: its own length, then the decode work that piled up behind it (a busy
period's expansion). Over its ``span = output x tpot`` (the mean TPOT, stalls in it) it can
absorb ``slack = output x (tpot_target - tpot0)`` seconds of them. Local prefills arrive as a
Poisson process (``mu = lam_l x span`` expected); one longer than the slack breaks it alone,
shorter ones do when more than ``slack / their mean`` come::

    P(meet TPOT) = exp(-mu P(S' > slack)) x PoissonCDF(floor(slack / E[S' | S' <= slack]); mu P(S' <= slack))

So the stalls' mean is the mean TPOT's excess, ``lam_l tpot E[S'] = tpot - tpot0``: a layout
predicted at a mean TPOT past the target cannot predict most requests within it. (Before
2026-12-03 the span was ``output x tpot0`` and ``S' = S``: the fifth session's colocated layout
was predicted at 84-97% through the elastic benchmark's documents phase at a mean TPOT of
190 ms against a 171 ms target, and measured 28-44%.)

The decode cost is a line in the batch plus, where the nodes registered one, their matmul
curve (``DecodeCost.matmul``: on CPU the BLAS kernels jump at some batch sizes; kv_index/
matmul_curve.py). The formulas above are linear in the batch, so each layout runs the line
through batch 1 and the batch it would itself run at (``operating_cost``: ``B = a tpot`` by
Little, ``tpot`` the line's at ``B``, by bisection): a colocated layout at batch 3 and 1P+1D
at batch 10 are each priced on their own stretch of the curve. And each layout runs the fit
measured while the cluster ran its role mix, where it ran it (``PlannerSignals.decode_for``;
router/planner/decode_fit.py says why), else the current one's.

Predicted goodput = ``lam`` x the mean probability of meeting both; a pool at or past full
utilization meets nothing. With an SLO band (``PlannerConfig.slo_band``) the probability is the
mean over the targets scaled by each of its factors: a layout with headroom scores above one
that meets the SLO only just. The planner compares layouts by it (router/planner/decide.py).

Calibration (``calibrate``): the fitted costs miss what the nodes really pay (a loaded node's
step beside the router, the engine's scheduling, a batch's real cost), so the window's finished
requests are the measure of the current layout. Its measured mean TPOT ``m`` is first
explained by the load, the part that differs between layouts: a factor ``k_u`` on a decode
node's decode work ``U_dec`` and ``k_l = 1 + (k_u - 1) w`` on its local prefills' time ``rho_l``,
``w = rho_l / U_d`` (the current layout's evidence on local prefills: none when it prefills
nothing locally), solved from ``fixed_s / (1 - k_u U_dec - k_l rho_l) = m``; what a clamped
``k_u`` leaves is a plain factor on every layout's TPOT; the measured mean TTFT over the
predicted one is a factor on every TTFT. Each is clamped and only taken with enough samples: a
layout measured slow cannot be predicted fine, and the others are judged with the same
correction (a plain TPOT factor alone would sink a layout with half the decode load per node
as deep as the measured one).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from router.admission import SLO_CLASSES
from router.cost_model import DecodeCost
from router.planner.signals import PlannerSignals, RequestSample

MAX_BATCH = 4096  # a decode node's batch the operating point is searched up to (operating_cost)


@dataclass(frozen=True, slots=True)
class Layout:
    prefill: int  # prefill nodes
    decode: int  # decode nodes (each prefills prompts under the threshold; all of them if prefill == 0)
    threshold: int  # short-prompt threshold (uncached tokens); moot without prefill nodes

    def __str__(self) -> str:
        if self.prefill == 0:
            return f"{self.decode} colocated"
        return f"{self.prefill}P+{self.decode}D (local prefill < {self.threshold} tokens)"

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True, slots=True)
class LayoutEstimate:
    layout: Layout
    goodput_rps: float
    attainment: float  # predicted share of requests meeting both SLOs
    prefill_util: float  # per prefill node (0 without prefill nodes)
    decode_util: float  # per decode node, local prefills included
    tpot_s: float  # predicted mean (inf: saturated)
    ttft_s: float  # predicted mean over the window's requests (inf: saturated)
    kv_util: float = 0.0  # a decode node's KV pool taken by its running sequences (0: capacity unknown)
    local_util: float = 0.0  # rho_l: the local prefills' part of decode_util

    @property
    def max_util(self) -> float:
        """The busiest pool's load. A saturated decode pool's KV figure is infinite (Little's
        law with an unbounded TPOT) and would make every saturated layout look alike; its
        decode utilization (>= 1) already says it is saturated, and by how much, which is what
        compares two saturated layouts (``decide``'s relief: the less overloaded one serves
        more before its queues run away)."""
        kv = self.kv_util if math.isfinite(self.kv_util) else 0.0
        return max(self.prefill_util, self.decode_util, kv)

    def figures(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}_goodput_rps": round(self.goodput_rps, 4), f"{prefix}_attainment": round(self.attainment, 4),
                f"{prefix}_prefill_util": round(self.prefill_util, 4), f"{prefix}_decode_util": round(self.decode_util, 4),
                f"{prefix}_tpot_s": round(self.tpot_s, 4), f"{prefix}_ttft_s": round(self.ttft_s, 4),
                f"{prefix}_kv_util": round(self.kv_util, 4)}


@dataclass(frozen=True, slots=True)
class Calibration:
    """Measured over predicted, for the current layout (1.0: not enough samples, or no figure)."""

    decode_work_scale: float = 1.0  # k_u, on a decode node's decode work
    local_prefill_scale: float = 1.0  # k_l, on its local prefills' time
    tpot_scale: float = 1.0  # what k_u leaves
    ttft_scale: float = 1.0
    tpot_samples: int = 0
    ttft_samples: int = 0
    measured_tpot_s: float = 0.0  # the window's mean (0: no sample)
    measured_ttft_s: float = 0.0

    def figures(self) -> dict[str, float]:
        return {"calib_decode_work_scale": round(self.decode_work_scale, 4),
                "calib_local_prefill_scale": round(self.local_prefill_scale, 4),
                "calib_tpot_scale": round(self.tpot_scale, 4), "calib_ttft_scale": round(self.ttft_scale, 4),
                "calib_tpot_samples": self.tpot_samples, "calib_ttft_samples": self.ttft_samples,
                "measured_tpot_s": round(self.measured_tpot_s, 4), "measured_ttft_s": round(self.measured_ttft_s, 4)}


def measured_requests(s: PlannerSignals, since: float | None = None,
                      arrived_since: float | None = None) -> list[RequestSample]:
    """The window's finished requests that measured the layout running now: finished since
    ``since``, and arrived since ``arrived_since`` (decide.py, ``measured_from``)."""
    return [r for r in s.requests if r.done and (since is None or r.at >= since)
            and (arrived_since is None or r.arrived_at >= arrived_since)]


def calibrate(s: PlannerSignals, current: LayoutEstimate, min_samples: int = 8, lo: float = 0.5,
              hi: float = 4.0, since: float | None = None, arrived_since: float | None = None) -> Calibration:
    """The factors that bring the current layout's predicted mean TPOT and TTFT to the window's
    measured means (``current``: the uncalibrated estimate of the layout the window ran on).
    ``since``: only requests finished from then on measured it (the last action: before it, the
    window's requests ran on another layout); ``arrived_since``: and only those that arrived
    from then on (after a role switch: not those served across it)."""
    mine = measured_requests(s, since, arrived_since)
    tpots = [r.tpot_s for r in mine if r.tpot_s is not None and r.output_tokens > 1]
    ttfts = [r.ttft_s for r in mine if r.ttft_s is not None]

    m_tpot, m_ttft = (sum(xs) / len(xs) if xs else 0.0 for xs in (tpots, ttfts))

    def ok(xs: list[float], predicted: float) -> bool:
        return len(xs) >= min_samples and 0 < predicted < math.inf and sum(xs) > 0

    def clamp(k: float) -> float:
        return min(max(k, lo), hi)

    k_u = k_l = k_tpot = k_ttft = 1.0
    if ok(tpots, current.tpot_s):
        fixed = current.tpot_s * (1 - current.decode_util)  # fixed_s, as the estimate used it
        rho_l, u_dec = current.local_util, current.decode_util - current.local_util
        w = rho_l / current.decode_util if current.decode_util > 0 else 0.0  # the evidence on local prefills
        if current.decode_util > 0:
            # fixed / (1 - k_u u_dec - (1 + (k_u - 1) w) rho_l) = measured, solved for k_u
            k_u = clamp((1 - fixed / m_tpot - (1 - w) * rho_l) / (u_dec + w * rho_l))
            k_l = 1 + (k_u - 1) * w
        # 1 - k_u u_dec - k_l rho_l stays > 0: k_u solves it to fixed / m_tpot; clamped down it
        # grows, clamped up to <= 1 it stays >= 1 - decode_util.
        k_tpot = clamp(m_tpot * (1 - k_u * u_dec - k_l * rho_l) / fixed)
    if ok(ttfts, current.ttft_s):
        k_ttft = clamp(m_ttft / current.ttft_s)
    return Calibration(k_u, k_l, k_tpot, k_ttft, len(tpots), len(ttfts), m_tpot, m_ttft)


def slo_targets(r: RequestSample, s: PlannerSignals, prefill_s: float, ttft_slo_factor: float,
                tpot_slo_factor: float) -> tuple[float, float]:
    """A request's (TTFT, TPOT) targets (module docstring); ``prefill_s``: its prefill's fitted time."""
    slo = SLO_CLASSES.get(r.slo_class, SLO_CLASSES["relaxed"])
    d = s.decode
    return (min(slo.ttft_budget_s(r.prompt_tokens), ttft_slo_factor * max(prefill_s, d.base_s)),
            min(slo.tbt_s, tpot_slo_factor * (s.unloaded_tpot_s or d.step_s(1, r.prompt_tokens + r.output_tokens))))


def late_in_flight(s: PlannerSignals, ttft_slo_factor: float = 5.0, since: float | None = None,
                   arrived_since: float | None = None, widest: float = 1.0) -> list[RequestSample]:
    """The window's requests in flight that arrived since ``arrived_since`` (else ``since``) and
    are past their TTFT target scaled by ``widest`` already: their first token came late, or has
    not come and they have waited longer than that. Each is a miss whatever comes next.

    Why count them before they finish: a layout that queues its requests finishes few, and the
    ones it finishes are the ones it served in time, so the finished ones alone take longest to
    judge the layout that serves worst. The held-out seed-6 run of 2026-12-03 held a switch to
    colocated for 18-22 s into its documents phase waiting for 8 requests to arrive after it and
    finish; 0-6 had. Only misses: a request in time so far may still miss its TPOT, and one
    past its TTFT target cannot be saved."""
    start = arrived_since if arrived_since is not None else since
    out = []
    for r in s.requests:
        if r.done or not r.first_token_watched or (start is not None and r.arrived_at < start):
            continue
        waited = r.ttft_s if r.ttft_s is not None else s.at - r.arrived_at  # so far, if none yet
        ttft_t, _ = slo_targets(r, s, s.prefill.predict(r.uncached, r.cached_tokens), widest * ttft_slo_factor, 1.0)
        if waited > ttft_t:
            out.append(r)
    return out


def measured_share(s: PlannerSignals, ttft_slo_factor: float = 5.0, tpot_slo_factor: float = 2.0,
                   since: float | None = None, band: tuple[float, ...] = (1.0,),
                   arrived_since: float | None = None) -> tuple[float, int]:
    """(share meeting both targets, requests): the window's requests finished since ``since``
    (and, with ``arrived_since``, that arrived since then: served by one layout from start to
    end), judged by the targets the model predicts against (``estimate``, with the same
    ``band``: the mean share over the targets scaled by each), so a layout measured and one
    predicted compare on one scale; and, as misses, those in flight already past their TTFT
    target at the widest of the band (``late_in_flight``)."""
    mine = measured_requests(s, since, arrived_since)
    late = late_in_flight(s, ttft_slo_factor, since, arrived_since, max(band))
    ok = 0.0
    for r in mine:
        prefill_s = s.prefill.predict(r.uncached, r.cached_tokens)
        for b in band:
            ttft_t, tpot_t = slo_targets(r, s, prefill_s, b * ttft_slo_factor, b * tpot_slo_factor)
            ok += ((r.ttft_s is None or r.ttft_s <= ttft_t) and (r.tpot_s is None or r.tpot_s <= tpot_t)) / len(band)
    n = len(mine) + len(late)
    return (ok / n if n else 0.0), n


def _moments(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return 0.0, 0.0
    return sum(xs) / len(xs), sum(x * x for x in xs) / len(xs)


def operating_cost(d: DecodeCost, a: float, ctx: float, rho_l: float, calibration: Calibration) -> DecodeCost:
    """``d`` as a line (``DecodeCost.secant``) at the batch a decode node runs at: ``B = a tpot``
    (Little), ``tpot`` the line's at ``B``, solved by bisection. ``d`` itself without a matmul
    curve; the line at ``MAX_BATCH`` when even that batch falls behind (saturated)."""
    if not d.matmul:
        return d

    def batch(b: float) -> float:  # the batch the line through b would run at
        e = d.secant(b)
        u = rho_l + calibration.decode_work_scale * a * (e.per_seq_s + e.per_ctx_token_s * ctx)
        return a * calibration.tpot_scale * e.fixed_s / (1 - u) if u < 1 else math.inf

    lo, hi = 1.0, float(MAX_BATCH)
    if batch(lo) <= lo:  # under one sequence on average
        return d.secant(lo)
    if batch(hi) > hi:  # even the largest batch falls behind
        return d.secant(hi)
    for _ in range(40):  # batch(lo) > lo, batch(hi) <= hi: a fixed point between
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if batch(mid) > mid else (lo, mid)
    return d.secant(hi)


def estimate(layout: Layout, s: PlannerSignals, ttft_slo_factor: float = 5.0,
             tpot_slo_factor: float = 2.0, calibration: Calibration = Calibration(),
             band: tuple[float, ...] = (1.0,)) -> LayoutEstimate:
    """The layout's predicted goodput on the window's requests (module docstring); its TPOT and
    TTFT times ``calibration``'s factors (the SLO targets stay what they are). ``band``: the
    attainment is the mean over the targets scaled by each factor (PlannerConfig.slo_band)."""
    reqs = s.requests
    lam = s.rate_rps
    if not reqs or lam <= 0 or layout.decode < 1:  # nothing to serve, or nobody to serve it
        return LayoutEstimate(layout, 0.0, 0.0, 0.0, 0.0, s.decode.base_s, 0.0)
    n = len(reqs)
    pf = s.prefill

    def remote(r: RequestSample) -> bool:
        return layout.prefill > 0 and r.uncached >= layout.threshold

    cost = {id(r): pf.predict(r.uncached, r.cached_tokens) for r in reqs}
    far = [cost[id(r)] for r in reqs if remote(r)]
    near = [cost[id(r)] for r in reqs if not remote(r)]
    # Prefill pool, per node.
    lam_p = lam * len(far) / n / max(layout.prefill, 1)
    m1, m2 = _moments(far)
    rho_p = lam_p * m1
    wq_p = lam_p * m2 / (2 * (1 - rho_p)) if rho_p < 1 else math.inf
    # Decode pool, per node.
    lam_l = lam * len(near) / n / layout.decode
    l1, l2 = _moments(near)
    rho_l = calibration.local_prefill_scale * lam_l * l1
    out = sum(r.output_tokens for r in reqs) / n
    ctx = sum(r.prompt_tokens + r.output_tokens / 2 for r in reqs) / n
    a = lam * out / layout.decode
    d = operating_cost(s.decode_for(layout.prefill, layout.decode), a, ctx, rho_l, calibration)
    u_dec = calibration.decode_work_scale * a * (d.per_seq_s + d.per_ctx_token_s * ctx)
    u_d = rho_l + u_dec
    k_tpot, k_ttft = calibration.tpot_scale, calibration.ttft_scale
    tpot = k_tpot * d.fixed_s / (1 - u_d) if u_d < 1 else math.inf
    tpot0 = k_tpot * d.fixed_s / (1 - u_dec) if u_dec < 1 else math.inf
    wq_l = lam_l * l2 / (2 * (1 - u_d)) if u_d < 1 else math.inf
    # KV: a decode node holds a * tpot sequences at once (Little), each about ctx tokens, in a pool
    # the size of the nodes' mean (a node keeps its pool whatever its role).
    caps = [n.kv_capacity_tokens for n in s.nodes if n.kv_capacity_tokens > 0]
    kv_util = a * tpot * ctx / (sum(caps) / len(caps)) if caps and u_d < 1 else (math.inf if caps else 0.0)
    near_sorted = sorted(near)
    prefix = [0.0]
    for x in near_sorted:
        prefix.append(prefix[-1] + x)

    # A local prefill of S seconds stalls a running decode by S * stretch: S itself, then the
    # decode work that piled up behind it (a busy period's expansion, 1 / (1 - u_dec)), at its
    # calibrated length. With the span at the mean TPOT, the stalls' mean is the mean TPOT's
    # excess over the decode-only one: lam_l tpot E[S] stretch = tpot - tpot0.
    stretch = calibration.local_prefill_scale / (1 - u_dec) if u_dec < 1 else math.inf

    def p_stalls_fit(output: int, target: float) -> float:
        """P(the local prefills during its decode fit in its slack) (module docstring)."""
        slack, span = output * (target - tpot0), output * tpot
        k = bisect.bisect_right(near_sorted, slack / stretch)  # local prefills that fit the slack alone
        if not near_sorted:
            return 1.0
        mu = lam_l * span
        mu_small = mu * k / len(near_sorted)
        p = math.exp(-(mu - mu_small))
        if k == 0 or mu_small == 0:
            return p
        mean = prefix[k] / k * stretch
        fits = int(slack / mean) if mean > 0 else 200  # prompts cached whole stall nothing
        term = cdf = math.exp(-mu_small)
        for i in range(1, min(fits, 200) + 1):
            term *= mu_small / i
            cdf += term
        return p * min(cdf, 1.0)

    met = 0.0
    ttft_sum = 0.0
    for r in reqs:
        sr = cost[id(r)]
        if remote(r):
            ttft = wq_p + sr + s.transfer_fixed_s + s.transfer_s_per_token * r.uncached
        else:
            ttft = wq_l + sr + tpot / k_tpot  # its first token, uncalibrated: k_ttft corrects the whole
        ttft *= k_ttft
        ttft_sum += ttft
        if u_d >= 1 or kv_util >= 1:
            continue
        for b in band:
            ttft_target, tpot_target = slo_targets(r, s, sr, b * ttft_slo_factor, b * tpot_slo_factor)
            if ttft > ttft_target or (r.output_tokens > 1 and tpot0 > tpot_target):
                continue
            met += (p_stalls_fit(r.output_tokens, tpot_target) if r.output_tokens > 1 else 1.0) / len(band)
    att = met / n
    return LayoutEstimate(layout, lam * att, att, rho_p, u_d, tpot, ttft_sum / n, kv_util, rho_l)
