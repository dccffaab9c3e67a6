"""Scenarios whose fault hits what connects the nodes: the router's link to a decode node, Redis,
the KV transfers, the router itself."""
from __future__ import annotations

import time

from chaos import faults
from chaos.context import Outcome, Run, hold
from chaos.injectors import INJECTORS, busiest


def partition(run: Run) -> Outcome:
    """The router's link to the decode node serving most streams stops forwarding (its
    loopback proxy goes silent: no byte passes, no socket closes) for ``partition_s``. Its
    streams must move within the detection bound, by keepalive or the stream's progress
    deadline: nothing else tells the router."""
    batch = run.batch()
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
    inj = INJECTORS["partition"](run.cluster, busiest(run.cluster, "decode"))
    run.progress(f"cut {inj.victim} off from the router (its proxy is silent) for up to {run.opts.partition_s} s")
    try:
        hold(batch, run.opts.partition_s, inj.at)
    finally:
        healed = inj.heal()
    run.progress(f"{inj.victim}'s link forwards again")
    logs = batch.join()
    return Outcome(logs, inj.at, {"partitioned": inj.victim, "partition_s": round(healed - inj.at, 3)})


def degraded(cluster) -> bool | None:
    """Whether the router says it serves without Redis (None: it does not say)."""
    router = cluster.router
    refresher = router.orchestrator.refresher if router is not None and router.orchestrator is not None else None
    if refresher is None or not hasattr(refresher, "degraded"):
        return None
    return refresher.degraded is not None


def redis_hang(run: Run) -> Outcome:
    """redis-server stops (SIGSTOP: connections open, nothing answers) while the first half of
    the streams runs; the second half is sent during the hang; Redis continues after
    ``freeze_s``. The router must keep serving by its last node view and say so
    (``degraded``); ``detect_s``: until it says so, ``recovered_s``: from the thaw until it no
    longer does."""
    from chaos.cluster import wait_for

    first, second = run.halves()
    running = run.batch(first)
    running.wait_until(lambda: running.under_way(1), "every stream to be under way")
    inj = INJECTORS["redis-hang"](run.cluster)
    run.progress(f"froze redis-server (pid {inj.info['pid']}) for {run.opts.freeze_s} s")
    try:
        waiting = run.batch(second)  # placed without the index
        seen = wait_for(lambda: degraded(run.cluster) is True, inj.at, run.opts.freeze_s, every_s=0.05)
        hold(waiting, run.opts.freeze_s, inj.at)
    finally:
        thawed = inj.heal()
    run.progress("continued redis-server")
    recovered = wait_for(lambda: degraded(run.cluster) is False, thawed, 30.0, every_s=0.1)
    logs = running.join() + waiting.join()
    return Outcome(logs, inj.at, {"hung_s": round(thawed - inj.at, 3), "recovered_s": recovered},
                   detect_s=seen, own_detect=True)


def redis_restart(run: Run) -> Outcome:
    """Redis dies before the batch starts (placement by the last known load, no index) and comes
    back empty mid-way: the nodes register again and rebuild the index from their snapshots."""
    from chaos.cluster import wait_for
    from deploy.redis_server import RedisServer

    cl = run.cluster
    if cl.redis is None:
        raise ValueError("redis-restart needs the cluster's own redis-server (not --redis-url)")
    blocks_before = cl.index_blocks()
    old = cl.redis
    run.progress("stopping redis-server")
    old.stop()
    fault_at = time.monotonic()
    batch = run.batch()
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way without Redis")
    run.progress("starting redis-server again, empty")
    cl.local.redis = RedisServer(port=old.port, host=old.host, password=old.password).start()
    back_at = time.monotonic()
    logs = batch.join()
    wanted = set(cl.actors)
    registered_s = wait_for(lambda: wanted <= set(cl.registered()), back_at, run.opts.restart_timeout_s or 60.0)
    # Each node resyncs its entries from its snapshot right after its first heartbeat finds
    # them gone; nothing was evicted meanwhile, so the rebuilt index holds at least as many.
    rebuilt_s = wait_for(lambda: cl.index_blocks() >= blocks_before, back_at, run.opts.restart_timeout_s or 60.0)
    return Outcome(logs, fault_at, {"reregistered_s": registered_s, "index_rebuilt_s": rebuilt_s,
                                    "index_blocks_before": blocks_before, "index_blocks_after": cl.index_blocks()})


def _transfer_figures(cluster) -> dict[str, int]:
    """KV transfers the decode nodes refused so far (``refused``), and those the prefill nodes'
    KV fault damaged, per transport (``shm``, ``tcp``, ``grpc``)."""
    out = {"refused": sum(int(faults.actor_stats(a).get("transfer_failures", 0))
                          for a in cluster.role_actors("decode").values())}
    for a in cluster.role_actors("prefill").values():
        for k, v in (faults.actor_stats(a).get("kv_fault_pushes") or {}).items():
            out[k] = out.get(k, 0) + int(v)
    return out


def corrupt_kv(run: Run) -> Outcome:
    """Every prefill node damages each KV transfer after its checksum, on every transport it
    tries (shared memory, TCP data stream, gRPC: prefill_node/faults.py): the decode nodes
    refuse each, write nothing, and the prompts are recomputed. Runs before its reference: a
    prompt the decode node has cached needs no transfer to damage. ``damaged_<transport>``:
    transfers damaged on each, ``transfers_damaged`` their sum (every transport the senders
    name), ``transfers_refused``: refusals on the decode nodes (their ``transfer_failures``,
    the count behind ``pdserve:kv_transfer_failures_total``). Every damaged transfer must be
    refused: one accepted is a corrupt KV cache, one refused that was not damaged a false alarm."""
    before = _transfer_figures(run.cluster)
    inj = INJECTORS["corrupt-kv"](run.cluster)
    try:
        logs = run.batch().join()
    finally:
        inj.heal()
    after = _transfer_figures(run.cluster)
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    extra = {"transfers_refused": delta.pop("refused"), "transfers_damaged": sum(delta.values())}
    extra.update({f"damaged_{t}": delta.get(t, 0) for t in ("shm", "tcp", "grpc")})
    return Outcome(logs, inj.at, extra, detect_s=None, own_detect=True)


def restart_router(run: Run) -> Outcome:
    """The router runs as its own process (``python -m frontend.server``, as in the chart) and is
    SIGKILLed while the first half of the streams (gRPC and HTTP) runs; the second half is sent
    while it is down; it starts again on the same ports after ``router_down_s``. The SDK
    retries the refused calls itself (``retried_before_start``); a cut stream is lost unless
    the client's retry of the whole request completes it (``interrupted`` counts the cuts)."""
    cl = run.cluster
    first, second = run.halves()
    with cl.router_process():
        running = run.batch(first)
        running.wait_until(lambda: running.under_way(2), "every stream to be under way")
        inj = INJECTORS["restart-router"](cl)
        run.progress(f"killed the router process (SIGKILL); starting it again in {run.opts.router_down_s} s")
        waiting = run.batch(second)
        time.sleep(run.opts.router_down_s)
        back_at = inj.heal()
        logs = running.join() + waiting.join()
    cut = [log for log in logs[: len(first)] if any(a.code is not None and a.tokens for a in log.attempts)]
    # Sent while it was down and completed: by the SDK's own retries (gRPC), by the client's
    # (HTTP, which has no SDK).
    later = [log for log in logs[len(first):] if log.last is not None and log.last.completed]
    retried = [log for log in later if log.last.sdk_attempts > 1]
    http_retried = [log for log in later if len(log.attempts) > 1 and log.key.endswith("-http")]
    errors = [a.ended - inj.at for log in logs for a in log.attempts if a.code is not None and a.ended is not None]
    return Outcome(logs, inj.at, {"router_down_s": round(back_at - inj.at, 3), "interrupted": len(cut),
                                  "retried_before_start": len(retried), "http_retried": len(http_retried)},
                   detect_s=round(min(errors), 3) if errors else None, own_detect=True)



def replica_specs(specs: list) -> list:
    """restart-router-replicas' requests: the first half (``Run.halves``) twice as long, so the
    victim still holds streams when its record (refreshed every 0.1 s) has said so."""
    from dataclasses import replace

    return [replace(s, max_tokens=s.max_tokens * 2) if i % 4 in (0, 3) else s for i, s in enumerate(specs)]


def restart_router_replicas(run: Run) -> Outcome:
    """Two router processes on one port (SO_REUSEPORT, sharing their load through Redis, as
    `pdserve up --routers 2`); the one with the most requests in flight by the records they
    publish is SIGKILLed while the first half of the streams runs, the second half is sent while
    it is down (the kernel hands every new connection to the survivor), and it starts again
    after ``router_down_s``. A cut stream's retry reconnects and lands on the survivor: nothing
    is lost. ``victim_inflight``: the victim's requests by its last record before the kill."""
    cl = run.cluster
    first, second = run.halves()
    with cl.router_replicas(2) as procs:
        running = run.batch(first)
        running.wait_until(lambda: running.under_way(2), "every stream to be under way")
        seen: dict = {}

        def busy() -> bool:
            seen.update(cl.router_records())
            return any(r["inflight"] for r in seen.values())

        running.wait_until(busy, "a replica's record to show requests in flight")
        rec = max(seen.values(), key=lambda r: r["inflight"])
        victim = next(p for p in procs if p.pid == rec["pid"])
        at = victim.kill()
        run.progress(f"killed router replica pid {rec['pid']} (SIGKILL, {rec['inflight']} in flight); the other "
                     f"serves; back in {run.opts.router_down_s} s")
        waiting = run.batch(second)
        time.sleep(run.opts.router_down_s)
        victim.start()
        back_at = time.monotonic()
        logs = running.join() + waiting.join()
    cut = [log for log in logs[: len(first)] if any(a.code is not None and a.tokens for a in log.attempts)]
    errors = [a.ended - at for log in logs for a in log.attempts if a.code is not None and a.ended is not None]
    return Outcome(logs, at, {"router_down_s": round(back_at - at, 3), "interrupted": len(cut),
                              "victim_inflight": rec["inflight"]},
                   detect_s=round(min(errors), 3) if errors else None, own_detect=True)
