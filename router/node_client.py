"""The router's calls to the nodes (kv.proto): one channel per node address (mutual TLS when
its config has TLS), and the calls the orchestrator makes on them.

Channels are kept while calls use them and closed once idle for ``CHANNEL_IDLE_S``, and at most
``MAX_IDLE_CHANNELS`` idle ones are kept (the least recently used go first). Nodes come and go
under new addresses (pod IPs, ports of restarted actors): a channel per address ever seen, kept
for the router's life, held a subchannel, its connection and buffers for every node long gone.
A node gone from the registry gets no new calls, so its channel closes ``CHANNEL_IDLE_S`` after
its last call ended; a channel with a call in flight (a Decode stream) is never closed, and a
live node whose channel was closed for idleness gets a new one at its next call.

The orchestrator decides what to call and what a failure means for the request; this module
only makes the calls. Two kinds:

- the request's own calls (ReserveBlocks, Prefill, Decode): their errors go back to the
  caller, which falls back, migrates or fails the request;
- housekeeping that no request waits on for its answer (RenewReservation, ReleaseReservation,
  AbortDecode): a failure is logged and dropped, because a lease or the node's own abort on a
  broken stream frees the blocks anyway. Those warnings come at the request rate under
  overload, so they go through ``node_call_log`` (telemetry/log_limit.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import grpc

from protos.conventions import grpc_options, keepalive_channel_options, reconnect_channel_options
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from security.tls import aio_channel
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
node_call_log = RateLimitedLog(log)
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...] | None  # trace context for the node's spans
# Idle seconds after which a node's channel is closed: long enough that a node between bursts
# keeps its connection (a new one costs a TCP and TLS handshake), short enough that the channels
# of nodes gone from the registry do not pile up. MAX_IDLE_CHANNELS bounds them whatever the churn.
CHANNEL_IDLE_S = 120.0
MAX_IDLE_CHANNELS = 256


async def await_renewing(call: Awaitable[T], renew: Callable[[], Awaitable[None]], lease_s: float) -> T:
    """Await ``call``, calling ``renew`` every third of ``lease_s`` meanwhile (``lease_s`` <= 0:
    never). A request can wait in a busy prefill node's queue longer than the decode node's
    reservation lease; without renewal the reservation expires, the push is refused and the
    prompt is computed a second time on the decode node."""
    if lease_s <= 0:
        return await call
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=lease_s / 3)
            if done:
                return task.result()
            await renew()
    finally:
        if not task.done():
            task.cancel()


@dataclass
class _Channel:
    channel: grpc.aio.Channel
    calls: int = 0  # in flight on it: never closed while > 0
    used: float = 0.0  # time.monotonic() its last call started or ended


class NodeClient:
    """Calls on the nodes, by gRPC address. Lives on the orchestrator's event loop."""

    def __init__(self, config: RouterConfig, idle_s: float = CHANNEL_IDLE_S,
                 max_idle: int = MAX_IDLE_CHANNELS) -> None:
        self.config = config
        self._channels: dict[str, _Channel] = {}
        self._idle_s, self._max_idle = idle_s, max_idle
        self._swept = time.monotonic()
        self._background: set[asyncio.Task] = set()  # best-effort aborts on failed nodes, closes

    # -- the request's calls: errors (grpc.aio.AioRpcError) go to the caller ----------------------
    async def reserve(self, decode_address: str, request: kv_pb2.ReserveBlocksRequest,
                      metadata: Metadata) -> kv_pb2.ReserveBlocksResponse:
        async with self._use(decode_address) as ch:
            return await kv_pb2_grpc.KVTransferStub(ch).ReserveBlocks(
                request, timeout=self.config.reserve_timeout_s, metadata=metadata)

    def prefill(self, prefill_address: str, request: kv_pb2.PrefillRequest, metadata: Metadata,
                timeout_s: float | None = None):
        """The Prefill call, started: await it with ``prefilled``; cancelling it aborts the
        prefill. ``timeout_s``: its deadline (router/liveness.py prefill_deadline_s; default
        prefill_timeout_s)."""
        return self._started(prefill_address, lambda ch: kv_pb2_grpc.PrefillNodeStub(ch).Prefill(
            request, timeout=timeout_s if timeout_s is not None else self.config.prefill_timeout_s,
            metadata=metadata))

    async def prefilled(self, call, decode_address: str, node_request_id: str,
                        lease_s: float) -> kv_pb2.PrefillResponse:
        """The Prefill ``call``'s response, the decode node's reservation renewed meanwhile."""
        async def renew() -> None:
            try:
                async with self._use(decode_address) as ch:
                    await kv_pb2_grpc.KVTransferStub(ch).RenewReservation(
                        kv_pb2.RenewReservationRequest(request_id=node_request_id),
                        timeout=self.config.control_timeout_s)
            except grpc.aio.AioRpcError as e:  # the push then fails and the request recomputes
                node_call_log.warning(f"RenewReservation {e.code().name}", "RenewReservation %s failed: %s",
                                      node_request_id, e.details())

        return await await_renewing(call, renew, lease_s)

    def decode(self, decode_address: str, request: kv_pb2.DecodeRequest, metadata: Metadata):
        """The Decode stream (``read()`` it; ``cancel()`` stops it). No deadline of its own:
        router/relay.py bounds each wait by the node's progress instead."""
        return self._started(decode_address,
                             lambda ch: kv_pb2_grpc.DecodeNodeStub(ch).Decode(request, metadata=metadata))

    # -- housekeeping: logged, never raised ---------------------------------------------------------
    async def release(self, decode_address: str, node_request_id: str) -> None:
        """Free a reservation no push will use."""
        try:
            async with self._use(decode_address) as ch:
                await kv_pb2_grpc.KVTransferStub(ch).ReleaseReservation(
                    kv_pb2.ReleaseReservationRequest(request_id=node_request_id),
                    timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:  # the reservation's lease frees it anyway
            node_call_log.warning(f"ReleaseReservation {e.code().name}", "ReleaseReservation %s on %s failed: %s",
                                  node_request_id, decode_address, e.details())

    async def abort_decode(self, decode_address: str, node_request_id: str, quiet: bool = False) -> None:
        """Stop the request on the decode node, whatever its phase: AbortDecode also drops a
        reservation. ``quiet``: a failure is expected (the node failed), logged at debug."""
        try:
            async with self._use(decode_address) as ch:
                await kv_pb2_grpc.DecodeNodeStub(ch).AbortDecode(pb.AbortRequest(request_id=node_request_id),
                                                                 timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:
            if quiet:
                log.debug("AbortDecode %s on %s failed: %s", node_request_id, decode_address, e.details())
            else:
                node_call_log.warning(f"AbortDecode {e.code().name}", "AbortDecode %s on %s failed: %s",
                                      node_request_id, decode_address, e.details())

    def abort_in_background(self, decode_address: str, node_request_id: str) -> None:
        """After a failure: a node that is in fact alive (a broken connection, a failed step)
        frees the request's blocks; a dead one just fails the call. Never awaited by the request."""
        task = asyncio.ensure_future(self.abort_decode(decode_address, node_request_id, quiet=True))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for entry in self._channels.values():
            await entry.channel.close()
        self._channels.clear()

    # -- channels -----------------------------------------------------------------------------------
    def _acquire(self, address: str) -> grpc.aio.Channel:
        now = time.monotonic()
        if now - self._swept >= min(self._idle_s, 10.0):
            self._sweep(now)
        entry = self._channels.get(address)
        if entry is None:
            # Mutual TLS when the config has TLS; keepalive so a frozen node fails its calls
            # within seconds (protos/conventions.py).
            entry = self._channels[address] = _Channel(aio_channel(
                address, self.config.tls, grpc_options(self.config.max_message_bytes) + keepalive_channel_options()
                + reconnect_channel_options()))
        entry.calls += 1
        entry.used = now
        return entry.channel

    def _release(self, address: str) -> None:
        entry = self._channels.get(address)
        if entry is not None:
            entry.calls -= 1
            entry.used = time.monotonic()

    @asynccontextmanager
    async def _use(self, address: str):
        """The channel to ``address``, counted in use for the block."""
        ch = self._acquire(address)
        try:
            yield ch
        finally:
            self._release(address)

    def _started(self, address: str, start: Callable[[grpc.aio.Channel], T]) -> T:
        """A call ``start`` makes on the channel to ``address``, counted in use until it ends."""
        ch = self._acquire(address)
        try:
            call = start(ch)
        except BaseException:
            self._release(address)
            raise
        call.add_done_callback(lambda _call: self._release(address))
        return call

    def _sweep(self, now: float) -> None:
        """Close the channels idle past ``idle_s``, then the least recently used idle ones
        beyond ``max_idle``; never one with a call in flight."""
        self._swept = now
        idle = sorted((e.used, a) for a, e in self._channels.items() if e.calls <= 0)
        stale = [a for used, a in idle if now - used >= self._idle_s]
        kept = [a for used, a in idle if now - used < self._idle_s]
        for address in stale + kept[:max(0, len(kept) - self._max_idle)]:
            task = asyncio.ensure_future(self._channels.pop(address).channel.close())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    @property
    def open_channels(self) -> int:
        return len(self._channels)
