"""The router's calls to the nodes (kv.proto): one channel per node address, kept for the
router's life (mutual TLS when its config has TLS), and the calls the orchestrator makes on them.

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
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from protos.conventions import grpc_options, keepalive_channel_options
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from security.tls import aio_channel
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)
node_call_log = RateLimitedLog(log)
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...] | None  # trace context for the node's spans


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


class NodeClient:
    """Calls on the nodes, by gRPC address. Lives on the orchestrator's event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._background: set[asyncio.Task] = set()  # best-effort aborts on failed nodes

    # -- the request's calls: errors (grpc.aio.AioRpcError) go to the caller ----------------------
    async def reserve(self, decode_address: str, request: kv_pb2.ReserveBlocksRequest,
                      metadata: Metadata) -> kv_pb2.ReserveBlocksResponse:
        return await self._kv(decode_address).ReserveBlocks(request, timeout=self.config.reserve_timeout_s,
                                                            metadata=metadata)

    def prefill(self, prefill_address: str, request: kv_pb2.PrefillRequest, metadata: Metadata,
                timeout_s: float | None = None):
        """The Prefill call, started: await it with ``prefilled``; cancelling it aborts the
        prefill. ``timeout_s``: its deadline (router/liveness.py prefill_deadline_s; default
        prefill_timeout_s)."""
        stub = kv_pb2_grpc.PrefillNodeStub(self._channel(prefill_address))
        return stub.Prefill(request, timeout=timeout_s if timeout_s is not None else self.config.prefill_timeout_s,
                            metadata=metadata)

    async def prefilled(self, call, decode_address: str, node_request_id: str,
                        lease_s: float) -> kv_pb2.PrefillResponse:
        """The Prefill ``call``'s response, the decode node's reservation renewed meanwhile."""
        kv = self._kv(decode_address)

        async def renew() -> None:
            try:
                await kv.RenewReservation(kv_pb2.RenewReservationRequest(request_id=node_request_id),
                                          timeout=self.config.control_timeout_s)
            except grpc.aio.AioRpcError as e:  # the push then fails and the request recomputes
                node_call_log.warning(f"RenewReservation {e.code().name}", "RenewReservation %s failed: %s",
                                      node_request_id, e.details())

        return await await_renewing(call, renew, lease_s)

    def decode(self, decode_address: str, request: kv_pb2.DecodeRequest, metadata: Metadata):
        """The Decode stream (``read()`` it; ``cancel()`` stops it). No deadline of its own:
        router/relay.py bounds each wait by the node's progress instead."""
        return kv_pb2_grpc.DecodeNodeStub(self._channel(decode_address)).Decode(request, metadata=metadata)

    # -- housekeeping: logged, never raised ---------------------------------------------------------
    async def release(self, decode_address: str, node_request_id: str) -> None:
        """Free a reservation no push will use."""
        try:
            await self._kv(decode_address).ReleaseReservation(
                kv_pb2.ReleaseReservationRequest(request_id=node_request_id), timeout=self.config.control_timeout_s)
        except grpc.aio.AioRpcError as e:  # the reservation's lease frees it anyway
            node_call_log.warning(f"ReleaseReservation {e.code().name}", "ReleaseReservation %s on %s failed: %s",
                                  node_request_id, decode_address, e.details())

    async def abort_decode(self, decode_address: str, node_request_id: str, quiet: bool = False) -> None:
        """Stop the request on the decode node, whatever its phase: AbortDecode also drops a
        reservation. ``quiet``: a failure is expected (the node failed), logged at debug."""
        stub = kv_pb2_grpc.DecodeNodeStub(self._channel(decode_address))
        try:
            await stub.AbortDecode(pb.AbortRequest(request_id=node_request_id), timeout=self.config.control_timeout_s)
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
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    # -- channels -----------------------------------------------------------------------------------
    def _kv(self, decode_address: str) -> kv_pb2_grpc.KVTransferStub:
        return kv_pb2_grpc.KVTransferStub(self._channel(decode_address))

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            # Mutual TLS when the config has TLS; keepalive so a frozen node fails its calls
            # within seconds (protos/conventions.py).
            ch = self._channels[address] = aio_channel(
                address, self.config.tls, grpc_options(self.config.max_message_bytes) + keepalive_channel_options())
        return ch
