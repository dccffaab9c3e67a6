"""`pdserve status`'s pool sizes: the targets the planner set (with who, why and when), the nodes
each role has now, and the pool controller's last changes (kv_index/pool_targets.py). Its own
module so deploy/status.py stays one screen of concerns."""
from __future__ import annotations

from collections.abc import Mapping

from kv_index.nodes import NodeInfo, Role
from kv_index.pool_targets import PoolTargets

CHANGES_SHOWN = 5


def pool_section(store: PoolTargets, nodes: Mapping[str, NodeInfo], now: float) -> dict | None:
    """The JSON part: ``targets`` (role -> count), ``reason``, ``by``, ``age_s``, ``nodes`` (role
    -> serving nodes now, draining ones left out) and ``changes`` (newest first); None when no
    target was ever set and nothing changed."""
    rec = store.record()
    changes = store.changes(CHANGES_SHOWN)
    if rec is None and not changes:
        return None
    have = {r.value: sum(1 for n in nodes.values() if n.role is r and not n.draining) for r in Role}
    return {"targets": {r.value: n for r, n in (rec.targets if rec else {}).items()},
            "reason": rec.reason if rec else "", "by": rec.by if rec else "",
            "age_s": round(now - rec.at, 1) if rec else None, "nodes": have,
            "changes": [{"role": c.role.value, "action": c.action, "node_id": c.node_id, "reason": c.reason,
                         "age_s": round(now - c.at, 1)} for c in changes]}


def render_pools(section: Mapping | None) -> list[str]:
    """The terminal lines (none when there is nothing to say)."""
    if not section:
        return []
    sizes = ", ".join(f"{role} {section['nodes'].get(role, 0)}/{section['targets'].get(role, '-')}"
                      for role in (r.value for r in Role))
    head = f"pool sizes (now/target): {sizes}"
    if section.get("age_s") is not None:
        head += f"; set {section['age_s']:.0f}s ago by {section['by'] or '-'}: {section['reason'] or '-'}"
    lines = ["", head]
    for c in section["changes"]:
        lines.append(f"  {c['age_s']:.0f}s ago: {c['action']} {c['node_id']}: {c['reason']}")
    return lines
