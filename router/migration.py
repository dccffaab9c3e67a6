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
# cluster's capacity and go back to the client as before. INTERNAL (a failed engine step) is a
# node failure with a budget of its own (``refusal``): a failed step fails every request in
# that node's batch, and a request that caused it would take the next node's batch down too,
# so it moves once, not again. UNKNOWN stays out.
NODE_FAILURE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE,  # process gone, connection refused or reset, engine stopped, keepalive
    grpc.StatusCode.CANCELLED,  # the server side cancelled (its gRPC server stopped); ours raise CancelledError
})
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
# Step errors a request may meet and still move: the first is the node's, a second one is
# likely the request's own (contract: docs/cluster.md, "Failures").
STEP_ERROR_BUDGET = 1


def status_code(code: grpc.StatusCode | int) -> grpc.StatusCode:
    """``code``: a status, or its number as an in-stream ``Error.code`` carries it."""
    if isinstance(code, int):
        return _CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return code


def is_node_failure(code: grpc.StatusCode | int) -> bool:
    return status_code(code) in NODE_FAILURE_CODES


def is_step_error(code: grpc.StatusCode | int) -> bool:
    """INTERNAL from a decode node: its engine step failed (in the stream or as the status)."""
    return status_code(code) == grpc.StatusCode.INTERNAL


class NodeFailed(Exception):
    """A node failed for this request (router/liveness.py names how: ``reason``): the request
    moves. If it cannot move the client gets ``code``: UNAVAILABLE (retryable) unless the node
    said more (INTERNAL for a failed engine step)."""

    def __init__(self, node: NodeInfo, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 reason: str = "unavailable") -> None:
        super().__init__(message)
        self.node = node
        self.code = code
        self.message = message
        self.reason = reason


def refusal(*, step_error: bool, n: int, yielded: bool, migrations: int, max_migrations: int,
            step_errors: int, aborted: bool) -> str | None:
    """Why a request whose node failed cannot move (None: it may). ``step_errors``: the step
    errors it has met, this one included; ``migrations``: the moves it made so far."""
    if aborted:
        return "aborted"
    if n != 1 and yielded:
        return f"n={n} after output (the samples forked on the failed node)"
    if migrations >= max_migrations:
        return f"max_migrations ({max_migrations}) reached"
    if step_error and step_errors > STEP_ERROR_BUDGET:
        return f"engine step failed for it {step_errors} times, on different nodes"
    return None


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
    thread-safe: the orchestrator's event loop owns it (placement reads a snapshot).

    A failure of the whole node (``reason`` in router/liveness.py NODE_WIDE: its keepalive,
    a stream's progress deadline, its lease) is remembered with its time, so the node's other
    streams move at once (``failed_since``) instead of each waiting out its own bound."""

    def __init__(self, exclude_s: float) -> None:
        self.exclude_s = exclude_s
        self._until: dict[tuple[str, str], float] = {}
        self._node_wide: dict[tuple[str, str], tuple[float, str]] = {}  # key -> (when, reason)

    def exclude(self, node: NodeInfo, now: float, node_wide: str | None = None) -> None:
        key = (node.node_id, node.grpc_address)
        self._until[key] = now + self.exclude_s
        if node_wide is not None:
            self._node_wide[key] = (now, node_wide)

    def failed_since(self, key: tuple[str, str], since: float) -> str | None:
        """The node-wide failure found on ``key`` at or after ``since``, if any."""
        got = self._node_wide.get(key)
        return got[1] if got is not None and got[0] >= since else None

    def active(self, now: float) -> frozenset[tuple[str, str]]:
        for key in [k for k, t in self._until.items() if t <= now]:
            del self._until[key]
            self._node_wide.pop(key, None)
        return frozenset(self._until)

    @staticmethod
    def usable(nodes: Iterable[NodeInfo], excluded: frozenset[tuple[str, str]]) -> list[NodeInfo]:
        return [n for n in nodes if (n.node_id, n.grpc_address) not in excluded]
