"""What a node lets in: a bound on its long RPCs, and a gate that closes when it drains.

Every Decode stream, Prefill and PushBlocks holds one gRPC worker thread for its whole life.
Without a bound, a burst of them takes every thread and queues the rest in the server's
executor (unbounded): memory grows with the overload, and the short control calls that free
capacity (AbortDecode, ReleaseReservation, RenewReservation, health) wait behind streams that
cannot finish sooner. So the long RPCs get at most ``limit`` threads, the rest of the pool is
kept for control calls, and a long RPC beyond the limit is answered at once::

    RESOURCE_EXHAUSTED  + retry-after-ms    the node is full now; blocks free as requests end
    UNAVAILABLE         + retry-after-ms    the node is draining; the router's view drops it

The interceptor also counts the long RPCs in flight: a draining node waits for that count to
reach zero. No torch here: plain grpc.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import grpc

from protos.conventions import retry_after_metadata

# Told to a caller refused for load: about the time a few requests take to free their slots.
BUSY_RETRY_AFTER_MS = 200
# Told to a caller refused by a draining node: about one refresh of a router's node view,
# after which it no longer places here.
DRAINING_RETRY_AFTER_MS = 500


class InflightGate:
    """Counts long RPCs in flight and refuses one beyond ``limit``. What a draining node
    still lets in is the role's call (node/server.py ``admit``): only work that finishes a
    request it already accepted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        self.num_refused = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    def enter(self) -> str | None:
        """Take a slot -> None, or the reason it was refused ("busy")."""
        with self._lock:
            if self._inflight >= self.limit:
                self.num_refused += 1
                return "busy"
            self._inflight += 1
            return None

    def leave(self) -> None:
        with self._lock:
            self._inflight -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float, also: Callable[[], bool] = lambda: True) -> bool:
        """Wait until no long RPC is in flight and ``also()`` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            # ``also`` first: work it tracks (a reservation) becomes a call that has already
            # entered the gate (Decode takes its reservation after entering), so a count read
            # after it includes that call.
            while not (also() and self._inflight == 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))  # ``also`` changes without notifying
            return True


def refuse_busy(context: grpc.ServicerContext, what: str) -> None:
    context.set_trailing_metadata(retry_after_metadata(BUSY_RETRY_AFTER_MS))
    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"{what}; retry in {BUSY_RETRY_AFTER_MS} ms")


def refuse_draining(context: grpc.ServicerContext, node_id: str) -> None:
    context.set_trailing_metadata(retry_after_metadata(DRAINING_RETRY_AFTER_MS))
    context.abort(grpc.StatusCode.UNAVAILABLE,
                  f"node {node_id} is draining (shutting down) and takes no new requests; "
                  f"retry in {DRAINING_RETRY_AFTER_MS} ms")


class LongRpcInterceptor(grpc.ServerInterceptor):
    """Puts the methods named in ``methods`` (full names, "/pkg.Service/Method") behind
    ``gate``; every other method (control calls, health, reflection) passes untouched."""

    def __init__(self, gate: InflightGate, methods: Iterable[str], node_id: str) -> None:
        self.gate = gate
        self.methods = frozenset(methods)
        self.node_id = node_id

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        gate = self.gate
        what = (f"node {self.node_id} has {gate.limit} long calls in flight (its limit, "
                f"max_streams)")
        def gated(inner):  # a call that returns (unary or client-streaming request)
            def call(request_or_iterator, context):
                if gate.enter():
                    refuse_busy(context, what)
                try:
                    return inner(request_or_iterator, context)
                finally:
                    gate.leave()
            return call

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                gated(handler.unary_unary), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_us = handler.unary_stream

            def unary_stream(request, context):
                if gate.enter():
                    refuse_busy(context, what)
                try:
                    yield from inner_us(request, context)
                finally:
                    gate.leave()

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                gated(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return handler  # stream-stream: none of ours
