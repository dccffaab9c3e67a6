"""`pdserve chaos --nemesis SECONDS`: faults drawn at random, on a random schedule, over a steady
stream of seeded requests; at the end, the history check.

    t=0 ......... t=SECONDS                       then: every fault healed, every node back
    clients   ====================== (``concurrency`` threads, one request after another,
                                      drawn in turn from a pool of greedy and sampled specs)
    nemesis     [freeze-decode]  [partition]   [redis-hang] ...   (one fault at a time, drawn
                 from a shuffled bag: inject on a random victim, hold 2-8 s, heal, wait until
                 every node is registered, a quiet 2-6 s gap)

The router runs as its own process for the whole run (restart-router SIGKILLs it). The
reference is the pool of specs run once more, fault-free, on the healed cluster. The history
check (chaos/history.py) then holds every request to: completed exactly once with the
reference's tokens, or failed with a typed error after its retry budget; ``lost`` and
``duplicated_tokens`` must be 0. The schedule is ``plan``'s, from ``--seed``: a run can be
repeated with the same faults in the same order (their effects depend on timing).

A run passes only if it tested something (``NEMESIS_EXPECTATIONS``): every scheduled fault
was injected (an injection that raises is recorded in ``injection_failures`` and fails the
run), every kind of fault was injected at least once (``faults_missing`` empty: a schedule too
short for every kind fails too), at least ``MIN_COMPLETED_SHARE`` of the requests sent
completed (typed failures are allowed, a run of refusals is not), and outputs are identical
(false when nothing completed). ``injected`` counts the faults that went in, by kind.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chaos.context import Options
from chaos.history import Expect, RequestLog, checks, figures, problems
from chaos.injectors import INJECTORS
from chaos.workload import Batch, Endpoints, Reference, Sender, make_specs

FAULTS = ("freeze-decode", "freeze-prefill", "kill-decode", "kill-prefill", "partition", "redis-hang",
          "step-error", "corrupt-kv", "slow-node", "restart-router")

# The least share of the requests sent that must complete: typed failures (a request refused
# while every decode node is down, an engine step that failed twice) are allowed, but a run in
# which most requests only failed tested nothing. The 120 s runs complete all of them.
MIN_COMPLETED_SHARE = 0.5

NEMESIS_EXPECTATIONS = (Expect("nodes_back", "==", True), Expect("injection_failures", "==", {}),
                        Expect("faults_missing", "==", []),
                        Expect("completed_share", ">=", MIN_COMPLETED_SHARE))


@dataclass(frozen=True, slots=True)
class FaultEvent:
    at_s: float  # seconds after the start of the run
    fault: str
    hold_s: float


def tally(records: Sequence[dict], faults: Sequence[str]) -> dict:
    """What went in, from ``_one_fault``'s records: ``injected`` (kind -> faults injected),
    ``injection_failures`` (kind -> injections that raised), ``faults_missing`` (the kinds of
    ``faults`` never injected, in their order)."""
    injected: dict[str, int] = {}
    failures: dict[str, int] = {}
    for rec in records:
        into = failures if "error" in rec else injected
        into[rec["fault"]] = into.get(rec["fault"], 0) + 1
    return {"injected": injected, "injection_failures": failures,
            "faults_missing": [f for f in dict.fromkeys(faults) if f not in injected]}


def completed_share(figs: dict) -> float | None:
    """Completed over sent (None: nothing sent, which fails the check)."""
    return round(figs["completed"] / figs["requests"], 3) if figs.get("requests") else None


def plan(rng: random.Random, seconds: float, faults: Sequence[str] = FAULTS, hold_s=(2.0, 8.0),
         gap_s=(2.0, 6.0)) -> list[FaultEvent]:
    """A schedule of faults, one at a time, all over within ``seconds``: a gap, a fault held
    for its time, a gap, ... (the time each heal takes comes on top, when the run follows it).
    Faults are drawn from a shuffled bag, refilled when empty: in random order, and every kind
    comes up once before any comes up twice."""
    if not faults:
        raise ValueError("the nemesis needs at least one fault")
    events, t, bag = [], rng.uniform(*gap_s), []
    while True:
        hold = rng.uniform(*hold_s)
        if t + hold > seconds:
            return events
        if not bag:
            bag = list(faults)
            rng.shuffle(bag)
        events.append(FaultEvent(round(t, 3), bag.pop(), round(hold, 3)))
        t += hold + rng.uniform(*gap_s)


class Clients:
    """``n`` threads sending one request after another until ``stop``; each request a new log."""

    def __init__(self, ep: Endpoints, specs, n: int, opts: Options) -> None:
        self.logs: list[RequestLog] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._specs = list(specs)
        self._next = 0
        self._senders = [Sender(ep, opts.budget, random.Random(i)) for i in range(n)]
        self._threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in self._senders]
        for t in self._threads:
            t.start()

    def _loop(self, sender: Sender) -> None:
        while not self._stop.is_set():
            with self._lock:
                spec = self._specs[self._next % len(self._specs)]
                self._next += 1
                log = RequestLog(spec.key)
                self.logs.append(log)
            sender.send(spec, log)

    def stop(self, timeout_s: float) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in self._senders:
            s.close()


def run_nemesis(cluster, seconds: float, opts: Options = Options(), seed: int = 0, concurrency: int = 4,
                faults: Sequence[str] = FAULTS, progress: Callable[[str], None] = lambda m: None) -> dict:
    """The nemesis on a started ChaosCluster; returns its result (module docstring)."""
    rng = random.Random(seed)
    schedule = plan(rng, seconds, faults)
    specs = make_specs(16, opts.max_tokens, f"nemesis-{seed}-{rng.getrandbits(32):08x}", http_every=4)
    done: list[dict] = []
    unplanned = sorted(set(faults) - {ev.fault for ev in schedule})
    if unplanned:
        progress(f"nemesis: {seconds:.0f} s leaves no time for {', '.join(unplanned)}: the run will fail "
                 f"its faults_missing check (a longer run schedules every kind)")
    with cluster.router_process():
        progress(f"nemesis: {len(schedule)} faults over {seconds:.0f} s, {concurrency} clients")
        clients = Clients(Endpoints(cluster.address, cluster.http_address), specs, concurrency, opts)
        t0 = time.monotonic()
        try:
            for ev in schedule:
                _sleep_until(t0 + ev.at_s)
                done.append(_one_fault(cluster, ev, rng, opts, t0, progress))
            _sleep_until(t0 + seconds)
        finally:
            clients.stop(timeout_s=opts.budget.seconds + 240.0)
            everyone_back = _all_registered(cluster, 120.0)
        logs = clients.logs
        progress(f"nemesis: {len(logs)} requests; reference run of the {len(specs)} specs, no fault")
        reference = Reference.of(Batch(Endpoints(cluster.address, cluster.http_address), specs).join())
    return verdict({"nemesis_s": seconds, "seed": seed, "concurrency": concurrency, "scheduled": len(schedule),
                    "faults": done,
                    **tally(done, faults), **figures(logs, reference.tokens, failures_allowed=True),
                    "nodes_back": everyone_back}, problems(logs, reference.tokens, failures_allowed=True))


def verdict(result: dict, bad: Sequence[str] = ()) -> dict:
    """``result`` (tally's and figures' fields, ``nodes_back``) with ``completed_share``,
    ``problems``, ``checks`` and ``passed``: the nemesis's own checks besides the base ones."""
    result["completed_share"] = completed_share(result)
    if bad:
        result["problems"] = list(bad)
    result["checks"] = checks(result, NEMESIS_EXPECTATIONS, failures_allowed=True)
    result["passed"] = all(result["checks"].values())
    return result


def _one_fault(cluster, ev: FaultEvent, rng: random.Random, opts: Options, t0: float, progress) -> dict:
    """Inject, hold, heal, wait for every node; what happened as a dict for the report."""
    rec = {"fault": ev.fault, "at_s": round(time.monotonic() - t0, 3), "hold_s": ev.hold_s}
    try:
        inj = INJECTORS[ev.fault](cluster, None, rng, restart_timeout_s=opts.restart_timeout_s)
    except Exception as e:  # noqa: BLE001 - recorded: the run goes on, its injection_failures check fails
        rec["error"] = f"{type(e).__name__}: {e}"
        progress(f"nemesis: {ev.fault} not injected: {rec['error']}")
        return rec
    rec["victim"] = inj.victim
    progress(f"nemesis t={rec['at_s']:.1f}s: {ev.fault} on {inj.victim} for {ev.hold_s:.1f} s")
    try:
        time.sleep(ev.hold_s)
    finally:
        inj.heal()
    rec["back_s"] = _all_registered(cluster, opts.restart_timeout_s or 60.0, since=inj.at)
    rec.update({k: v for k, v in inj.info.items() if k != "pid"})
    return rec


def _all_registered(cluster, timeout_s: float, since: float | None = None):
    """Seconds from ``since`` (default now) until every node is registered; True/False without
    ``since``."""
    from chaos.cluster import wait_for

    start = time.monotonic() if since is None else since
    got = wait_for(lambda: set(cluster.actors) <= set(cluster.registered()), start, timeout_s + (time.monotonic() - start))
    return got is not None if since is None else got


def _sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))
