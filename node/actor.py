"""A serving node as a Ray actor, whatever its role.

Ray places, restarts and names the node; gRPC carries everything else (no tensors through
Ray). A restarted actor builds a fresh engine and registers again, which drops whatever its
previous life published to the index (NodePublisher.register). SIGTERM drains the node (it
finishes its requests, leaves the index) and the actor then exits for good (NodeServer.drain).

Failures. A node whose engine turned unhealthy (node/server.py) has left the index; its actor
then ends its process so that Ray restarts it: a fresh process is what clears a wedged
accelerator or a corrupt engine state, and the restart is cheap next to a node that is
silently gone. Ray restarts without pause and without limit (``max_restarts=-1``), so the actor
bounds the loop itself (node/start_guard.py): it waits longer before each start after a failed
one, and after ``max_start_failures`` failed lives in a row its constructor raises, which Ray
never restarts; the node stays down with its reason in its health record (`pdserve status`).

The role's server comes from ``build_server``, a module-level function (``deploy.nodes.
build_any_role``, or a role package's own ``build_server``). Ray ships it by reference and the
actor calls it in its own process, so torch and the model load there, never in the driver.

Roles change live (node/role_switch.py): the node serves another role over the same engine
when its desired role (kv_index/roles.py) differs, polled after every heartbeat, or on
``switch_role``; ``address`` then returns the new role server's port. A factory that builds
one role only (no ``roles`` attribute naming both) makes every switch a refusal.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import ray

from kv_index.client import RedisTimeouts, redis_client
from kv_index.health import HealthStore
from kv_index.roles import RoleStore
from node.config import NodeConfig, ray_actor_options
from node.health import StartPolicy
from node.role_switch import RoleSwitcher
from node.start_guard import NodeDownError, StartGuard
from telemetry.role_switch_metrics import RoleSwitchMetrics

if TYPE_CHECKING:  # the server module loads torch: only the actor's process imports it
    from node.server import NodeServer

ServerFactory = Callable[[NodeConfig], "NodeServer"]

log = logging.getLogger(__name__)

# How often the actor copies its node's figures into the Ray dashboard's gauges.
DASHBOARD_PERIOD_S = 5.0
# Ray dashboard gauge (exported as ray_<name>) -> what it shows. Names use "_" only (Ray
# refuses ":"); the Prometheus names on the node's own /metrics are the pdserve: ones.
DASHBOARD_GAUGES = {
    "pdserve_num_requests_running": "Sequences in the node engine's running batch.",
    "pdserve_num_requests_waiting": "Sequences waiting for a slot in the node's engine.",
    "pdserve_kv_cache_usage_perc": "Fraction of the node's KV blocks in use (1 = full).",
    "pdserve_running_tokens": "Tokens (prompt + output) of running sequences: their KV footprint.",
    "pdserve_prefix_cache_hit_ratio": "Prompt tokens found in the prefix cache over those looked up, since start.",
    "pdserve_spec_decode_acceptance": "Draft tokens accepted over draft tokens proposed, since start (decode).",
    "pdserve_kv_transfer_failures": "KV transfers that failed on this node, since start.",
}
DASHBOARD_TAGS = ("node_id", "role", "model_name")


def dashboard_values(stats: Mapping) -> dict[str, float]:
    """A node's ``stats()`` -> the dashboard gauges' values (a figure the node lacks is left out)."""
    out = {"pdserve_num_requests_running": stats.get("running"),
           "pdserve_num_requests_waiting": stats.get("waiting"),
           "pdserve_kv_cache_usage_perc": stats.get("kv_usage"),
           "pdserve_running_tokens": stats.get("running_tokens"),
           "pdserve_kv_transfer_failures": stats.get("transfer_failures")}
    queries = stats.get("prefix_cache_query_tokens")
    if queries:
        out["pdserve_prefix_cache_hit_ratio"] = stats.get("prefix_cache_hit_tokens", 0) / queries
    spec = stats.get("speculative") or {}
    if spec.get("draft_tokens"):
        out["pdserve_spec_decode_acceptance"] = spec.get("accepted_tokens", 0) / spec["draft_tokens"]
    return {k: float(v) for k, v in out.items() if v is not None}


def with_advertised_host(config: NodeConfig, env: Mapping[str, str], node_ip: Callable[[], str]) -> NodeConfig:
    """A node bound to every interface (a pod's 0.0.0.0) registers the address of where it runs:
    ``$POD_IP`` (the chart sets it from the pod's status), else the Ray node's IP. The driver
    that spawned the actor cannot know it: Ray picks the host."""
    if config.advertised_host is not None:
        return config
    return replace(config, advertise_host=env.get("POD_IP") or node_ip())


@ray.remote
class NodeActor:
    """Starts the role's server in the actor process; its methods are idempotent reads."""

    def __init__(self, config: NodeConfig, build_server: ServerFactory) -> None:
        if config.cpu_affinity:  # before the model loads: torch sizes its pools from what it may use
            os.sched_setaffinity(0, set(config.cpu_affinity))
        config = with_advertised_host(config, os.environ, ray.util.get_node_ip_address)
        self._redis = redis_client(config.redis_url, RedisTimeouts(config.redis_connect_timeout_s,
                                                                   config.redis_timeout_s))
        self._guard = StartGuard(HealthStore(self._redis, config.namespace), config.node_id,
                                 StartPolicy(config.max_start_failures),
                                 reconstructed=ray.get_runtime_context().was_current_actor_reconstructed)
        self._guard.before_start()  # raises NodeDownError: the node stays down
        try:
            self._server = build_server(config)
            self._address = self._server.start()
        except Exception as err:
            if self._guard.start_failed(err):
                raise NodeDownError(f"node {config.node_id} stays down after {self._guard.failures} failed "
                                    f"starts in a row; last: {err!r}") from err
            log.exception("%s failed to start; exiting so that Ray starts it again", config.node_id)
            _exit_for_restart()
        self._guard.started()
        self._stop = threading.Event()
        self._server.on_unhealthy = self._restart_unhealthy
        tags = {"node_id": config.node_id, "role": config.role.value, "model_name": config.engine.model}
        self._tags = tags
        # Live role switches (node/role_switch.py): polled after each heartbeat on the index
        # publisher's thread, or asked for directly (``switch_role``).
        self._switcher = RoleSwitcher(
            self._server, build_server, RoleSwitchMetrics(config.served_model_name or config.engine.model,
                                                          config.node_id),
            on_new_server=self._serving, on_fatal=lambda err: self._restart_unhealthy(f"role switch failed: {err!r}"))
        roles = RoleStore(self._redis, config.namespace)
        self._server.publisher.on_beat = lambda: self._switcher.poll(roles)
        threading.Thread(target=self._export_to_dashboard, args=(tags,), name="ray-dashboard-metrics",
                         daemon=True).start()
        # SIGTERM (a pod going away, an operator) drains instead of dropping the requests in
        # flight. Ray runs a sync actor's __init__ on the process's main thread, the only one
        # that may set a handler; its own handler (exit at once) is replaced.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self._stop.is_set():  # the handler must return at once: drain on a thread
            self._stop.set()
            threading.Thread(target=self._drain_and_exit, name="drain", daemon=True).start()

    def _restart_unhealthy(self, reason: str) -> None:
        """The server turned unhealthy and left the index: record it and end this process, so
        that Ray starts a fresh one (or, after too many failed lives, the next one stays down)."""
        self._stop.set()
        self._guard.unhealthy(reason)
        try:
            self._server.stop(deregister=True, grace_s=2.0)  # its streams have ended: let them flush
        except Exception:
            log.exception("stop of an unhealthy node failed")
        log.error("%s unhealthy (%s); exiting so that Ray restarts it", self._server.config.node_id, reason)
        _exit_for_restart()

    def _serving(self, server: NodeServer) -> None:
        """A role switch is done: ``server`` serves now (same engine, new role and address)."""
        server.on_unhealthy = self._restart_unhealthy
        self._server, self._address = server, server.address
        self._tags["role"] = server.role.value

    def switch_role(self, role: str, timeout_s: float | None = None) -> dict:
        """Serve ``role`` from now on, over the loaded model (node/role_switch.py); returns when
        done: outcome ("ok", "timeout", "refused", "failed", "unchanged"), seconds, reason, the
        new address. ``timeout_s`` bounds the drain (default drain_timeout_s). Ray's control
        plane only; the planner's path is kv_index/roles.py RoleStore, polled every heartbeat."""
        try:
            return self._switcher.switch(role, timeout_s).as_dict()
        except Exception as err:  # no role serves: restart (a fresh process, its configured role)
            self._restart_unhealthy(f"role switch failed: {err!r}")
            raise

    def _drain_and_exit(self) -> None:
        try:
            self._switcher.close().drain()  # after a switch in progress, on the role it ended in
        except Exception:  # exit anyway: the lease expires what a failed drain left
            log.exception("drain failed")
        self._guard.clear()  # an intended stop: nothing to report
        # An exit through the actor's own method is intentional: Ray does not restart it. No
        # retries: a retry pending on the exiting actor would keep its process alive.
        ray.get_runtime_context().current_actor.exit_drained.options(max_task_retries=0).remote()

    def exit_drained(self) -> None:
        ray.actor.exit_actor()

    def address(self) -> str:
        return self._address

    def ready(self) -> bool:
        return self._server.aengine is not None and self._server.aengine.alive

    def stats(self) -> dict:
        # The pid tells restarts apart (a restarted actor is a new process).
        switching = self._switcher.switching
        return {**self._server.stats(), "pid": os.getpid(),
                "switching_to": switching.value if switching is not None else None}

    def set_step_delay(self, seconds: float) -> None:
        """Fault injection for `pdserve chaos` (a slow node): sleep this long after each engine
        step. Reached through Ray's control plane only, never from a pdserve socket."""
        self._server.aengine.step_delay_s = float(seconds)

    def set_step_fault(self, steps: int, fatal: bool = False) -> int:
        """Fault injection for `pdserve chaos --scenario step-error` (node/faults.py): the next
        ``steps`` engine steps raise (-1: every step until ``set_step_fault(0)``; ``fatal``: the
        engine thread dies of it). Ray's control plane only. Returns the steps failed so far."""
        return self._server.set_step_fault(int(steps), bool(fatal))

    def set_kv_fault(self, mode: str | None) -> None:
        """Fault injection for `pdserve chaos --scenario corrupt-kv` (prefill nodes): damage
        every KV push ("flip", "cut"), or None to stop. Ray's control plane only."""
        self._server.set_kv_fault(mode)

    def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain (up to ``drain_timeout_s``, default the config's), leave the index and stop
        serving (then end the actor with ray.kill)."""
        self._stop.set()
        self._switcher.close().drain(drain_timeout_s)
        self._guard.clear()

    def _export_to_dashboard(self, tags: dict[str, str]) -> None:
        """Every DASHBOARD_PERIOD_S, the node's main figures into ``ray.util.metrics`` gauges,
        so they show on the Ray dashboard's metrics view next to the named actor."""
        from ray.util.metrics import Gauge

        gauges = {name: Gauge(name, description=doc, tag_keys=DASHBOARD_TAGS)
                  for name, doc in DASHBOARD_GAUGES.items()}
        while True:
            try:
                aengine = self._server.aengine
                if self._guard.pending and aengine is not None and aengine.health.good_steps:
                    self._guard.proven()  # this life works: earlier failures are forgiven
                for name, value in dashboard_values(self._server.stats()).items():
                    gauges[name].set(value, tags=tags)
            except Exception:  # the dashboard is a view: never let it take the actor down
                log.exception("exporting dashboard metrics failed")
            if self._stop.wait(DASHBOARD_PERIOD_S):
                return


def _exit_for_restart() -> None:
    """End this process as a crash would: Ray restarts an actor whose process died (an exit
    through ``ray.actor.exit_actor`` would be final)."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def spawn_node(config: NodeConfig, build_server: ServerFactory, *, gpu: bool = False,
               accelerator_type: str | None = None, num_cpus: float = 1, detached: bool = False,
               extra_resources: dict[str, float] | None = None):
    """Start a node actor named ``config.node_id`` in its role's pool; returns its handle."""
    opts = ray_actor_options(config, gpu=gpu, accelerator_type=accelerator_type, num_cpus=num_cpus,
                             detached=detached, extra_resources=extra_resources)
    return NodeActor.options(**opts).remote(config, build_server)
