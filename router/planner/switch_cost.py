"""What a role switch costs before the new mix serves: the nodes that change role finish what
they hold first (node/role_switch.py drains them), taking nothing new, so for that long the
cluster serves on the nodes that stay. The planner (decide.py) weighs a layout by its goodput
averaged over its window with that drain in it, not by its goodput once switched. Pure: plain
signals in, seconds and rates out."""
from __future__ import annotations

from dataclasses import dataclass

from kv_index.nodes import Role
from router.planner.model import Layout, LayoutEstimate
from router.planner.signals import NodeSignal


def role_changes(nodes: tuple[NodeSignal, ...], target: Layout) -> dict[str, Role]:
    """Which nodes switch role to move toward ``target``: as many as one pool lacks and the
    other has in excess (the rest is the pool controller's: nodes added or removed), the least
    busy first (they drain soonest)."""
    cur = {r: [n for n in nodes if n.role == r] for r in Role}
    want = {Role.PREFILL: target.prefill, Role.DECODE: target.decode}
    out: dict[str, Role] = {}
    for src, dst in ((Role.DECODE, Role.PREFILL), (Role.PREFILL, Role.DECODE)):
        k = min(want[dst] - len(cur[dst]), len(cur[src]) - want[src])
        movers = sorted(cur[src], key=lambda n: (n.running + n.waiting, n.backlog_s, n.node_id))[:max(k, 0)]
        out.update({n.node_id: dst for n in movers})
    return out


@dataclass(frozen=True, slots=True)
class SwitchCost:
    """What moving to a role mix costs before it serves (``switch_cost``): the nodes that would
    change role (``movers``) finish what they hold for ``drain_s`` and take nothing new, so the
    cluster serves with ``keep`` of its nodes meanwhile."""

    movers: int = 0
    drain_s: float = 0.0
    keep: float = 1.0


def switch_cost(nodes: tuple[NodeSignal, ...], target: Layout, mean_output: float) -> SwitchCost:
    """The drain of the nodes ``role_changes`` would move toward ``target``: the longest of them.
    A decode node's running requests need about half their output still (they are midway on
    average) and its queued ones all of it, at its measured step; a prefill node, its predicted
    backlog. Why it counts: on the CPU benchmark a decode node with a full batch drained for
    ~30 s after the planner moved it, half the cluster idle for new work, and the burst it was
    moved for had ended by then (docs/benchmarks.md, Elastic)."""
    movers = role_changes(nodes, target)
    if not movers:
        return SwitchCost()
    drain = 0.0
    for n in nodes:
        if n.node_id not in movers:
            continue
        if n.role == Role.DECODE:
            held = 0.5 + n.waiting / max(n.running, 1) if n.running + n.waiting else 0.0
            drain = max(drain, n.step_s * mean_output * held)
        else:
            drain = max(drain, n.backlog_s)
    return SwitchCost(len(movers), drain, (len(nodes) - len(movers)) / len(nodes))


def over_horizon(cur: LayoutEstimate, target: LayoutEstimate, cost: SwitchCost, horizon_s: float) -> float:
    """The target's goodput averaged over the next ``horizon_s``: the current layout on the
    nodes that stay for the drain, then the target's."""
    d = min(cost.drain_s, horizon_s)
    return (cur.goodput_rps * cost.keep * d + target.goodput_rps * (horizon_s - d)) / horizon_s


def util_over_horizon(cur: LayoutEstimate, target: LayoutEstimate, cost: SwitchCost, horizon_s: float) -> float:
    """The busiest pool's load averaged alike: the current load on fewer nodes, then the target's."""
    d = min(cost.drain_s, horizon_s)
    during = cur.max_util / cost.keep if cost.keep > 0 else float("inf")
    return (during * d + target.max_util * (horizon_s - d)) / horizon_s if d > 0 else target.max_util
