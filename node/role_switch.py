"""A node changes role live (prefill <-> decode) over the model and KV cache it already has.

The node actor owns a ``RoleSwitcher``: it holds the role server serving now and replaces it
on ``switch``. The old role's server retires (``NodeServer.retire``): it heartbeats
``draining`` at once (routers place nothing new on it), finishes what it holds (Prefill calls
and their KV pushes, Decode streams to their end, reservations taken), and closes its gRPC
port and receivers, but hands its engine loop, cache and index link over. The new role's
server is built over that same engine (no weights reloaded, cached blocks still valid) and
starts on the hand-over: a new port, and one heartbeat that writes the new role, address and
load in one transaction. The node's blocks never leave the index (docs/cluster.md, "Roles that
change live").

Bounded: the drain waits at most ``timeout_s``; what is still held then fails with
UNAVAILABLE and the router moves it exactly (router/migration.py): never dropped, never run
twice. A switch that cannot be done over this engine is refused before anything changes
(``switch_refusal``); a new server that fails to start gives the node back its old role over
the same engine; if that fails too the error propagates (the actor then restarts).

Trigger: ``poll`` runs on the index publisher's thread after each heartbeat, reads the
node's wish (kv_index/roles.py RoleStore: one bounded Redis read; a wish of an earlier cluster
generation or past its expiry is none) and obeys it on a thread of its own, so heartbeats (the
draining flag above all) go on during the drain. Obeying is not blind:

- a wish its config rules out (``switch_refusal``) is refused for good: marked so in the store
  (the pool controller then counts the node in the role it serves), counted once;
- a switch that would leave the role it leaves with fewer serving nodes than the wish's floor
  (never fewer than one decode node) is not started: ``RoleStore.claim`` decides that in one
  script run, so two nodes never both leave the last pair;
- while the node holds a request no router could move (n > 1 with output: its samples forked
  here, router/migration.py ``refusal``), the drain is not started, since a timed-out drain
  would lose it;
- a switch that failed (the new role's server did not start) is tried again.

Those three wait and try again, after ``retry_delay`` (doubling to ``RETRY_MAX_S``), until the
wish is obeyed, replaced or expires.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from kv_index.nodes import Role
from kv_index.roles import RoleStore, Wish
from node.config import NodeConfig
from telemetry.log_limit import RateLimitedLog
from telemetry.role_switch_metrics import RoleSwitchMetrics

if TYPE_CHECKING:  # the server module loads torch: only the node's process imports it
    from node.server import Handover, NodeServer

log = logging.getLogger(__name__)

# ``build_server(config, engine=...)``: the role's server over an engine already loaded
# (deploy/node_servers.py build_any_role). Its ``roles`` attribute says which roles it builds.
ServerFactory = Callable[..., "NodeServer"]

# A wish not obeyed yet (a floor, a request that cannot move, a failed start) is tried again
# after RETRY_BASE_S, doubling per try up to RETRY_MAX_S: soon enough for a node that registers
# a moment later, rare enough that a wish that cannot be obeyed costs a Redis call a minute.
RETRY_BASE_S = 2.0
RETRY_MAX_S = 60.0
# The claim outlives the switch's drain by this much (a start, the first heartbeat), then lapses
# by itself should the node die mid-switch.
CLAIM_SLACK_S = 30.0


def retry_delay(tries: int) -> float:
    """Seconds before the next try of a wish tried ``tries`` times already."""
    return min(RETRY_MAX_S, RETRY_BASE_S * 2 ** max(0, tries - 1))


def held_unmovable(engine) -> int:
    """Requests ``engine`` holds that no router could move elsewhere: n > 1 once it produced
    output (router/migration.py ``refusal``; its samples forked here). Runs on the engine loop."""
    sched = engine.scheduler
    return len({s.request_id for s in (*sched.waiting, *sched.running)
                if s.params.n > 1 and (s.forked or s.num_output_tokens > 0)})


@dataclass(slots=True)
class _Attempt:
    wish_id: str
    tries: int
    retry_at: float = float("inf")  # monotonic; inf: in progress, or nothing left to retry


def switch_refusal(config: NodeConfig, to_role: Role, buildable: Iterable[Role]) -> str | None:
    """Why a node configured as ``config`` cannot serve ``to_role`` over its loaded engine
    (None: it can). Pure: plain config in, a reason out."""
    to_role = Role(to_role)
    if to_role not in tuple(buildable):
        return f"its server factory builds only {', '.join(r.value for r in buildable)}"
    if config.engine.speculative.enabled:
        # The engine was built with a drafter for the decode role; a prefill server runs no
        # proposer (and a prefill node's engine has none to decode with).
        return "speculative decoding is configured: its engine's speculation loop belongs to the decode role"
    tp = getattr(config, "tensor_parallel", 1)
    if tp > 1:
        return f"tensor_parallel={tp}: a tensor-parallel engine's hand-over between roles is not exercised yet"
    return None


@dataclass(frozen=True, slots=True)
class SwitchResult:
    """One switch, as ``switch_role`` returns it and the metrics count it."""

    from_role: str
    to_role: str
    outcome: str  # telemetry.metrics.ROLE_SWITCH_OUTCOMES, or "unchanged" (already that role)
    seconds: float = 0.0
    reason: str = ""
    failed_over: int = 0  # requests failed over to other nodes when the drain timed out
    address: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


class RoleSwitcher:
    """The role server a node serves with now, and the switches between roles."""

    def __init__(self, server: NodeServer, build_server: ServerFactory, metrics: RoleSwitchMetrics,
                 on_new_server: Callable[[NodeServer], None] = lambda s: None,
                 on_fatal: Callable[[BaseException], None] | None = None) -> None:
        self.server = server
        self.build_server = build_server
        self.metrics = metrics
        self.on_new_server = on_new_server
        self.on_fatal = on_fatal  # a polled switch left no role serving (the actor restarts)
        self.buildable = tuple(getattr(build_server, "roles", (server.role,)))
        self.switching: Role | None = None  # the role being switched to, while a switch runs
        self.lock = threading.Lock()  # one switch at a time; a drain waits for it (``close``)
        self.closed = False
        self._attempt: _Attempt | None = None  # the wish being obeyed, and when to try it again
        self._poll_log = RateLimitedLog(log)
        server.metrics.registry.register(metrics)

    def switch(self, to_role: Role | str, timeout_s: float | None = None) -> SwitchResult:
        """Serve ``to_role`` from now on; returns when the node serves it (or why not).
        ``timeout_s``: the drain's bound (default the node's drain_timeout_s)."""
        to_role = Role(to_role)
        with self.lock:
            old = self.server
            frm = old.role.value
            if self.closed:
                return SwitchResult(frm, to_role.value, "refused", reason="the node is stopping")
            if to_role is old.role:
                return SwitchResult(frm, to_role.value, "unchanged", address=old.address or "")
            reason = switch_refusal(old.config, to_role, self.buildable)
            if reason is not None:
                log.warning("%s refuses to switch %s -> %s: %s", old.config.node_id, frm, to_role.value, reason)
                self.metrics.switched(frm, to_role.value, "refused")
                return SwitchResult(frm, to_role.value, "refused", reason=reason)
            timeout_s = old.config.drain_timeout_s if timeout_s is None else timeout_s
            self.switching = to_role
            t0 = time.monotonic()
            try:
                return self._switch(old, to_role, timeout_s, t0)
            finally:
                self.switching = None

    def _switch(self, old: NodeServer, to_role: Role, timeout_s: float, t0: float) -> SwitchResult:
        frm, nid = old.role.value, old.config.node_id
        log.info("%s switching %s -> %s (drain up to %.1f s)", nid, frm, to_role.value, timeout_s)
        handover = old.retire(timeout_s)
        outcome, reason = ("ok" if handover.drained else "timeout"), ""
        try:
            new = self._serve(replace(old.config, role=to_role), handover)
        except Exception as err:
            log.exception("%s could not start as %s; serving as %s again", nid, to_role.value, frm)
            outcome, reason = "failed", f"{to_role.value} server failed to start: {err!r}"
            try:
                new = self._serve(old.config, handover)
            except Exception:  # no role can serve: the caller restarts the node (``on_fatal``)
                self.metrics.switched(frm, to_role.value, outcome, time.monotonic() - t0)
                raise
        seconds = time.monotonic() - t0
        self.metrics.switched(frm, to_role.value, outcome, seconds)
        log.info("%s now serves as %s on %s (%s in %.2f s, %d requests failed over)", nid, new.role.value,
                 new.address, outcome, seconds, handover.failed)
        return SwitchResult(frm, to_role.value, outcome, seconds, reason, handover.failed, new.address or "")

    def _serve(self, config: NodeConfig, handover: Handover) -> NodeServer:
        server = self.build_server(config, engine=handover.engine)
        server.metrics.registry.register(self.metrics)
        server.start(handover)
        self.server = server
        self.on_new_server(server)
        return server

    def poll(self, roles: RoleStore) -> None:
        """After a heartbeat (the publisher's thread): obey the node's wish, on a thread of its
        own, when it asks for another role than the one served. Never raises; never waits but
        for one read."""
        try:
            node_id = self.server.config.node_id
            wish = roles.wish(node_id)
        except Exception as err:  # never into the index thread: the next heartbeat reads again
            self._poll_log.warning("roles", "reading the desired role failed: %s", err)
            return
        if wish is None or wish.role is self.server.role:
            self._attempt = None  # served as wished: a later wish is new
            return
        a = self._attempt
        if wish.refused or self.closed or self.lock.locked():
            return
        if a is not None and a.wish_id == wish.wish_id and time.monotonic() < a.retry_at:
            return  # in progress, refused for good, or not yet time to try again
        tries = a.tries + 1 if a is not None and a.wish_id == wish.wish_id else 1
        self._attempt = _Attempt(wish.wish_id, tries)
        threading.Thread(target=self._obey, args=(roles, wish, tries), name=f"role-switch-{node_id}",
                         daemon=True).start()

    def _obey(self, roles: RoleStore, wish: Wish, tries: int) -> None:
        server = self.server
        cfg, frm, to = server.config, server.role, wish.role
        why = switch_refusal(cfg, to, self.buildable)
        if why is not None:  # its config rules the role out: no retry, the store says why
            log.warning("%s refuses to switch %s -> %s: %s", cfg.node_id, frm.value, to.value, why)
            self.metrics.switched(frm.value, to.value, "refused")
            try:
                roles.refuse(cfg.node_id, wish, why)
            except Exception as err:
                self._poll_log.warning("refuse", "recording the refusal failed: %s", err)
            return
        try:
            held = self._unmovable()
            if held:
                return self._later(wish, tries, f"{held} request(s) held here could not move to another node "
                                                f"(n > 1 after output)")
            floor = wish.floor(frm)
            claimed, others = roles.claim(cfg.node_id, frm, floor, cfg.drain_timeout_s + CLAIM_SLACK_S)
        except Exception as err:  # Redis, or the engine loop not answering: try again later
            return self._later(wish, tries, f"{type(err).__name__}: {err}")
        if not claimed:
            if tries == 1:  # counted once per wish, however often it is tried again
                self.metrics.switched(frm.value, to.value, "refused")
            return self._later(wish, tries, f"{others} other {frm.value} node(s) serve, the floor is {floor}")
        try:
            result = self._switch_to(to)
        finally:
            try:
                roles.release(cfg.node_id)
            except Exception:  # it lapses by itself (CLAIM_SLACK_S past the drain)
                pass
        if result is not None and result.outcome in ("failed", "refused"):
            self._later(wish, tries, result.reason)

    def _later(self, wish: Wish, tries: int, why: str) -> None:
        delay = retry_delay(tries)
        self._attempt = _Attempt(wish.wish_id, tries, time.monotonic() + delay)
        self._poll_log.warning(f"later:{wish.wish_id}", "%s does not switch %s -> %s yet (try %d): %s; trying "
                               "again in %.0f s", self.server.config.node_id, self.server.role.value, wish.role.value,
                               tries, why, delay)

    def _unmovable(self) -> int:
        aengine = getattr(self.server, "aengine", None)
        return 0 if aengine is None else int(aengine.run(held_unmovable, timeout=5.0))

    def _switch_to(self, want: Role) -> SwitchResult | None:
        try:
            return self.switch(want)
        except Exception as err:
            log.exception("role switch to %s failed", want.value)
            if self.on_fatal is not None:
                self.on_fatal(err)
            return None

    def close(self) -> NodeServer:
        """No switch from now on (the node is stopping); waits for one in progress. Returns
        the server serving now, for the caller to drain."""
        with self.lock:
            self.closed = True
            return self.server
