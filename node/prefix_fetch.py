"""Fetching a prompt's leading blocks from the node that holds them, before prefilling.

The router asks for it (``PrefillRequest.fetch``) when its cost model says moving the blocks
beats computing them. This node::

    reserve   blocks for the prefix's n leading blocks: those it caches itself are pinned, the
              rest reserved under a fresh token in its KVInbox (node/kv_inbox.py)
    ask       the holder's PushPrefix (node/prefix_holder.py) with the tokens, hashes, the
              reserved ids and the token; the holder pushes them over the fastest transport,
              into this node's data port or its PushBlocks, each checked on arrival
    register  the leading blocks that landed in every layer, hashed from this node's own
              tokens, as cached blocks: the prefill's prefix lookup then hits them
    release   after the prefill (``done``); they stay cached

Every wait is bounded by the fetch's ``timeout_s`` (the router's bound from its cost model,
clamped to [MIN_TIMEOUT_S, MAX_TIMEOUT_S]). A fetch that fails, is refused, arrives corrupt or
takes longer is computed instead: ``fetch`` never raises, it reports an outcome (the
``pdserve:kv_fetch_total`` label). Blocks a push may still be writing into are never given
back before that push ends (``KVInbox``): a holder frozen mid-push costs its reserved blocks
until the receiver's stall limit, never a wrong block.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc

from kv_transfer.validate import Reservation, new_token
from node.prefix_kv import register_prefix, reserve_prefix
from protos.conventions import grpc_options, keepalive_channel_options
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from security.tls import channel
from telemetry.log_limit import RateLimitedLog
from tokens.block_hash import hash_prompt_blocks

log = logging.getLogger(__name__)
fetch_log = RateLimitedLog(log)

# The bounds a fetch's timeout is clamped to: below the lower one a healthy holder on a busy
# machine misses it, above the upper one a prefill waits longer than computing would take.
MIN_TIMEOUT_S = 0.2
MAX_TIMEOUT_S = 30.0
DEFAULT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True, slots=True)
class FetchOutcome:
    """What one fetch did (PrefillResponse.fetch_*). ``outcome``: "ok" and "held" reuse the
    prefix, "failed", "timeout", "corrupt", "refused" compute it."""

    outcome: str
    blocks: int = 0  # blocks that landed and were registered
    bytes: int = 0
    seconds: float = 0.0  # reserve to registered (or given up)
    transport: str = ""
    transfer_s: float = 0.0  # the holder's push alone
    onboarded_host_blocks: int = 0
    onboarded_disk_blocks: int = 0
    onboard_s: float = 0.0

    @property
    def reused(self) -> bool:
        return self.outcome in ("ok", "held")

    def fill(self, resp: kv_pb2.PrefillResponse) -> None:
        resp.fetch_outcome = self.outcome
        resp.fetch_blocks, resp.fetch_bytes, resp.fetch_s = self.blocks, self.bytes, self.seconds
        resp.fetch_transport, resp.fetch_transfer_s = self.transport, self.transfer_s
        resp.fetch_onboarded_host_blocks = self.onboarded_host_blocks
        resp.fetch_onboarded_disk_blocks = self.onboarded_disk_blocks
        resp.fetch_onboard_s = self.onboard_s


def outcome_of(code: grpc.StatusCode) -> str:
    """The outcome label of a PushPrefix that failed with ``code``."""
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code is grpc.StatusCode.DATA_LOSS:
        return "corrupt"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                grpc.StatusCode.CANCELLED, grpc.StatusCode.NOT_FOUND):
        return "failed"
    return "refused"


def fetch_timeout(asked_s: float) -> float:
    """The bound a fetch runs under: the router's (0: none given), clamped."""
    if not asked_s > 0:
        return DEFAULT_TIMEOUT_S
    return min(MAX_TIMEOUT_S, max(MIN_TIMEOUT_S, asked_s))


class PrefixFetcher:
    """A node's prefix fetches. Thread-safe: each Prefill handler fetches for its own request.
    ``node`` is a NodeServer with an ``inbox`` (KVInbox)."""

    def __init__(self, node) -> None:
        self.node = node
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._held: set[str] = set()  # hold ids whose release is ours (done), not a push's end

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    @staticmethod
    def hold_id(request_id: str) -> str:
        return f"{request_id}/fetch"

    def fetch(self, request_id: str, prompt: list[int], spec: kv_pb2.KVFetch) -> FetchOutcome:
        """Bring the prompt's leading ``spec.num_blocks`` blocks here from ``spec.holder_address``
        (less what this node holds already). Never raises; call ``done(request_id)`` once the
        prefill no longer needs the blocks, whatever the outcome."""
        t0 = time.monotonic()
        bound = fetch_timeout(spec.timeout_s)
        try:
            out = self._fetch(request_id, prompt, spec, t0 + bound)
        except Exception:  # a fetch is an optimisation: anything unexpected computes instead
            log.exception("prefix fetch of %r from %s failed unexpectedly", request_id, spec.holder_address)
            out = FetchOutcome("failed")
        out = dataclasses.replace(out, seconds=time.monotonic() - t0)
        self.node.metrics.fetch.record(out.outcome, out.bytes, out.seconds)
        return out

    def done(self, request_id: str) -> None:
        """The prefill is over: give the fetched blocks back to the pool (they stay cached)."""
        hold = self.hold_id(request_id)
        with self._lock:
            ours = hold in self._held
            self._held.discard(hold)
        if ours:
            self.node.aengine.release_kv(hold)

    def _fetch(self, request_id: str, prompt: list[int], spec: kv_pb2.KVFetch, deadline: float) -> FetchOutcome:
        node, eng = self.node, self.node.engine
        bs = eng.block_size
        n = min(spec.num_blocks, (len(prompt) - 1) // bs)  # one token is always computed
        if n <= 0 or not spec.holder_address:
            return FetchOutcome("held")
        tokens = prompt[: n * bs]
        hashes = hash_prompt_blocks(tokens, bs, eng.fingerprint.encode())
        hold = self.hold_id(request_id)
        got = node.aengine.run(lambda e: reserve_prefix(e, hold, hashes, tokens))
        if got is None:
            return FetchOutcome("refused")  # no room for the blocks now: compute
        held, dest = got
        if not dest:
            return FetchOutcome("held")
        with self._lock:
            self._held.add(hold)
        inbox = node.inbox
        wire = inbox.wire_blocks(hold, dest)  # a TP node's landing slots (kv_regroup.py LandingArea)
        if wire is None:
            return FetchOutcome("refused")  # no landing room now: compute (``done`` releases the hold)
        dest = list(wire)
        token = new_token()
        inbox.reservations.add(hold, Reservation(held, tuple(dest), tuple(hashes[held:]), token), tuple(tokens))
        try:
            resp = self._ask(spec.holder_address, kv_pb2.PushPrefixRequest(
                request_id=hold, model_fingerprint=eng.fingerprint, block_size=bs, token_ids=tokens,
                block_hashes=hashes, first_block_index=held, dest_block_ids=dest,
                dest_address=node.address, dest_kv_endpoints=inbox.kv_endpoints(), token=token), deadline)
            landed = inbox.reservations.complete_prefix(hold) if isinstance(resp, kv_pb2.PushPrefixResponse) else 0
            if landed:
                node.aengine.run(lambda e: register_prefix(e, hold, tokens, held + landed))
        finally:
            self._forget(hold)
        if not isinstance(resp, kv_pb2.PushPrefixResponse):
            return FetchOutcome(resp)
        if not landed:
            return FetchOutcome("failed")
        block_bytes = resp.bytes_sent // max(1, resp.blocks_sent)
        return FetchOutcome("ok", landed, block_bytes * landed, transport=resp.transport, transfer_s=resp.transfer_s,
                            onboarded_host_blocks=resp.onboarded_host_blocks,
                            onboarded_disk_blocks=resp.onboarded_disk_blocks, onboard_s=resp.onboard_s)

    def _ask(self, address: str, request: kv_pb2.PushPrefixRequest, deadline: float):
        """PushPrefix on the holder -> its response, or the outcome label of its failure."""
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        stub = kv_pb2_grpc.KVHolderStub(self._channel(address))
        try:
            return stub.PushPrefix(request, timeout=left)
        except grpc.RpcError as err:
            outcome = outcome_of(err.code())
            fetch_log.warning(f"prefix fetch {err.code().name}", "prefix fetch of %r from %s: %s (%s); computing it",
                              request.request_id, address, err.code().name, err.details())
            return outcome

    def _forget(self, hold: str) -> None:
        """Take the fetch's reservation off the table. Blocks a push may still write into are
        released by that push's end (KVInbox), never here, and then not by ``done`` either."""
        inbox = self.node.inbox
        found, release_now = inbox.reservations.drop(hold)
        if found and not release_now:
            with self._lock:
                self._held.discard(hold)
        elif inbox.landing is not None:  # no push writes into its landing slots any more
            inbox.landing.free(hold)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                # Keepalive: a frozen holder fails the call within seconds, not at its deadline.
                ch = self._channels[address] = channel(address, self.node.config.tls,
                                                       grpc_options() + keepalive_channel_options())
            return ch
