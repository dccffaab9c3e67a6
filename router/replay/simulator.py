"""A trace-driven simulator of the prefill/decode cluster, for comparing placement policies on
equal terms.

The policy under test and the index are the real ones: each request is placed by a
``PlacementPolicy`` (router.placement, router.replay.baselines) on what a router knows at that
moment, with the prefix match read from the Redis index through ``IndexReader.match`` (one
script call, a ``PrefixMatch`` per node) after the simulated nodes published their block events
through ``NodePublisher``. Only the nodes are simulated, in simulated time (no sleeping), and
they have a truth of their own that no policy is given (router/replay/sim_config.py):

  prefill node  one FIFO server with a tiered cache (``TieredCache``: device, host memory,
                disk; LRU demotion down the tiers). Compute = ``NodeTruth`` (not the cost
                model's family) x the node's speed (``speed_spread``) x a log-normal step noise
                (``step_noise``), for the tokens it neither holds nor fetches. Its host and disk
                hits are onboarded (``TierTruth``) and a fetch moves the holder's blocks at the
                pair bandwidth (the holder reading its disk hits first); loading starts when
                the request arrives and overlaps its queue wait, the compute starts when both
                are done. When a prefill finishes its block events go to the index and its
                measured compute goes out as a step report, its onboards and fetch as measured
                moves, which reach the router's ``CostBook`` one refresh later: the book starts
                from the generic prior and fits each node online, as in production.
  transfer      prompt KV bytes / pair bandwidth; the router measures it (``add_transfer``).
  decode node   ``decode_max_batch`` slots; a request holds one for output_tokens x step time.

What the router sees is what the live one sees:
  * node heartbeats (``NodeInfo``): waiting requests, running ones and their tokens, the share
    of the KV pool running sequences hold; each request counted once;
  * its ledger (``router.node_view.PrefillLedger``, the live class): the predicted compute
    seconds of every request it sent to a node whose response has not come back, the running
    one in full (a router does not know when a node started it);
  * no decode backlog (the live ledger has none), only the decode nodes' heartbeats.

Router replicas (``routers`` > 1, `pdserve bench router --routers N`): each request goes to one of
N routers at random (SO_REUSEPORT spreads connections, not requests by load), and each has its
own ledger. With ``share_s`` set they publish and read each other's ledgers every ``share_s``
(router/replicas.py; the live period is the node view's refresh): between ticks a replica sees
its own requests at once and the others' as of the last tick. ``share_s`` None: no sharing
(the negative control; each sees only its own). The index, the heartbeats and the cost book
are shared (every replica reads the same Redis and the same step reports; the transfer fits a
replica learns from its own responses are pooled, a simplification).

Admission, the same rule for every policy; a rejection is an SLO miss:
  "none"           nobody rejects.
  "queue_bound"    policy-neutral: a request whose true wait on the prefill node its policy
                   chose (the queued work ahead of it there) exceeds ``gate_queue_fraction`` of
                   its TTFT budget is rejected. No policy's model enters it.
  "pdserve_model"  ``decide`` on the estimate of the chosen pair from pdserve's cost book and
                   ledger (pdserve's own estimate is that estimate): pdserve's model judging
                   the others' choices, which favours pdserve; kept as a secondary figure.

``shared_fetch`` gives a policy without fetch of its own a shared tier at fetch's bandwidth:
the chosen node loads whatever longer prefix another prefill node holds, from that node, as
pdserve's fetch would (the capability comparison).

Placement happens at arrival; a FIFO node whose service time is drawn at dispatch then fixes
the request's start and finish at once, so the loop is one pass over the trace. What the router
learns later (index events, step reports, responses) is queued as timed events.

    TTFT = max(queue on p, loading) + compute + transfer + wait for a decode slot
"""
from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from kv_index.events import BlockRemoved, BlockStored, KVEvent, fold_kv_events_by_tier
from kv_index.nodes import NodeInfo, PrefixMatch, Role, StepReport
from kv_index.publisher import NodePublisher
from kv_index.reader import IndexReader
from router.admission import SLO_CLASSES, Estimate, decide
from router.cost_model import CostBook
from router.node_view import PrefillLedger
from router.placement import Match, Placement, PlacementPolicy, TtftPolicy, holder_reads, tier_tokens
from router.replay.baselines import ReplayRequest, RouterSide
from router.replay.lru import LruCache, TieredCache
from router.replay.results import PolicyResult
from router.replay.sim_config import NodeTruth, SimConfig, TierTruth, time_scale
from router.replay.traces import TraceRequest

# Names the benchmark and the tests import from here.
__all__ = ["ADMISSION_MODES", "IndexLink", "LruCache", "NodeTruth", "PolicyResult", "SimConfig", "TierTruth",
           "TieredCache", "simulate", "time_scale"]

ADMISSION_MODES = ("none", "queue_bound", "pdserve_model")


# ----------------------------------------------------------------------------- nodes
@dataclass(slots=True)
class _Prefill:
    node_id: str
    cache: TieredCache
    speed: float  # multiplier on the true cost (1 = NodeTruth)
    free_at: float = 0.0
    busy_s: float = 0.0
    inflight: list = field(default_factory=list)  # heap of (finish, start, prompt_tokens)


@dataclass(slots=True)
class _Decode:
    node_id: str
    active: list = field(default_factory=list)  # heap of (end, context_tokens)


class IndexLink:
    """The simulated nodes' publishers and the router's reader over one Redis namespace."""

    def __init__(self, reader: IndexReader, publishers: dict[str, NodePublisher]) -> None:
        self.reader = reader
        self.publishers = publishers
        self.node_round_trips = 0

    def publish(self, node_id: str, stored: Mapping[int, list[int]], removed: Mapping[int, list[int]]) -> None:
        """One batch of a node's block events: tier -> hashes stored, tier -> hashes removed."""
        pub = self.publishers[node_id]
        if not pub.publish(stored=stored, removed=removed):
            raise RuntimeError(f"index gap for {node_id}: the simulator publishes every batch in order")
        self.node_round_trips += 1


# Timed events the router learns of after the fact.
_INDEX, _REPORT, _RESPONSE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class _Served:
    """What serving one request really cost its prefill node."""

    tokens: tuple[int, int, int]  # prompt tokens reused from p's device, host, disk
    fetch_tokens: int
    onboard_s: tuple[float, float]  # host, disk
    fetch_s: float  # the transfer from the holder
    # what the holder first brought back for the fetch: (tokens, seconds) from host, from disk
    holder: tuple[tuple[int, float], tuple[int, float]]

    @property
    def reused(self) -> int:
        return sum(self.tokens) + self.fetch_tokens

    @property
    def load_s(self) -> float:
        return sum(self.onboard_s) + self.fetch_s + self.holder[0][1] + self.holder[1][1]


class _Run:
    """One policy over one trace: the nodes, the router's state and the timed events."""

    def __init__(self, name: str, cfg: SimConfig, policy: PlacementPolicy | None, costs: CostBook,
                 index: IndexLink | None, admission: str, global_pool: bool, shared_fetch: bool = False,
                 routers: int = 1, share_s: float | None = None) -> None:
        self.cfg, self.policy, self.costs, self.index = cfg, policy, costs, index
        self.admission, self.global_pool, self.shared_fetch = admission, global_pool, shared_fetch
        dev, host, disk = cfg.blocks(cfg.cache_tokens), cfg.blocks(cfg.host_cache_tokens), cfg.blocks(
            cfg.disk_cache_tokens)
        self.prefill = [_Prefill(f"prefill-{i}", TieredCache(max(1, dev), host, disk), cfg.speed(i))
                        for i in range(cfg.prefill_nodes)]
        n = cfg.prefill_nodes
        self.shared = TieredCache(max(1, dev) * n, host * n, disk * n) if global_pool else None
        self.decode = [_Decode(f"decode-{i}") for i in range(cfg.decode_nodes)]
        self.by_id = {p.node_id: p for p in self.prefill}
        self.decode_by_id = {d.node_id: d for d in self.decode}
        self.side = policy if isinstance(policy, RouterSide) else None
        self.ledgers = [PrefillLedger() for _ in range(routers)]
        self.share_s, self.next_share = share_s, 0.0
        self.pick = random.Random(f"routers-{cfg.seed}")  # which replica a request reaches
        self.gate = TtftPolicy(costs, short_prompt_tokens=0, compute_weight=0.0)  # estimates a chosen pair
        self.events: list[tuple] = []  # heap of (at, seq, kind, payload)
        self.seq = 0
        self.last_event_at = {p.node_id: 0.0 for p in self.prefill}
        self.res = PolicyResult(name)
        self.slo = SLO_CLASSES[cfg.slo_class]

    def push(self, at: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, payload))

    def deliver(self, t: float) -> None:
        """Everything the router and the index learn by ``t``: one publish per node."""
        batch: dict[str, list[KVEvent]] = {}
        while self.events and self.events[0][0] <= t:
            at, _, kind, payload = heapq.heappop(self.events)
            if kind == _INDEX:
                nid, stored, removed = payload
                evs = batch.setdefault(nid, [])
                # Removals first: a block that left one tier and entered another ends in the other.
                evs.extend(BlockRemoved(tuple(hs), tier) for tier, hs in removed.items())
                evs.extend(BlockStored(tuple(hs), None, (), tier) for tier, hs in stored.items())
                self.last_event_at[nid] = at
            elif kind == _REPORT:
                self.report(*payload)
            else:
                rid, pid, did, tokens, xfer_s, router = payload
                self.ledgers[router].done(pid, rid)
                if self.side is not None:
                    self.side.finished(int(rid), pid)
                self.costs.add_transfer(pid, did, tokens * self.cfg.kv_bytes_per_token, xfer_s, num_tokens=tokens)
        for nid, evs in batch.items():
            stored, removed, _ = fold_kv_events_by_tier(evs)
            self.index.publish(nid, stored, removed)

    def report(self, node_id: str, step: StepReport | None, served: _Served, holder: str | None) -> None:
        """A prefill's measurements reach the cost book: compute, onboards, the fetch."""
        kvb = self.cfg.kv_bytes_per_token
        if step is not None:
            self.costs.add_step(node_id, step)
        for tier, tokens, secs in (("host", served.tokens[1], served.onboard_s[0]),
                                   ("disk", served.tokens[2], served.onboard_s[1])):
            if tokens > 0:
                self.costs.add_onboard(node_id, tier, tokens * kvb, secs)
        if holder is not None and served.fetch_tokens > 0:
            self.costs.add_transfer(holder, node_id, served.fetch_tokens * kvb, served.fetch_s,
                                    num_tokens=served.fetch_tokens)
            for tier, (tokens, secs) in zip(("host", "disk"), served.holder):
                if tokens > 0:
                    self.costs.add_onboard(holder, tier, tokens * kvb, secs)

    def share(self, t: float) -> None:
        """Each replica's view of the others' ledgers, as of the last ``share_s`` tick by ``t``."""
        if self.share_s is None or len(self.ledgers) < 2 or t < self.next_share:
            return
        own = [ledger.own_backlog_s() for ledger in self.ledgers]
        for r, ledger in enumerate(self.ledgers):
            others: dict[str, float] = {}
            for k, o in enumerate(own):
                if k != r:
                    for nid, v in o.items():
                        others[nid] = others.get(nid, 0.0) + v
            ledger.set_others(others)
        self.next_share = t - (t % self.share_s) + self.share_s

    def place(self, i: int, rreq: ReplayRequest, infos: list[NodeInfo], backlog: dict[str, float]
              ) -> tuple[Placement, Mapping[str, Match]]:
        t, hashes, prompt, bs = rreq.now, rreq.hashes, rreq.num_prompt_tokens, rreq.block_size
        if self.global_pool:
            p = min(self.prefill, key=lambda x: (max(0.0, x.free_at - t), x.node_id))
            d = min(self.decode, key=lambda x: (len(x.active), x.node_id))
            info = {x.node_id: x for x in infos}
            m = self.shared.match(hashes)
            return Placement(info[p.node_id], info[d.node_id], min(m.blocks * bs, prompt), "global pool"), \
                {p.node_id: m}
        ids = [p.node_id for p in self.prefill]
        matched = self.side.match(rreq, ids) if self.side is not None else None
        if matched is None:
            matched = {}
            if self.policy.uses_index and self.index is not None and hashes:
                matched = self.index.reader.match(hashes, ids)
                self.res.freshness_s.extend(t - self.last_event_at[x] for x in ids)
        return self.policy.choose(rreq, infos, matched, backlog), matched

    def admits(self, p: _Prefill, t: float, est: Estimate, prompt: int) -> bool:
        if self.admission == "queue_bound":
            return max(0.0, p.free_at - t) <= self.cfg.gate_queue_fraction * self.slo.ttft_budget_s(prompt)
        if self.admission == "pdserve_model":
            return decide(est, self.slo, prompt).admit
        return True

    def longest_holder(self, p: _Prefill, hashes: Sequence[int]) -> str | None:
        """The shared tier's source for p: the prefill node that holds the longest prefix of
        ``hashes`` in any tier, if longer than p's own (ties: the first node)."""
        own = p.cache.match(hashes).blocks
        best, holder = own, None
        for q in self.prefill:
            held = q.cache.match(hashes).blocks if q is not p else 0
            if held > best:
                best, holder = held, q.node_id
        return holder

    def serve(self, p: _Prefill, pl: Placement, hashes: Sequence[int], prompt: int) -> _Served:
        """What the nodes really hold and move for this request (nothing changes yet)."""
        cfg, bs, kvb = self.cfg, self.cfg.block_size, self.cfg.kv_bytes_per_token
        shape = ReplayRequest(prompt, bs)
        m = (self.shared if self.global_pool else p.cache).match(hashes)
        tokens = tier_tokens(shape, m)
        onboard = (cfg.tiers.host_s(tokens[1] * kvb), cfg.tiers.disk_s(tokens[2] * kvb))
        fetch_tokens, fetch_s, holder = 0, 0.0, ((0, 0.0), (0, 0.0))
        if pl.fetch_from is not None and not self.global_pool:
            mq = self.by_id[pl.fetch_from].cache.match(hashes)
            fetch_tokens = max(0, min(mq.blocks * bs, prompt) - sum(tokens))
            if fetch_tokens:
                on_host, on_disk = holder_reads(shape, mq, sum(tokens))
                fetch_s = fetch_tokens * kvb / cfg.bandwidth
                holder = ((on_host, cfg.tiers.host_s(on_host * kvb)), (on_disk, cfg.tiers.disk_s(on_disk * kvb)))
        return _Served(tokens, fetch_tokens, onboard, fetch_s, holder)

    def step(self, i: int, req: TraceRequest, t: float, noise: float) -> None:
        cfg, res = self.cfg, self.res
        res.requests += 1
        prompt, hashes = req.input_tokens, req.hash_ids
        # 1. What the router knows at t.
        self.deliver(t)
        self.share(t)
        router = self.pick.randrange(len(self.ledgers)) if len(self.ledgers) > 1 else 0
        ledger = self.ledgers[router]
        infos = _views(self.prefill, self.decode, t, cfg)
        backlog = ledger.backlog_s()
        rreq = ReplayRequest(prompt, cfg.block_size, 1, req.output_tokens, cfg.slo_class, request_id=i,
                             hashes=hashes, now=t)
        # 2. Placement.
        pl, matched = self.place(i, rreq, infos, backlog)
        p, d = self.by_id[pl.prefill_node.node_id], self.decode_by_id[pl.decode_node.node_id]
        # 3. Admission: the same rule for every policy.
        est = pl.estimate if pl.estimate is not None else _estimate(self.gate, rreq, pl, backlog, matched)
        if not self.admits(p, t, est, prompt):
            res.rejected += 1
            res.ttft_s.append(math.nan)
            return
        if self.side is not None:
            self.side.routed(rreq, pl)
        if self.shared_fetch and pl.fetch_from is None:
            pl = replace(pl, fetch_from=self.longest_holder(p, hashes))
        ledger.add(p.node_id, str(i), est.compute_s)
        # 4. What the nodes really do: load and prefill on p (FIFO), transfer, a decode slot.
        served = self.serve(p, pl, hashes, prompt)
        reused = served.reused
        compute = cfg.truth.seconds(prompt - reused, reused) * p.speed * noise
        start = max(t + served.load_s, p.free_at)
        finish = start + compute
        p.free_at = finish
        p.busy_s += compute
        res.node_requests[p.node_id] += 1
        res.node_wait_s[p.node_id] += start - t
        heapq.heappush(p.inflight, (finish, start, prompt))
        xfer = prompt * cfg.kv_bytes_per_token / cfg.bandwidth
        step = StepReport(prompt - reused, prompt, compute) if prompt > reused else None
        self.push(finish + cfg.report_delay_s, _REPORT, (p.node_id, step, served, pl.fetch_from))
        self.push(finish + xfer, _RESPONSE, (str(i), p.node_id, d.node_id, prompt, xfer, router))
        if self.global_pool:
            self.shared.insert(hashes)
        else:
            stored, removed = p.cache.insert(hashes)
            if self.index is not None and (stored or removed):
                self.push(finish, _INDEX, (p.node_id, stored, removed))
        self.decode_slot(d, req, prompt, t, finish + xfer, tbt_budget=self.slo.tbt_s)
        for key, n in zip(("device", "host", "disk", "remote"), (*served.tokens, served.fetch_tokens)):
            res.hit_tokens[key] += n
        res.input_tokens += prompt
        res.cached_tokens += reused
        res.fetched_tokens += served.fetch_tokens
        res.predicted_exact += pl.predicted_cached_tokens == reused
        res.predicted_abs_err += abs(pl.predicted_cached_tokens - reused)

    def decode_slot(self, d: _Decode, req: TraceRequest, prompt: int, t: float, ready: float,
                    tbt_budget: float) -> None:
        """The request joins d's batch when its KV is there and a slot is free; records TTFT."""
        cfg, res = self.cfg, self.res
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
        within = ttft <= self.slo.ttft_budget_s(prompt)
        res.ttft_met += within
        res.slo_met += within and tbt <= tbt_budget


def simulate(name: str, requests: Sequence[TraceRequest], cfg: SimConfig, policy: PlacementPolicy | None,
             costs: CostBook, index: IndexLink | None, *, admission: str = "none",
             global_pool: bool = False, scale: float | None = None, shared_fetch: bool = False,
             routers: int = 1, share_s: float | None = None) -> PolicyResult:
    """Replay ``requests`` under ``policy``. ``global_pool``: one shared cache of all nodes'
    capacity, tier by tier, and least-backlog placement on the true queues (the upper bound on
    the hit ratio: no policy, no index). ``shared_fetch``: the chosen node fetches a longer
    prefix from the node that holds it (a peer given pdserve's fetch). ``costs`` is the
    router's cost book: pass a fresh one (generic prior) per run. ``routers``, ``share_s``: that
    many router replicas, sharing their ledgers every ``share_s`` (None: not at all; module
    docstring)."""
    if routers < 1:
        raise ValueError(f"routers must be >= 1, got {routers}")
    if share_s is not None and not share_s > 0:  # NaN fails too
        raise ValueError(f"share_s must be > 0 seconds (None: no sharing), got {share_s}")
    if admission not in ADMISSION_MODES:
        raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {admission!r}")
    rng = random.Random(cfg.seed)  # one draw per request in trace order: the same noise for every policy
    scale = time_scale(requests, cfg) if scale is None else scale
    run = _Run(name, cfg, policy, costs, index, admission, global_pool, shared_fetch, routers, share_s)
    rt0 = index.reader.round_trips if index else 0
    t_first = requests[0].arrival_s if requests else 0.0
    run.res.span_s = (requests[-1].arrival_s - t_first) * scale if requests else 0.0
    for i, req in enumerate(requests):
        noise = math.exp(rng.gauss(0.0, cfg.step_noise)) if cfg.step_noise > 0 else 1.0
        run.step(i, req, (req.arrival_s - t_first) * scale, noise)
    res = run.res
    res.busy_s = {p.node_id: p.busy_s for p in run.prefill}
    if index is not None:
        res.router_round_trips = index.reader.round_trips - rt0
        res.node_round_trips = index.node_round_trips
    return res


def _estimate(gate: TtftPolicy, request: ReplayRequest, pl: Placement, backlog: dict[str, float],
              matched: Mapping[str, Match]) -> Estimate:
    """The router's estimate for a pair another policy chose: pdserve's model on that pair alone,
    with the cached prefix that policy predicted, in the tiers the index says when it read the
    index (a policy with a tree of its own is taken to predict device hits)."""
    pid, bs = pl.prefill_node.node_id, request.block_size
    m = matched.get(pid)
    predicted = pl.predicted_cached_tokens
    if not (isinstance(m, PrefixMatch) and min(m.blocks * bs, request.num_prompt_tokens) == predicted):
        m = -(-predicted // bs)
    return gate.choose(request, [pl.prefill_node, pl.decode_node], {pid: m}, backlog).estimate


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
