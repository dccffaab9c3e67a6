"""Migration: a request whose node failed is placed again and its stream goes on.

Pure bookkeeping (no sockets); router/orchestrator.py drives it. When a decode stream breaks
after k tokens reached the client, the request continues from prompt + those k tokens::

    first attempt:   prompt p0..pn | out o0 .. o(k-1) | X   decode node dies
    next attempt:    prompt' = p0..pn o0..o(k-1), resumed_output_tokens = k
                     -> prefilled elsewhere (or on the new decode node), streams ok, ok+1, ...

The k tokens stay *output* on the new node (DecodeRequest / PrefillRequest
``resumed_output_tokens``): max_tokens, min_tokens, penalties and the seeded generator of
each step (derived from seed, sample index and step) count them, so the continuation is the
run that never failed, token for token. The client gets no token twice (the new node streams
only what follows) and none is missing.

A failed node is excluded from placement for ``exclude_s``, by node id *and* address: Ray
restarts a killed actor under the same id on a new port, and that new life may serve at once.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kv_index.nodes import NodeInfo

# A node's stream or call ended by these: the node (or the way to it) is gone, not the request.
# INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND... say something about the request or the
# cluster's capacity and go back to the client as before. INTERNAL and UNKNOWN stay out on
# purpose: a failed engine step fails every request in that node's batch, and a request that
# caused it would take the next node's batch down too.
NODE_FAILURE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,  # process gone, connection refused or reset, engine stopped
    grpc.StatusCode.CANCELLED,  # the server side cancelled (its gRPC server stopped); ours raise CancelledError
})
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def is_node_failure(code: grpc.StatusCode | int) -> bool:
    """``code``: a status, or its number as an in-stream ``Error.code`` carries it."""
    if isinstance(code, int):
        code = _CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return code in NODE_FAILURE_CODES


class NodeFailed(Exception):
    """A node's call or stream ended by the node failing (``is_node_failure``): the request
    moves. The client sees UNAVAILABLE (retryable) if it cannot move, whatever the node's code."""

    def __init__(self, node: NodeInfo, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        super().__init__(message)
        self.node = node
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Continuation:
    """What the next attempt of a request sends: its prompt with the streamed tokens appended."""

    prompt: list[int]
    resumed_output_tokens: int
    remaining_tokens: int  # max_tokens left (placement sizes the decode slot by it)


def continuation(prompt: list[int], streamed: Iterable[int], max_tokens: int) -> Continuation:
    """``prompt``: the client's prompt; ``streamed``: every token the client got so far, over
    all attempts."""
    out = list(streamed)
    return Continuation(list(prompt) + out, len(out), max_tokens - len(out))


class Exclusions:
    """Nodes that failed lately, each left out of placement until its time is up. Not
    thread-safe: the orchestrator's event loop owns it (placement reads a snapshot)."""

    def __init__(self, exclude_s: float) -> None:
        self.exclude_s = exclude_s
        self._until: dict[tuple[str, str], float] = {}

    def exclude(self, node: NodeInfo, now: float) -> None:
        self._until[(node.node_id, node.grpc_address)] = now + self.exclude_s

    def active(self, now: float) -> frozenset[tuple[str, str]]:
        for key in [k for k, t in self._until.items() if t <= now]:
            del self._until[key]
        return frozenset(self._until)

    @staticmethod
    def usable(nodes: Iterable[NodeInfo], excluded: frozenset[tuple[str, str]]) -> list[NodeInfo]:
        return [n for n in nodes if (n.node_id, n.grpc_address) not in excluded]
