"""Fetching a prompt's leading blocks from the node that holds them, before prefilling.

The router asks for it (``PrefillRequest.fetch``) when its cost model says moving the blocks
beats computing them. This node::

    trust     the holder: a live node of this cluster's registry serving this model, else refused
              before anything is reserved or dialled (node/peer_trust.py)
    reserve   blocks for the prefix's n leading blocks: those it caches itself are pinned, the
              rest reserved in its KVInbox (node/kv_inbox.py), for the whole bound
    ask       the holder's PushPrefix (node/prefix_holder.py) with the tokens, hashes, the
              reserved ids and a nonce (with the cluster token's MAC when one is set); the
              holder pushes them over the fastest transport, into this node's data port or its
              PushBlocks, each checked on arrival against the token derived from the nonce
              (security/cluster_token.py): only a cluster member can write here
    close     the reservation, to every push at once, whatever the answer
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
# A fetch's reservation lives this much past the fetch's bound: the fetch closes it itself by
# then; the lease only frees it should the fetching thread never come back.
FETCH_LEASE_MARGIN_S = 1.0


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
        self.trust = node.holder.trust  # the node's peer checks and cluster token (node/peer_trust.py)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    @staticmethod
    def hold_id(request_id: str) -> str:
        return f"{request_id}/fetch"

    def fetch(self, request_id: str, prompt: list[int], spec: kv_pb2.KVFetch, cache_salt: bytes = b"") -> FetchOutcome:
        """Bring the prompt's leading ``spec.num_blocks`` blocks here from ``spec.holder_address``
        (less what this node holds already; blocks of the chain of ``cache_salt``, the request's).
        Never raises; call ``done(request_id)`` once the prefill no longer needs the blocks,
        whatever the outcome."""
        t0 = time.monotonic()
        bound = fetch_timeout(spec.timeout_s)
        try:
            out = self._fetch(request_id, prompt, spec, t0 + bound, cache_salt)
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

    def _fetch(self, request_id: str, prompt: list[int], spec: kv_pb2.KVFetch, deadline: float,
               cache_salt: bytes = b"") -> FetchOutcome:
        node, eng = self.node, self.node.engine
        bs = eng.block_size
        n = min(spec.num_blocks, (len(prompt) - 1) // bs)  # one token is always computed
        if n <= 0 or not spec.holder_address:
            return FetchOutcome("held")
        # Only from a live node of this cluster's registry, before anything is reserved or
        # dialled: a Prefill call may name any address, and what lands here is served to every
        # later request as cached KV, which no check of the bytes could tell from a forgery.
        problem = self.trust.holder_problem(spec.holder_address, eng.fingerprint)
        if problem:
            fetch_log.warning("prefix fetch refused", "prefix fetch of %r refused: %s; computing it",
                              request_id, problem)
            return FetchOutcome("refused")
        tokens = prompt[: n * bs]
        hashes = hash_prompt_blocks(tokens, bs, eng.fingerprint.encode(), salt=cache_salt)
        hold = self.hold_id(request_id)
        got = self._reserve(hold, hashes, tokens, deadline)
        if isinstance(got, str):
            return FetchOutcome(got)  # no room for the blocks now, or no answer in time: compute
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
        # The holder gets a nonce; the reservation admits only the token derived from it with the
        # cluster token (the nonce itself without one), so a holder that is no member cannot push.
        nonce = new_token()
        # Its lease covers the fetch's whole bound (up to MAX_TIMEOUT_S), not only the decode
        # role's wait (reservation_lease_s): a slow but healthy holder still finds its blocks.
        lease_s = max(inbox.reservations.lease_s, deadline - time.monotonic() + FETCH_LEASE_MARGIN_S)
        inbox.reservations.add(hold, Reservation(held, tuple(dest), tuple(hashes[held:]), self.trust.push_token(nonce)),
                               tuple(tokens), lease_s=lease_s)
        try:
            resp = self._ask(spec.holder_address, kv_pb2.PushPrefixRequest(
                request_id=hold, model_fingerprint=eng.fingerprint, block_size=bs, token_ids=tokens,
                block_hashes=hashes, first_block_index=held, dest_block_ids=dest,
                dest_address=node.address, dest_kv_endpoints=inbox.kv_endpoints(), token=nonce,
                cache_salt=cache_salt), deadline)
        finally:
            # Closed to every push at once, whatever the answer: a late (or a second) push must
            # not write into blocks that are about to become shared cache.
            landed = self._close(hold)
        if not isinstance(resp, kv_pb2.PushPrefixResponse):
            return FetchOutcome(resp)
        if not landed:
            return FetchOutcome("failed")
        node.aengine.run(lambda e: register_prefix(e, hold, tokens, held + landed, cache_salt))
        block_bytes = resp.bytes_sent // max(1, resp.blocks_sent)
        return FetchOutcome("ok", landed, block_bytes * landed, transport=resp.transport, transfer_s=resp.transfer_s,
                            onboarded_host_blocks=resp.onboarded_host_blocks,
                            onboarded_disk_blocks=resp.onboarded_disk_blocks, onboard_s=resp.onboard_s)

    def _reserve(self, hold: str, hashes: list[int], tokens: list[int], deadline: float):
        """``reserve_prefix`` on the engine thread, waited for until ``deadline`` -> its result,
        or the outcome label: "refused" (no room now), "timeout". A reservation must not outlive
        a wait given up: a command not run yet is cancelled (the loop skips it), and one already
        running is undone by a release queued right behind it (commands run in order)."""
        aengine = self.node.aengine
        future = aengine.call(lambda e: reserve_prefix(e, hold, hashes, tokens))
        try:
            got = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            if not future.cancel():
                aengine.call(lambda e: e.release_kv(hold))
            return "timeout"
        return "refused" if got is None else got

    def _ask(self, address: str, request: kv_pb2.PushPrefixRequest, deadline: float):
        """PushPrefix on the holder -> its response, or the outcome label of its failure."""
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout"
        stub = kv_pb2_grpc.KVHolderStub(self._channel(address))
        # The MAC covers every field: the holder refuses a request changed on the way.
        metadata = self.trust.sign(request.SerializeToString(deterministic=True))
        try:
            return stub.PushPrefix(request, timeout=left, metadata=metadata)
        except grpc.RpcError as err:
            outcome = outcome_of(err.code())
            fetch_log.warning(f"prefix fetch {err.code().name}", "prefix fetch of %r from %s: %s (%s); computing it",
                              request.request_id, address, err.code().name, err.details())
            return outcome

    def _close(self, hold: str) -> int:
        """Close the fetch's reservation to every push -> its leading blocks that landed in
        every layer. Blocks a push is still writing into are released by that push's end
        (KVInbox), never here, and then not by ``done`` either; nothing of them counts."""
        inbox = self.node.inbox
        landed = inbox.reservations.close_prefix(hold)
        if landed is None:
            with self._lock:
                self._held.discard(hold)
            return 0
        if inbox.landing is not None:  # no push writes into its landing slots any more
            inbox.landing.free(hold)
        return landed

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                # Keepalive: a frozen holder fails the call within seconds, not at its deadline.
                ch = self._channels[address] = channel(address, self.node.config.tls,
                                                       grpc_options() + keepalive_channel_options())
            return ch
