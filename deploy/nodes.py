"""Node actors on a Ray cluster: the configs `pdserve up` spawns on its own local Ray, and
`pdserve nodes`, which keeps them running on a Ray cluster that already exists (a KubeRay
RayCluster from the Helm chart, or `ray up` on plain VMs).

    pdserve nodes --ray-address 127.0.0.1:6379 --redis-url redis://redis:6379/0 \\
        --prefill-nodes auto --decode-nodes auto --host 0.0.0.0 --grpc-port 50061 \\
        --metrics-port 9400 --model /models/llama [engine flags as for `pdserve up`]

Every pass (``--interval-s``) it compares the named node actors in its Ray namespace with the
wanted count per role and spawns or stops the difference:

    wanted  = --prefill-nodes N, or "auto": one per unit of the pool's custom resource in the
              cluster right now (a worker pod offers {"prefill_pool": 1}: scaling the worker
              group in Kubernetes scales the nodes)
    spawn   = the lowest free indexes: prefill-0, prefill-1, ...
    stop    = the surplus, those that do not answer first (a node whose pod went away is
              pending a restart), then the highest index; each leaves the index before it dies
    down    = a node that failed ``--max-start-failures`` lives in a row stays down (its health
              record in Redis says why, kv_index/health.py): it keeps its name and its place in
              the count and is not spawned again, so a bad model path does not turn into a
              spawn every pass. A supervisor that starts (a new deployment) gives every down
              node one more round of tries.

With ``--follow-targets`` the counts come from the pool targets the planner writes to Redis
instead, within ``--min-/--max-{prefill,decode}-nodes``, one node added or drained and removed at
a time (deploy/pool_controller.py); the flags' counts hold while no target is set.

A ``--host`` other than loopback needs TLS or a shared ``--cluster-token-file``: without either
any peer on the network could call the nodes as a member; ``--insecure-bind`` says to serve so
anyway, and the refusal says why (``bind_problem``).

Actors are detached: they outlive this process, so a restarted supervisor adopts them by name
instead of starting a second set. The node binds ``--host`` and registers the address of the
machine it lands on (node/actor.py ``with_advertised_host``).
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from deploy.node_servers import server_builder
from engine.config import EngineConfig, SpeculativeConfig
from kv_index.nodes import Role
from node.config import NodeConfig, pool_resource
from settings.flags import add_arguments as add_setting_arguments
from settings.flags import from_args, like, setting, shared_values

log = logging.getLogger(__name__)


def node_id(role: Role, index: int) -> str:
    return f"{Role(role).value}-{index}"


def node_index(name: str, role: Role) -> int | None:
    """``prefill-3`` -> 3 for the prefill role; None for any other name."""
    m = re.fullmatch(rf"{Role(role).value}-(\d+)", name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class NodeTemplate:
    """What every node of one cluster shares; ``config`` adds a node's role and index. Its
    fields are NodeConfig's of the same names (their declarations and `pdserve nodes` flags
    are NodeConfig's) and go to every node as they are."""

    engine: EngineConfig
    redis_url: str = setting(repr=False, flag="--redis-url", help="the index (default $PDSERVE_REDIS_URL); its "
                             "password from $PDSERVE_REDIS_PASSWORD")
    namespace: str = like(NodeConfig, "namespace")
    host: str = like(NodeConfig, "host", default="127.0.0.1")
    grpc_port: int = like(NodeConfig, "grpc_port")
    metrics_port: int | None = like(NodeConfig, "metrics_port")
    kv_data_port: int | None = like(NodeConfig, "kv_data_port")  # decode nodes' raw KV data port
    kv_streaming: bool = like(NodeConfig, "kv_streaming")  # prefill nodes send KV layer by layer while they compute
    kv_dist: bool = like(NodeConfig, "kv_dist")  # nodes also receive KV over torch.distributed groups
    # Ranks of each node's engine, by role (NodeConfig.tensor_parallel; sizes may differ: KV
    # crosses with all its heads, docs/cluster.md).
    prefill_tensor_parallel: int = 1
    decode_tensor_parallel: int = 1
    prefill_step_tokens: int | None = None  # the prefill role's step budget (NodeConfig.prefill_step_tokens)
    lease_s: float = like(NodeConfig, "lease_s")
    redis_connect_timeout_s: float = like(NodeConfig, "redis_connect_timeout_s")  # Redis bounds (kv_index/client.py)
    redis_timeout_s: float = like(NodeConfig, "redis_timeout_s")
    otlp_endpoint: str | None = like(NodeConfig, "otlp_endpoint")
    served_model_name: str | None = like(NodeConfig, "served_model_name")  # the router's --model-name (metrics label)
    # SIGTERM / stop: how long a node finishes its requests
    drain_timeout_s: float = like(NodeConfig, "drain_timeout_s")
    max_step_failures: int = like(NodeConfig, "max_step_failures")  # failed engine steps in a row: unhealthy
    max_start_failures: int = like(NodeConfig, "max_start_failures")  # failed lives in a row: stays down
    # Mutual TLS between members (NodeConfig's fields of the same names).
    tls_cert_file: str | None = like(NodeConfig, "tls_cert_file")
    tls_key_file: str | None = like(NodeConfig, "tls_key_file")
    tls_ca_file: str | None = like(NodeConfig, "tls_ca_file")
    tls_server_name: str | None = like(NodeConfig, "tls_server_name")
    cluster_token_file: str | None = like(NodeConfig, "cluster_token_file")  # the prefix-fetch link without TLS

    def config(self, role: Role, index: int, **fields) -> NodeConfig:
        role = Role(role)
        # Speculation is a decode-role feature; prefill nodes produce one token per request.
        engine = self.engine if role is Role.DECODE else replace(self.engine, speculative=SpeculativeConfig())
        if engine.cache.disk_cache_dir:  # a disk KV tier is one node's: its own subdirectory, kept across restarts
            engine = replace(engine, cache=replace(engine.cache, disk_cache_dir=os.path.join(
                engine.cache.disk_cache_dir, node_id(role, index))))
        tensor_parallel = self.prefill_tensor_parallel if role is Role.PREFILL else self.decode_tensor_parallel
        # Both roles load the tokenizer: the prefill node samples a structured output's first
        # token under its grammar, built from the tokenizer's vocabulary.
        return NodeConfig(**{**shared_values(self, NodeConfig), "node_id": node_id(role, index), "role": role,
                             "heartbeat_s": min(0.5, self.lease_s / 4), "engine": engine, "load_tokenizer": True,
                             "tensor_parallel": tensor_parallel, **fields})


@dataclass(frozen=True, slots=True)
class PoolResources:
    """What each node actor of a role asks Ray for besides one unit of its pool."""

    gpu: bool = False
    accelerator_type: str | None = None
    num_cpus: float = 0  # the pool unit, not CPU slots, places a node
    # A custom resource the pool's hosts offer (`ray start --resources '{"zone_a": 1}'`): each
    # node asks for a sliver of it, a label rather than a count, so the pool's units still
    # say how many fit while only those hosts are eligible.
    ray_resource: str | None = None

    def extra_resources(self) -> dict[str, float] | None:
        return {self.ray_resource: RESOURCE_LABEL_UNITS} if self.ray_resource else None


RESOURCE_LABEL_UNITS = 0.001


class Plan(NamedTuple):
    spawn: tuple[str, ...]
    stop: tuple[str, ...]


def plan(role: Role, want: int, existing: Mapping[str, bool]) -> Plan:
    """Names to spawn and to stop so that ``want`` actors of ``role`` exist.

    ``existing``: actor name -> whether it answered (a node that stays down is there, False);
    names of other roles are ignored. The surplus goes unanswering first, then highest index;
    new actors take the lowest free indexes.
    """
    mine = {name: alive for name, alive in existing.items() if node_index(name, role) is not None}
    surplus = max(0, len(mine) - want)
    order = sorted(mine, key=lambda n: (mine[n], -node_index(n, role)))
    stop = tuple(order[:surplus])
    taken = {node_index(n, role) for n in mine}
    free = (i for i in range(len(mine) + want) if i not in taken)
    spawn = tuple(node_id(role, next(free)) for _ in range(max(0, want - len(mine))))
    return Plan(spawn, stop)


def pool_capacity(resources: Mapping[str, float], role: Role) -> int:
    """Node actors of ``role`` the cluster has room for: its pool resource's total."""
    return int(resources.get(pool_resource(role), 0))


class NodeSupervisor:
    """Keeps the wanted node actors alive on the connected Ray cluster (``ray.init`` first).

    ``counts``: role -> wanted actors, None = the pool's capacity. ``build_server`` gives the
    role's server factory (``server_builder``; tests pass their own).
    """

    def __init__(self, template: NodeTemplate, counts: Mapping[Role, int | None],
                 resources: Mapping[Role, PoolResources] | None = None,
                 build_server: Callable[[Role], Callable] | None = None, probe_s: float = 2.0) -> None:
        self.template = template
        self.counts = dict(counts)
        self.resources = dict(resources or {})
        self.build_server = build_server or (lambda role: server_builder(role, template.engine.backend))
        self.probe_s = probe_s
        self._store = None  # kv_index.health.HealthStore, made on first use
        self._reported: set[str] = set()  # down nodes already logged

    def wanted(self, role: Role) -> int:
        import ray

        count = self.counts.get(role)
        return pool_capacity(ray.cluster_resources(), role) if count is None else count

    def _existing(self) -> dict[str, object]:
        import ray

        handles = {}
        for name in ray.util.list_named_actors():
            if any(node_index(name, r) is not None for r in Role):
                try:
                    handles[name] = ray.get_actor(name)
                except ValueError:  # died between the listing and the lookup
                    continue
        return handles

    def _health(self):
        from kv_index.client import RedisTimeouts, redis_client
        from kv_index.health import HealthStore

        if self._store is None:
            t = self.template
            self._store = HealthStore(redis_client(t.redis_url, RedisTimeouts(t.redis_connect_timeout_s,
                                                                              t.redis_timeout_s)), t.namespace)
        return self._store

    def down_nodes(self) -> dict[str, str]:
        """Nodes of this namespace that stay down -> why (none when Redis does not answer)."""
        import redis

        from kv_index.health import DOWN

        try:
            records = self._health().read_all()
        except redis.RedisError as e:
            log.warning("health records unreadable (%s): no node counted as down this pass", e)
            return {}
        down = {nid: rec.reason for nid, rec in records.items()
                if rec.state == DOWN and any(node_index(nid, r) is not None for r in Role)}
        for nid in down.keys() - self._reported:
            log.error("%s stays down (not spawned again until the supervisor restarts): %s", nid, down[nid])
        self._reported = set(down)
        return down

    def reset_down(self) -> list[str]:
        """Give every down node another round of tries (a new supervisor: new flags, maybe a
        fixed model path). Returns their ids."""
        down = list(self.down_nodes())
        for nid in down:
            self._health().clear(nid)
        return down

    def _answering(self, handles: Mapping[str, object]) -> dict[str, bool]:
        import ray

        refs = {name: h.ready.remote() for name, h in handles.items()}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.probe_s) if refs else ([], [])
        answered = set(done)
        out = {}
        for name, ref in refs.items():
            try:
                out[name] = ref in answered and bool(ray.get(ref))
            except ray.exceptions.RayError:
                out[name] = False
        return out

    def step(self) -> dict[Role, Plan]:
        """One pass: spawn the missing actors, stop the surplus. Returns what it did per role."""
        import ray

        handles = self._existing()
        alive = {**{nid: False for nid in self.down_nodes()}, **self._answering(handles)}
        done = {}
        for role in Role:
            p = done[role] = plan(role, self.wanted(role), alive)
            for name in p.stop:
                if name not in handles:  # down: no actor left, only its record
                    self._health().clear(name)
                    continue
                log.info("stopping %s", name)
                try:  # leave the index and stop serving, then end the actor for good
                    ray.get(handles[name].stop.remote(), timeout=self.template.drain_timeout_s + 10)
                except ray.exceptions.RayError as e:
                    log.info("%s did not stop cleanly (%s); killing it", name, type(e).__name__)
                ray.kill(handles[name], no_restart=True)
            for name in p.spawn:
                self.spawn(role, name)
        return done

    def spawn(self, role: Role, name: str):
        """Start the detached node actor ``name`` (``{role}-{index}``) in its role's pool."""
        from node.actor import spawn_node

        log.info("spawning %s", name)
        res = self.resources.get(role, PoolResources())
        return spawn_node(self.template.config(role, node_index(name, role)), self.build_server(role), gpu=res.gpu,
                          accelerator_type=res.accelerator_type, num_cpus=res.num_cpus, detached=True,
                          extra_resources=res.extra_resources())

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while True:
            self.step()
            if stop.wait(interval_s):
                return


# ---------------------------------------------------------------------- `pdserve nodes`
def _count(text: str) -> int | None:
    if text == "auto":
        return None
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"a node count is >= 0 or 'auto', got {text}")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve nodes` flags beyond the engine's (deploy/cli.py adds those)."""
    p.add_argument("--ray-address", default="auto", help="the Ray cluster's GCS address (HOST:PORT, or auto)")
    for role in Role:
        p.add_argument(f"--{role.value}-nodes", type=_count, default=None, metavar="N|auto",
                       help=f"{role.value} node actors (default auto: one per {pool_resource(role)} unit)")
        p.add_argument(f"--{role.value}-gpu", action="store_true", help=f"each {role.value} node takes one GPU")
        p.add_argument(f"--{role.value}-accelerator-type", default=None,
                       help=f"Ray accelerator type {role.value} nodes need (e.g. H100)")
        p.add_argument(f"--{role.value}-ray-resource", default=None, metavar="NAME",
                       help=f"a custom resource the hosts that may run {role.value} nodes offer (pins the pool to them)")
    # The nodes' own settings (NodeConfig's declarations, by way of NodeTemplate).
    add_setting_arguments(p, NodeTemplate, defaults={"redis_url": os.environ.get("PDSERVE_REDIS_URL"),
                                                     "host": "0.0.0.0"})
    add_per_role_arguments(p)
    p.add_argument("--interval-s", type=float, default=10.0, help="seconds between two passes")
    from deploy.pool_runners import add_pool_arguments

    add_pool_arguments(p)  # --follow-targets and the pool bounds
    p.add_argument("--once", action="store_true", help="one pass, then exit (the actors stay)")
    p.add_argument("--insecure-bind", action="store_true",
                   help="serve on a non-loopback --host with neither TLS nor --cluster-token-file (refused otherwise: "
                        "docs/security.md)")
    p.add_argument("--connect-timeout-s", type=float, default=300.0, help="how long to wait for Ray to answer")


def template_from_args(a: argparse.Namespace, engine: EngineConfig, env: Mapping[str, str]) -> NodeTemplate:
    from kv_index.redis_url import resolve_redis_url

    if not a.redis_url:
        raise SystemExit("error: pass --redis-url or set PDSERVE_REDIS_URL")
    try:
        tp = tensor_parallel_sizes(a)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return from_args(NodeTemplate, a, engine=engine, redis_url=resolve_redis_url(a.redis_url, env),
                     prefill_tensor_parallel=tp[0], decode_tensor_parallel=tp[1],
                     prefill_step_tokens=a.prefill_step_tokens)


def add_per_role_arguments(p: argparse.ArgumentParser) -> None:
    """What differs between the roles' nodes (`pdserve up` and `pdserve nodes`):
    ``--tensor-parallel`` and its per-role overrides, and the prefill role's step budget."""
    p.add_argument("--prefill-step-tokens", type=int, default=None, metavar="N",
                   help="each engine's per-step token budget while its node prefills for others (default "
                        "--max-num-batched-tokens, which the decode role keeps: a node that changes role "
                        "prefills in longer chunks with no decodes to stall)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="ranks of each node's engine (CPU processes, or GPUs with --*-gpu), each holding 1/N of the "
                        "heads; N must divide the model's attention and KV heads")
    for role in Role:
        p.add_argument(f"--{role.value}-tensor-parallel", type=int, default=None, metavar="N",
                       help=f"ranks of each {role.value} node (default --tensor-parallel)")


def tensor_parallel_sizes(a: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) ranks per node from the flags; ValueError naming a size below 1."""
    per_role = (getattr(a, f"{r.value}_tensor_parallel") for r in (Role.PREFILL, Role.DECODE))
    sizes = tuple(a.tensor_parallel if n is None else n for n in per_role)
    if min(sizes) < 1:
        raise ValueError(f"tensor_parallel sizes must be >= 1, got prefill {sizes[0]}, decode {sizes[1]}")
    return sizes


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name, or every interface: reachable from elsewhere
        return False


def bind_problem(t: NodeTemplate) -> str:
    """Why the nodes must not serve as ``t`` says without ``--insecure-bind`` ("" if they may).
    Without TLS and without a cluster token, anyone who reaches a node's ports may call it like a
    member: name a holder to fetch KV from (which then serves every user as cached blocks), ask
    it to push prefixes and pin its pool, push KV into what it reserved."""
    if is_loopback_host(t.host) or (t.tls_cert_file and t.tls_ca_file) or t.cluster_token_file:
        return ""
    return (f"the nodes would bind {t.host!r}, which is not loopback, with TLS off and no cluster token: any peer that "
            "reaches their ports could call them as a cluster member (fetch KV from a holder of its choosing that "
            "then serves every user, pin their pools, make them dial out). Give them TLS (--tls-cert-file, "
            "--tls-key-file, --tls-ca-file) or a shared --cluster-token-file, bind --host 127.0.0.1, or pass "
            "--insecure-bind to serve in plaintext on this network anyway (docs/security.md)")


def _connect(address: str, namespace: str, timeout_s: float) -> None:
    """``ray.init`` until the cluster answers: beside a Ray head that is still starting, the
    first tries fail."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
            return
        except ConnectionError as e:
            if time.monotonic() > deadline:
                raise
            log.info("Ray at %s not answering yet (%s); retrying", address, e)
            time.sleep(2.0)


def run(a: argparse.Namespace, engine: EngineConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    template = template_from_args(a, engine, os.environ)
    if a.follow_targets:
        from deploy.pool_runners import follow_targets, pool_bounds

        pool_bounds(a)  # refused before Ray is asked anything
    problem = bind_problem(template)
    if problem and not a.insecure_bind:
        raise SystemExit(f"error: {problem}")
    if problem:
        log.warning("--insecure-bind: %s", problem)
    counts = {role: getattr(a, f"{role.value}_nodes") for role in Role}
    if engine.backend == "vllm":  # decode nodes that prefill their own prompts (deploy/node_servers.py)
        if counts[Role.PREFILL] or a.follow_targets:
            raise SystemExit("error: --engine vllm runs decode nodes only: pass --prefill-nodes 0 and no "
                             "--follow-targets (vLLM prefill nodes need the KV connector, issue 46 section 2)")
        counts[Role.PREFILL] = 0
    resources = {role: PoolResources(gpu=getattr(a, f"{role.value}_gpu"),
                                     accelerator_type=getattr(a, f"{role.value}_accelerator_type"),
                                     ray_resource=getattr(a, f"{role.value}_ray_resource")) for role in Role}
    _connect(a.ray_address, a.namespace, a.connect_timeout_s)
    supervisor = NodeSupervisor(template, counts, resources)
    from deploy.pool_runners import begin_generation

    begin_generation(template)  # no node to adopt: a fresh cluster, earlier wishes dropped
    for nid in supervisor.reset_down():
        log.info("%s was down; trying it again", nid)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    if a.follow_targets:
        follow_targets(a, template, supervisor, stop)
    elif a.once:
        supervisor.step()
    else:
        supervisor.run(stop, a.interval_s)
    return 0
