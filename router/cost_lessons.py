"""What one prefill response teaches the router's cost book: the KV transfer it made (prefill
node -> decode node) and the prefix fetch before it (holder -> prefill node), including the
holder's onboarding from its lower tiers. The orchestrator calls these after every Prefill."""
from __future__ import annotations

from protos.pdserve.v1 import kv_pb2
from router.cost_model import CostBook


def learn_transfer(costs: CostBook, src: str, dst: str, resp: kv_pb2.PrefillResponse, block_size: int) -> None:
    """Teach the cost book one prefill's KV transfer from ``src`` to ``dst``. A node older than
    the transports names none, and could only push over gRPC; one that does not stream (or does
    not report it) leaves ``kv_streamed`` false, and the book then counts the whole transfer as
    waited for. ``transfer_s`` times only the attempts that landed, so a push that fell back
    (``kv_fallbacks``) is a clean sample of the transport that carried it; streamed ones teach
    the exposed share only (CostBook.add_transfer)."""
    costs.add_transfer(src, dst, resp.bytes_sent, resp.transfer_s, num_tokens=resp.blocks_sent * block_size,
                       transport=resp.transport or "grpc", exposed_s=resp.transfer_exposed_s,
                       streamed=resp.kv_streamed, pushes=resp.kv_pushes)


def learn_fetch(costs: CostBook, holder: str, dst: str, resp: kv_pb2.PrefillResponse, fetch_tokens: int) -> None:
    """Teach the cost book one prefix fetch from ``holder`` into prefill node ``dst``: what the
    prefill waited for the blocks (``fetch_s``, less the holder's onboarding from its lower
    tiers, which the book fits per node and tier) for the bytes that came. A fetch that ran out
    its bound teaches the pair that the ``fetch_tokens`` it was sent for take at least that
    long; a failed one teaches nothing (the holder may be gone: a failure is not a price)."""
    if resp.fetch_outcome == "ok":
        nbytes = resp.fetch_bytes
    elif resp.fetch_outcome == "timeout":
        nbytes = fetch_tokens * costs.kv_bytes_per_token
    else:
        return
    costs.add_transfer(holder, dst, nbytes, max(resp.fetch_s - resp.fetch_onboard_s, 0.0),
                       transport=resp.fetch_transport or "grpc", pushes=1)
    host, disk = resp.fetch_onboarded_host_blocks, resp.fetch_onboarded_disk_blocks
    if resp.fetch_onboard_s > 0 and bool(host) != bool(disk) and resp.fetch_blocks:
        per_block = resp.fetch_bytes / resp.fetch_blocks
        costs.add_onboard(holder, "host" if host else "disk", per_block * (host or disk), resp.fetch_onboard_s)
