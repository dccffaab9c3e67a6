"""Where a node receives KV into its pool: its reservations and both receivers over them.

A decode node receives the prompts prefill nodes push to it; any node receives the prefixes it
fetches from the node that holds them (node/prefix_fetch.py). Both are the same thing: blocks
reserved under a request id and a token (``node/reservations.py``), written only by a transfer
that names both, through either receiver:

    PushBlocks on the node's gRPC port   kv_transfer/grpc_transport.py KVReceiver
    its data port (tcp, shm, and dist    kv_transfer/receiver.py TcpKVServer, opened unless the
    with NodeConfig.kv_dist)             node has TLS (the data port is plaintext)

``KVInbox`` holds the table, both receivers and the reaper that frees a reservation whose lease
passed; the role decides what a landed transfer means (``on_received``) and what a transfer's
outcome counts in its metrics (``on_outcome``). A reservation's blocks go back to the engine
(``release``) only when no push may still write into them: a drop while a push is in flight
defers the release to that push's end (``ReservationTable.drop``).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable

import grpc

from engine.parallel.kv_regroup import LandingArea
from kv_transfer.dist_transport import dist_endpoint
from kv_transfer.grpc_transport import KVReceiver
from kv_transfer.receiver import TcpKVServer
from kv_transfer.shm_transport import shm_endpoint
from kv_transfer.tcp_transport import SCHEME as TCP_SCHEME
from kv_transfer.validate import ReceivedBlocks, Reservation
from node.config import NodeConfig, host_port
from node.output_stream import EngineStoppedError
from node.reservations import ReservationTable
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)


class KVInbox:
    """One node's KV reservations and receivers into ``pool`` (the engine's KV tensor).

    ``release(request_id)`` gives a reservation's blocks back to the engine (raises
    EngineStoppedError when the engine is gone); ``on_received`` is called for every transfer
    that landed, after the table recorded it; ``on_outcome(ok, bytes, seconds)`` once per
    transfer, refused ones included.
    """

    def __init__(self, config: NodeConfig, pool, fingerprint: str, num_layers: int, *,
                 release: Callable[[str], None],
                 on_received: Callable[[ReceivedBlocks], None] = lambda r: None,
                 on_outcome: Callable[[bool, int, float], None] = lambda ok, nbytes, seconds: None,
                 landing: LandingArea | None = None) -> None:
        self.config = config
        self.reservations = ReservationTable(num_layers, config.reservation_lease_s)
        # A tensor-parallel node (engine/parallel/kv_regroup.py LandingArea): transfers land
        # full-head in ``landing`` and are scattered into the rank pools; reservations name its
        # slots on the wire.
        self.landing = landing
        if landing is not None:
            pool = landing.tensor
        self._release = release
        self._on_received_hook = on_received
        self._on_outcome = on_outcome
        self.receiver = KVReceiver(pool, fingerprint, self._on_received, self.reservations.get)
        if landing is not None:  # every way a reservation ends gives its landing slots back
            self._release = lambda rid: (landing.free(rid), release(rid))
        # The raw TCP data stream beside PushBlocks (plaintext: not opened when TLS is on).
        self.data_server: TcpKVServer | None = None
        if config.kv_data_port is not None and config.tls is None:
            self.data_server = TcpKVServer(
                pool, fingerprint, on_received=self._on_received, reservation_for=self.reservations.get,
                begin_push=self.reservations.begin_push, end_push=self._end_push, on_outcome=on_outcome,
                host=config.host, port=config.kv_data_port, dist=config.kv_dist)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._expire, name=f"reaper-{config.node_id}", daemon=True)

    def start(self) -> None:
        """Listen on the data port (before the node advertises it) and start the reaper."""
        if self.data_server is not None:
            self.data_server.start()
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()
        if self._reaper.is_alive():
            self._reaper.join()
        if self.data_server is not None:
            self.data_server.stop()

    def kv_endpoints(self) -> tuple[str, ...]:
        """The data plane beside PushBlocks, fastest first: what a sender is given to push here
        (docs/cluster.md, "KV data plane")."""
        host = self.config.advertised_host
        if self.data_server is None or self.data_server.port is None or host is None:
            return ()
        address = host_port(host, self.data_server.port)
        dist = (dist_endpoint(address),) if self.data_server.dist is not None else ()
        return shm_endpoint(address), *dist, f"{TCP_SCHEME}://{address}"

    def wire_blocks(self, request_id: str, engine_blocks) -> tuple[int, ...] | None:
        """The block ids a sender writes ``engine_blocks`` of ``request_id`` as: the same ids, or
        (tensor parallel) landing slots; None when the landing area has too few free."""
        if self.landing is None:
            return tuple(engine_blocks)
        return self.landing.take(request_id, engine_blocks)

    def take(self, request_id: str, prompt_token_ids: tuple[int, ...]) -> Reservation:
        """``ReservationTable.take``, its landing slots (if any) given back."""
        res = self.reservations.take(request_id, prompt_token_ids)
        if self.landing is not None:
            self.landing.free(request_id)
        return res

    def drop(self, request_id: str) -> tuple[bool, bool]:
        """Forget ``request_id``'s reservation -> (found, released now). Its blocks go back to
        the engine now, unless a push into them is in flight: that push's end releases them.
        Thread-safe; idempotent. Raises EngineStoppedError when the blocks were due back and the
        engine is gone."""
        found, release_now = self.reservations.drop(request_id)
        if release_now:
            self._release(request_id)
        return found, release_now

    def PushBlocks(self, request_iterator, context: grpc.ServicerContext) -> kv_pb2.PushBlocksResponse:
        """The gRPC receiver, its push counted in flight on its reservation: the blocks must not
        be released (lease expiry, a drop) while it may still write."""
        t0 = time.monotonic()
        first = next(request_iterator, None)
        rid = first.header.request_id if first is not None and first.WhichOneof("kind") == "header" else None
        began = rid is not None and self.reservations.begin_push(rid)
        messages = itertools.chain([] if first is None else [first], request_iterator)
        try:
            resp = self.receiver.PushBlocks(messages, context)
        except BaseException:  # refused (validation, checksum, no reservation) or broken off
            self._on_outcome(False, 0, 0.0)
            raise
        finally:
            if began:
                self._end_push(rid)
        self._on_outcome(True, resp.bytes_written, time.monotonic() - t0)
        return resp

    def _on_received(self, r: ReceivedBlocks) -> None:
        if self.landing is not None:  # into the rank pools before the table (and Decode) sees it
            self.landing.scatter(r.request_id, r.block_ids, r.layers)
        self.reservations.received(r.request_id, r.layers, r.first_block_index, len(r.block_ids))
        self._on_received_hook(r)

    def _end_push(self, request_id: str) -> None:
        if self.reservations.end_push(request_id):  # dropped while the push wrote: free now
            try:
                self._release(request_id)
            except EngineStoppedError:
                pass  # the engine and its blocks are gone with it

    def _expire(self) -> None:
        period = max(0.05, min(1.0, self.config.reservation_lease_s / 4))
        while not self._stop.wait(period):
            for rid in self.reservations.expire():
                log.info("reservation of %r expired after %.1fs without being taken; releasing",
                         rid, self.config.reservation_lease_s)
                try:
                    self._release(rid)
                except EngineStoppedError:
                    return


class InboxReceiver(kv_pb2_grpc.KVTransferServicer):
    """KVTransfer with only PushBlocks, into an inbox: what a node that does not take prompts
    from prefill nodes serves to receive the prefixes it fetches (the rest is UNIMPLEMENTED)."""

    def __init__(self, inbox: KVInbox) -> None:
        self.inbox = inbox

    def PushBlocks(self, request_iterator, context):
        return self.inbox.PushBlocks(request_iterator, context)
