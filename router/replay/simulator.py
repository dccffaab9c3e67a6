"""A trace-driven simulator of the prefill/decode cluster, for comparing placement policies on
equal terms.

The policy under test and the index are the real ones: each request is placed by a
``PlacementPolicy`` (router.placement, router.replay.baselines) on what a router knows at that
moment, with the prefix match read from the Redis index through ``IndexReader.match`` (one
script call) after the simulated nodes published their block events through ``NodePublisher``.
Only the nodes are simulated, in simulated time (no sleeping), and they have a truth of their
own that no policy is given:

  prefill node  one FIFO server. Service = ``NodeTruth`` (not the cost model's family: a floor
                for short prompts, a step cost per chunk, other coefficients) x the node's
                speed (``speed_spread``) x a log-normal step noise (``step_noise``), for the
                tokens its LRU cache (``cache_tokens``) does not hold. When a prefill finishes
                its blocks go to the index and its measured time goes out as a step report,
                which reaches the router's ``CostBook`` one refresh later: the book starts from
                the generic prior and fits each node online, as in production.
  transfer      prompt KV bytes / pair bandwidth; the router measures it (``add_transfer``).
  decode node   ``decode_max_batch`` slots; a request holds one for output_tokens x step time.

What the router sees is what the live one sees:
  * node heartbeats (``NodeInfo``): waiting requests, running ones and their tokens, the share
    of the KV pool running sequences hold; each request counted once;
  * its ledger (``router.node_view.PrefillLedger``, the live class): the predicted prefill
    seconds of every request it sent to a node whose response has not come back, the running
    one in full (a router does not know when a node started it);
  * no decode backlog (the live ledger has none), only the decode nodes' heartbeats.

Admission: "same_for_all" puts every policy's choice through one gate, ``decide`` on the
estimate of the chosen pair from the same online cost book and ledger (pdserve's own estimate
is that estimate); a rejection is an SLO miss. "none": nobody rejects.

Placement happens at arrival; a FIFO node whose service time is drawn at dispatch then fixes
the request's start and finish at once, so the loop is one pass over the trace. What the router
learns later (index events, step reports, responses) is queued as timed events.

    TTFT = queue on p + prefill (+ fetch of replicated blocks) + transfer + wait for a decode slot
"""
from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_index.events import BlockRemoved, BlockStored, KVEvent, fold_kv_events
from kv_index.nodes import NodeInfo, Role, StepReport
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from router.admission import SLO_CLASSES, Estimate, decide
from router.cost_model import CostBook, DecodeCost
from router.node_view import PrefillLedger
from router.placement import Placement, PlacementPolicy, TtftPolicy
from router.replay.baselines import ReplayRequest, RouterSide
from router.replay.lru import LruCache
from router.replay.traces import TraceRequest

ADMISSION_MODES = ("same_for_all", "none")


@dataclass(frozen=True, slots=True)
class NodeTruth:
    """What a prefill really costs a simulated node at speed 1. Deliberately outside the family
    the router fits (``PrefillCost``: a + b*new + c*new*(cached + new/2)) and away from its
    prior: a prompt shorter than ``min_tokens`` costs as much as ``min_tokens`` (an accelerator
    step is not cheaper for fewer tokens), every ``chunk_tokens`` of chunked prefill adds a
    step's overhead, the linear term is cheaper and attention dearer than the prior says (a 7k
    prompt is 20% cheaper than the prior predicts, an 85k one 6% dearer)."""

    fixed_s: float = 0.025
    per_token_s: float = 6.0e-5
    attn_s: float = 1.6e-9
    min_tokens: int = 512
    chunk_tokens: int = 8192
    chunk_s: float = 0.008

    def seconds(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        chunks = -(-new_tokens // self.chunk_tokens)
        return (self.fixed_s + self.per_token_s * max(new_tokens, self.min_tokens) + self.chunk_s * chunks
                + self.attn_s * new_tokens * (cached_tokens + new_tokens / 2))


# ----------------------------------------------------------------------------- nodes
@dataclass(slots=True)
class _Prefill:
    node_id: str
    cache: LruCache
    speed: float  # multiplier on the true cost (1 = NodeTruth)
    free_at: float = 0.0
    busy_s: float = 0.0
    inflight: list = field(default_factory=list)  # heap of (finish, start, prompt_tokens)


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
    truth: NodeTruth = NodeTruth()
    speed_spread: float = 0.4  # prefill node i's time x (1 + spread * (i / (N-1) - 1/2)): 0.8x-1.2x
    step_noise: float = 0.1  # sigma of the log-normal factor on each prefill's time
    decode_cost: DecodeCost = DecodeCost()
    kv_bytes_per_token: int = 131072
    bandwidth: float = 25e9  # bytes/s between any two nodes
    decode_max_batch: int = 128
    report_delay_s: float = 0.5  # a step report reaches the cost book one router refresh later
    slo_class: str = "standard"
    seed: int = 0

    def speed(self, i: int) -> float:
        n = self.prefill_nodes
        return 1.0 + (self.speed_spread * (i / (n - 1) - 0.5) if n > 1 else 0.0)


@dataclass(slots=True)
class PolicyResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)  # per request, trace order; nan = rejected
    span_s: float = 0.0  # simulated seconds from the first arrival to the last
    input_tokens: int = 0
    cached_tokens: int = 0
    rejected: int = 0
    slo_met: int = 0  # TTFT within the class budget and TBT within its limit
    ttft_met: int = 0  # TTFT within the class budget (goodput)
    requests: int = 0
    router_round_trips: int = 0
    node_round_trips: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    predicted_exact: int = 0  # requests whose predicted cached tokens == actually reused
    predicted_abs_err: int = 0
    fetched_tokens: int = 0
    freshness_s: list[float] = field(default_factory=list)  # age of the index at each lookup

    def summary(self, common: Sequence[bool] | None = None) -> dict:
        """``common[i]``: request i counts in the TTFT statistics (the requests every compared
        policy served); None: every request this policy served."""
        served = [x for x in self.ttft_s if not math.isnan(x)]
        t = sorted(served if common is None else [x for x, c in zip(self.ttft_s, common) if c])
        s = sorted(served)
        n_served = max(1, len(served))
        busy = list(self.busy_s.values()) or [0.0]
        mean_busy = sum(busy) / len(busy)
        return {
            "hit_ratio": self.cached_tokens / max(1, self.input_tokens),
            "goodput_rps": self.ttft_met / self.span_s if self.span_s > 0 else math.nan,
            "ttft_mean_s": sum(t) / len(t) if t else math.nan,
            "ttft_p50_s": _pct(t, 0.50),
            "ttft_p99_s": _pct(t, 0.99),
            "ttft_requests": len(t),
            "ttft_mean_served_s": sum(s) / len(s) if s else math.nan,
            "ttft_p99_served_s": _pct(s, 0.99),
            "slo_attainment": self.slo_met / max(1, self.requests),
            "ttft_slo_attainment": self.ttft_met / max(1, self.requests),
            "imbalance": max(busy) / mean_busy if mean_busy > 0 else 1.0,
            "rejected": self.rejected,
            "redis_rtt_per_request": self.router_round_trips / max(1, self.requests),
            "node_rtt_per_request": self.node_round_trips / max(1, self.requests),
            "index_exact_fraction": self.predicted_exact / n_served,
            "index_mean_abs_err_tokens": self.predicted_abs_err / n_served,
            "index_age_mean_s": sum(self.freshness_s) / len(self.freshness_s) if self.freshness_s else 0.0,
            "fetched_tokens": self.fetched_tokens,
        }


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    return sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))]


def time_scale(requests: Sequence[TraceRequest], cfg: SimConfig) -> float:
    """Factor on arrival times that makes the offered load ``cfg.load``: the trace's prefill
    work without any cache hit (true cost at speed 1, the nodes' mean), over the span, per
    node, equals ``load`` of a node's time."""
    if len(requests) < 2:
        return 1.0
    work = sum(cfg.truth.seconds(r.input_tokens) for r in requests)
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


# Timed events the router learns of after the fact.
_INDEX, _REPORT, _RESPONSE = 0, 1, 2


def simulate(name: str, requests: Sequence[TraceRequest], cfg: SimConfig, policy: PlacementPolicy | None,
             costs: CostBook, index: IndexLink | None, *, admission: str = "same_for_all",
             global_pool: bool = False, scale: float | None = None) -> PolicyResult:
    """Replay ``requests`` under ``policy``. ``global_pool``: one shared cache of all nodes'
    capacity and least-backlog placement on the true queues (the upper bound: no policy, no
    index). ``costs`` is the router's cost book: pass a fresh one (generic prior) per run."""
    if admission not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {admission!r}")
    rng = random.Random(cfg.seed)  # one draw per request in trace order: the same noise for every policy
    scale = time_scale(requests, cfg) if scale is None else scale
    bs = cfg.block_size
    cap_blocks = max(1, cfg.cache_tokens // bs)
    prefill = [_Prefill(f"prefill-{i}", LruCache(cap_blocks), cfg.speed(i)) for i in range(cfg.prefill_nodes)]
    prefill_ids = [p.node_id for p in prefill]
    shared = LruCache(cap_blocks * cfg.prefill_nodes) if global_pool else None
    decode = [_Decode(f"decode-{i}") for i in range(cfg.decode_nodes)]
    by_id = {p.node_id: p for p in prefill}
    decode_by_id = {d.node_id: d for d in decode}
    side = policy if isinstance(policy, RouterSide) else None
    ledger = PrefillLedger()
    gate = TtftPolicy(costs, short_prompt_tokens=0, compute_weight=0.0)  # estimates a chosen pair
    events: list[tuple] = []  # heap of (at, seq, kind, payload)
    last_event_at: dict[str, float] = {p.node_id: 0.0 for p in prefill}
    seq = 0
    res = PolicyResult(name)
    slo = SLO_CLASSES[cfg.slo_class]
    rt0 = index.reader.round_trips if index else 0
    t_first = requests[0].arrival_s if requests else 0.0
    res.span_s = (requests[-1].arrival_s - t_first) * scale if requests else 0.0

    def deliver(t: float) -> None:
        """Everything the router and the index learn by ``t``: one publish per node."""
        batch: dict[str, list[KVEvent]] = {}
        while events and events[0][0] <= t:
            at, _, kind, payload = heapq.heappop(events)
            if kind == _INDEX:
                nid, st, rm = payload
                # An eviction and an insertion of one prefill: the insertion wins, as in a node.
                batch.setdefault(nid, []).extend((BlockRemoved(tuple(rm)), BlockStored(tuple(st), None, ())))
                last_event_at[nid] = at
            elif kind == _REPORT:
                costs.add_step(*payload)
            else:
                rid, pid, did, tokens, xfer_s = payload
                ledger.done(pid, rid)
                if side is not None:
                    side.finished(int(rid), pid)
                costs.add_transfer(pid, did, tokens * cfg.kv_bytes_per_token, xfer_s, num_tokens=tokens)
        for nid, evs in batch.items():
            stored, removed, _ = fold_kv_events(evs)
            index.publish(nid, stored, removed)

    for i, req in enumerate(requests):
        t = (req.arrival_s - t_first) * scale
        noise = math.exp(rng.gauss(0.0, cfg.step_noise)) if cfg.step_noise > 0 else 1.0
        res.requests += 1
        prompt = req.input_tokens
        hashes = req.hash_ids
        # 1. What the router knows at t.
        deliver(t)
        infos = _views(prefill, decode, t, cfg)
        backlog = ledger.backlog_s()
        rreq = ReplayRequest(prompt, bs, 1, req.output_tokens, cfg.slo_class, request_id=i, hashes=hashes, now=t)
        # 2. Placement.
        if global_pool:
            p = min(prefill, key=lambda x: (max(0.0, x.free_at - t), x.node_id))
            d = min(decode, key=lambda x: (len(x.active), x.node_id))
            info = {x.node_id: x for x in infos}
            pl = Placement(info[p.node_id], info[d.node_id], min(shared.match(hashes) * bs, prompt), "global pool")
        else:
            matched = side.match(rreq, prefill_ids) if side is not None else None
            if matched is None:
                matched = {}
                if policy.uses_index and index is not None and hashes:
                    matched = index.reader.match(hashes, prefill_ids)
                    res.freshness_s.extend(t - last_event_at[x] for x in prefill_ids)
            pl = policy.choose(rreq, infos, matched, backlog)
            p = by_id[pl.prefill_node.node_id]
            d = decode_by_id[pl.decode_node.node_id]
        # 3. Admission: one gate for every policy.
        est = pl.estimate if pl.estimate is not None else _estimate(gate, rreq, pl, backlog)
        if admission == "same_for_all" and not decide(est, slo, prompt).admit:
            res.rejected += 1
            res.ttft_s.append(math.nan)
            continue
        if side is not None:
            side.routed(rreq, pl)
        ledger.add(p.node_id, str(i), est.prefill_s)
        # 4. What the nodes really do: prefill on p (FIFO), transfer, a decode slot.
        if global_pool:
            cached, fetch_tokens = pl.predicted_cached_tokens, 0
        else:
            cached = min(p.cache.match(hashes) * bs, prompt)
            fetch_tokens = 0
            if pl.fetch_from is not None:
                have = min(by_id[pl.fetch_from].cache.match(hashes) * bs, prompt)
                fetch_tokens = max(0, have - cached)
        fetch_s = fetch_tokens * cfg.kv_bytes_per_token / cfg.bandwidth
        reused = cached + fetch_tokens
        new = prompt - reused
        compute = cfg.truth.seconds(new, reused) * p.speed * noise
        start = max(t, p.free_at)
        finish = start + compute + fetch_s
        p.free_at = finish
        p.busy_s += compute + fetch_s
        heapq.heappush(p.inflight, (finish, start, prompt))
        xfer = prompt * cfg.kv_bytes_per_token / cfg.bandwidth
        if new > 0:
            seq += 1
            heapq.heappush(events, (finish + cfg.report_delay_s, seq, _REPORT,
                                    (p.node_id, StepReport(new, prompt, compute))))
        seq += 1
        heapq.heappush(events, (finish + xfer, seq, _RESPONSE, (str(i), p.node_id, d.node_id, prompt, xfer)))
        if global_pool:
            shared.insert(hashes)
        else:
            stored, removed = p.cache.insert(hashes)
            if index is not None and (stored or removed):
                seq += 1
                heapq.heappush(events, (finish, seq, _INDEX, (p.node_id, stored, removed)))
        ready = finish + xfer
        while d.active and d.active[0][0] <= ready:
            heapq.heappop(d.active)
        slot = ready
        if len(d.active) >= cfg.decode_max_batch:
            slot = heapq.heappop(d.active)[0]
        ctx = sum(c for _, c in d.active) + prompt + req.output_tokens
        tbt = cfg.decode_cost.step_s(len(d.active) + 1, ctx)
        heapq.heappush(d.active, (slot + req.output_tokens * tbt, prompt + req.output_tokens))
        ttft = slot - t
        res.ttft_s.append(ttft)
        res.input_tokens += prompt
        res.cached_tokens += reused
        res.fetched_tokens += fetch_tokens
        predicted = pl.predicted_cached_tokens
        res.predicted_exact += predicted == reused
        res.predicted_abs_err += abs(predicted - reused)
        within = ttft <= slo.ttft_budget_s(prompt)
        res.ttft_met += within
        res.slo_met += within and tbt <= slo.tbt_s
    res.busy_s = {p.node_id: p.busy_s for p in prefill}
    if index is not None:
        res.router_round_trips = index.reader.round_trips - rt0
        res.node_round_trips = index.node_round_trips
    return res


def _estimate(gate: TtftPolicy, request: ReplayRequest, pl: Placement, backlog: dict[str, float]) -> Estimate:
    """The router's estimate for a pair another policy chose: pdserve's model on that pair alone,
    with the cached prefix that policy predicted."""
    blocks = -(-pl.predicted_cached_tokens // request.block_size)
    return gate.choose(request, [pl.prefill_node, pl.decode_node], {pl.prefill_node.node_id: blocks},
                       backlog).estimate


def _views(prefill: list[_Prefill], decode: list[_Decode], t: float, cfg: SimConfig) -> list[NodeInfo]:
    """NodeInfo per node as its heartbeat would report it at ``t`` (no lag): a prefill node's
    waiting requests (not started), its running one, that one's tokens and the share of the
    pool its blocks hold; a decode node's running requests and their tokens."""
    bs = cfg.block_size
    infos = []
    for p in prefill:
        while p.inflight and p.inflight[0][0] <= t:
            heapq.heappop(p.inflight)
        running = [tokens for _, s, tokens in p.inflight if s <= t]
        held = sum(-(-tokens // bs) for tokens in running)
        infos.append(NodeInfo(p.node_id, Role.PREFILL, "", "sim", bs, p.cache.capacity,
                              waiting=len(p.inflight) - len(running), running=len(running),
                              running_tokens=sum(running), kv_usage=min(1.0, held / p.cache.capacity)))
    for d in decode:
        while d.active and d.active[0][0] <= t:
            heapq.heappop(d.active)
        infos.append(NodeInfo(d.node_id, Role.DECODE, "", "sim", bs, cfg.decode_max_batch,
                              running=len(d.active), running_tokens=sum(c for _, c in d.active)))
    return infos
