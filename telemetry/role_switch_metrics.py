"""A node's live role switches as Prometheus metrics (node/role_switch.py; docs/observability.md,
"Role switches")."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from telemetry.metrics import name

ROLE_SWITCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# How a live role switch ended (node/role_switch.py): done with nothing left over, done after
# the drain timeout failed the rest over to other nodes, refused before anything changed,
# failed (the node went back to its old role, or restarts).
ROLE_SWITCH_OUTCOMES = ("ok", "timeout", "refused", "failed")


class RoleSwitchMetrics:
    """``pdserve:role_switches_total{from_role,to_role,outcome}`` and
    ``pdserve:role_switch_seconds{from_role,to_role}`` of one node. They outlive the role's
    server (whose registry the next role's replaces), so they keep a registry of their own and
    are a collector that each role server's registry includes (``registry.register(this)``)."""

    def __init__(self, model_name: str, node_id: str) -> None:
        self.registry = CollectorRegistry()
        keys = ["model_name", "node_id", "from_role", "to_role"]
        self._labels = {"model_name": model_name, "node_id": node_id}
        self._switches = Counter(name("role_switches"), "Live role switches of this node, by outcome.",
                                 [*keys, "outcome"], registry=self.registry)
        self._seconds = Histogram(name("role_switch_seconds"), "Duration of a live role switch: drain, "
                                  "hand-over, serving in the new role.", keys, buckets=ROLE_SWITCH_BUCKETS,
                                  registry=self.registry)

    def switched(self, from_role: str, to_role: str, outcome: str, seconds: float | None = None) -> None:
        labels = {**self._labels, "from_role": from_role, "to_role": to_role}
        self._switches.labels(**labels, outcome=outcome).inc()
        if seconds is not None:
            self._seconds.labels(**labels).observe(seconds)

    def collect(self):
        return self.registry.collect()
