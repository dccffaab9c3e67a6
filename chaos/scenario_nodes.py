"""Scenarios whose fault hits nodes: kill, freeze, failing steps, every decode node down, a
slow node. Each body runs the batch, injects its fault once the streams are under way (or while
a prefill is in progress), undoes it, and returns the clients' logs and its own figures
(chaos/scenarios.py adds the common ones and the checks)."""
from __future__ import annotations

import time

from chaos import faults
from chaos.context import Outcome, Run, hold
from chaos.history import completed_once
from chaos.injectors import INJECTORS, busiest


def kill_decode(run: Run) -> Outcome:
    """Once every stream is under way, the decode actor serving most of them dies."""
    batch = run.batch()
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
    inj = INJECTORS["kill-decode"](run.cluster, busiest(run.cluster, "decode"),
                                   restart_timeout_s=run.opts.restart_timeout_s)
    run.progress(f"killed {inj.victim} (Ray restarts it)")
    logs = batch.join()
    inj.heal()
    return Outcome(logs, inj.at, {"killed": inj.victim, "restart_s": inj.info.get("restart_s")})


def _prefilling(run: Run) -> str | None:
    for nid, a in sorted(run.cluster.role_actors("prefill").items()):
        if faults.actor_stats(a).get("prefills_in_progress", 0):
            return nid
    return None


def _start_prefilling(run: Run):
    """The batch, once a prefill node is prefilling one of its prompts (the prompts are new to
    every node: the scenario runs before its reference)."""
    actors = run.cluster.role_actors("prefill")
    if not actors:
        raise ValueError("this scenario needs a prefill node")
    if run.opts.step_delay_s:  # a tiny model prefills in a blink: make the prefill last
        faults.set_step_delay(actors.values(), max(1.0, 20 * run.opts.step_delay_s))
    batch = run.batch()
    found: list[str] = []

    def prefilling() -> bool:
        nid = _prefilling(run)
        if nid is not None:
            found.append(nid)
        return bool(found)

    batch.wait_until(prefilling, "a prefill in progress")
    return batch, found[0]


def kill_prefill(run: Run) -> Outcome:
    """A prefill actor dies while it prefills: the decode node prefills those prompts."""
    batch, victim = _start_prefilling(run)
    inj = INJECTORS["kill-prefill"](run.cluster, victim, restart_timeout_s=run.opts.restart_timeout_s)
    run.progress(f"killed {victim} mid-prefill (Ray restarts it)")
    if run.opts.step_delay_s:
        faults.set_step_delay(run.cluster.role_actors("prefill").values(), run.opts.step_delay_s)
    logs = batch.join()
    inj.heal()
    return Outcome(logs, inj.at, {"killed": victim, "restart_s": inj.info.get("restart_s")})


def _freeze(run: Run, batch, victim: str, role: str) -> Outcome:
    inj = INJECTORS[f"freeze-{role}"](run.cluster, victim)
    run.progress(f"froze {victim} (SIGSTOP pid {inj.info['pid']}) for up to {run.opts.freeze_s} s")
    try:
        hold(batch, run.opts.freeze_s, inj.at)
    finally:
        thawed = inj.heal()
    run.progress(f"continued {victim}")
    logs = batch.join()
    return Outcome(logs, inj.at, {"frozen": victim, "frozen_s": round(thawed - inj.at, 3),
                                  "rejoined_s": inj.info.get("rejoined_s")})


def freeze_decode(run: Run) -> Outcome:
    """The decode node serving most streams stops (SIGSTOP) with its sockets open; continued
    after ``freeze_s``. Its streams must move within the detection bound; awake, its late
    tokens must not reach anyone twice."""
    batch = run.batch()
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
    return _freeze(run, batch, busiest(run.cluster, "decode"), "decode")


def freeze_prefill(run: Run) -> Outcome:
    """A prefill node stops (SIGSTOP) mid-prefill: the Prefill call's deadline moves the
    request (the decode node prefills it)."""
    batch, victim = _start_prefilling(run)
    try:
        return _freeze(run, batch, victim, "prefill")
    finally:
        if run.opts.step_delay_s:
            faults.set_step_delay(run.cluster.role_actors("prefill").values(), run.opts.step_delay_s)


def step_error(run: Run) -> Outcome:
    """The busiest decode node's engine steps raise, every one, until the batch is done: its
    requests end with INTERNAL ("engine step failed: ..."), the router moves each once; the
    node turns itself unhealthy after ``max_step_failures`` and Ray starts it again."""
    batch = run.batch()
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
    inj = INJECTORS["step-error"](run.cluster, busiest(run.cluster, "decode"),
                                  restart_timeout_s=run.opts.restart_timeout_s)
    run.progress(f"{inj.victim}: every engine step raises")
    logs = batch.join()
    inj.heal()
    return Outcome(logs, inj.at, {"faulted": inj.victim, "rejoined_s": inj.info.get("rejoined_s"),
                                  "restarted": inj.info.get("restarted")})


def all_decode_down(run: Run) -> Outcome:
    """Every decode actor dies while the first half of the streams runs (Ray restarts them).
    Once the router reports no decode node (health NOT_SERVING, ``detect_s``), a probe with no
    retry must be refused with UNAVAILABLE at once (``probe_unavailable_s``), not held until a
    node is back, and the second half is sent: refused too, each attempt within seconds
    (``unavailable_s``, the longest any client attempt took to fail; the SDK's own retries of a
    refused call included), and retried by its client. Sent any earlier, while the router
    still saw the nodes, they would be placed and held for a node like the running streams,
    and nothing would be refused to time. Once every decode node is back (``restart_s``), the
    first half is sent once more: each of those requests must complete
    (``sent_after_restart``, ``completed_after_restart``)."""
    cl = run.cluster
    first, second = run.halves()
    running = run.batch(first)
    running.wait_until(lambda: running.under_way(2), "every stream to be under way")
    victims = sorted(cl.role_actors("decode"))
    pids = {nid: faults.actor_pid(cl.actors[nid]) for nid in victims}
    fault_at = time.monotonic()
    for nid in victims:
        faults.kill_actor(cl.actors[nid])
    run.progress(f"killed every decode node: {', '.join(victims)}")
    gone_s, probe = _probe_when_down(cl, fault_at)
    waiting = run.batch(second)
    probe_s = probe["s"] if probe.get("outcome") == "UNAVAILABLE" else None
    logs = running.join() + waiting.join()
    from chaos.injectors import _new_life

    restart_s = max((_new_life(cl, nid, pids[nid], fault_at, run.opts.restart_timeout_s) or float("inf"))
                    for nid in victims)
    restart_s = None if restart_s == float("inf") else restart_s
    failed = [(a.ended - max(a.started, fault_at)) for log in logs for a in log.attempts
              if a.code == "UNAVAILABLE" and a.ended is not None and a.ended >= fault_at]
    seen = [a.ended - fault_at for log in logs for a in log.attempts
            if a.code is not None and a.ended is not None and a.ended >= fault_at]
    later = []
    if restart_s is not None:  # sent again: the same keys, judged against the same references
        run.progress(f"every decode node is back: {len(first)} requests again")
        later = run.batch(first).join()
    return Outcome(logs + later, fault_at, {
        "killed": victims, "restart_s": restart_s,
        "unavailable_s": round(max(failed), 3) if failed else None, "probe_unavailable_s": probe_s, "probe": probe,
        "client_errors": len(seen), "first_client_error_s": round(min(seen), 3) if seen else None,
        "sent_after_restart": len(later), "completed_after_restart": sum(map(completed_once, later))},
        detect_s=gone_s, own_detect=True)


def _probe_when_down(cl, fault_at: float) -> tuple[float | None, dict]:
    """Once the router says it has no decode node (health NOT_SERVING: seconds from the fault,
    None if not within 30 s), one request with no retry: from then on it must be refused at
    once, not held until a node comes back. -> (that time, the probe's outcome and seconds)."""
    import pdserve
    from chaos.cluster import wait_for

    with pdserve.Client(cl.address, timeout=5, retries=0) as c:
        gone_s = wait_for(lambda: not _serving(c), fault_at, 30.0, every_s=0.05)
    probe = {"after_s": gone_s}
    if gone_s is not None:
        t0 = time.monotonic()
        with pdserve.Client(cl.address, timeout=120, retries=0) as c:
            try:
                c.complete("Are you there?", max_tokens=2)
                probe["outcome"] = "completed"
            except pdserve.PdServeError as e:
                probe["outcome"] = e.code.name
        probe["s"] = round(time.monotonic() - t0, 3)
    return gone_s, probe


def _serving(client) -> bool:
    import pdserve

    try:
        return client.health()
    except pdserve.PdServeError:
        return False


SLOW_WAVE1_LONGER = 4  # slow-node's first wave: this many times --max-tokens


def wave1_size(n: int) -> int:
    return max(2, n // 2)


def slow_node_specs(specs: list) -> list:
    """slow-node's requests: the first wave's ``SLOW_WAVE1_LONGER`` times as long."""
    from dataclasses import replace

    k = wave1_size(len(specs))
    return [replace(s, max_tokens=s.max_tokens * SLOW_WAVE1_LONGER) if i < k else s for i, s in enumerate(specs)]


def slow_node(run: Run) -> Outcome:
    """One decode node's steps become 10x slower while it streams: placement must leave it out
    (router/placement.py without_stragglers, on the step times the nodes heartbeat) and place
    the next requests on the other decode node. ``detect_s``: until placement leaves it out."""
    from router.placement import SLOW_STEP_FACTOR, without_stragglers

    cl = run.cluster
    actors = cl.role_actors("decode")
    if len(actors) < 2:
        raise ValueError("slow-node needs at least two decode nodes")
    orch = cl.router.orchestrator
    factor = getattr(orch.policy, "slow_step_factor", SLOW_STEP_FACTOR)

    def decoders() -> list:
        return [n for n in orch.refresher.view.nodes if n.node_id in actors]

    def running() -> int:
        return sum(n.running for n in decoders())

    # Wave 1, one stream at a time once the router sees the previous one running, so that
    # every decode node streams (and has a measured step time) when the fault comes; its
    # requests are longer (slow_node_specs), so that both nodes still step while the router
    # judges the slowed one against its peer and its own recent best.
    first = wave1_size(len(run.specs))
    wave1 = []
    for spec in run.specs[:first]:
        b = run.batch([spec])
        wave1.append(b)
        b.wait_until(lambda: b.under_way(2) and (running() >= len(wave1) or b.logs[0].ended),
                     "a stream to be seen running")
    # The victim is the node the load figures alone would pick next, among those still
    # streaming: only a node that steps shows its new step time.
    busy = {nid for nid, a in actors.items() if faults.actor_stats(a).get("running", 0)}
    if not busy:
        raise RuntimeError("slow-node: the first wave ended before the slowdown (raise --max-tokens)")
    victim = min((n for n in decoders() if n.node_id in busy),
                 key=lambda n: (n.running + n.waiting, n.kv_usage, n.node_id))
    base = run.opts.step_delay_s or victim.step_s or 0.01
    run.progress(f"slowing {victim.node_id}: {base:.3f} -> {10 * base:.3f} s per step")
    fault_at = time.monotonic()
    # with a base delay the step is about that delay; else add 9 measured steps to each
    faults.set_step_delay([actors[victim.node_id]], 10 * base if run.opts.step_delay_s else 9 * base)
    from chaos.cluster import wait_for

    avoided_s = wait_for(lambda: all(n.node_id != victim.node_id for n in without_stragglers(decoders(), factor)),
                         fault_at, max(30.0, run.opts.restart_timeout_s))
    before = faults.actor_stats(actors[victim.node_id]).get("decodes", 0)
    wave2 = run.batch(run.specs[first:])
    wave2.wait_until(lambda: wave2.under_way(1), "the second wave to be placed")
    placed_on_slow = faults.actor_stats(actors[victim.node_id]).get("decodes", 0) - before
    faults.set_step_delay([actors[victim.node_id]], run.opts.step_delay_s)  # done: finish quickly
    logs = [log for b in wave1 for log in b.join()] + wave2.join()
    return Outcome(logs, fault_at, {"slowed": victim.node_id, "placed_on_slow_node": placed_on_slow,
                                    "requests_after_detection": len(run.specs) - first}, detect_s=avoided_s,
                   own_detect=True)
