"""`pdserve status`'s router replicas: every live one with its address, process, requests in
flight and the prefill backlog it has placed per node, from the records the replicas publish to
share their load (router/replicas.py). Its own module so deploy/status.py stays one screen."""
from __future__ import annotations

from collections.abc import Mapping

from router.replicas import read_replicas


def router_section(r, ns: str, now: float) -> list[dict]:
    """The JSON part: one row per live replica, oldest record first (read only, no pruning)."""
    records = read_replicas(r, ns, now, prune=False)
    return [{"replica_id": rid, "address": rec["address"], "pid": rec["pid"], "inflight": rec["inflight"],
             "backlog_s": {k: round(v, 3) for k, v in sorted(rec["load"].items())},
             "age_s": round(max(0.0, now - rec["at"]), 1)}
            for rid, rec in sorted(records.items(), key=lambda kv: (kv[1]["at"], kv[0]))]


def render_routers(rows: list[Mapping] | None) -> list[str]:
    """The terminal lines (none when no replica published a record)."""
    if not rows:
        return []
    lines = ["", f"routers: {len(rows)} live replica(s)"]
    for row in rows:
        backlog = sum(row["backlog_s"].values())
        lines.append(f"  {row['replica_id']:<28} {row['address']:<21} pid {row['pid']:<7} "
                     f"in flight {row['inflight']:<4} prefill backlog {backlog * 1e3:.0f} ms, "
                     f"seen {row['age_s']:.1f}s ago")
    return lines
