"""How long the router waits on a node before it calls the node failed for a request, and how
it names what it saw. Pure: plain numbers in, seconds or a reason out; router/relay.py and
router/orchestrator.py apply them to the calls.

A node fails loudly (its process dies: the calls end UNAVAILABLE at once) or quietly (it
freezes, its link goes silent, its engine wedges in a step). Quiet failures are found by
whichever sign comes first::

    keepalive           the channel pings the node (protos/conventions.py); a frozen process
                        cannot answer: every call on that connection ends UNAVAILABLE (3-4 s)
    progress deadline   a Decode stream brings no token and no heartbeat for progress_bound_s:
                        the node's engine has not moved for this stream (a wedged engine whose
                        gRPC still answers pings; a frozen node too)
    lease lapsed        the node left the registry (its heartbeats to Redis stopped): its open
                        streams move, not only new requests (within lease + refresh)
    step error          the node's engine step raised (INTERNAL): retried elsewhere once
    prefill deadline    a Prefill call ran past its deadline, derived from the cost model's
                        prediction: the decode node recomputes the prompt
    fetch bound         a prefill node's fetch of a prefix from its holder ran past its bound
                        (``fetch_timeout_s``): the prefill node computes the prefix

The progress deadline scales with the node's own step time (``NodeInfo.step_s``, the average
its engine heartbeats): a stream on a node whose steps take 100 ms waits ``factor`` x 100 ms,
but never less than ``floor_s`` (one long step: a chunk of a prompt prefilled on the decode
node, a spike on a loaded host) nor more than ``ceiling_s`` (a slow node is still detected
when it stops). A node with no step time yet (idle until now) gets the ceiling: its first
step is the one that warms it up.
"""
from __future__ import annotations

import grpc

from router.admission import Estimate

# Reasons, as the metric pdserve:router_node_failures_detected_total labels them.
UNAVAILABLE = "unavailable"  # the call ended UNAVAILABLE / CANCELLED: process gone, connection refused or reset
KEEPALIVE = "keepalive"  # the connection's keepalive ping went unanswered
PROGRESS_DEADLINE = "progress_deadline"
LEASE_LAPSED = "lease_lapsed"
STEP_ERROR = "step_error"
PREFILL_DEADLINE = "prefill_deadline"
# Failures of the node, not of one call: every other stream on that node moves as well when
# one of its streams finds one (router/relay.py), instead of each waiting out its own bound.
NODE_WIDE = frozenset({KEEPALIVE, PROGRESS_DEADLINE, LEASE_LAPSED})

# The longest heartbeat period the router asks a decode node for: short next to any floor, so
# a live node's silence never reaches the deadline between two heartbeats.
MAX_HEARTBEAT_S = 0.5


def check_deadlines(decode_factor: float, floor_s: float, ceiling_s: float, prefill_factor: float,
                    prefill_floor_s: float, prefill_ceiling_s: float) -> None:
    """Raise ValueError unless both deadlines are usable: factors > 0 and 0 < floor <= ceiling
    < inf (NaN fails too). RouterConfig and `pdserve up`'s ClusterConfig check with this."""
    inf = float("inf")
    if not (decode_factor > 0 and 0 < floor_s <= ceiling_s < inf):
        raise ValueError("need decode_progress_factor > 0 and 0 < decode_progress_floor_s <= "
                         f"decode_progress_ceiling_s < inf, got {decode_factor}, {floor_s}, {ceiling_s}")
    if not (prefill_factor > 0 and 0 < prefill_floor_s <= prefill_ceiling_s < inf):
        raise ValueError("need prefill_deadline_factor > 0 and 0 < prefill_deadline_floor_s <= "
                         f"prefill_timeout_s < inf, got {prefill_factor}, {prefill_floor_s}, {prefill_ceiling_s}")


def progress_bound_s(step_s: float, factor: float, floor_s: float, ceiling_s: float) -> float:
    """Seconds a Decode stream may stay silent (no token, no heartbeat) before its node counts
    as failed for it: ``factor * step_s`` clamped to [floor_s, ceiling_s]; the ceiling when the
    step time is unknown (``step_s`` <= 0)."""
    if step_s <= 0:
        return ceiling_s
    return min(ceiling_s, max(floor_s, factor * step_s))


def heartbeat_period_s(floor_s: float) -> float:
    """How often a silent stream's node sends a heartbeat (DecodeRequest.heartbeat_s): at
    least four per shortest bound, and no more than MAX_HEARTBEAT_S apart."""
    return min(MAX_HEARTBEAT_S, floor_s / 4)


def prefill_deadline_s(estimate: Estimate | None, factor: float, floor_s: float, ceiling_s: float) -> float:
    """The Prefill call's deadline: ``factor`` times the placement's predicted queue, prefill
    and transfer seconds, clamped to [floor_s, ceiling_s]; the ceiling when the policy predicts
    nothing (policy "prefix_load")."""
    if estimate is None:
        return ceiling_s
    predicted = estimate.queue_s + estimate.prefill_s + estimate.transfer_s
    return min(ceiling_s, max(floor_s, factor * predicted))


# A prefix fetch's bound (PrefillRequest.fetch.timeout_s): this many times the placement's
# predicted load, within [floor, ceiling] seconds. The floor covers a healthy holder on a busy
# machine (a fetch there is a few RPCs and one push); past the ceiling computing would have
# been faster for any prompt this cluster serves. The node clamps it too (node/prefix_fetch.py).
FETCH_TIMEOUT_FACTOR = 4.0
FETCH_TIMEOUT_FLOOR_S = 1.0
FETCH_TIMEOUT_CEILING_S = 10.0


def fetch_timeout_s(estimate: Estimate | None, factor: float = FETCH_TIMEOUT_FACTOR,
                    floor_s: float = FETCH_TIMEOUT_FLOOR_S, ceiling_s: float = FETCH_TIMEOUT_CEILING_S) -> float:
    """How long a prefill node waits for the prefix it fetches before computing it instead:
    ``factor`` times the predicted load (``Estimate.load_s``: the fetch and any onboarding),
    clamped to [floor_s, ceiling_s]."""
    predicted = estimate.load_s if estimate is not None else 0.0
    return min(ceiling_s, max(floor_s, factor * predicted))


def call_failure(code: grpc.StatusCode, details: str | None) -> str | None:
    """What a node call's status says about the node: one of the reasons above, or None when
    it is about the request (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND, ...)."""
    if code == grpc.StatusCode.INTERNAL:
        return STEP_ERROR
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        text = (details or "").lower()
        # gRPC's words for an unanswered keepalive ping ("Stream removed (ping timeout)" in
        # 1.85, "keepalive watchdog timeout" in older releases).
        return KEEPALIVE if "ping timeout" in text or "keepalive" in text else UNAVAILABLE
    return None
