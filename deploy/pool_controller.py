"""Pool sizes that follow targets: add or remove node actors, one at a time, within bounds.

The planner (router/planner/) writes how many nodes of each role it wants into Redis
(kv_index/pool_targets.py); this controller makes the Ray cluster match, in `pdserve up`
(deploy/launcher.py, its private Ray) and in `pdserve nodes --follow-targets` (deploy/nodes.py,
a long-lived Ray cluster); deploy/pool_runners.py holds both set-ups. On Kubernetes that is all it takes for the KubeRay worker groups to
follow: each node actor asks for one unit of its pool's resource (``prefill_pool``,
``decode_pool``), one worker pod offers one unit, so an actor with no room pends and the KubeRay
autoscaler adds a pod of that group (up to its maxReplicas); a removed actor leaves its pod
idle and the autoscaler removes it (down to its minReplicas).

Each pass:

    observe   node actors by name (``prefill-3``) in the Ray namespace, joined with the registry
              and the role wishes (kv_index/roles.py): a node with a standing wish for another
              role than it serves is "switching" and counts in the wished one, before and during
              its drain, as the planner that wrote the wish (and the targets with it) counts it;
              else a registered node counts in the role it serves now (a node whose role was
              switched live counts in its new one), a node not registered yet is "starting" and
              counts in its name's role; a draining one counts in none; one that stays down
              (`pdserve nodes`: failed its starts, kv_index/health.py) keeps its place
    decide    ``decide()``, pure: wanted = target clamped to [min, max] (a role without a target
              keeps its size, clamped); hold during the cool-down after a change and while a node
              it added is still starting; a node that has not registered after ``start_timeout_s``
              (no room for it, a hung start) is removed first, making way for a fresh try; else
              add one node to the role furthest below what it wants (adding goes first:
              capacity before savings), or remove one from the role furthest above: a down node
              (its record is cleared), else a starting one, else the idlest by the registry's load (waiting + running, then
              running tokens), never a switching one, never the last serving decode node
    act       add: spawn a node actor with a fresh id: the lowest index of its role above every
              one issued or removed before (kept in Redis, kv_index/pool_targets.py ``retire``:
              across controller restarts too), so nothing keyed by a node id (a role wish, a
              health record, index entries) passes to a new node;
              remove: the actor's ``stop(drain_timeout_s)`` (it heartbeats ``draining`` so
              routers place nothing new there, finishes what it holds, leaves the index), then
              ``ray.kill`` and, should its process outlive that (a frozen worker), SIGKILL
              (deploy/ray_reap.py); a node that never registered is killed at once (nothing to
              drain, and its ``stop`` would wait behind its constructor); both logged with their
              reason, counted (``pdserve:pool_changes_total{role,action}`` where a metrics
              registry is given) and noted in Redis for `pdserve status`
"""
from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from deploy.ray_reap import actor_process, reap
from kv_index.nodes import NodeInfo, Role

log = logging.getLogger(__name__)

ADD, REMOVE = "add", "remove"
# DOWN: failed max_start_failures lives in a row, no actor left, only its health record
# (kv_index/health.py): it keeps its place in its pool, as under `pdserve nodes` without
# targets, so that a bad model path does not turn into a spawn every cool-down.
STARTING, SERVING, DRAINING, DOWN = "starting", "serving", "draining", "down"
# SWITCHING: a standing role wish for another role than it serves; counted in the wished role.
SWITCHING = "switching"


def node_name_role(name: str) -> tuple[Role, int] | None:
    """``decode-4`` -> (Role.DECODE, 4); None for a name no pool controller made."""
    m = re.fullmatch(r"(prefill|decode)-(\d+)", name)
    return (Role(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True, slots=True)
class PoolBounds:
    """Nodes per role never fewer than ``minimum`` nor more than ``maximum`` (None: no limit).
    ValueError, naming the limit, for bounds that cannot hold."""

    minimum: Mapping[Role, int] = field(default_factory=lambda: {Role.PREFILL: 0, Role.DECODE: 1})
    maximum: Mapping[Role, int | None] = field(default_factory=lambda: {Role.PREFILL: None, Role.DECODE: None})

    def __post_init__(self) -> None:
        for role in Role:
            lo, hi = self.low(role), self.high(role)
            if lo < 0:
                raise ValueError(f"min {role.value} nodes must be >= 0, got {lo}")
            if hi is not None and hi < lo:
                raise ValueError(f"min {role.value} nodes ({lo}) is above max {role.value} nodes ({hi})")
        if self.low(Role.DECODE) < 1:  # the only pool that can serve alone must never empty
            raise ValueError(f"min decode nodes must be >= 1 (decode nodes are the only ones that can serve "
                             f"alone), got {self.low(Role.DECODE)}")

    def low(self, role: Role) -> int:
        return int(self.minimum.get(role, 1 if role is Role.DECODE else 0))

    def high(self, role: Role) -> int | None:
        return self.maximum.get(role)

    def clamp(self, role: Role, n: int) -> int:
        hi = self.high(role)
        return max(self.low(role), n if hi is None else min(n, hi))


@dataclass(frozen=True, slots=True)
class PoolNode:
    """One node actor as the controller sees it (plain data: tests build them by hand)."""

    node_id: str
    role: Role  # the role it serves (registry), or its name's role while it starts
    state: str = SERVING  # STARTING (not registered yet), SERVING, SWITCHING, DRAINING, DOWN
    load: int = 0  # waiting + running, as of its last heartbeat
    running_tokens: int = 0
    starting_s: float = 0.0  # seconds since the controller first saw it starting


class PoolChange(NamedTuple):
    role: Role
    action: str  # ADD or REMOVE
    node_id: str
    reason: str


class Decision(NamedTuple):
    change: PoolChange | None
    why: str  # what the change is for, or why nothing changes


def wanted(nodes: Sequence[PoolNode], targets: Mapping[Role, int], bounds: PoolBounds) -> dict[Role, tuple[int, int]]:
    """role -> (nodes it has, nodes it should have): the target, or its current size when it
    has none, clamped to the bounds. Draining nodes are on their way out: not counted."""
    out = {}
    for role in Role:
        have = sum(1 for n in nodes if n.role is role and n.state != DRAINING)
        out[role] = (have, bounds.clamp(role, targets.get(role, have)))
    return out


def fresh_id(role: Role, taken: set[str], issued: int = -1) -> str:
    """The lowest id of ``role`` above ``issued`` (the highest index ever issued or removed)
    that nothing holds now."""
    i = issued + 1
    while f"{role.value}-{i}" in taken:
        i += 1
    return f"{role.value}-{i}"


def _removal_order(n: PoolNode) -> tuple:
    """A down node first (nothing there), then a starting one (nothing in flight), then the
    idlest, then the newest name."""
    parsed = node_name_role(n.node_id)
    return (n.state != DOWN, n.state != STARTING, n.load, n.running_tokens, -(parsed[1] if parsed else 0),
            n.node_id)


def decide(nodes: Sequence[PoolNode], targets: Mapping[Role, int], bounds: PoolBounds, *, now: float,
           last_change_at: float | None, cooldown_s: float, start_timeout_s: float = 300.0,
           taken: set[str] = frozenset(), note: str = "", issued: Mapping[Role, int] | None = None) -> Decision:
    """At most one change that brings the pools toward their targets. ``taken``: node ids
    already in use (actors and registry entries) besides ``nodes``'; ``note``: the targets'
    reason, carried into the change's; ``issued``: role -> the highest index issued or removed
    so far (never made again). Pure: no clock, no Redis, no Ray."""
    if last_change_at is not None and now - last_change_at < cooldown_s:
        return Decision(None, f"cool-down: {cooldown_s - (now - last_change_at):.1f} s left")
    pending = [n for n in nodes if n.state == STARTING and n.starting_s < start_timeout_s]
    stuck = [n for n in nodes if n.state == STARTING and n.starting_s >= start_timeout_s]
    if stuck:  # no room for it (a pending actor) or a start that hangs: make way for a fresh try
        n = stuck[0]
        return Decision(PoolChange(n.role, REMOVE, n.node_id, f"{n.node_id} did not register within "
                                   f"{start_timeout_s:.0f} s"), "")
    sizes = wanted(nodes, targets, bounds)
    ups = sorted((want - have, role) for role, (have, want) in sizes.items() if want > have)
    downs = sorted((have - want, role) for role, (have, want) in sizes.items() if have > want)
    why = f" ({note})" if note else ""
    if ups:
        if pending:  # one change at a time: the last node added is still loading
            return Decision(None, f"waiting for {pending[0].node_id} to register")
        _, role = ups[-1]
        have, want = sizes[role]
        nid = fresh_id(role, set(taken) | {n.node_id for n in nodes}, (issued or {}).get(role, -1))
        return Decision(PoolChange(role, ADD, nid, f"{role.value} nodes {have} -> {want}{why}"), "")
    holds = []
    for _, role in reversed(downs):
        have, want = sizes[role]
        mine = sorted((n for n in nodes if n.role is role and n.state not in (DRAINING, SWITCHING)),
                      key=_removal_order)
        if not mine:  # only nodes on their way into the role: the surplus is a later pass's
            holds.append(f"the {role.value} nodes above the target are still switching into the role")
            continue
        victim = mine[0]
        serving_decode = sum(1 for n in nodes if n.role is Role.DECODE and n.state == SERVING)
        if role is Role.DECODE and victim.state == SERVING and serving_decode <= 1:
            holds.append("removing would leave no serving decode node")
            continue  # never the last decode node that serves
        return Decision(PoolChange(role, REMOVE, victim.node_id,
                                   f"{role.value} nodes {have} -> {want}{why}; {victim.node_id} is the "
                                   f"{_WHICH.get(victim.state, 'idlest')} "
                                   f"(load {victim.load})"), "")
    if holds:
        return Decision(None, "holding: " + "; ".join(holds))
    return Decision(None, "pools at their targets")


_WHICH = {DOWN: "one that stays down", STARTING: "one still starting"}


def observe(actor_names: Sequence[str], registry: Mapping[str, NodeInfo], first_seen: dict[str, float],
            now: float, down: Sequence[str] = (), wishes: Mapping[str, Role] | None = None) -> list[PoolNode]:
    """The node actors as ``PoolNode``s: joined with the registry by id; ``down``: ids of nodes
    that stay down (health records), shown DOWN when no actor has their name; ``wishes``: node
    id -> the role a standing wish asks of it (RoleStore.all). ``first_seen`` (node id -> when it
    was first seen starting) is updated in place."""
    wishes = wishes or {}
    out = [PoolNode(nid, parsed[0], DOWN) for nid in sorted(set(down) - set(actor_names))
           if (parsed := node_name_role(nid)) is not None]
    for name in actor_names:
        parsed = node_name_role(name)
        if parsed is None:
            continue
        info = registry.get(name)
        if info is None:  # a restarted node starts in its name's role, then obeys its wish
            start = first_seen.setdefault(name, now)
            out.append(PoolNode(name, wishes.get(name, parsed[0]), STARTING, starting_s=now - start))
            continue
        first_seen.pop(name, None)
        want = wishes.get(name)
        if want is not None and want is not info.role:  # about to switch, or draining for it
            state, role = SWITCHING, want
        else:
            state, role = (DRAINING if info.draining else SERVING), info.role
        out.append(PoolNode(name, role, state, load=info.waiting + info.running, running_tokens=info.running_tokens))
    for gone in set(first_seen) - set(actor_names):
        del first_seen[gone]
    return out


class PoolController:
    """Follows the targets in Redis on the connected Ray cluster (``ray.init`` first).

    ``spawn(role, node_id)`` starts a node actor with that name and returns its handle;
    ``defaults()`` gives the count per role until targets are first set in this cluster
    generation (a role it leaves out keeps its size); once a target record exists, a role it
    leaves out keeps its size, not the default: a planner that moved a node to the other role
    live must not see it put back; and once it expires, every role keeps its size.
    ``on_removed(node_id)`` is told after a node is gone; ``down()`` (node id -> why) names the
    nodes that stay down, ``forget(node_id)`` clears such a node's record when it is removed. ``metrics``: a
    ``telemetry.metrics.PoolMetrics`` (``pdserve:pool_changes_total``), or None.
    """

    def __init__(self, redis_client, namespace: str, bounds: PoolBounds, spawn: Callable[[Role, str], object], *,
                 cooldown_s: float = 30.0, drain_timeout_s: float = 30.0, start_timeout_s: float = 300.0,
                 defaults: Callable[[], Mapping[Role, int]] = dict, on_removed: Callable[[str], None] = lambda n: None,
                 down: Callable[[], Mapping[str, str]] = dict, forget: Callable[[str], None] = lambda n: None,
                 metrics=None, clock: Callable[[], float] = time.monotonic) -> None:
        from kv_index.pool_targets import PoolTargets
        from kv_index.reader import IndexReader
        from kv_index.roles import RoleStore

        for name, v in (("cooldown_s", cooldown_s), ("drain_timeout_s", drain_timeout_s),
                        ("start_timeout_s", start_timeout_s)):
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"pool controller {name} must be a finite number of seconds >= 0, got {v}")
        self.targets = PoolTargets(redis_client, namespace)
        self.reader = IndexReader(redis_client, namespace)
        self.roles = RoleStore(redis_client, namespace)
        self.bounds, self.spawn, self.defaults, self.on_removed = bounds, spawn, defaults, on_removed
        self.down, self.forget = down, forget
        self.cooldown_s, self.drain_timeout_s, self.start_timeout_s = cooldown_s, drain_timeout_s, start_timeout_s
        self.metrics, self.clock = metrics, clock
        self.last_change_at: float | None = None
        self.last: Decision | None = None
        self._first_seen: dict[str, float] = {}
        self._said = ""  # the last "nothing to do" reason logged (logged once, not every pass)

    def _actor_names(self) -> list[str]:
        import ray

        return [n for n in ray.util.list_named_actors() if node_name_role(n) is not None]

    def step(self) -> Decision:
        """One pass: observe, decide, act. Redis or Ray errors propagate (``run`` logs them)."""
        now = self.clock()
        rec = self.targets.record()
        # Expired targets are no targets: every pool keeps its size (not the defaults, which
        # would undo what the planner did while its targets stood).
        targets = self.defaults() if rec is None else {} if rec.expired else rec.targets
        registry = self.reader.live_nodes()
        names = self._actor_names()
        nodes = observe(names, registry, self._first_seen, now, down=list(self.down()), wishes=self.roles.all())
        d = self.last = decide(nodes, targets, self.bounds, now=now, last_change_at=self.last_change_at,
                               cooldown_s=self.cooldown_s, start_timeout_s=self.start_timeout_s,
                               taken=set(names) | set(registry), note=rec.reason if rec is not None else "",
                               issued=self.targets.issued())
        if d.change is None:
            if d.why != self._said and not d.why.startswith("cool-down"):
                log.info("pools: %s", d.why)
                self._said = d.why
            return d
        self._said = ""
        c = d.change
        log.info("pool change: %s %s node %s: %s", c.action, c.role.value, c.node_id, c.reason)
        self.last_change_at = now
        self.targets.retire(*node_name_role(c.node_id))  # before the act: an id is never made twice
        if c.action == ADD:
            self.spawn(c.role, c.node_id)
            self._first_seen[c.node_id] = now
        else:
            victim = next((n for n in nodes if n.node_id == c.node_id), None)
            self._remove(c.node_id, drain=victim is None or victim.state != STARTING)
        self.last_change_at = self.clock()  # the cool-down counts from the end of a drain
        if self.metrics is not None:
            self.metrics.changed(c.role.value, c.action)
        try:
            self.targets.note_change(c.role, c.action, c.node_id, c.reason)
        except Exception as e:  # the log line above already says it; status is a view
            log.warning("pool change not noted in Redis: %s", e)
        return d

    def _remove(self, name: str, drain: bool = True) -> None:
        """Drain the node (its requests finish, it leaves the index), then end its actor.
        ``drain`` False: a node that never registered, which no router placed anything on; its
        ``stop`` would only queue behind a constructor that may never return (a hung or frozen
        start, an actor with no room), holding every other change for the drain's bound."""
        import ray

        try:
            handle = ray.get_actor(name)
        except ValueError:  # no actor: a node that stays down (its record goes) or one gone already
            self.forget(name)
            self.on_removed(name)
            return
        t0 = time.monotonic()
        where = actor_process(name)  # before the kill: ray.kill may leave a frozen process behind
        if drain:
            try:
                ray.get(handle.stop.remote(drain_timeout_s=self.drain_timeout_s), timeout=self.drain_timeout_s + 10)
            except ray.exceptions.RayError as e:  # a node that never started, or died: nothing to drain
                log.info("%s did not drain cleanly (%s); killing it", name, type(e).__name__)
        ray.kill(handle, no_restart=True)
        if where is not None:
            reap(name, where)
        log.info("%s removed after %.1f s%s", name, time.monotonic() - t0, " of draining" if drain else "")
        self.on_removed(name)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Pass after pass until ``stop`` is set; a pass that fails is logged and retried."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:
                log.exception("pool controller pass failed; next pass in %.1f s", interval_s)
            if stop.wait(interval_s):
                return
