"""host-loss: a whole Ray host dies with the node on it, mid-stream.

    before   head: prefill-0, ...     host 0 (a raylet that joined): decode-0    host 1: decode-1
    fault    the host of the decode node serving most streams: its raylet, agents and workers
             SIGKILLed at once (deploy/ray_hosts.py)
    after    the router moves that node's streams to the nodes left; Ray cannot restart it
             (its host is gone: the restart waits for a host that offers the resource); then
             every decode node is started on the head again and the other host stopped

Why a host per decode node: which node the router fills is its choice, not the scenario's; with
every decode node on a host of its own, the busiest node's host can be the one that dies.

What makes it different from kill-decode: nothing on the lost host says goodbye (no actor
exit, no raylet to report it; the GCS only learns it from missed health checks, seconds
later), and Ray does not bring the node back. The router must see the loss through its own
links (the streams' sockets reset) and the node's lease, within the frozen-node bound.
"""
from __future__ import annotations

import time

from chaos import faults
from chaos.context import Outcome, Run
from chaos.injectors import _new_life

HOST_RESOURCE = "pdserve_chaos_host_{}"  # only that joined raylet offers it: what pins a node there
HOST_START_TIMEOUT_S = 90.0


def _move_to_hosts(run: Run, hosts: dict) -> float | None:
    """Respawn each decode node on its joined host (node id -> JoinedRaylet, all at once);
    seconds until every one registered from there (None: not in time)."""
    from chaos.cluster import wait_for

    cluster = run.cluster
    t0 = time.monotonic()
    for i, nid in enumerate(sorted(hosts)):
        cluster.local.respawn(nid, {HOST_RESOURCE.format(i): 1})

    def there(nid: str) -> bool:
        try:
            pid = faults.actor_pid(cluster.actors[nid], timeout_s=5.0)
        except Exception:  # noqa: BLE001 - still starting: it answers nothing yet
            return False
        return pid in hosts[nid].pids()

    took = wait_for(lambda: all(there(n) for n in hosts) and set(hosts) <= set(cluster.registered()), t0,
                    HOST_START_TIMEOUT_S)
    run.progress(f"{', '.join(sorted(hosts))} moved to hosts of their own (after {took} s)")
    return took


class _GcsWatch:
    """Seconds from the kill until Ray's GCS lists the lost host dead (its health checks take
    seconds), watched from a thread; None if not by ``stop()``."""

    def __init__(self, host, since: float) -> None:
        import threading

        self.seen: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, since), name="chaos-gcs-watch", daemon=True)
        self._thread.start()

    def _run(self, host, since: float) -> None:
        while not self._stop.wait(0.5):
            try:
                if not host.alive_in_gcs():
                    self.seen = round(time.monotonic() - since, 3)
                    return
            except Exception:  # noqa: BLE001 - the GCS busy for a moment: look again
                continue

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join(5)
        return self.seen


def host_loss(run: Run) -> Outcome:
    """Every decode node on a host of its own; once the streams are under way, the host of the
    node serving the most of them dies."""
    from chaos.injectors import busiest
    from deploy.ray_hosts import JoinedRaylet, head_address

    cluster = run.cluster
    decoders = sorted(cluster.role_actors("decode"))
    gcs, ip = head_address()
    run.progress(f"starting {len(decoders)} more Ray hosts (raylets joining {gcs})")
    hosts: dict = {}
    try:
        for i, nid in enumerate(decoders):
            hosts[nid] = JoinedRaylet(gcs, ip, {"decode_pool": 1, HOST_RESOURCE.format(i): 1}).start(
                HOST_START_TIMEOUT_S)
        moved_s = _move_to_hosts(run, hosts)
        if moved_s is None:
            raise TimeoutError(f"chaos: the decode nodes did not register from their hosts in {HOST_START_TIMEOUT_S} s")
        pids = {nid: faults.actor_pid(cluster.actors[nid]) for nid in decoders}
        if run.opts.step_delay_s:  # new lives: the run's step delay (set on every node at its start) again
            faults.set_step_delay([cluster.actors[n] for n in decoders], run.opts.step_delay_s)
        cluster.settle()  # the router places on them (none left out after the moves)
        batch = run.batch()
        batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
        victim = busiest(cluster, "decode")
        lost = hosts[victim]
        at = lost.kill()
        gcs = _GcsWatch(lost, at)  # Ray's own view of the loss, without holding the run up
        run.progress(f"host of {victim} lost: {len(lost.killed)} processes SIGKILLed (pid {pids[victim]} among them)")
        logs = batch.join()
    except BaseException:
        for h in hosts.values():
            h.cleanup()
        raise
    # New lives on the head, as an operator replacing the host would do; the survivor's host goes too.
    t0 = time.monotonic()
    for nid in decoders:
        cluster.local.respawn(nid)
    for h in hosts.values():
        h.cleanup()
    back_s = max((_new_life(cluster, n, pids[n], t0, run.opts.restart_timeout_s) or float("inf")) for n in decoders)
    gcs_dead_s = gcs.stop()
    # The next scenario starts where every scenario starts: every node registered and placed on.
    cluster.settle()
    return Outcome(logs, at, {"lost_host_node": victim, "moved_s": moved_s, "killed_processes": len(lost.killed),
                              "victim_pid_killed": pids[victim] in lost.killed, "gcs_marked_dead_s": gcs_dead_s,
                              "restart_s": None if back_s == float("inf") else back_s})
