"""Placement: which prefill node (if any) and which decode node serve a request.

Pure: plain data in (the request's shape, the live nodes, how many leading prompt blocks each
node holds), a decision out. No sockets, no Redis; the orchestrator gathers the inputs in one
index round trip. A policy is a hint like the index it reads: a wrong guess costs time
(a cache miss, a queue), never a wrong answer.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kv_transfer.kv_index import NodeInfo


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    num_prompt_tokens: int
    block_size: int
    n: int = 1
    max_tokens: int = 16


@dataclass(frozen=True, slots=True)
class Placement:
    prefill_node: NodeInfo | None  # None: the decode node prefills the prompt itself
    decode_node: NodeInfo
    predicted_cached_tokens: int  # prompt tokens expected from the chosen prefiller's cache
    reason: str  # one line for logs and traces: why this pair


class NoCapacityError(Exception):
    """No live node can take the request (no decode node)."""


class PlacementPolicy(ABC):
    """Chooses a (prefill, decode) pair. Implementations hold configuration only: ``choose``
    mutates nothing and may be called concurrently."""

    @abstractmethod
    def choose(self, request: PlacementRequest, nodes: list[NodeInfo],
               matched_blocks: dict[str, int]) -> Placement:
        """``matched_blocks[node_id]`` = leading prompt blocks that node holds (absent = 0).
        Raises NoCapacityError when no decode node is live."""


def decode_load_key(node: NodeInfo) -> tuple:
    # Fewest running sequences first, then the emptiest KV pool; node id keeps it deterministic.
    return (node.running + node.waiting, node.kv_usage, node.node_id)


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

    def __init__(self, alpha: float = 0.5, short_prompt_tokens: int = 64, max_n: int = 1) -> None:
        self.alpha = alpha
        self.short_prompt_tokens = short_prompt_tokens
        self.max_n = max_n

    def choose(self, request: PlacementRequest, nodes: list[NodeInfo],
               matched_blocks: dict[str, int]) -> Placement:
        decoders = [n for n in nodes if n.role == "decode"]
        if not decoders:
            raise NoCapacityError("no live decode node")
        decode = min(decoders, key=decode_load_key)

        def cached(node: NodeInfo) -> int:
            # A block match beyond the prompt cannot happen, but the cap keeps the arithmetic honest.
            return min(matched_blocks.get(node.node_id, 0) * request.block_size, request.num_prompt_tokens)

        if request.num_prompt_tokens < self.short_prompt_tokens:
            return Placement(None, decode, cached(decode),
                             f"short prompt ({request.num_prompt_tokens} < {self.short_prompt_tokens} tokens)")
        if request.n > self.max_n:
            return Placement(None, decode, cached(decode), f"n={request.n} > {self.max_n}: prefill on decode")
        prefillers = [n for n in nodes if n.role == "prefill"]
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
