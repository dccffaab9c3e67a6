"""What `pdserve bench serve --compare elastic` watches while a layout serves: every SAMPLE_S,
on a thread of its own, the role each live node serves (the node registry), the threshold an
active planner keeps in force (its plan record, kv_index/plan.py) and the planner's decision
counters (the router's /metrics): the roles over time, role switches and decisions of a run."""
from __future__ import annotations

import threading
import time
import urllib.request

from bench.serve.elastic.figures import planner_decisions

SAMPLE_S = 0.5  # seconds between two samples


class RoleSampler:
    """``with RoleSampler(cluster) as s: ...serve...``; then ``s.samples`` ((t, {node: role})),
    ``s.thresholds`` ((t, tokens)), ``s.decisions`` ((t, {"action/reason": rounds so far})) and
    ``s.plans`` ((t, action, reason, detail) where they change), t in seconds since the block
    began; the decisions also once at the start and once at the end."""

    def __init__(self, cluster) -> None:
        from kv_index.client import redis_client
        from kv_index.reader import IndexReader

        self._client = redis_client(cluster.redis_url)
        self._reader = IndexReader(self._client, cluster.config.namespace)
        self._ns = cluster.config.namespace
        self._metrics_url = f"http://{cluster.http_address}/metrics" if cluster.http_address else None
        self.samples: list[tuple[float, dict[str, str]]] = []
        self.thresholds: list[tuple[float, int]] = []
        self.decisions: list[tuple[float, dict[str, float]]] = []
        # (t, action, reason, detail) each time the plan's action or reason changes: why it held.
        self.plans: list[tuple[float, str, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="role-sampler", daemon=True)
        self.t0 = 0.0

    def __enter__(self) -> RoleSampler:
        self.t0 = time.monotonic()
        self.decisions.append((0.0, self._scrape()))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self.decisions.append((time.monotonic() - self.t0, self._scrape()))
        self._client.close()

    def _scrape(self) -> dict[str, float]:
        if self._metrics_url is None:
            return {}
        try:
            with urllib.request.urlopen(self._metrics_url, timeout=2.0) as resp:
                return planner_decisions(resp.read().decode())
        except OSError:  # a missed scrape: the next one has the counters
            return {}

    def _run(self) -> None:
        plans = _plan_store(self._client, self._ns)
        while True:
            t = time.monotonic() - self.t0
            try:
                self.samples.append((t, {n: str(v.role) for n, v in self._reader.live_nodes().items()}))
                plan = plans.read() if plans is not None else None
                # An active planner's every plan carries the threshold in force (a hold keeps it).
                if plan and plan.get("mode") == "active" and isinstance(plan.get("threshold"), int):
                    self.thresholds.append((t, int(plan["threshold"])))
                if plan and (not self.plans or self.plans[-1][1:3] != (plan.get("action"), plan.get("reason"))):
                    self.plans.append((t, str(plan.get("action")), str(plan.get("reason")), str(plan.get("detail"))))
            except Exception:  # a missed sample is a gap in the plot, not a failed run
                pass
            if (d := self._scrape()):
                self.decisions.append((t, d))
            if self._stop.wait(SAMPLE_S):
                return


def _plan_store(client, ns: str):
    try:
        from kv_index.plan import PlanStore
    except ImportError:  # a tree without the planner: roles only
        return None
    return PlanStore(client, ns)
