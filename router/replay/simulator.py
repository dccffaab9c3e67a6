"""A trace-driven simulator of the prefill/decode cluster, for comparing placement policies.

The policy under test and the index are the real ones: each request is placed by a
``PlacementPolicy`` from router.placement / router.replay.baselines, on ``NodeInfo`` load figures, with
the prefix match read from the Redis index through ``IndexReader.match`` (one script call) after
the simulated nodes published their block events through ``NodePublisher``. Only the nodes are
simulated, in simulated time (no sleeping):

  prefill node  one FIFO server; service = its true cost model (``PrefillCost`` x speed) of the
                tokens its LRU cache (``cache_tokens``) does not hold; blocks are published to
                the index when its prefill finishes (so the index lags, as a real one does), and
                a step report feeds the router's online cost fit (``CostBook``).
  transfer      prompt KV bytes / pair bandwidth.
  decode node   ``decode_max_batch`` slots; a request holds one for output_tokens x step time.

Placement happens at arrival; a FIFO node with deterministic service times then fixes the
request's start and finish at once, so the loop is one pass over the trace.

    TTFT = queue on p + prefill (+ fetch of replicated blocks) + transfer + wait for a decode slot
"""
from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv_index.events import BlockRemoved, BlockStored, KVEvent, fold_kv_events
from kv_index.nodes import NodeInfo, Role, StepReport
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from router.admission import SLO_CLASSES, decide
from router.cost_model import CostBook, DecodeCost, PrefillCost
from router.placement import PlacementPolicy, PlacementRequest
from router.replay.traces import TraceRequest


# ----------------------------------------------------------------------------- nodes
class LruCache:
    """A prefix cache of whole blocks with LRU eviction. A request touches its blocks last to
    first, so a chain's head is the most recently used and its tail is evicted first (what a
    block pool freeing a sequence's blocks in reverse order does)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Touch/insert ``hashes``; returns (newly stored, evicted)."""
        stored, evicted = [], []
        for h in reversed(hashes[: self.capacity]):
            if h in self._blocks:
                self._blocks.move_to_end(h)
            else:
                self._blocks[h] = None
                stored.append(h)
        while len(self._blocks) > self.capacity:
            h, _ = self._blocks.popitem(last=False)
            evicted.append(h)
        stored_set = set(stored)
        evicted_set = set(evicted)
        return [h for h in stored if h not in evicted_set], [h for h in evicted if h not in stored_set]

    @property
    def usage(self) -> float:
        return len(self._blocks) / self.capacity if self.capacity else 1.0


@dataclass(slots=True)
class _Prefill:
    node_id: str
    cache: LruCache
    speed: float  # true cost multiplier (1 = the nominal cost model)
    free_at: float = 0.0
    busy_s: float = 0.0
    inflight: list = field(default_factory=list)  # heap of (finish, start, new_tokens, predicted_s)


@dataclass(slots=True)
class _Decode:
    node_id: str
    active: list = field(default_factory=list)  # heap of (end, context_tokens)


# ----------------------------------------------------------------------------- config/results
@dataclass(frozen=True, slots=True)
class SimConfig:
    prefill_nodes: int = 8
    decode_nodes: int = 4
    cache_tokens: int = 3_000_000  # per prefill node
    block_size: int = 512
    load: float = 0.8  # offered prefill work without any cache hit / total prefill capacity
    prefill_cost: PrefillCost = PrefillCost()
    decode_cost: DecodeCost = DecodeCost()
    kv_bytes_per_token: int = 131072
    bandwidth: float = 25e9  # bytes/s between any two nodes
    decode_max_batch: int = 128
    speed_spread: float = 0.0  # prefill node i runs at 1 + spread * (i / (N-1) - 1/2) x the cost
    report_noise: float = 0.05  # relative noise on step reports
    slo_class: str = "standard"
    seed: int = 0


@dataclass(slots=True)
class PolicyResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0
    rejected: int = 0
    slo_met: int = 0
    requests: int = 0
    router_round_trips: int = 0
    node_round_trips: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    predicted_exact: int = 0  # requests whose predicted cached tokens == actually reused
    predicted_abs_err: int = 0
    fetched_tokens: int = 0
    freshness_s: list[float] = field(default_factory=list)  # age of the index at each lookup

    def summary(self) -> dict:
        t = sorted(self.ttft_s)
        served = max(1, self.requests - self.rejected)
        busy = list(self.busy_s.values()) or [0.0]
        mean_busy = sum(busy) / len(busy)
        return {
            "hit_ratio": self.cached_tokens / max(1, self.input_tokens),
            "ttft_mean_s": sum(t) / len(t) if t else math.nan,
            "ttft_p50_s": _pct(t, 0.50),
            "ttft_p99_s": _pct(t, 0.99),
            "slo_attainment": self.slo_met / max(1, self.requests),
            "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "rejected": self.rejected,
            "redis_rtt_per_request": self.router_round_trips / max(1, self.requests),
            "node_rtt_per_request": self.node_round_trips / max(1, self.requests),
            "index_exact_fraction": self.predicted_exact / served,
            "index_mean_abs_err_tokens": self.predicted_abs_err / served,
            "index_age_mean_s": sum(self.freshness_s) / len(self.freshness_s) if self.freshness_s else 0.0,
            "fetched_tokens": self.fetched_tokens,
        }


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def time_scale(requests: Sequence[TraceRequest], cfg: SimConfig) -> float:
    """Factor on arrival times that makes the offered load ``cfg.load``: the trace's prefill
    work without any cache hit, over the span, per node, equals ``load`` of a node's time."""
    if len(requests) < 2:
        return 1.0
    work = sum(cfg.prefill_cost.predict(r.input_tokens) for r in requests)
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        return 1.0
    return work / (cfg.prefill_nodes * cfg.load * span)


# ----------------------------------------------------------------------------- the run
class IndexLink:
    """The simulated nodes' publishers and the router's reader over one Redis namespace."""

    def __init__(self, reader: IndexReader, publishers: dict[str, NodePublisher]) -> None:
        self.reader = reader
        self.publishers = publishers
        self.node_round_trips = 0

    def publish(self, node_id: str, stored: list[int], removed: list[int]) -> None:
        pub = self.publishers[node_id]
        if not pub.publish(stored=stored, removed=removed):
            raise RuntimeError(f"index gap for {node_id}: the simulator publishes every batch in order")
        self.node_round_trips += 1


def simulate(name: str, requests: Sequence[TraceRequest], cfg: SimConfig, policy: PlacementPolicy | None,
             costs: CostBook, index: IndexLink | None, *, admission: bool = False,
             global_pool: bool = False, scale: float | None = None,
             on_ttft: Callable[[float], None] | None = None) -> PolicyResult:
    """Replay ``requests`` under ``policy``. ``global_pool``: one shared cache of all nodes'
    capacity and least-backlog placement (the upper bound, no policy, no index)."""
    rng = random.Random(cfg.seed)
    scale = time_scale(requests, cfg) if scale is None else scale
    cap_blocks = max(1, cfg.cache_tokens // cfg.block_size)
    n = cfg.prefill_nodes
    prefill = [_Prefill(f"prefill-{i}", LruCache(cap_blocks),
                        1.0 + (cfg.speed_spread * (i / (n - 1) - 0.5) if n > 1 else 0.0)) for i in range(n)]
    shared = LruCache(cap_blocks * n) if global_pool else None
    decode = [_Decode(f"decode-{i}") for i in range(cfg.decode_nodes)]
    by_id = {p.node_id: p for p in prefill}
    events: list[tuple[float, int, str, list[int], list[int]]] = []  # (at, seq, node, stored, removed)
    last_event_at: dict[str, float] = {p.node_id: 0.0 for p in prefill}
    seq = 0
    res = PolicyResult(name)
    slo = SLO_CLASSES[cfg.slo_class]
    rt0 = index.reader.round_trips if index else 0
    t_first = requests[0].arrival_s if requests else 0.0

    for req in requests:
        t = (req.arrival_s - t_first) * scale
        res.requests += 1
        # 1. Index events of prefills finished by now, one publish per node.
        if index is not None and events and events[0][0] <= t:
            batch: dict[str, list[KVEvent]] = {}
            while events and events[0][0] <= t:
                at, _, nid, st, rm = heapq.heappop(events)
                # An eviction and an insertion of one prefill: the insertion wins, as in a node.
                batch.setdefault(nid, []).extend((BlockRemoved(tuple(rm)), BlockStored(tuple(st), None, ())))
                last_event_at[nid] = at
            for nid, evs in batch.items():
                stored, removed, _ = fold_kv_events(evs)
                index.publish(nid, stored, removed)
        # 2. Node view at t.
        infos, backlog = _views(prefill, decode, t, cfg)
        hashes = list(req.hash_ids)
        if global_pool:
            p = min(prefill, key=lambda x: (max(0.0, x.free_at - t), x.node_id))
            cached_blocks = shared.match(hashes)
            cached = min(cached_blocks * cfg.block_size, req.input_tokens)
            d = min(decode, key=lambda x: (len(x.active), x.node_id))
            predicted, fetch_from, fetch_tokens = cached, None, 0
        else:
            matched = {}
            if policy.uses_index and index is not None and hashes:
                matched = index.reader.match(hashes, [p.node_id for p in prefill])
                res.freshness_s.extend(t - last_event_at[x.node_id] for x in prefill)
            pl = policy.choose(PlacementRequest(req.input_tokens, cfg.block_size, 1, req.output_tokens,
                                                cfg.slo_class), infos, matched, backlog)
            if admission and pl.estimate is not None and not decide(pl.estimate, slo, req.input_tokens).admit:
                res.rejected += 1
                continue
            p = by_id[pl.prefill_node.node_id]
            d = next(x for x in decode if x.node_id == pl.decode_node.node_id)
            cached = min(p.cache.match(hashes) * cfg.block_size, req.input_tokens)
            predicted, fetch_from, fetch_tokens = pl.predicted_cached_tokens, pl.fetch_from, 0
            if fetch_from is not None:
                src = by_id[fetch_from]
                have = min(src.cache.match(hashes) * cfg.block_size, req.input_tokens)
                fetch_tokens = max(0, have - cached)
        # 3. Prefill on p (FIFO), then transfer and a decode slot.
        fetch_s = fetch_tokens * cfg.kv_bytes_per_token / cfg.bandwidth
        reused = cached + fetch_tokens
        new = req.input_tokens - reused
        service = cfg.prefill_cost.predict(new, reused) * p.speed + fetch_s
        start = max(t, p.free_at)
        finish = start + service
        p.free_at = finish
        p.busy_s += service
        predicted_s = pl.estimate.prefill_s if policy is not None and pl.estimate is not None else service
        heapq.heappush(p.inflight, (finish, start, new, predicted_s))
        if new > 0:
            noisy = service - fetch_s
            noisy *= 1.0 + rng.uniform(-cfg.report_noise, cfg.report_noise)
            costs.add_step(p.node_id, StepReport(new, req.input_tokens, noisy))
        if global_pool:
            shared.insert(hashes)
        else:
            stored, removed = p.cache.insert(hashes)
            if index is not None and (stored or removed):
                seq += 1
                heapq.heappush(events, (finish, seq, p.node_id, stored, removed))
        xfer = req.input_tokens * cfg.kv_bytes_per_token / cfg.bandwidth
        ready = finish + xfer
        while d.active and d.active[0][0] <= ready:
            heapq.heappop(d.active)
        slot = ready
        if len(d.active) >= cfg.decode_max_batch:
            slot = heapq.heappop(d.active)[0]
        ctx = sum(c for _, c in d.active) + req.input_tokens + req.output_tokens
        tbt = cfg.decode_cost.step_s(len(d.active) + 1, ctx)
        heapq.heappush(d.active, (slot + req.output_tokens * tbt, req.input_tokens + req.output_tokens))
        ttft = slot - t
        res.ttft_s.append(ttft)
        if on_ttft:
            on_ttft(ttft)
        res.input_tokens += req.input_tokens
        res.cached_tokens += reused
        res.fetched_tokens += fetch_tokens
        res.predicted_exact += predicted == reused
        res.predicted_abs_err += abs(predicted - reused)
        if ttft <= slo.ttft_budget_s(req.input_tokens) and tbt <= slo.tbt_s:
            res.slo_met += 1
    res.busy_s = {p.node_id: p.busy_s for p in prefill}
    if index is not None:
        res.router_round_trips = index.reader.round_trips - rt0
        res.node_round_trips = index.node_round_trips
    return res


def _views(prefill: list[_Prefill], decode: list[_Decode], t: float, cfg: SimConfig
           ) -> tuple[list[NodeInfo], dict[str, float]]:
    """NodeInfo per node as the router would see it at ``t`` (its own in-flight accounting),
    and the backlog in seconds as the router's ledger knows it: the predicted service times of
    its requests still in flight, less the time the running one has had (the router saw the
    previous one complete, so it knows when this one started)."""
    infos, backlog = [], {}
    for p in prefill:
        while p.inflight and p.inflight[0][0] <= t:
            heapq.heappop(p.inflight)
        waiting = sum(1 for _, s, _, _ in p.inflight if s > t)
        tokens = 0
        for f, s, new, _ in p.inflight:
            tokens += new if s > t else int(new * (f - t) / max(1e-9, f - s))
        head_start = min((s for _, s, _, _ in p.inflight), default=t)
        backlog[p.node_id] = max(0.0, sum(x[3] for x in p.inflight) - max(0.0, t - head_start))
        infos.append(NodeInfo(p.node_id, Role.PREFILL, "", "sim", cfg.block_size, p.cache.capacity,
                              waiting=waiting, running=len(p.inflight) - waiting, running_tokens=tokens,
                              kv_usage=p.cache.usage))
    for d in decode:
        while d.active and d.active[0][0] <= t:
            heapq.heappop(d.active)
        infos.append(NodeInfo(d.node_id, Role.DECODE, "", "sim", cfg.block_size, cfg.decode_max_batch,
                              running=len(d.active), running_tokens=sum(c for _, c in d.active)))
        backlog[d.node_id] = 0.0 if len(d.active) < cfg.decode_max_batch else max(0.0, d.active[0][0] - t)
    return infos, backlog
