"""What the planner decides from, as plain data, and how the router gathers it.

``PlannerSignals`` is one round's picture: the live nodes and their load (from the registry's
heartbeats, ``router/node_view.py``), the requests this router finished over the last window
(``RequestWindow``, fed by the orchestrator), and the fitted costs (``router/cost_model.py``:
the pooled prefill fit, a decode-step fit from the decode nodes' heartbeats, the KV transfer
model). Tests build it by hand; ``build_signals`` builds it from the live router.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from kv_index.nodes import NodeInfo, Role
from router.admission import SLO_CLASSES
from router.cost_model import CostBook, DecodeCost, PrefillCost


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One request as the router saw it: finished, or (``done`` False) still in flight, with
    ``output_tokens`` its ``max_tokens`` (what it may still produce) and no latencies yet.
    ``tpot_s`` is None for a single token."""

    at: float  # wall clock when it finished
    prompt_tokens: int
    cached_tokens: int  # predicted from the index at placement
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    slo_class: str = "relaxed"
    local: bool = False  # prefilled on its decode node
    done: bool = True  # False: admitted and placed, not finished (``at``: when it was placed)
    # In flight: the router sets ``ttft_s`` when its first token comes (RequestWindow.first_token),
    # so one with none yet has waited ``signals.at - at`` so far. False in recordings made before
    # that, whose requests in flight carry no first token whether they had one or not.
    first_token_watched: bool = False

    @property
    def uncached(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)

    @property
    def arrived_at(self) -> float:
        """Wall clock when the router took it: for a finished request its latencies read back
        from ``at`` (``ttft_s`` runs from arrival, ``tpot_s`` is the mean gap over the other
        output tokens), so recordings made before this existed answer it too; ``at`` itself
        for one in flight, or one that failed before its first token."""
        if not self.done or self.ttft_s is None:
            return self.at
        return self.at - self.ttft_s - (self.tpot_s or 0.0) * max(0, self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class NodeSignal:
    node_id: str
    role: Role
    waiting: int = 0
    running: int = 0
    running_tokens: int = 0
    kv_usage: float = 0.0
    step_s: float = 0.0
    backlog_s: float = 0.0  # predicted wait before a new request starts here
    kv_capacity_tokens: int = 0  # tokens its KV pool holds (0: unknown)


@dataclass(frozen=True, slots=True)
class PlannerSignals:
    at: float  # wall clock of the round
    span_s: float  # seconds the requests cover (their rate is len(requests) / span_s)
    nodes: tuple[NodeSignal, ...]
    requests: tuple[RequestSample, ...]
    prefill: PrefillCost = PrefillCost()  # the cluster's typical node (pooled fit)
    decode: DecodeCost = DecodeCost()  # fitted from the decode nodes' heartbeats, in the role mix running now
    transfer_fixed_s: float = 0.0
    transfer_s_per_token: float = 0.0
    short_prompt_tokens: int = 64  # the threshold in force
    draining: int = 0  # registered nodes out of the view: draining (a role switch, a removal)
    offered_rps: float = 0.0  # requests admitted per second (0: unknown, the finished ones' rate)
    # The TPOT of a request that had a decode node to itself, as measured (RequestWindow.unloaded_tpot_s);
    # 0: unknown (the decode fit's step at batch 1 stands in).
    unloaded_tpot_s: float = 0.0
    # (prefill nodes, decode nodes, the decode fit measured while the cluster ran that mix), for
    # every mix it ran (router/planner/decode_fit.py): a layout is priced at its own mix's fit.
    decode_by_mix: tuple[tuple[int, int, DecodeCost], ...] = ()

    def decode_for(self, prefill: int, decode: int) -> DecodeCost:
        """The decode fit measured on this role mix, or the current one where it never ran."""
        for p, d, cost in self.decode_by_mix:
            if (p, d) == (prefill, decode):
                return cost
        return self.decode

    @property
    def rate_rps(self) -> float:
        """The load the layouts are judged at: requests admitted per second where known, else
        the finished requests' rate (which past saturation falls below what arrives)."""
        if self.offered_rps > 0:
            return self.offered_rps
        return len(self.requests) / self.span_s if self.span_s > 0 else 0.0

    def count(self, role: Role) -> int:
        return sum(1 for n in self.nodes if n.role == role)

    def pool(self, role: Role) -> dict[str, float]:
        """Per pool: nodes, queued requests, mean predicted wait and KV usage (figures for logs)."""
        ns = [n for n in self.nodes if n.role == role]
        k = max(len(ns), 1)
        return {"nodes": len(ns), "queue": sum(n.waiting for n in ns), "wait_s": sum(n.backlog_s for n in ns) / k,
                "kv_usage": sum(n.kv_usage for n in ns) / k}

    def long_share(self) -> float:
        """Share of requests whose uncached prompt reaches the threshold in force."""
        if not self.requests:
            return 0.0
        return sum(r.uncached >= self.short_prompt_tokens for r in self.requests) / len(self.requests)

    def offered_since(self, since: float | None) -> tuple[float, float]:
        """(requests, prompt tokens) per second over the window's requests since ``since`` (all
        of them when None), finished or in flight: the load two layouts measured under, compared
        before the attainments they measured are (returns.py, ``rollback_reason``). Prompt tokens, not
        uncached ones: what the cache saves depends on the layout."""
        span = self.span_s if since is None else min(self.span_s, self.at - since)
        if span <= 0:
            return 0.0, 0.0
        mine = [r for r in self.requests if since is None or r.at >= since]
        return len(mine) / span, sum(r.prompt_tokens for r in mine) / span


def measured_attainment(requests: Iterable[RequestSample]) -> dict[str, float]:
    """Per SLO class, the share of finished requests that met its TTFT budget and TBT."""
    met: dict[str, list[int]] = {}
    for r in requests:
        if not r.done:
            continue
        slo = SLO_CLASSES.get(r.slo_class, SLO_CLASSES["relaxed"])
        ok = ((r.ttft_s is None or r.ttft_s <= slo.ttft_budget_s(r.prompt_tokens))
              and (r.tpot_s is None or r.tpot_s <= slo.tbt_s))
        met.setdefault(r.slo_class, []).append(ok)
    return {c: sum(v) / len(v) for c, v in sorted(met.items())}


# The unloaded TPOT: the 2nd fastest of the last 512 finished requests (not the fastest: one
# request of a single token's span, or a clock quirk, must not set the SLO).
UNLOADED_TPOT_KEEP = 512
UNLOADED_TPOT_RANK = 2


class RequestWindow:
    """The requests this router finished recently, and those in flight: the orchestrator adds
    each one (its event loop), the planner thread reads a copy. At most ``keep`` finished; older
    than ``recent``'s stretch of windows: dropped."""

    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._samples: deque[RequestSample] = deque(maxlen=keep)
        self._inflight: dict[str, RequestSample] = {}  # request id -> placed, not finished (done False)
        self._arrivals: deque[float] = deque(maxlen=keep)  # wall clock of each request admitted
        self._tpots: deque[float] = deque(maxlen=UNLOADED_TPOT_KEEP)  # the last finished ones' TPOT, any age

    def started(self, key: str, sample: RequestSample) -> None:
        """A request was placed (``sample.done`` False): the planner sees it before it finishes."""
        with self._lock:
            self._inflight[key] = sample

    def first_token(self, key: str, ttft_s: float) -> None:
        """The request ``key``, in flight, had its first token ``ttft_s`` after it arrived: one
        still running past its TTFT target is a miss already (model.measured_share)."""
        with self._lock:
            if key in self._inflight:
                self._inflight[key] = replace(self._inflight[key], ttft_s=ttft_s)

    def ended(self, key: str) -> None:
        """The request ``key`` left (finished, failed or aborted): no longer in flight."""
        with self._lock:
            self._inflight.pop(key, None)

    def add(self, sample: RequestSample) -> None:
        with self._lock:
            self._samples.append(sample)
            if sample.tpot_s is not None and sample.tpot_s > 0:
                self._tpots.append(sample.tpot_s)

    def unloaded_tpot_s(self) -> float:
        """The TPOT of a request decoded alone, as measured: the ``UNLOADED_TPOT_RANK``-th fastest
        of the last ``UNLOADED_TPOT_KEEP`` finished requests (0: fewer than that finished).
        Why measured: the SLO is a factor of it, and the decode fit's step at batch 1 is a
        line's intercept through loaded steps (the elastic benchmark's CPU node: 95 ms
        against 40 ms measured alone), which let a layout at 2-3x the real TPOT pass as within
        the SLO. Under load with no request ever alone it is the fastest loaded one: an upper
        bound, as the fit is."""
        with self._lock:
            tpots = sorted(self._tpots)
        return tpots[UNLOADED_TPOT_RANK - 1] if len(tpots) >= UNLOADED_TPOT_RANK else 0.0

    def arrived(self, at: float) -> None:
        """A request was admitted at ``at`` (wall clock): the offered load counts it now, not
        when it finishes."""
        with self._lock:
            self._arrivals.append(at)

    def offered_rps(self, now: float, window_s: float, since: float | None = None, burst_s: float = 0.0) -> float:
        """Requests admitted per second over the last ``window_s`` (or since ``since``, when
        the router began, if that is shorter). Why not the finished ones: past saturation a
        layout finishes fewer requests than arrive, so their rate understates the load exactly
        when it matters (the fixed layout of the elastic benchmark finished 0.2-0.5 a second of
        the 0.8 sent, and the planner judged it fine). ``burst_s`` > 0: the last ``burst_s``
        seconds' rate instead when they stand out as a burst (``burst_rate``)."""
        start = max(now - window_s, since if since is not None else now - window_s)
        with self._lock:
            while self._arrivals and self._arrivals[0] < now - 4 * window_s:
                self._arrivals.popleft()
            arrivals = [t for t in self._arrivals if t >= start]
        rate = len(arrivals) / max(now - start, 1.0)
        if burst_s > 0:
            rate = max(rate, burst_rate(arrivals, now, start, burst_s) or 0.0)
        return rate

    def recent(self, now: float, window_s: float, min_requests: int, stretch: float = 4.0) -> tuple[RequestSample, ...]:
        """Every request in flight, and the finished ones of the last ``window_s``; when they are
        fewer than ``min_requests`` together, the finished ones stretch back to make up
        ``min_requests`` from the last ``stretch`` windows. A window in seconds alone never
        fills at a low rate (12 s at one request a second holds about 8 finished ones, fewer
        while long answers run), and one in requests alone would judge a quiet hour by its
        last burst: a decision needs both enough requests and recent ones.

        Why the requests in flight count: the finished ones alone tell the mix late and wrong.
        Past saturation they are few (the elastic benchmark's planner waited 40 s for 8, half
        of a mix), and the short ones finish first (a document's 16-token answer before a
        chat's 100), so the first finished ones overstate the documents. The ones in flight
        are the arrivals the finished ones have not caught up with."""
        with self._lock:
            while self._samples and self._samples[0].at < now - stretch * window_s:
                self._samples.popleft()
            held = tuple(self._samples)
            flying = tuple(sorted(self._inflight.values(), key=lambda r: r.at))
        inside = [r for r in held if r.at >= now - window_s]
        if len(inside) + len(flying) >= min_requests:
            return (*inside, *flying)
        more = max(min_requests - len(flying), 0)
        return (*(held[-more:] if more else ()), *flying)


# How far above the window's earlier rate the last seconds' arrivals must be to count as a burst:
# this many Poisson standard deviations (and one request) above the count that rate expects.
# On the elastic benchmark's arrivals (seeds 1-4, 30 s window, 10 s burst window, a round every
# 2 s), 3 flagged 2 lone rounds of the ~360 of the steady mixes (never two in a row: the planner
# acts on a target that wins confirm_rounds in a row) and the burst from 6 s into it (10 s in
# seed 3), where the window's rate read 0.8-1.3 a second and the burst window's 1.4-2.2.
BURST_Z = 3.0


def burst_rate(arrivals: Iterable[float], now: float, start: float, burst_s: float,
               z: float = BURST_Z) -> float | None:
    """The rate of the arrivals in the last ``burst_s`` seconds when it is a burst: more than
    the rate of the window's earlier part (``start`` up to ``now - burst_s``) expects, by ``z``
    Poisson standard deviations and one request; else None. None too while that earlier part is
    shorter than ``burst_s`` (nothing to compare with yet).

    Why: the window's mean is the right load for a steady mix but lags a burst by most of a
    window: the elastic benchmark's burst (20 s at three times the documents' rate, after
    them) read as 1.1 requests a second at its middle over a 30 s window while 2.0 arrived,
    and the planner moved to the layout the burst needed 14-18 s after it ended. A short
    window alone would swing with every few arrivals (10 s at 0.6 a second holds about 6)."""
    cut = now - burst_s
    before_s = cut - start
    if burst_s <= 0 or before_s < burst_s:
        return None
    recent = before = 0
    for t in arrivals:
        if t >= cut:
            recent += 1
        elif t >= start:
            before += 1
    expected = before / before_s * burst_s
    if recent > expected + z * expected ** 0.5 + 1:
        return recent / burst_s
    return None


def build_signals(nodes: Iterable[NodeInfo], requests: tuple[RequestSample, ...], costs: CostBook,
                  decode: DecodeCost, backlog_s: Mapping[str, float], short_prompt_tokens: int,
                  now: float, window_s: float, draining: int = 0, observed_since: float | None = None,
                  offered_rps: float = 0.0, unloaded_tpot_s: float = 0.0,
                  decode_by_mix: tuple[tuple[int, int, DecodeCost], ...] = ()) -> PlannerSignals:
    """One round's signals from the router's view (``nodes``: live, not draining; ``draining``:
    how many registered nodes it left out), its finished requests since ``now - window_s``, its
    cost book and its ledger of prefill work. ``observed_since``: when the router began to
    record requests (wall clock): the requests' rate is over the window or that, whichever is
    shorter (None: since the oldest request, which overstates the rate of a short burst)."""
    nodes = tuple(nodes)
    prefill_ids = [n.node_id for n in nodes if n.role == Role.PREFILL]
    decode_ids = [n.node_id for n in nodes if n.role == Role.DECODE]
    src, dst = (prefill_ids[0], decode_ids[0]) if prefill_ids and decode_ids else ("", "")
    xfer = costs.transfer_model(src, dst)

    def wait(n: NodeInfo) -> float:
        if n.node_id in backlog_s:
            return backlog_s[n.node_id]
        return costs.prefill(n.node_id).predict(n.running_tokens) if n.role == Role.PREFILL else 0.0

    sig = tuple(NodeSignal(n.node_id, n.role, n.waiting, n.running, n.running_tokens, n.kv_usage, n.step_s, wait(n),
                           n.num_blocks * n.block_size) for n in nodes)
    start = observed_since if observed_since is not None else min((r.at for r in requests), default=now)
    return PlannerSignals(
        at=now, span_s=max(min(window_s, now - start), 1.0), nodes=sig, requests=requests,
        prefill=costs.reference_prefill(), decode=decode, transfer_fixed_s=xfer.fixed_s,
        transfer_s_per_token=costs.kv_bytes_per_token / xfer.bandwidth if xfer.bandwidth > 0 else 0.0,
        short_prompt_tokens=short_prompt_tokens, draining=draining, offered_rps=offered_rps,
        unloaded_tpot_s=unloaded_tpot_s, decode_by_mix=decode_by_mix)
