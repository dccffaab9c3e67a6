"""`pdserve chaos`: faults injected into a live local cluster under load, judged against the same
requests run without the fault (docs/cluster.md, Faults; docs/benchmarks.md, chaos).

    cli.py           the command: --scenario NAME | all, --nemesis SECONDS; the exit code
    scenarios.py     the registry and the one way each scenario runs; its checks
    scenario_nodes.py, scenario_infra.py   the scenarios' bodies
    injectors.py     each fault as inject() -> heal()
    faults.py        SIGSTOP / SIGCONT (never left stopped), kills, the nodes' fault hooks
    proxy.py         the loopback proxy that goes silent (partition)
    cluster.py       the LocalCluster chaos runs on, proxies, router processes (deploy/router_process.py), figures
    context.py       a run's options, what a scenario body gets and returns
    workload.py      greedy and seeded sampled requests over gRPC and HTTP, a retrying client
    history.py       the judge: figures, the history check, checks and exit code (pure)
    nemesis.py       random faults on a random schedule, then the history check
"""
from chaos.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
