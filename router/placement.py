"""Placement: which prefill node (if any) and which decode node serve a request.

Pure: plain data in (the request's shape, the live nodes, how many leading prompt blocks each
node holds), a decision out. No sockets, no Redis; the orchestrator gathers the inputs in one
index round trip. A policy is a hint like the index it reads: a wrong guess costs time
(a cache miss, a queue), never a wrong answer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from kv_index.nodes import NodeInfo, PrefixMatch, Role
from kv_index.schema import TIER_DISK, TIER_HOST
from router.admission import SLO_CLASSES, Estimate
from router.cost_model import CostBook

# What the index says one node holds of a prompt: a PrefixMatch (the live router's
# IndexReader.match), or a plain count of leading blocks, all on the device (approximate trees
# of the peer policies, hand-built tests).
Match = PrefixMatch | int


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    num_prompt_tokens: int
    block_size: int
    n: int = 1
    max_tokens: int = 16
    slo_class: str = "relaxed"  # a key of router.admission.SLO_CLASSES


@dataclass(frozen=True, slots=True)
class Placement:
    prefill_node: NodeInfo | None  # None: the decode node prefills the prompt itself
    decode_node: NodeInfo
    predicted_cached_tokens: int  # prompt tokens expected from the chosen prefiller's cache
    reason: str  # one line for logs and traces: why this pair
    estimate: Estimate | None = None  # predicted latency parts (policies with a cost model)
    # Hot-block replication: fetch this many leading tokens' KV from fetch_from into the
    # prefill node before computing the rest (None: recompute whatever it lacks).
    fetch_from: str | None = None
    fetch_tokens: int = 0

    @property
    def kind(self) -> str:
        """The decision in one word (a metric label): where the prompt is computed."""
        if self.prefill_node is None:
            return "local"
        return "disaggregated_fetch" if self.fetch_from else "disaggregated"


class NoCapacityError(Exception):
    """No live node can take the request (no decode node)."""


class PlacementPolicy(ABC):
    """Chooses a (prefill, decode) pair. Implementations hold configuration only: ``choose``
    mutates nothing and may be called concurrently."""

    # Whether choose() reads matched_blocks: a policy that does not needs no index lookup.
    uses_index: bool = True

    @abstractmethod
    def choose(self, request: PlacementRequest, nodes: list[NodeInfo],
               matched_blocks: Mapping[str, Match], backlog_s: Mapping[str, float] | None = None) -> Placement:
        """``matched_blocks[node_id]`` = the leading prompt blocks that node holds and in which
        tiers (``PrefixMatch``; a plain int counts device blocks; absent = none).
        ``backlog_s[node_id]``, where known, is how long until the node could start this
        request (a prefill node's queue, a decode node's wait for a free slot).
        Raises NoCapacityError when no decode node is live."""


def prefix_match(matched_blocks: Mapping[str, Match], node_id: str) -> PrefixMatch:
    """A node's match as a ``PrefixMatch`` (an int: that many device blocks; absent: none)."""
    m = matched_blocks.get(node_id, 0)
    return m if isinstance(m, PrefixMatch) else PrefixMatch(int(m))


def cached_tokens(request: PlacementRequest, matched_blocks: Mapping[str, Match], node_id: str) -> int:
    """Prompt tokens a node's matched leading blocks cover, in any tier (a match never exceeds
    the prompt, but the cap keeps the arithmetic honest)."""
    return min(prefix_match(matched_blocks, node_id).blocks * request.block_size, request.num_prompt_tokens)


def tier_tokens(request: PlacementRequest, m: PrefixMatch) -> tuple[int, int, int]:
    """(device, host, disk) prompt tokens of a match. The tiers are taken to hold the prefix in
    that order (device first, then host, then disk), as an LRU demotes a chain's tail first::

        prompt   |<-------- blocks held ---------->|
                 | device      | host     | disk    | not held
    """
    cap = request.num_prompt_tokens
    bs = request.block_size
    dev = min(m.device * bs, cap)
    host = min((m.device + m.host) * bs, cap) - dev
    return dev, host, min(m.blocks * bs, cap) - dev - host


def decode_load_key(node: NodeInfo) -> tuple:
    # Fewest running sequences first, then the emptiest KV pool; node id keeps it deterministic.
    return (node.running + node.waiting, node.kv_usage, node.node_id)


SLOW_STEP_FACTOR = 3.0


def without_stragglers(decoders: list[NodeInfo], factor: float = SLOW_STEP_FACTOR) -> list[NodeInfo]:
    """The decode nodes less the stragglers: those whose steps (``step_s``, heartbeated) take
    more than ``factor`` times the fastest one's, or more than ``factor`` times their own best
    recent step time at a comparable batch (``step_best_s``, router/step_history.py; it exposes
    a slow node when no peer has a measurement, e.g. the other node just restarted, or there is
    no other). A node slowed by a neighbour, thermal limits or a failing device stretches every
    token of every request placed there, while its load figures look as good as anyone's until
    its requests pile up. A node reporting no step time (idle for a while) stays a candidate, so
    one that recovered gets traffic, and is measured, again. Never returns an empty list: if all
    were excluded it returns them all. ``factor`` <= 0 turns the check off. Decode nodes only:
    a prefill step's time depends on the prompt it computed (prefill speed is the cost model's)."""
    if factor <= 0:
        return decoders
    known = [d.step_s for d in decoders if d.step_s > 0]
    limit = factor * min(known) if len(known) >= 2 else float("inf")

    def straggler(d: NodeInfo) -> bool:
        return d.step_s > limit or (d.step_best_s > 0 and d.step_s > factor * d.step_best_s)

    return [d for d in decoders if not straggler(d)] or decoders


def queued_tokens(node: NodeInfo) -> int:
    """A prefill node's backlog in tokens. ``running_tokens`` counts what it is computing;
    waiting requests are counted at a nominal size since their lengths are not reported."""
    return node.running_tokens + node.waiting * _NOMINAL_WAITING_TOKENS


_NOMINAL_WAITING_TOKENS = 512


class PrefixLoadPolicy(PlacementPolicy):
    """Prefill where the longest prefix is cached, discounted by the node's backlog::

        score(p) = cached_tokens(p) - alpha * queued_tokens(p)      (argmax; ties -> less loaded)

    A cached token saves computing it; a queued token delays this request by about one token of
    compute, so alpha ~ 1 weighs them equally; below 1 favours cache hits over balance.
    Decode node: the least loaded. Prefill happens on the decode node (prefill_node None) when
    the prompt is shorter than ``short_prompt_tokens`` (a transfer costs more than recomputing),
    when n > ``max_n`` (the hand-off carries one sample) or when no prefill node is live.
    """

    def __init__(self, alpha: float = 0.5, short_prompt_tokens: int = 64, max_n: int = 1,
                 slow_step_factor: float = SLOW_STEP_FACTOR) -> None:
        self.alpha = alpha
        self.short_prompt_tokens = short_prompt_tokens
        self.max_n = max_n
        self.slow_step_factor = slow_step_factor

    def choose(self, request: PlacementRequest, nodes: list[NodeInfo],
               matched_blocks: Mapping[str, Match], backlog_s: Mapping[str, float] | None = None) -> Placement:
        decoders = [n for n in nodes if n.role == Role.DECODE]
        if not decoders:
            raise NoCapacityError("no live decode node")
        decode = min(without_stragglers(decoders, self.slow_step_factor), key=decode_load_key)

        def cached(node: NodeInfo) -> int:
            return cached_tokens(request, matched_blocks, node.node_id)

        if request.num_prompt_tokens < self.short_prompt_tokens:
            return Placement(None, decode, cached(decode),
                             f"short prompt ({request.num_prompt_tokens} < {self.short_prompt_tokens} tokens)")
        if request.n > self.max_n:
            return Placement(None, decode, cached(decode), f"n={request.n} > {self.max_n}: prefill on decode")
        prefillers = [n for n in nodes if n.role == Role.PREFILL]
        if not prefillers:
            return Placement(None, decode, cached(decode), "no live prefill node")

        def rank(node: NodeInfo) -> tuple:
            score = cached(node) - self.alpha * queued_tokens(node)
            # max() over this tuple: best score, then the smaller backlog, then a stable id order.
            return (score, -queued_tokens(node), _reverse_id(node.node_id))

        best = max(prefillers, key=rank)
        return Placement(best, decode, cached(best),
                         f"prefix {cached(best)} cached tokens, {queued_tokens(best)} queued")


def _reverse_id(node_id: str) -> tuple[int, ...]:
    # Deterministic tie-break for max(): the lexicographically smallest id wins.
    return tuple(-ord(c) for c in node_id) + (0,)


def holder_reads(request: PlacementRequest, m: PrefixMatch, have: int) -> tuple[int, int]:
    """Of the tokens a holder with match ``m`` sends to a node that has the first ``have``:
    how many it must first bring back from its host memory, and from its disk (its tiers hold
    the prefix in order, ``tier_tokens``)."""
    dev, host, disk = tier_tokens(request, m)
    end = dev + host + disk
    on_host = max(0, min(dev + host, end) - max(have, dev))
    on_disk = max(0, end - max(have, dev + host))
    return on_host, on_disk


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How one prefill node would come by a prompt's KV: the prefix it holds (device hits are
    free, host and disk hits are onboarded), the blocks beyond it that it fetches from a node
    holding a longer prefix, and the rest, which it computes. Loading (onboarding, fetching)
    starts when the request reaches the node and overlaps its wait in the queue; the compute
    starts once both are done (a node prefetches while a request queues, as Mooncake and
    HiCache's storage prefetch do)::

        |<--- queue wait --->|<-- compute -->|          load <= wait: loading is hidden
        |<--- load ------------->|<-- compute -->|      load > wait: the excess shows
    """

    cached: int  # prompt tokens the node holds, in any tier
    load_s: float  # onboarding its host/disk hits + the fetch
    compute_s: float  # the tokens neither held nor fetched
    fetch_from: str | None = None
    fetch_tokens: int = 0

    def start_s(self, wait_s: float) -> float:
        """Seconds from arrival until the compute can start."""
        return max(wait_s, self.load_s)


class TtftPolicy(PlacementPolicy):
    """pdserve's policy: the (prefill p, decode d) pair with the smallest predicted time to
    first token, Mooncake-style::

        ttft(p, d) = max(wait(p), load(p))                      queue on p; loading overlaps it
                   + prefill_p(uncached_p, cached_p)            p's own fitted cost model
                   + exposed(p, d) * (fixed(p, d)               KV transfer to d: the part the
                       + (prompt - cached_d) * kv_bytes / bw(p, d))   request waits for
                   + wait(d)                                    a free decode slot on d

        load(p)    = onboard_p(host hits) + onboard_p(disk hits)     p's own fits per tier
                   [+ fetch(q -> p) of the blocks q holds beyond p]  replicate: raw transfer,
                                                                     + q's disk read

    where fixed and bw are fitted per pair for the transport it last used (shm, tcp, grpc) and
    exposed is the share of a transfer not hidden behind the compute (1 unless the pair's KV is
    streamed layer by layer), all from ``CostBook`` (``transfer_s``, ``raw_transfer_s``,
    ``onboard_s``). A device hit costs nothing; a hit in p's host memory or on its disk costs
    what p's onboards of that tier have been measured to cost; a hit on another node q costs
    the fetch, and is taken only when fetching beats computing those blocks (``PrefillPlan``).

    subject to tbt(d with this request) <= the request's SLO, where possible. A cached token
    counts exactly as much as the compute it saves, and a queued second as much as a second of
    compute, so cache affinity and balance are traded in one unit.

    ``replicate``: fetching from another node (Mooncake's hot-block replication); the
    placement then names q and the tokens to fetch.

    The pair is ranked by ``ttft + compute_weight * work``, ``work`` being the compute the
    request still needs (the tokens neither held nor fetched) priced at the cluster's typical
    node (``CostBook.reference_prefill``, the pooled fit). The TTFT is this request's; the
    second term prices what its compute costs everyone else: a second spent recomputing a
    prefix that another node holds delays every request queued behind it too, and the
    recomputed blocks evict others from p's cache; at 0 the policy is greedy per request and
    spreads conversations over the nodes (more duplicated blocks, a lower hit ratio). The work
    is priced at the typical node's speed, not p's own: at p's own speed the term multiplied a
    fast node's real advantage by (1 + compute_weight), so the fast nodes drew the long prompts
    until their queues were that many times longer (held-out trace, weight 4: the fastest
    node's mean wait 1.18 s against 0.2-0.56 s elsewhere). The TTFT term alone weighs a node's
    speed, once. Loading is not weighted: it moves bytes while the node computes other requests.
    With ``replicate`` every node can reuse the longest prefix by fetching it, so the term
    hardly changes a choice.

    Without ``backlog_s`` a node's queue is estimated from its reported backlog tokens. Decode
    nodes whose measured step time is ``slow_step_factor`` times the fastest's are left out
    (``without_stragglers``).
    """

    def __init__(self, costs: CostBook, short_prompt_tokens: int = 64, max_n: int = 1,
                 replicate: bool = False, compute_weight: float = 1.0,
                 slow_step_factor: float = SLOW_STEP_FACTOR, local_uncached_tokens: int = 0) -> None:
        self.costs = costs
        self.local_uncached_tokens = local_uncached_tokens
        self.slow_step_factor = slow_step_factor
        self.compute_weight = compute_weight
        self.short_prompt_tokens = short_prompt_tokens
        self.max_n = max_n
        self.replicate = replicate

    def choose(self, request: PlacementRequest, nodes: list[NodeInfo],
               matched_blocks: Mapping[str, Match], backlog_s: Mapping[str, float] | None = None) -> Placement:
        backlog_s = backlog_s or {}
        decoders = without_stragglers([n for n in nodes if n.role == Role.DECODE], self.slow_step_factor)
        if not decoders:
            raise NoCapacityError("no live decode node")
        slo = SLO_CLASSES.get(request.slo_class, SLO_CLASSES["relaxed"])
        prompt = request.num_prompt_tokens

        def wait(node: NodeInfo) -> float:
            if node.node_id in backlog_s:
                return backlog_s[node.node_id]
            return self.costs.prefill(node.node_id).predict(queued_tokens(node)) if node.role == Role.PREFILL else 0.0

        def tbt(d: NodeInfo) -> float:
            return self.costs.decode.step_s(d.running + 1, d.running_tokens + prompt + request.max_tokens)

        # Decode side: prefer nodes whose TBT with this request meets the SLO; if none does,
        # every node is a candidate and admission will reject on the TBT estimate.
        tbt_of = {d.node_id: tbt(d) for d in decoders}
        ok = [d for d in decoders if tbt_of[d.node_id] <= slo.tbt_s] or decoders
        prefillers = [n for n in nodes if n.role == Role.PREFILL]
        if prompt < self.short_prompt_tokens or request.n > self.max_n or not prefillers:
            return self._local(request, ok, matched_blocks, wait, tbt_of)
        near = [d for d in ok if prompt - cached_tokens(request, matched_blocks, d.node_id) < self.local_uncached_tokens]
        if near:  # the decode node holds nearly all of it: computing the rest there beats a transfer
            return self._local(request, near, matched_blocks, wait, tbt_of)

        decode_wait = {d.node_id: wait(d) for d in ok}
        holders = [(n.node_id, prefix_match(matched_blocks, n.node_id)) for n in nodes
                   if not n.draining] if self.replicate else []
        best: tuple | None = None
        for p in prefillers:
            q = wait(p)
            plan = self.plan(request, p.node_id, matched_blocks, holders, q)
            start = plan.start_s(q)
            reused = plan.cached + plan.fetch_tokens
            work = self.costs.reference_prefill().predict(prompt - reused, reused)
            for d in ok:
                xfer = self.costs.transfer_s(p.node_id, d.node_id, prompt - cached_tokens(request, matched_blocks,
                                                                                          d.node_id))
                est = Estimate(q, start - q + plan.compute_s, xfer, decode_wait[d.node_id], tbt_of[d.node_id],
                               load_s=plan.load_s)
                key = (est.ttft_s + self.compute_weight * work, decode_load_key(d), p.node_id)
                if best is None or key < best[0]:
                    best = (key, p, d, est, plan)
        _, p, d, est, plan = best
        reason = (f"ttft {est.ttft_s * 1e3:.0f} ms: queue {est.queue_s * 1e3:.0f} + prefill "
                  f"{est.prefill_s * 1e3:.0f} ({plan.cached} cached, load {plan.load_s * 1e3:.0f}) + transfer "
                  f"{est.transfer_s * 1e3:.0f} + decode wait {est.decode_wait_s * 1e3:.0f}")
        if plan.fetch_from is not None:
            reason += f"; fetching {plan.fetch_tokens} tokens from {plan.fetch_from}"
        return Placement(p, d, plan.cached + plan.fetch_tokens, reason, est, plan.fetch_from, plan.fetch_tokens)

    def plan(self, request: PlacementRequest, node_id: str, matched_blocks: Mapping[str, Match],
             holders: list[tuple[str, PrefixMatch]] = (), wait_s: float = 0.0) -> PrefillPlan:
        """The cheapest way for prefill node ``node_id`` to come by the prompt's KV, by the
        policy's rank (``start_s(wait_s) + compute_s + compute_weight * work``): what it holds
        (its host and disk hits onboarded), plus, for each node in ``holders`` with a longer
        prefix, fetching the blocks beyond its own (the holder reads those it keeps on disk
        first)."""
        prompt, bs = request.num_prompt_tokens, request.block_size
        m = prefix_match(matched_blocks, node_id)
        _, host, disk = tier_tokens(request, m)
        c = min(m.blocks * bs, prompt)
        model = self.costs.prefill(node_id)
        onboard = self.costs.onboard_s(node_id, TIER_HOST, host) + self.costs.onboard_s(node_id, TIER_DISK, disk)
        best = PrefillPlan(c, onboard, model.predict(prompt - c, c))
        ref = self.costs.reference_prefill()

        def cost(plan: PrefillPlan) -> float:
            reused = plan.cached + plan.fetch_tokens
            return (plan.start_s(wait_s) + plan.compute_s
                    + self.compute_weight * ref.predict(prompt - reused, reused))

        for q, mq in holders:
            cq = min(mq.blocks * bs, prompt)
            if q == node_id or cq <= c:
                continue
            on_host, on_disk = holder_reads(request, mq, c)
            fetch = (self.costs.raw_transfer_s(q, node_id, cq - c) + self.costs.onboard_s(q, TIER_HOST, on_host)
                     + self.costs.onboard_s(q, TIER_DISK, on_disk))
            plan = PrefillPlan(c, onboard + fetch, model.predict(prompt - cq, cq), q, cq - c)
            if cost(plan) < cost(best):
                best = plan
        return best

    def _local(self, request: PlacementRequest, ok: list[NodeInfo], matched_blocks: Mapping[str, Match],
               wait, tbt_of: Mapping[str, float]) -> Placement:
        """The decode node prefills the prompt itself: a short prompt (a transfer costs more
        than computing it), a prompt the node holds all but ``local_uncached_tokens`` of, n >
        max_n (the hand-off carries one sample), or no prefill node."""
        prompt = request.num_prompt_tokens
        plans = {d.node_id: self.plan(request, d.node_id, matched_blocks) for d in ok}

        def local_s(d: NodeInfo) -> float:
            return plans[d.node_id].load_s + plans[d.node_id].compute_s

        d = min(ok, key=lambda d: (wait(d) + local_s(d), decode_load_key(d)))
        why = ("short prompt" if prompt < self.short_prompt_tokens else
               f"n={request.n} > {self.max_n}" if request.n > self.max_n else
               f"{prompt - plans[d.node_id].cached} uncached < {self.local_uncached_tokens}"
               if prompt - plans[d.node_id].cached < self.local_uncached_tokens else "no live prefill node")
        est = Estimate(queue_s=0.0, prefill_s=local_s(d), decode_wait_s=wait(d), tbt_s=tbt_of[d.node_id],
                       load_s=plans[d.node_id].load_s)
        return Placement(None, d, plans[d.node_id].cached, f"{why}: prefill on the decode node", est)
