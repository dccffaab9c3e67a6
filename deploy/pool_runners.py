"""Where the pool controller (deploy/pool_controller.py) runs: `pdserve nodes --follow-targets`
(its flags, bounds checked before Ray is asked anything, the controller over the supervisor's
actors) and `pdserve up --planner active --planner-resize` (``LocalPools``: a thread in the
launcher, room in its private Ray for the largest pools allowed); and where `pdserve nodes`
starts a cluster generation (``begin_generation``; `pdserve up` starts one in its launcher)."""
from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from deploy.pool_controller import PoolBounds, PoolController, node_name_role
from kv_index.nodes import Role

if TYPE_CHECKING:
    from deploy.nodes import NodeSupervisor, NodeTemplate

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- `pdserve nodes`: the generation
def begin_generation(template: NodeTemplate, actor_names: Sequence[str] | None = None) -> str | None:
    """`pdserve nodes` at start (``ray.init`` first): with no node actor of its namespace to
    adopt (``actor_names``: default Ray's named actors), its nodes are a fresh cluster (an
    install, or a reinstall on a Redis that outlived the last one), so a new generation starts
    and the wishes and targets of the earlier one are dropped (kv_index/roles.py); with some, a
    restarted supervisor goes on with the same cluster and its wishes. Returns the new
    generation, or None."""
    from kv_index.client import RedisTimeouts, redis_client
    from kv_index.roles import start_generation

    if actor_names is None:
        import ray

        actor_names = ray.util.list_named_actors()
    adopted = sorted(n for n in actor_names if node_name_role(n) is not None)
    if adopted:
        log.info("adopting %d node actors (%s): the cluster generation goes on", len(adopted), ", ".join(adopted))
        return None
    import redis

    client = redis_client(template.redis_url, RedisTimeouts(template.redis_connect_timeout_s, template.redis_timeout_s))
    try:
        gen = start_generation(client, template.namespace)
    except redis.RedisError as e:  # the nodes cannot read wishes either; expiry and floors still hold
        log.warning("no new cluster generation: Redis did not answer (%s); wishes of an earlier cluster stand "
                    "until they expire", e)
        return None
    finally:
        client.close()
    log.info("a fresh cluster: generation %s (role wishes and pool targets of earlier ones dropped)", gen)
    return gen


# ---------------------------------------------------------------------- `pdserve nodes --follow-targets`
def add_pool_arguments(p: argparse.ArgumentParser) -> None:
    from node.config import pool_resource

    p.add_argument("--follow-targets", action="store_true",
                   help="follow the pool targets the planner writes to Redis (deploy/pool_controller.py): one node "
                        "added or removed (drained first) at a time, within the bounds below; --prefill-nodes and "
                        "--decode-nodes are the counts until targets are first set")
    for role, lo in ((Role.PREFILL, 0), (Role.DECODE, 1)):
        p.add_argument(f"--min-{role.value}-nodes", type=int, default=lo,
                       help=f"--follow-targets: never fewer {role.value} nodes (default {lo})")
        p.add_argument(f"--max-{role.value}-nodes", type=int, default=None,
                       help=f"--follow-targets: never more {role.value} nodes (default: no limit; an actor "
                            f"without a free {pool_resource(role)} unit waits for one, e.g. a pod KubeRay adds)")
    p.add_argument("--pool-cooldown-s", type=float, default=30.0,
                   help="--follow-targets: seconds after one pool change (a drain's end) before the next")
    p.add_argument("--pool-start-timeout-s", type=float, default=900.0,
                   help="--follow-targets: seconds an added node may take to register (a new pod scheduled, its "
                        "image pulled, the model loaded) before it is removed for a fresh try")


def pool_bounds(a: argparse.Namespace):
    """The flags' pool bounds; SystemExit naming the limit for bounds that cannot hold."""
    try:
        return PoolBounds({r: getattr(a, f"min_{r.value}_nodes") for r in Role},
                          {r: getattr(a, f"max_{r.value}_nodes") for r in Role})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def pool_controller(a: argparse.Namespace, template: NodeTemplate, supervisor: NodeSupervisor) -> PoolController:
    """The pool controller `pdserve nodes --follow-targets` runs: the supervisor's actors, its
    counts until targets are first set, the flags' bounds, its down nodes."""
    from kv_index.client import RedisTimeouts, redis_client
    from kv_index.health import HealthStore

    bounds = pool_bounds(a)
    client = redis_client(template.redis_url, RedisTimeouts(template.redis_connect_timeout_s,
                                                            template.redis_timeout_s))
    return PoolController(client, template.namespace, bounds, supervisor.spawn, cooldown_s=a.pool_cooldown_s,
                          drain_timeout_s=template.drain_timeout_s, start_timeout_s=a.pool_start_timeout_s,
                          defaults=lambda: {r: supervisor.wanted(r) for r in Role}, down=supervisor.down_nodes,
                          forget=HealthStore(client, template.namespace).clear)


def follow_targets(a: argparse.Namespace, template: NodeTemplate, supervisor: NodeSupervisor,
                   stop: threading.Event) -> None:
    controller = pool_controller(a, template, supervisor)
    if a.once:
        controller.step()
    else:
        controller.run(stop, a.interval_s)


# ---------------------------------------------------------------------- `pdserve up`
def planner_pools(config) -> PoolBounds | None:
    """The bounds `pdserve up` keeps its pools within while they follow the planner's targets:
    None unless its planner is active and resizes pools (``ClusterConfig.planner_config``:
    ``--planner active --planner-resize``, both maxima set). A maximum below the count started
    with is that count. ValueError for bounds that cannot hold."""
    pc = config.planner_config
    if not (pc.acts and pc.resizes):
        return None
    started = {Role.PREFILL: config.prefill_nodes, Role.DECODE: config.decode_nodes}
    return PoolBounds({r: getattr(pc, f"min_{r.value}_nodes") for r in Role},
                      {r: max(started[r], getattr(pc, f"max_{r.value}_nodes") or 0) for r in Role})


def local_pool_resources(config) -> dict[str, int]:
    """The pool units `pdserve up` offers its private Ray: room for the largest pools allowed."""
    from node.config import pool_resource

    bounds = planner_pools(config)
    counts = {Role.PREFILL: config.prefill_nodes, Role.DECODE: config.decode_nodes}
    return {pool_resource(r): counts[r] if bounds is None else max(counts[r], bounds.high(r)) for r in Role}


class LocalPools:
    """The pool controller of a `pdserve up` cluster (deploy/launcher.py LocalCluster) on its
    own thread: spawns nodes as the launcher does and keeps ``cluster.actors`` current."""

    def __init__(self, cluster, template: NodeTemplate, bounds: PoolBounds, cores: Sequence[int]) -> None:
        from dataclasses import replace

        from deploy.node_servers import server_builder
        from kv_index.client import redis_client
        from node.actor import spawn_node
        from telemetry.metrics import PoolMetrics

        cfg = cluster.config
        planner = cfg.planner_config

        def spawn(role: Role, nid: str):
            index = node_name_role(nid)[1]
            affinity = (cores[len(cluster.actors) % len(cores)],) if cfg.pin_cores else None
            node = replace(template.config(role, index, cpu_affinity=affinity), **cluster.node_fields.get(nid, {}))
            # Like the launcher's own nodes: no CPU slot asked, the pools place them.
            cluster.actors[nid] = spawn_node(node, server_builder(role, template.engine.backend), num_cpus=0)
            return cluster.actors[nid]

        orch = getattr(cluster.router, "orchestrator", None)
        registry = getattr(getattr(orch, "metrics", None), "registry", None)
        self.controller = PoolController(
            redis_client(cluster.redis_url), cfg.namespace, bounds, spawn, cooldown_s=planner.cooldown_s,
            drain_timeout_s=cfg.drain_timeout_s, start_timeout_s=cfg.ready_timeout_s,
            on_removed=lambda nid: cluster.actors.pop(nid, None),
            metrics=PoolMetrics(registry, cfg.engine.model) if registry is not None else None)
        self.interval_s = min(1.0, planner.interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.controller.run, args=(self._stop, self.interval_s),
                                        name="pool-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """After the pass under way (a drain included) ends."""
        self._stop.set()
        self._thread.join(timeout=self.controller.drain_timeout_s + 15)
