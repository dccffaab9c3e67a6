"""Published placement policies, reimplemented from their descriptions as baselines for
``pdserve bench router``. Same interface and inputs as pdserve's own policy (router.placement):
the index's per-node prefix match and the nodes' load; the decode node is the least loaded one
in every baseline (they are prefill-side policies).

Load, as the sim and the router report it on ``NodeInfo``:
  ``running + waiting``  requests dispatched to the node and not finished (router accounting),
  ``waiting``            of those, not started yet (the node's queue),
  ``running_tokens``     their uncomputed prompt tokens (``queued_tokens`` adds waiting * nominal),
  ``kv_usage``           fraction of the node's KV pool holding blocks.

Ties go to the less loaded node, then the smaller node id, so runs are reproducible.
"""
from __future__ import annotations

import itertools

from kv_index.nodes import NodeInfo, Role
from router.placement import NoCapacityError, Placement, PlacementPolicy, cached_tokens, decode_load_key, queued_tokens


def _split(nodes: list[NodeInfo]) -> tuple[list[NodeInfo], NodeInfo]:
    decoders = [n for n in nodes if n.role == Role.DECODE]
    if not decoders:
        raise NoCapacityError("no live decode node")
    prefillers = sorted((n for n in nodes if n.role == Role.PREFILL), key=lambda n: n.node_id)
    if not prefillers:
        raise NoCapacityError("no live prefill node")
    return prefillers, min(decoders, key=decode_load_key)


def _requests(n: NodeInfo) -> int:
    return n.running + n.waiting


def _place(request, matched, p: NodeInfo, d: NodeInfo, reason: str) -> Placement:
    return Placement(p, d, cached_tokens(request, matched, p.node_id), reason)


class RoundRobin(PlacementPolicy):
    """Prefill nodes in turn. Holds a counter: the one mutable exception to choose() being pure."""

    uses_index = False

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        p = prefillers[next(self._next) % len(prefillers)]
        return _place(request, matched_blocks, p, d, "round robin")


class LeastLoaded(PlacementPolicy):
    """The prefill node with the fewest outstanding prompt tokens (no cache information)."""

    uses_index = False

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        p = min(prefillers, key=lambda n: (queued_tokens(n), _requests(n), n.node_id))
        return _place(request, matched_blocks, p, d, f"least loaded ({queued_tokens(p)} tokens queued)")


class LongestPrefix(PlacementPolicy):
    """The longest cached prefix, load ignored; ties rotate among the tied nodes (otherwise
    every unmatched request would land on the same node)."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        best = max(matched_blocks.get(n.node_id, 0) for n in prefillers)
        tied = [n for n in prefillers if matched_blocks.get(n.node_id, 0) == best]
        p = tied[next(self._next) % len(tied)]
        return _place(request, matched_blocks, p, d, f"longest prefix ({best} blocks)")


class SglangCacheAware(PlacementPolicy):
    """SGLang router's cache_aware policy.

    1. Imbalanced (max load - min load > ``balance_abs`` and max load > ``balance_rel`` x min
       load, load = in-flight requests): the least loaded node, cache ignored.
    2. Else the node with the highest prefix match rate (matched / prompt tokens) if that rate
       exceeds ``cache_threshold``;
    3. else the node with the most free cache (SGLang: the smallest approximate tree; here the
       node's reported KV usage, a more accurate signal than the router's own tree).
    Defaults are the router's documented ones (cache 0.3, abs 64, rel 1.5).
    """

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        loads = [_requests(n) for n in prefillers]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            p = min(prefillers, key=lambda n: (_requests(n), n.node_id))
            return _place(request, matched_blocks, p, d, "imbalanced: least loaded")
        rate = {n.node_id: cached_tokens(request, matched_blocks, n.node_id) / max(1, request.num_prompt_tokens)
                for n in prefillers}
        p = max(prefillers, key=lambda n: (rate[n.node_id], -_requests(n), _neg_id(n.node_id)))
        if rate[p.node_id] > self.cache_threshold:
            return _place(request, matched_blocks, p, d, f"match rate {rate[p.node_id]:.2f}")
        p = min(prefillers, key=lambda n: (n.kv_usage, _requests(n), n.node_id))
        return _place(request, matched_blocks, p, d, f"low match: emptiest cache ({p.kv_usage:.2f})")


class DynamoKv(PlacementPolicy):
    """NVIDIA Dynamo's KV router cost (temperature 0: argmin)::

        cost = overlap_weight * prefill_blocks + active_blocks
        prefill_blocks = blocks of the prompt the node would compute (prompt - overlap)
        active_blocks  = blocks the node already has in flight (its outstanding tokens / block)
    """

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        bs = request.block_size
        total = -(-request.num_prompt_tokens // bs)

        def cost(n: NodeInfo) -> float:
            prefill_blocks = total - min(matched_blocks.get(n.node_id, 0), total)
            return self.overlap_weight * prefill_blocks + queued_tokens(n) / bs

        p = min(prefillers, key=lambda n: (cost(n), _requests(n), n.node_id))
        return _place(request, matched_blocks, p, d, f"dynamo cost {cost(p):.1f} blocks")


class LlmdWeighted(PlacementPolicy):
    """llm-d inference scheduler's weighted scorers (argmax of the weighted sum), each in [0, 1]:
      prefix:  matched blocks / prompt blocks
      kv:      1 - KV usage
      queue:   (max q - q) / (max q - min q) over the candidates, q = waiting requests (1 if all equal)
    Weights: the default profile's prefix 3 and queue 2, plus kv-utilisation 2.
    """

    def __init__(self, prefix_weight: float = 3.0, kv_weight: float = 2.0, queue_weight: float = 2.0) -> None:
        self.w = (prefix_weight, kv_weight, queue_weight)

    def choose(self, request, nodes, matched_blocks, backlog_s=None) -> Placement:
        prefillers, d = _split(nodes)
        total = max(1, -(-request.num_prompt_tokens // request.block_size))
        qs = [n.waiting for n in prefillers]
        lo, hi = min(qs), max(qs)

        def score(n: NodeInfo) -> float:
            prefix = min(matched_blocks.get(n.node_id, 0), total) / total
            queue = 1.0 if hi == lo else (hi - n.waiting) / (hi - lo)
            return self.w[0] * prefix + self.w[1] * (1.0 - n.kv_usage) + self.w[2] * queue

        p = max(prefillers, key=lambda n: (score(n), -_requests(n), _neg_id(n.node_id)))
        return _place(request, matched_blocks, p, d, f"llm-d score {score(p):.2f}")


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
