"""Published placement policies, reimplemented from their routers' code and documentation as
baselines for ``pdserve bench router``. Same interface as pdserve's own policy
(router.placement); the decode node is the least loaded one in every baseline (they are
prefill-side policies).

Each gets the information its real router has, no more and no less:

  policy              prefix information                      load information
  round_robin         none                                    none
  least_loaded        none                                    router-side: prompt tokens it sent to
                                                              each node that have not returned
  longest_prefix      the KV-event index (Redis)              none
  sglang_cache_aware  its own approximate tree per worker:    router-side: requests in flight per
                      the routed prompt is inserted at        worker
                      routing time; LRU-evicted down to
                      ``max_tree_size`` every eviction interval
  dynamo_kv           the KV-event index (Dynamo's KvIndexer) router-side active sequences: the
                                                              uncached prompt tokens of requests
                                                              still in prefill, the unique KV blocks
                                                              of the requests active on the worker
  llmd_weighted       its own approximate per-pod LRU of      the pods' metrics: waiting requests,
                      block hashes, inserted at routing time  KV-cache utilisation
                      (with tiers: the KV-event index and
                      its tier weights, the precise scorer)

With host and disk tiers on the nodes, the peers whose real systems know tiers use them with
their published defaults: Dynamo credits a host hit 0.75 and a disk hit 0.25 of a device hit
(ai-dynamo/dynamo lib/kv-router/src/scheduling/config.rs, ``host_cache_hit_weight`` and
``disk_cache_hit_weight``; overlap.rs adds them to the device overlap); llm-d weighs each
block by the fastest tier a pod holds it in, gpu 1.0, cpu 0.8, storage 0.3 (llm-d/llm-d-router
pkg/kvcache/backend.go, the longest-prefix scorer of kvblock_scorer.go), scored by its precise
prefix-cache scorer; SGLang's router knows no tiers (HiCache is inside each worker), so its
approximate trees are sized to a node's whole hierarchy, L1 + L2 + L3.

The router-side state lives in the policy (``RouterSide``); the simulator tells it what was
sent (``routed``) and what came back (``finished``). ``NodeInfo`` carries what a node's
heartbeat reports: ``waiting`` (not started), ``running``, ``running_tokens`` (the running
sequences' tokens: their KV footprint) and ``kv_usage`` (fraction of the pool held by sequences).

Ties go to the less loaded node, then the smaller node id, so runs are reproducible.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from kv_index.nodes import NodeInfo, Role
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST
from router.placement import (
    Match,
    NoCapacityError,
    Placement,
    PlacementPolicy,
    PlacementRequest,
    cached_tokens,
    decode_load_key,
    prefix_match,
)
from router.replay.lru import LruCache


@dataclass(frozen=True, slots=True)
class ReplayRequest(PlacementRequest):
    """A request as a router in the replay sees it: its id, its prompt's chained block hashes
    (what a router computes from the tokens) and the simulated time it arrives."""

    request_id: int = 0
    hashes: tuple[int, ...] = ()
    now: float = 0.0


class RouterSide:
    """What a router keeps about its own traffic. The simulator calls ``match`` before
    ``choose`` (None: the policy reads the shared KV-event index, if it reads one), ``routed``
    once the request is admitted and sent, ``finished`` when the prefill node's response is back."""

    def match(self, request: ReplayRequest, node_ids: list[str]) -> dict[str, Match] | None:
        return None

    def routed(self, request: ReplayRequest, placement: Placement) -> None:
        pass

    def finished(self, request_id: int, node_id: str) -> None:
        pass


def _split(nodes: list[NodeInfo]) -> tuple[list[NodeInfo], NodeInfo]:
    decoders = [n for n in nodes if n.role == Role.DECODE]
    if not decoders:
        raise NoCapacityError("no live decode node")
    prefillers = sorted((n for n in nodes if n.role == Role.PREFILL), key=lambda n: n.node_id)
    if not prefillers:
        raise NoCapacityError("no live prefill node")
    return prefillers, min(decoders, key=decode_load_key)


def _place(request, matched, p: NodeInfo, d: NodeInfo, reason: str) -> Placement:
    return Placement(p, d, cached_tokens(request, matched, p.node_id), reason)


def _blocks(request: PlacementRequest) -> int:
    return -(-request.num_prompt_tokens // request.block_size)


class RoundRobin(PlacementPolicy):
    """Prefill nodes in turn. Holds a counter: the one mutable exception to choose() being pure."""

    uses_index = False

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        p = prefillers[next(self._next) % len(prefillers)]
        return _place(request, matched_blocks, p, d, "round robin")


class LeastLoaded(PlacementPolicy, RouterSide):
    """The prefill node with the fewest outstanding prompt tokens, as the router counts them
    (tokens it sent there whose prefill has not returned); no cache information."""

    uses_index = False

    def __init__(self) -> None:
        self._tokens: Counter[str] = Counter()
        self._inflight: dict[int, tuple[str, int]] = {}

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        p = min(prefillers, key=lambda n: (self._tokens[n.node_id], n.node_id))
        return _place(request, matched_blocks, p, d, f"least loaded ({self._tokens[p.node_id]} tokens outstanding)")

    def routed(self, request: ReplayRequest, placement: Placement) -> None:
        nid = placement.prefill_node.node_id
        self._tokens[nid] += request.num_prompt_tokens
        self._inflight[request.request_id] = (nid, request.num_prompt_tokens)

    def finished(self, request_id: int, node_id: str) -> None:
        nid, tokens = self._inflight.pop(request_id)
        self._tokens[nid] -= tokens


class LongestPrefix(PlacementPolicy):
    """The longest cached prefix, load ignored; ties rotate among the tied nodes (otherwise
    every unmatched request would land on the same node)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        held = {n.node_id: prefix_match(matched_blocks, n.node_id).blocks for n in prefillers}
        best = max(held.values())
        tied = [n for n in prefillers if held[n.node_id] == best]
        p = tied[next(self._next) % len(tied)]
        return _place(request, matched_blocks, p, d, f"longest prefix ({best} blocks)")


class SglangCacheAware(PlacementPolicy, RouterSide):
    """SGLang router's cache_aware policy (sgl-router ``policies/cache_aware.rs``).

    load = requests the router has in flight on the worker (counted at routing, released when
    the worker's part is done).
    1. Imbalanced (max load - min load > ``balance_abs`` and max load > ``balance_rel`` x min
       load): the least loaded worker, cache ignored.
    2. Else the worker with the longest match in the router's approximate tree, if its match
       rate (matched / prompt tokens) exceeds ``cache_threshold``;
    3. else the worker with the smallest tree.
    Either way the prompt is inserted into the chosen worker's tree when it is routed (the
    router never hears from the worker's cache). Every ``eviction_interval_s`` the trees are
    cut back to ``max_tree_blocks`` by LRU. Defaults: the router's command-line ones (cache
    0.3, abs 64, rel 1.5, 120 s); its max_tree_size counts characters, here blocks, and the
    bench sets it to the node's cache size.
    """

    uses_index = False

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 max_tree_blocks: int | None = None, eviction_interval_s: float = 120.0) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_tree_blocks = max_tree_blocks
        self.eviction_interval_s = eviction_interval_s
        self._trees: dict[str, LruCache] = {}
        self._load: Counter[str] = Counter()
        self._inflight: dict[int, str] = {}
        self._next_eviction = eviction_interval_s

    def _tree(self, node_id: str) -> LruCache:
        if node_id not in self._trees:
            self._trees[node_id] = LruCache(None)
        return self._trees[node_id]

    def tree_blocks(self, node_id: str) -> int:
        return len(self._trees[node_id]) if node_id in self._trees else 0

    def match(self, request: ReplayRequest, node_ids: list[str]) -> dict[str, int]:
        return {n: self._tree(n).match(request.hashes) for n in node_ids}

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        load = self._load
        loads = [load[n.node_id] for n in prefillers]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            p = min(prefillers, key=lambda n: (load[n.node_id], n.node_id))
            return _place(request, matched_blocks, p, d, "imbalanced: least loaded")
        rate = {n.node_id: cached_tokens(request, matched_blocks, n.node_id) / max(1, request.num_prompt_tokens)
                for n in prefillers}
        p = max(prefillers, key=lambda n: (rate[n.node_id], -load[n.node_id], _neg_id(n.node_id)))
        if rate[p.node_id] > self.cache_threshold:
            return _place(request, matched_blocks, p, d, f"match rate {rate[p.node_id]:.2f}")
        p = min(prefillers, key=lambda n: (self.tree_blocks(n.node_id), load[n.node_id], n.node_id))
        return _place(request, matched_blocks, p, d, f"low match: smallest tree ({self.tree_blocks(p.node_id)} blocks)")

    def routed(self, request: ReplayRequest, placement: Placement) -> None:
        if self.eviction_interval_s and request.now >= self._next_eviction:
            if self.max_tree_blocks is not None:
                for tree in self._trees.values():
                    tree.evict_to(self.max_tree_blocks)
            while self._next_eviction <= request.now:
                self._next_eviction += self.eviction_interval_s
        nid = placement.prefill_node.node_id
        self._tree(nid).insert(request.hashes)
        self._load[nid] += 1
        self._inflight[request.request_id] = nid

    def finished(self, request_id: int, node_id: str) -> None:
        self._load[self._inflight.pop(request_id)] -= 1


class DynamoKv(PlacementPolicy, RouterSide):
    """NVIDIA Dynamo's KV router cost (temperature 0: argmin), prefix overlap from KV events::

        cost = overlap_weight * prefill_blocks + active_blocks
        prefill_blocks = (prefill tokens of the worker's requests still in prefill
                          + this prompt's tokens not covered by the worker's overlap) / block
        active_blocks  = unique KV blocks of the requests active on the worker, plus this
                         prompt's blocks not among them
        overlap        = device blocks + host_weight * host blocks + disk_weight * disk blocks

    (``overlap_weight`` is today's ``prefill_load_scale``.) Both terms are the router's own
    bookkeeping of what it routed (Dynamo's ActiveSequences): added at routing, released when
    the prefill completes; a request's prefill tokens are booked net of its credited overlap.
    A prompt without block hashes (Azure traces) counts its blocks as unshared.
    """

    def __init__(self, overlap_weight: float = 1.0, host_weight: float = 0.75, disk_weight: float = 0.25) -> None:
        self.overlap_weight = overlap_weight
        self.host_weight = host_weight
        self.disk_weight = disk_weight
        self._blocks: dict[str, Counter[int]] = {}  # node -> refcount of each active block hash
        self._unhashed: Counter[str] = Counter()  # node -> active blocks without a hash
        self._prefill_tokens: Counter[str] = Counter()
        self._inflight: dict[int, tuple[str, tuple[int, ...], int, int]] = {}
        # the last choose(): its request id, node -> overlap credit in tokens
        self._credited: tuple[int, dict[str, int]] = (-1, {})

    def active_blocks(self, node_id: str) -> int:
        return len(self._blocks.get(node_id, ())) + self._unhashed[node_id]

    def overlap(self, request: PlacementRequest, node_id: str, matched_blocks: Mapping[str, Match]) -> float:
        """The credited overlap in blocks: device hits whole, lower tiers at their weights."""
        m = prefix_match(matched_blocks, node_id)
        credit = m.device + self.host_weight * m.host + self.disk_weight * m.disk
        return min(credit, _blocks(request))

    def cost(self, request: PlacementRequest, node_id: str, matched_blocks: Mapping[str, Match]) -> float:
        bs = request.block_size
        hashes = request.hashes if isinstance(request, ReplayRequest) else ()
        credited = round(self.overlap(request, node_id, matched_blocks) * bs)
        new_tokens = max(0, request.num_prompt_tokens - credited)
        active = self._blocks.get(node_id, {})
        added = sum(1 for h in hashes if h not in active) if hashes else _blocks(request)
        prefill_blocks = (self._prefill_tokens[node_id] + new_tokens) / bs
        return self.overlap_weight * prefill_blocks + self.active_blocks(node_id) + added

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        self._credited = (getattr(request, "request_id", -1),
                          {n.node_id: round(self.overlap(request, n.node_id, matched_blocks) * request.block_size)
                           for n in prefillers})
        cost = {n.node_id: self.cost(request, n.node_id, matched_blocks) for n in prefillers}
        p = min(prefillers, key=lambda n: (cost[n.node_id], n.node_id))
        return _place(request, matched_blocks, p, d, f"dynamo cost {cost[p.node_id]:.1f} blocks")

    def routed(self, request: ReplayRequest, placement: Placement) -> None:
        nid = placement.prefill_node.node_id
        rid, credits = self._credited
        credited = credits.get(nid, 0) if rid == request.request_id else placement.predicted_cached_tokens
        new_tokens = max(0, request.num_prompt_tokens - min(credited, request.num_prompt_tokens))
        unhashed = 0 if request.hashes else _blocks(request)
        self._blocks.setdefault(nid, Counter()).update(request.hashes)
        self._unhashed[nid] += unhashed
        self._prefill_tokens[nid] += new_tokens
        self._inflight[request.request_id] = (nid, request.hashes, unhashed, new_tokens)

    def finished(self, request_id: int, node_id: str) -> None:
        nid, hashes, unhashed, new_tokens = self._inflight.pop(request_id)
        blocks = self._blocks[nid]
        blocks.subtract(hashes)
        for h in hashes:
            if blocks[h] <= 0:
                del blocks[h]
        self._unhashed[nid] -= unhashed
        self._prefill_tokens[nid] -= new_tokens


# llm-d's default tier weights (llm-d/llm-d-router pkg/kvcache/backend.go): gpu, cpu, storage.
LLMD_TIER_WEIGHTS: dict[int, float] = {TIER_DEVICE: 1.0, TIER_HOST: 0.8, TIER_DISK: 0.3}


class LlmdWeighted(PlacementPolicy, RouterSide):
    """llm-d inference scheduler's weighted scorers (argmax of the weighted sum), each in [0, 1]:
      prefix:  leading blocks in the scheduler's approximate per-pod LRU / prompt blocks (the
               approximate prefix-cache scorer: the routed prompt's blocks are added to the
               chosen pod's LRU at routing time; capacity ``lru_blocks`` per pod, which the
               scheduler's autoTune reads from the pod's KV capacity);
               with ``tier_weights`` the precise prefix-cache scorer instead: the KV-event index,
               each leading block weighted by the fastest tier the pod holds it in, min-max
               normalised over the pods that hold any (``indexedScoresToNormalizedScoredPods``:
               1 for all when they tie, 0 for a pod that holds none)
      kv:      1 - KV usage (pod metrics)
      queue:   (max q - q) / (max q - min q) over the candidates, q = waiting requests (pod
               metrics; 1 if all equal)
    Weights: the default profile's prefix 3 and queue 2, plus kv-utilisation 2.
    """

    def __init__(self, prefix_weight: float = 3.0, kv_weight: float = 2.0, queue_weight: float = 2.0,
                 lru_blocks: int | None = None, tier_weights: Mapping[int, float] | None = None) -> None:
        self.w = (prefix_weight, kv_weight, queue_weight)
        self.lru_blocks = lru_blocks
        self.tier_weights = dict(tier_weights) if tier_weights is not None else None
        self.uses_index = self.tier_weights is not None
        self._lru: dict[str, LruCache] = {}

    def _pod(self, node_id: str) -> LruCache:
        if node_id not in self._lru:
            self._lru[node_id] = LruCache(self.lru_blocks)
        return self._lru[node_id]

    def match(self, request: ReplayRequest, node_ids: list[str]) -> dict[str, int] | None:
        if self.tier_weights is not None:
            return None  # the precise scorer reads the KV-event index
        return {n: self._pod(n).match(request.hashes) for n in node_ids}

    def prefix_scores(self, request: PlacementRequest, node_ids: list[str],
                      matched_blocks: Mapping[str, Match]) -> dict[str, float]:
        total = max(1, _blocks(request))
        matches = {n: prefix_match(matched_blocks, n) for n in node_ids}
        if self.tier_weights is None:
            return {n: min(m.blocks, total) / total for n, m in matches.items()}
        w = self.tier_weights
        raw = {n: w[TIER_DEVICE] * m.device + w[TIER_HOST] * m.host + w[TIER_DISK] * m.disk
               for n, m in matches.items() if m.blocks > 0}
        lo, hi = min(raw.values(), default=0.0), max(raw.values(), default=0.0)
        return {n: 0.0 if n not in raw else 1.0 if hi == lo else (raw[n] - lo) / (hi - lo) for n in node_ids}

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        prefix = self.prefix_scores(request, [n.node_id for n in prefillers], matched_blocks)
        qs = [n.waiting for n in prefillers]
        lo, hi = min(qs), max(qs)

        def score(n: NodeInfo) -> float:
            queue = 1.0 if hi == lo else (hi - n.waiting) / (hi - lo)
            return self.w[0] * prefix[n.node_id] + self.w[1] * (1.0 - n.kv_usage) + self.w[2] * queue

        p = max(prefillers, key=lambda n: (score(n), -(n.running + n.waiting), _neg_id(n.node_id)))
        return _place(request, matched_blocks, p, d, f"llm-d score {score(p):.2f}")

    def routed(self, request: ReplayRequest, placement: Placement) -> None:
        if self.tier_weights is None:
            self._pod(placement.prefill_node.node_id).insert(request.hashes)


def _neg_id(node_id: str) -> tuple[int, ...]:
    # For max(): the lexicographically smallest id wins a tie.
    return tuple(-ord(c) for c in node_id) + (0,)


BASELINES = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "longest_prefix": LongestPrefix,
    "sglang_cache_aware": SglangCacheAware,
    "dynamo_kv": DynamoKv,
    "llmd_weighted": LlmdWeighted,
}
