"""The scenario registry and the one way every scenario runs.

    reference run  the requests, no fault (after the faulted run where the fault needs prompts
                   no node has cached: kill-prefill, freeze-prefill, corrupt-kv)
    faulted run    the same requests; the fault injected mid-way (chaos/scenario_*.py)
    result         the clients' figures against the reference (chaos/history.py), the
                   router's migrations over the run, ``detect_s``, ``recovery_s``, the
                   scenario's own figures, and ``checks``: each expectation -> whether it held

``detect_s``: from the fault to the first migration the router made (the router's counters,
watched every 50 ms), or where nothing migrates, to what the scenario names (slow-node: until
placement leaves the node out; redis-hang: until the router says ``degraded``; all-decode-down:
until its health says NOT_SERVING; restart-router, restart-router-replicas: until a client saw an error; corrupt-kv: none). ``recovery_s``: the longest wait, from the fault,
for the next token of a request open at the fault (after a client's retry, the retry's first).
"""
from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from chaos import faults, scenario_host, scenario_infra, scenario_nodes, scenario_rcluster
from chaos.cluster import FirstIncrease
from chaos.context import Options, Outcome, Run
from chaos.history import Expect, Figure, checks, figures, problems, recovery_s
from chaos.workload import Batch, Reference, make_specs


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    body: Callable[[Run], Outcome]
    fault_first: bool = False  # the faulted run goes before its reference (uncached prompts)
    failures_allowed: bool = False  # requests may fail with a typed error after their retries
    http_every: int = 4  # every http_every-th pair of requests goes over HTTP
    expect: Callable[[Options], tuple[Expect, ...]] = lambda o: ()
    needs_decode: int = 1  # decode nodes the scenario needs
    shape: Callable[[list], list] = lambda specs: specs  # the scenario's own changes to its requests
    redis: str = "any"  # "single": needs one redis-server of its own; "cluster": a Redis Cluster (--redis-cluster)


def _restarted(o: Options) -> tuple[Expect, ...]:
    return (Expect("restart_s", "not_none"),) if o.restart_timeout_s > 0 else ()


def _served_after_restart(o: Options) -> tuple[Expect, ...]:
    """all-decode-down: requests sent once every decode node is back all complete (only when
    the run waits for Ray's restart: without it there is no "after")."""
    if o.restart_timeout_s <= 0:
        return ()
    return (Expect("sent_after_restart", ">=", 1),
            Expect("completed_after_restart", "==", Figure("sent_after_restart")))


def _detected(o: Options) -> tuple[Expect, ...]:
    return (Expect("detect_s", "<=", o.detect_bound_s),)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("kill-decode", scenario_nodes.kill_decode, expect=lambda o: (Expect("detect_s", "not_none"), *_restarted(o))),
    Scenario("kill-prefill", scenario_nodes.kill_prefill, fault_first=True,
             expect=lambda o: (Expect("detect_s", "not_none"), *_restarted(o))),
    Scenario("freeze-decode", scenario_nodes.freeze_decode, needs_decode=2,
             expect=lambda o: (*_detected(o), Expect("rejoined_s", "not_none"))),
    Scenario("freeze-prefill", scenario_nodes.freeze_prefill, fault_first=True,
             expect=lambda o: (*_detected(o), Expect("rejoined_s", "not_none"))),
    Scenario("partition", scenario_infra.partition, expect=_detected, needs_decode=2),
    Scenario("redis-hang", scenario_infra.redis_hang, redis="single",
             expect=lambda o: (Expect("detect_s", "not_none"), Expect("recovered_s", "not_none"))),
    Scenario("redis-restart", scenario_infra.redis_restart, redis="single",
             expect=lambda o: (Expect("reregistered_s", "not_none"), Expect("index_rebuilt_s", "not_none"))),
    Scenario("step-error", scenario_nodes.step_error, needs_decode=2,
             expect=lambda o: (Expect("detect_s", "not_none"), Expect("rejoined_s", "not_none"))),
    Scenario("corrupt-kv", scenario_infra.corrupt_kv, fault_first=True,
             expect=lambda o: (Expect("transfers_refused", "==", Figure("transfers_damaged")),
                               Expect("damaged_shm", ">=", 1), Expect("damaged_tcp", ">=", 1),
                               Expect("damaged_grpc", ">=", 1))),
    Scenario("slow-node", scenario_nodes.slow_node, needs_decode=2, shape=scenario_nodes.slow_node_specs,
             expect=lambda o: (Expect("detect_s", "not_none"), Expect("placed_on_slow_node", "==", 0))),
    # http_every=2: HTTP requests in the half sent while the nodes are down, refused at once
    # (no SDK retries them), so that unavailable_s always has a refusal to time.
    Scenario("all-decode-down", scenario_nodes.all_decode_down, failures_allowed=True, http_every=2,
             expect=lambda o: (Expect("probe_unavailable_s", "<=", o.unavailable_within_s),
                               Expect("unavailable_s", "<=", o.unavailable_within_s), *_restarted(o),
                               *_served_after_restart(o))),
    Scenario("restart-router", scenario_infra.restart_router, http_every=2,
             expect=lambda o: (Expect("interrupted", ">=", 1), Expect("retried_before_start", ">=", 1))),
    Scenario("restart-router-replicas", scenario_infra.restart_router_replicas, http_every=2,
             shape=scenario_infra.replica_specs,
             expect=lambda o: (Expect("interrupted", ">=", 1), Expect("victim_inflight", ">=", 1))),
    # The node's own process among the host's dead, the loss seen (a migration: none happens
    # unless streams were on the lost host) within the frozen-node bound. The reference runs
    # first, on the head: the nodes' moves give them empty caches either way.
    Scenario("host-loss", scenario_host.host_loss, needs_decode=2,
             expect=lambda o: (*_detected(o), Expect("victim_pid_killed", "==", True), *_restarted(o))),
    Scenario("redis-shard-hang", scenario_rcluster.redis_shard_hang, redis="cluster",
             expect=lambda o: (Expect("detect_s", "not_none"), Expect("recovered_s", "not_none"))),
    Scenario("redis-failover", scenario_rcluster.redis_failover, redis="cluster",
             expect=lambda o: (Expect("promoted_s", "not_none"), Expect("recovered_s", "not_none"),
                               Expect("reregistered_s", "not_none"))),
)}
# `--scenario all` runs them in this order: the ones that restart nodes come after those that
# need every node measured (slow-node first: both decode nodes have step times then).
ORDER = ("slow-node", "corrupt-kv", "freeze-decode", "partition", "step-error", "kill-decode", "host-loss",
         "freeze-prefill", "kill-prefill", "redis-hang", "redis-restart", "redis-shard-hang", "redis-failover",
         "all-decode-down", "restart-router", "restart-router-replicas")
assert sorted(ORDER) == sorted(SCENARIOS)


def on_redis_cluster(cluster) -> bool:
    return cluster.redis is not None and hasattr(cluster.redis, "master_for")


def fits(sc: Scenario, cluster) -> bool:
    """Whether ``cluster``'s Redis is the kind the scenario faults (``--scenario all`` runs those)."""
    if sc.redis == "cluster":
        return on_redis_cluster(cluster)
    if sc.redis == "single":
        return cluster.redis is not None and not on_redis_cluster(cluster)
    return True


def run_scenario(cluster, name: str, opts: Options = Options(),
                 progress: Callable[[str], None] = lambda m: None) -> dict:
    """Run scenario ``name`` on a started ChaosCluster; returns its result (module docstring)."""
    sc = SCENARIOS.get(name)
    if sc is None:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(ORDER)}")
    if len(cluster.role_actors("decode")) < sc.needs_decode:
        raise ValueError(f"{name} needs at least {sc.needs_decode} decode nodes")
    if not fits(sc, cluster):
        raise ValueError(f"{name} needs {'a Redis Cluster (--redis-cluster N)' if sc.redis == 'cluster' else 'one redis-server of its own (no --redis-cluster, no --redis-url)'}")
    salt = f"{name}-{uuid.uuid4().hex[:8]}"
    run = Run(cluster, opts, sc.shape(make_specs(opts.requests, opts.max_tokens, salt, sc.http_every)), progress)
    if opts.step_delay_s:
        faults.set_step_delay(cluster.actors.values(), opts.step_delay_s)

    def reference_run() -> Reference:
        progress(f"{name}: reference run, {len(run.specs)} requests x {opts.max_tokens} tokens, no fault")
        return Reference.of(Batch(run.endpoints(), run.specs).join())

    reference = None if sc.fault_first else reference_run()
    progress(f"{name}: faulted run")
    before = cluster.migrations()
    watch = FirstIncrease(cluster.moved).arm()
    try:
        out = sc.body(run)
    finally:
        watch.stop()
    if sc.fault_first:
        reference = reference_run()
    if not out.own_detect:
        out.detect_s = watch.since(out.fault_at)
    result = {"scenario": name, **figures(out.logs, reference.tokens, sc.failures_allowed),
              "detect_s": out.detect_s, "recovery_s": recovery_s(out.logs, out.fault_at), **out.extra}
    after = cluster.migrations()  # the in-process router's counters, or a router process's /metrics
    if after and not name.startswith("restart-router"):  # a restarted router counts from zero
        result["migrations"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    bad = problems(out.logs, reference.tokens, sc.failures_allowed)
    if bad:
        result["problems"] = bad
    result["checks"] = checks(result, sc.expect(opts), sc.failures_allowed)
    result["passed"] = all(result["checks"].values())
    return result
