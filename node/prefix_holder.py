"""``KVHolder.PushPrefix``, served by every node: the KV of a prefix this node holds, pushed
into a reservation another node made for it (the fetching side is node/prefix_fetch.py).

    fetching node --PushPrefix(tokens, hashes, its reservation + token)--> this node
        trust       the caller's cluster-token MAC (when set); the node pushed to is a live
                    registered node, its data endpoints on its host (node/peer_trust.py)
        verify      hashes are the chained hashes of the tokens (this node's model); each
                    cached block's stored tokens equal the ones asked for
        pin         the longest leading run it holds, referenced so that neither eviction nor
                    a write touches it while it is read (node/prefix_kv.py)
        push        blocks [first, m) through the node's KV sender, fastest transport first
                    (shm, tcp, then gRPC PushBlocks), as a prefill node pushes to a decode node
        unpin       always; the blocks stay cached
    <-- blocks sent, bytes, transport, seconds

The push is bounded by the call's own deadline (the fetching node's bound) and by the
transports' limits; the receiver checks the reservation's token and every checksum before it
writes a byte, so a holder can only write where the fetching node let it.
"""
from __future__ import annotations

import logging
import time
import uuid

import grpc

from kv_transfer.transport import TransferError
from node.output_stream import EngineStoppedError
from node.peer_trust import PeerTrust
from node.prefix_kv import pin_prefix, unpin_prefix
from node.rpc_trace import traced_rpc
from node.tp_engine import send_view
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from telemetry import tracing
from telemetry.log_limit import RateLimitedLog
from tokens.block_hash import hash_prompt_blocks

log = logging.getLogger(__name__)
# Failed pushes, per status: the first logged, then a count at most every 10 s.
push_log = RateLimitedLog(log)
# A push to the fetching node may take at most this long, whatever the call's deadline.
PUSH_TIMEOUT_S = 60.0


class PrefixHolder(kv_pb2_grpc.KVHolderServicer):
    """PushPrefix on ``node`` (a NodeServer: its engine thread, KV sender, health, drain)."""

    def __init__(self, node) -> None:
        self.node = node
        self.num_pushes = 0
        self.num_failures = 0
        # Who may ask and be pushed to (node/peer_trust.py); the fetching side uses it too.
        self.trust = PeerTrust(node)

    @traced_rpc("node.PushPrefix", lambda r: {tracing.REQUEST_ID: r.request_id,
                                              "pdserve.fetch.blocks": len(r.block_hashes),
                                              "pdserve.dest_address": r.dest_address})
    def PushPrefix(self, request: kv_pb2.PushPrefixRequest, context: grpc.ServicerContext):
        node, eng = self.node, self.node.engine
        # First of all: a caller without the cluster token (when one is set) learns nothing of
        # this node's pool, pins nothing and makes it dial nobody.
        refusal = self.trust.check_caller(context.invocation_metadata(), request.SerializeToString(deterministic=True))
        if refusal is not None:
            context.abort(*refusal)
        if request.model_fingerprint != eng.fingerprint or request.block_size != eng.block_size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this node serves model {eng.fingerprint!r} with block_size {eng.block_size}; "
                          f"got {request.model_fingerprint!r} / {request.block_size}")
        problem = push_prefix_problem(request, eng.fingerprint, eng.num_blocks)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        # Only into a node of this cluster's registry, over data endpoints on its host: a
        # request must not turn this node into a dialler of any host:port.
        problem = self.trust.dest_problem(request.dest_address, request.dest_kv_endpoints)
        if problem:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        node.admit(context, accepted=True)  # unhealthy: UNAVAILABLE; it adds no engine work
        tokens, hashes = list(request.token_ids), list(request.block_hashes)
        first = request.first_block_index
        pin_id = f"push-{uuid.uuid4().hex}"
        try:
            pinned = node.aengine.run(lambda e: pin_prefix(e, pin_id, hashes, tokens, request.cache_salt))
        except Exception as err:  # the engine is gone or refused: nothing is pinned
            _unpin(node, pin_id)  # whatever the export took before it failed
            context.abort(grpc.StatusCode.UNAVAILABLE, f"could not pin the prefix: {err}")
        try:
            if len(pinned.block_ids) <= first:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"this node holds {len(pinned.block_ids)} of the {len(hashes)} blocks asked for, "
                              f"none after block {first}")
            result = self._push(request, pinned.block_ids, hashes, context)
        finally:
            _unpin(node, pin_id)
        self.num_pushes += 1
        return kv_pb2.PushPrefixResponse(blocks_sent=result.blocks_written, bytes_sent=result.bytes_written,
                                         transport=result.transport, transfer_s=result.seconds,
                                         onboarded_host_blocks=pinned.host_blocks,
                                         onboarded_disk_blocks=pinned.disk_blocks, onboard_s=pinned.onboard_s)

    def _push(self, request: kv_pb2.PushPrefixRequest, table: list[int], hashes: list[int], context):
        node, eng = self.node, self.node.engine
        first, m = request.first_block_index, len(table)
        left = context.time_remaining()
        timeout = PUSH_TIMEOUT_S if left is None else max(0.001, min(PUSH_TIMEOUT_S, left))
        t0 = time.monotonic()
        # Tensor parallel: from the blocks gathered with all their heads (node/tp_engine.py).
        pool, table = send_view(eng, node.tp, table, min(first, m))
        try:
            result = node.kv_sender.push(
                request.dest_address, pool, request_id=request.request_id, fingerprint=eng.fingerprint,
                src_block_ids=table, block_hashes=hashes[:m], num_tokens=m * eng.block_size,
                dest_block_ids=list(request.dest_block_ids)[: m - first],
                token=self.trust.push_token(request.token),  # a nonce: the token is derived (cluster_token.py)
                skip_leading_blocks=first, timeout=timeout, endpoints=tuple(request.dest_kv_endpoints))
        except TransferError as err:
            self.num_failures += 1
            push_log.warning(f"PushPrefix {err.code.name}", "prefix push of %r to %s failed: %s",
                              request.request_id, request.dest_address, err)
            context.abort(err.code, f"prefix push to {request.dest_address} failed: {err.details}")
        return result if result.seconds else result._replace(seconds=time.monotonic() - t0)


def _unpin(node, pin_id: str) -> None:
    try:
        node.aengine.run(lambda e: unpin_prefix(e, pin_id))
    except (EngineStoppedError, TimeoutError):
        pass  # the engine and its blocks are gone with it (or it is wedged, and unhealthy soon)


def push_prefix_problem(request: kv_pb2.PushPrefixRequest, fingerprint: str, pool_blocks: int) -> str:
    """Why a PushPrefix request can never be served ("" if it can), checked before anything is
    pinned: the shapes of its lists, and its hashes against its tokens for this model."""
    if not request.request_id:
        return "request_id is required"
    if not request.dest_address:
        return "dest_address is required"
    n = len(request.block_hashes)
    bs = request.block_size
    if n == 0:
        return "block_hashes is required (the prefix's blocks)"
    if n > pool_blocks:
        return f"{n} blocks asked for but this node's pool has {pool_blocks}"
    if len(request.token_ids) != n * bs:
        return f"token_ids has {len(request.token_ids)} tokens, expected {n} blocks x {bs} = {n * bs}"
    if request.first_block_index >= n:
        return f"first_block_index ({request.first_block_index}) must be below the {n} blocks asked for"
    if len(request.dest_block_ids) != n - request.first_block_index:
        return (f"dest_block_ids has {len(request.dest_block_ids)} ids, expected one per block after "
                f"first_block_index: {n - request.first_block_index}")
    salt = request.cache_salt  # the chain's: another salt's blocks are never sent
    if hash_prompt_blocks(list(request.token_ids), bs, fingerprint.encode(), salt=salt) != list(request.block_hashes):
        return "block_hashes are not the chained hashes of token_ids for this model"
    return ""
