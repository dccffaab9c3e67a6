"""`pdserve chaos`: bring up a local cluster, run one scenario, every scenario (``all``) or the
nemesis, print the results, exit 1 if any check failed.

    pdserve chaos --scenario freeze-decode --json
    pdserve chaos --scenario all --json          one JSON line per scenario, then a summary line
    pdserve chaos --nemesis 120 --seed 7 --json

With ``--json`` the last line printed is one JSON object (a single scenario's result, or the
summary ``{"scenarios": [...], "passed": ...}``); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from chaos.context import Options
from chaos.history import exit_code
from chaos.scenarios import ORDER, SCENARIOS, fits, run_scenario
from chaos.workload import RetryBudget


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--scenario", choices=(*ORDER, "all"), help="one scenario, or all of them in turn")
    what.add_argument("--nemesis", type=float, metavar="SECONDS",
                      help="random faults on a random schedule over a steady stream of requests for SECONDS")
    p.add_argument("--json", action="store_true", help="print results as JSON lines (the last one: the verdict)")
    p.add_argument("--requests", type=int, default=8, help="requests per scenario, half greedy, half seeded sampled")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (EOS ignored)")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=2)
    p.add_argument("--redis-cluster", type=int, default=0, metavar="N",
                   help="the index on a Redis Cluster of N masters (a replica each) instead of one redis-server "
                        "(the redis-shard-hang and redis-failover scenarios need it)")
    p.add_argument("--node-threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="slow every engine step by this much in both runs, so that a fault lands mid-way "
                        "on a fast model (a tiny test model)")
    p.add_argument("--restart-timeout-s", type=float, default=120.0,
                   help="how long to wait for Ray to restart a killed node (0: do not wait)")
    p.add_argument("--freeze-s", type=float, default=8.0, help="a frozen process (SIGSTOP) is continued after this")
    p.add_argument("--partition-s", type=float, default=8.0, help="a partitioned link forwards again after this")
    p.add_argument("--router-down-s", type=float, default=2.0, help="restart-router: seconds the router stays down")
    p.add_argument("--detect-bound-s", type=float, default=5.0,
                   help="a frozen node or a cut-off link must be detected (first migration) within this")
    p.add_argument("--unavailable-within-s", type=float, default=15.0,
                   help="all-decode-down: a client's failed attempt must have failed within this")
    p.add_argument("--retry-attempts", type=int, default=10, help="the clients' attempts per request")
    p.add_argument("--retry-budget-s", type=float, default=60.0, help="no client retry starts later than this")
    p.add_argument("--seed", type=int, default=0, help="--nemesis: the schedule's seed")
    p.add_argument("--concurrency", type=int, default=4, help="--nemesis: clients sending at once")


def options(args: argparse.Namespace) -> Options:
    return Options(requests=args.requests, max_tokens=args.max_tokens, step_delay_s=args.step_delay_s,
                   restart_timeout_s=args.restart_timeout_s, freeze_s=args.freeze_s, partition_s=args.partition_s,
                   router_down_s=args.router_down_s, detect_bound_s=args.detect_bound_s,
                   unavailable_within_s=args.unavailable_within_s,
                   budget=RetryBudget(attempts=args.retry_attempts, seconds=args.retry_budget_s))


def run(args: argparse.Namespace, engine) -> int:
    """The CLI: bring a cluster up, run, print, tear down; the exit code says whether every check held."""
    from chaos.cluster import ChaosCluster
    from chaos.faults import FREEZER
    from deploy.launcher import ClusterConfig

    opts = options(args)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    def emit(result: dict) -> None:
        print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)

    config = ClusterConfig(engine=engine, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
                           grpc_port=0, http_port=0, dashboard_port=0, node_threads=args.node_threads,
                           redis_cluster=args.redis_cluster,
                           namespace=f"chaos-{int(time.time())}")
    results: list[dict] = []
    try:
        with ChaosCluster(config, progress) as cluster:
            if args.nemesis is not None:
                from chaos.nemesis import run_nemesis

                results.append(run_nemesis(cluster, args.nemesis, opts, seed=args.seed,
                                           concurrency=args.concurrency, progress=progress))
                emit(results[-1])
                return exit_code(results)
            names = [n for n in ORDER if fits(SCENARIOS[n], cluster)] if args.scenario == "all" else [args.scenario]
            for i, name in enumerate(names):
                if i and cluster.settle() is None:
                    progress("the cluster did not settle within 60 s after the last scenario; going on")
                results.append(_one(cluster, name, opts, progress))
                if args.scenario == "all":
                    emit(results[-1])
    finally:
        FREEZER.thaw_all()
    if args.scenario == "all":
        emit(summary(results))
    else:
        emit(results[0])
    return exit_code(results)


def _one(cluster, name: str, opts: Options, progress) -> dict:
    """A scenario's result; one that raised is a failed result, and the run goes on."""
    try:
        result = run_scenario(cluster, name, opts, progress)
    except Exception as e:  # noqa: BLE001 - reported as a failed check, the next scenario still runs
        result = {"scenario": name, "error": f"{type(e).__name__}: {e}", "checks": {"ran": False}, "passed": False}
    progress(f"{name}: {'passed' if result['passed'] else 'FAILED'}"
             + ("" if result["passed"] else f" ({[k for k, v in result['checks'].items() if not v]})"))
    return result


FIGURES = ("requests", "completed", "lost", "duplicated_tokens", "outputs_identical", "detect_s", "recovery_s")


def summary(results: list[dict]) -> dict:
    """``--scenario all``'s last line: each scenario's main figures and failed checks."""
    rows = []
    for r in results:
        row = {"scenario": r["scenario"], **{k: r.get(k) for k in FIGURES}, "passed": r["passed"]}
        failed = [k for k, v in r.get("checks", {}).items() if not v]
        if failed:
            row["failed_checks"] = failed
        if "error" in r:
            row["error"] = r["error"]
        rows.append(row)
    return {"scenarios": rows, "passed": exit_code(results) == 0}
