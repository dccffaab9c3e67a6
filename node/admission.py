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
reach zero.

PushBlocks is a client stream whose first message (the header) carries the reservation token
it is checked by; until that message arrives the caller is nobody in particular, and without
TLS anyone can open such streams. So streams still waiting for their first message hold at
most ``first_message_limit`` of the gate's slots (the rest stay for Decode, Prefill and pushes
under way): one more cancels the one that has waited longest, rather than being refused (real
senders send the header with the call, so the one waiting longest is the likeliest stranger),
and each is cancelled ``first_message_timeout_s`` after it started. No torch here: plain grpc.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import grpc

from protos.conventions import retry_after_metadata
from protos.pdserve.v1 import kv_pb2

# Told to a caller refused for load: about the time a few requests take to free their slots.
BUSY_RETRY_AFTER_MS = 200
# Told to a caller refused by a draining node: about one refresh of a router's node view,
# after which it no longer places here.
DRAINING_RETRY_AFTER_MS = 500
# A PushBlocks stream whose header has not come within this long is cancelled.
FIRST_MESSAGE_TIMEOUT_S = 5.0
# A waiting stream younger than this is never evicted for a newer one: a real sender's header
# follows its stream's start at once, and under concurrent pushes (several requests, a fallback
# after shm/tcp) evicting the youngest would cancel real transfers (seen in
# test_fault_migration). A stranger's streams are evicted once they are this old.
FIRST_MESSAGE_GRACE_S = 0.5
_PUSH = kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"].methods_by_name["PushBlocks"]
# Client streams checked by their first message: held to the first-message bounds.
FIRST_MESSAGE_METHODS = (f"/{_PUSH.containing_service.full_name}/{_PUSH.name}",)


def first_message_limit(limit: int) -> int:
    """Of ``limit`` long-call slots, how many streams waiting for their first message may hold."""
    return max(1, limit // 4)


class InflightGate:
    """Counts long RPCs in flight and refuses one beyond ``limit``. What a draining node
    still lets in is the role's call (node/server.py ``admit``): only work that finishes a
    request it already accepted."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self._clock = clock
        self.first_message_limit = first_message_limit(limit)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inflight = 0
        # Of them, client streams whose first message has not come, oldest first -> (its cancel,
        # when it started).
        self._awaiting: OrderedDict[object, tuple[Callable[[], None], float]] = OrderedDict()
        self.num_refused = 0
        self.num_evicted = 0  # streams cancelled for a newer one while waiting for their first message

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def awaiting_first_message(self) -> int:
        return len(self._awaiting)

    def enter(self, waiting: object | None = None, cancel: Callable[[], None] = lambda: None) -> str | None:
        """Take a slot -> None, or the reason it was refused ("busy"). ``waiting``: a client
        stream (any key) that waits for its first message until ``first_message_seen(waiting)``;
        when ``first_message_limit`` wait already, the oldest is cancelled (its ``cancel``) and
        gives its slot back as its call ends, unless it started under FIRST_MESSAGE_GRACE_S ago."""
        evicted = None
        with self._lock:
            if self._inflight >= self.limit:
                self.num_refused += 1
                return "busy"
            if waiting is not None:
                now = self._clock()
                if len(self._awaiting) >= self.first_message_limit:
                    oldest = next(iter(self._awaiting))
                    if now - self._awaiting[oldest][1] >= FIRST_MESSAGE_GRACE_S:
                        evicted = self._awaiting.pop(oldest)[0]
                        self.num_evicted += 1
                self._awaiting[waiting] = (cancel, now)
            self._inflight += 1
        if evicted is not None:
            evicted()
        return None

    def first_message_seen(self, waiting: object) -> None:
        with self._lock:
            self._awaiting.pop(waiting, None)

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


class FirstMessageWatch:
    """A client stream's request iterator while it waits for its first message: counted by the
    gate (``enter`` names it), and its call cancelled (``context.cancel``) when that message
    has not come within ``timeout_s`` of ``start``. ``close`` (idempotent) ends the wait."""

    def __init__(self, requests, context: grpc.ServicerContext, gate: InflightGate, timeout_s: float) -> None:
        self._requests = requests
        self._gate = gate
        self.cancel = context.cancel
        self._timer: threading.Timer | None = threading.Timer(timeout_s, context.cancel)
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._requests)
        finally:
            self.close()  # the first message came, or the stream ended or was cancelled

    def close(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            self._gate.first_message_seen(self)


class LongRpcInterceptor(grpc.ServerInterceptor):
    """Puts the methods named in ``methods`` (full names, "/pkg.Service/Method") behind
    ``gate``; every other method (control calls, health, reflection) passes untouched. Those
    of them in ``first_message_methods`` (client streams) are also held to the first-message
    bounds until their first message (see above)."""

    def __init__(self, gate: InflightGate, methods: Iterable[str], node_id: str,
                 first_message_methods: Iterable[str] = FIRST_MESSAGE_METHODS,
                 first_message_timeout_s: float = FIRST_MESSAGE_TIMEOUT_S) -> None:
        self.gate = gate
        self.methods = frozenset(methods)
        self.node_id = node_id
        self.first_message_methods = frozenset(first_message_methods)
        self.first_message_timeout_s = first_message_timeout_s

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
        if handler.stream_unary and handler_call_details.method in self.first_message_methods:
            return grpc.stream_unary_rpc_method_handler(
                self._first_message_gated(handler.stream_unary, what), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                gated(handler.stream_unary), handler.request_deserializer, handler.response_serializer)
        return handler  # stream-stream: none of ours

    def _first_message_gated(self, inner, what: str):
        gate, timeout_s = self.gate, self.first_message_timeout_s

        def call(request_iterator, context):
            watch = FirstMessageWatch(request_iterator, context, gate, timeout_s)
            if gate.enter(watch, watch.cancel):
                refuse_busy(context, what)
            watch.start()
            try:
                return inner(watch, context)
            finally:
                watch.close()
                gate.leave()
        return call
