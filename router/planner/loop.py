"""Running the planner in a router process: a thread that, every ``interval_s``, takes or renews
the leader lease (kv_index/plan.py); the leader gathers the signals, decides
(router/planner/decide.py), reports (metric, log line, span, the plan record) and, in active
mode, acts: node roles through the role store, pool sizes through the pool targets, the
short-prompt threshold on its own placement policy. A follower reads the plan and applies its
threshold when the plan was applied. Redis that fails or hangs (every call bounded by the
client's timeouts) makes a round do nothing: the planner stands still, the router serves on.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol

from kv_index.nodes import Role
from kv_index.plan import PlanStore
from kv_index.pool_targets import PoolTargets
from kv_index.roles import RoleStore
from router.planner.config import PlannerConfig
from router.planner.decide import Decision, PlannerState, decide
from router.planner.decode_fit import DecodeFit
from router.planner.record import RoundRecorder
from router.planner.signals import PlannerSignals, build_signals
from telemetry import tracing
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)


class RoleRequests(Protocol):
    def request(self, node_id: str, role: Role, reason: str = "", *, ttl_s: float = ...,
                floors: Mapping[Role, int] | None = None) -> None: ...


class TargetSetter(Protocol):
    def set(self, targets: Mapping[Role, int], reason: str = "", *, ttl_s: float = ...,
            wishes: Mapping[str, Role] | None = None, floors: Mapping[Role, int] | None = None) -> None: ...


def plan_record(d: Decision, holder: str, mode: str, applied: bool, at: float) -> dict:
    """The JSON the leader publishes (kv_index/plan.py documents the fields)."""
    return {"leader": holder, "at": at, "mode": mode, "applied": applied, "action": d.action, "reason": d.reason,
            "detail": d.detail, "layout": {"prefill": d.layout.prefill, "decode": d.layout.decode},
            "threshold": d.threshold, "roles": {k: v.value for k, v in d.roles.items()},
            "pool_targets": {k.value: v for k, v in d.pool_targets.items()} if d.pool_targets is not None else None,
            # JSON has no infinity: a saturated pool's figure is null
            "figures": {k: v if math.isfinite(v) else None for k, v in d.figures.items()}}


class PlannerLoop:
    """One router's planner. ``round()`` is one step (the thread calls it; tests call it
    directly); ``start``/``stop`` run it every ``config.interval_s``."""

    def __init__(self, config: PlannerConfig, plans: PlanStore, roles: RoleRequests, targets: TargetSetter,
                 signals: Callable[[], PlannerSignals], apply_threshold: Callable[[int], None], holder: str,
                 on_decision: Callable[[str, str], None] = lambda action, reason: None,
                 clock: Callable[[], float] = time.time,
                 record: Callable[[PlannerSignals, Decision], None] | None = None) -> None:
        self.config = config
        self.plans = plans
        self.roles = roles
        self.targets = targets
        self.signals = signals
        self.apply_threshold = apply_threshold
        self.holder = holder
        self.on_decision = on_decision  # the metric
        self.clock = clock
        self.record = record  # each round's signals and decision (router/planner/record.py)
        self.state = PlannerState()
        self.leading = False
        self.last: Decision | None = None
        self._errors = RateLimitedLog(log)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-planner", daemon=True)

    def start(self) -> "PlannerLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        if self.leading:
            try:
                self.plans.release(self.holder)  # another router takes over at its next round
            except Exception as e:  # Redis gone: the lease lapses by itself
                log.warning("planner could not release its lease: %s", e)
            self.leading = False
        if self.record is not None and hasattr(self.record, "close"):
            self.record.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self.round()

    def round(self) -> Decision | None:
        """Lead (decide, report, act) or follow (apply the plan's threshold); the decision when
        this planner led, None when it followed or Redis failed."""
        try:
            was, self.leading = self.leading, self.plans.lead(self.holder, self.config.leader_lease_s)
            if was != self.leading:
                log.info("planner %s %s", self.holder, "leads" if self.leading else "follows")
            if not self.leading:
                self._follow()
                return None
            return self._lead()
        except Exception as e:  # Redis down or hung (bounded), or a bug: stand still this round
            self._errors.warning(type(e).__name__, "planner round skipped: %s: %s", type(e).__name__, e)
            return None

    def _follow(self) -> None:
        plan = self.plans.read()
        if plan and plan.get("applied") and isinstance(plan.get("threshold"), int):
            self.apply_threshold(plan["threshold"])

    def _lead(self) -> Decision:
        cfg = self.config
        with tracing.tracer().start_as_current_span("planner.decide") as span:
            s = self.signals()
            d = decide(s, self.state, cfg)
            if self.record is not None:
                try:
                    self.record(s, d)
                except OSError as e:  # a full disk costs the recording, not the planner
                    self._errors.warning("record", "planner round not recorded: %s", e)
            applied = cfg.acts and d.acts
            span.set_attributes({"planner.action": d.action, "planner.reason": d.reason, "planner.mode": cfg.mode,
                                 "planner.applied": applied, "planner.detail": d.detail,
                                 **{f"planner.{k}": float(v) for k, v in d.figures.items() if math.isfinite(v)}})
            if applied:
                self._act(d)
            self.plans.publish(plan_record(d, self.holder, cfg.mode, applied, self.clock()))
        self.state = d.state
        same = self.last is not None and (self.last.action, self.last.reason) == (d.action, d.reason)
        self.last = d
        self.on_decision(d.action, d.reason)
        figures = " ".join(f"{k}={v}" for k, v in sorted(d.figures.items()))
        # Every decision is logged; a hold that repeats the last round's at DEBUG (one a round).
        level = logging.DEBUG if same and not d.acts else logging.INFO
        log.log(level, "planner %s%s (%s): %s [%s]", d.action, "" if applied or not d.acts else " (advisory: not applied)",
                d.reason, d.detail, figures)
        return d


    def _act(self, d: Decision) -> None:
        """The decision's wishes, for ``wish_ttl_s``, each leaving at least the bounds' minima in
        the role a node leaves. With pool targets, the wishes go in the same transaction: the
        pool controller counts a node wished to another role in that role (deploy/pool_controller.py),
        so targets seen without the switch they count on (or the switch without its targets) made
        it add a node and remove it again a cool-down later."""
        cfg = self.config
        floors = {Role.PREFILL: cfg.min_prefill_nodes, Role.DECODE: cfg.min_decode_nodes}
        if d.pool_targets is not None:
            self.targets.set(d.pool_targets, d.detail, ttl_s=cfg.wish_ttl_s, wishes=dict(d.roles), floors=floors)
        else:
            for node_id, role in sorted(d.roles.items()):
                self.roles.request(node_id, role, d.detail, ttl_s=cfg.wish_ttl_s, floors=floors)
        self.apply_threshold(d.threshold)


def threshold_setter(policy) -> Callable[[int], None]:
    """The live short-prompt threshold: a placement policy reads ``short_prompt_tokens`` on every
    ``choose``; one attribute store is atomic, so a request placed meanwhile sees the old value
    or the new one."""
    def apply(tokens: int) -> None:
        if policy.short_prompt_tokens != tokens:
            log.info("short-prompt threshold %d -> %d tokens", policy.short_prompt_tokens, tokens)
            policy.short_prompt_tokens = tokens
    return apply


def router_planner(config: PlannerConfig, client, namespace: str, refresher, costs, orchestrator, policy,
                   on_decision: Callable[[str, str], None]) -> PlannerLoop:
    """The planner of a router process (frontend/server.py): its signals from the router's node
    view, finished requests, cost book and prefill ledger; its stores on the router's Redis
    client (bounded waits)."""
    decode_fit = DecodeFit()
    started = time.time()

    def signals() -> PlannerSignals:
        view = refresher.view
        unloaded_tpot_s = orchestrator.window.unloaded_tpot_s()
        decode_fit.observe(view.nodes, unloaded_tpot_s)
        now = time.time()
        draining = len(view.live) - len(view.nodes) if view.live is not None else 0
        requests = orchestrator.window.recent(now, config.window_s, config.min_requests)
        # A window stretched back to hold min_requests covers their time, not window_s.
        span = max(config.window_s, now - min((r.at for r in requests), default=now))
        return build_signals(view.nodes, requests, costs, decode_fit.model, orchestrator.ledger.backlog_s(),
                             policy.short_prompt_tokens, now, span, max(draining, 0), observed_since=started,
                             offered_rps=orchestrator.window.offered_rps(
                                 now, config.window_s, since=started, burst_s=min(config.burst_window_s,
                                                                                  config.window_s / 2)),
                             unloaded_tpot_s=unloaded_tpot_s, decode_by_mix=decode_fit.by_mix())

    holder = f"router@{socket.gethostname()}:{os.getpid()}/{uuid.uuid4().hex[:6]}"
    return PlannerLoop(config, PlanStore(client, namespace), RoleStore(client, namespace),
                       PoolTargets(client, namespace), signals, threshold_setter(policy), holder, on_decision,
                       record=RoundRecorder(config.record) if config.record else None)
