"""The router's view of the cluster, kept off the request path: the live nodes of the served
model (refreshed from the registry on a thread of its own), this router's ledger of prefill
work in flight, and how accurate the index's prefix predictions turn out to be.

A request never waits for the registry: it reads ``NodeRefresher.view``, an immutable snapshot
replaced whole every ``refresh_s``. The same thread reads the prefill nodes' step reports into
the ``CostBook`` the TTFT policy predicts with.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from kv_index.nodes import NodeInfo, Role
from kv_index.reader import IndexReader
from router.cost_model import CostBook
from router.step_history import StepHistory

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeView:
    """An immutable snapshot of the live nodes of the served model; replaced whole."""

    nodes: tuple[NodeInfo, ...] = ()
    fingerprint: str | None = None
    block_size: int | None = None
    error: str | None = None  # why the registry could not be read, if it could not

    @property
    def has_decode(self) -> bool:
        return any(n.role == Role.DECODE for n in self.nodes)


def build_view(nodes: dict[str, NodeInfo]) -> NodeView:
    """Keep the nodes of one model. Mixed fingerprints mean a misconfigured cluster (KV of one
    model is garbage to another): the fingerprint with the most decode nodes wins, the rest
    are excluded and logged. A draining node (finishing its requests before it stops) is left
    out: nothing new is placed there."""
    nodes = {nid: n for nid, n in nodes.items() if not n.draining}
    if not nodes:
        return NodeView()
    groups = Counter((n.fingerprint, n.block_size) for n in nodes.values() if n.role == Role.DECODE)
    if not groups:
        groups = Counter((n.fingerprint, n.block_size) for n in nodes.values())
    (fp, bs), _ = min(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = tuple(n for n in nodes.values() if (n.fingerprint, n.block_size) == (fp, bs))
    if len(keep) != len(nodes):
        odd = sorted(f"{n.node_id} ({n.fingerprint}, block_size {n.block_size})"
                     for n in nodes.values() if (n.fingerprint, n.block_size) != (fp, bs))
        log.error("nodes with a different model fingerprint or block size are excluded from routing "
                  "(serving %s, block_size %d): %s", fp, bs, ", ".join(odd))
    return NodeView(keep, fp, bs)


class NodeRefresher:
    """Reads the registry every ``refresh_s`` on its own thread; ``view`` is the latest
    snapshot. A node whose lease lapses leaves the view within lease + refresh_s.

    While Redis cannot be read (down, restarting) the view keeps the last nodes it read, for
    up to ``outage_grace_s``, with ``error`` set: requests go on being placed by those nodes'
    last known load, without the index (whose lookup fails too), and a node that died
    meanwhile is found out by its failed call (the router migrates). Once Redis answers again
    (restarted empty, say) the nodes' next heartbeats register them again and resync their
    index entries from their snapshots (node/publisher.py)."""

    def __init__(self, reader: IndexReader, refresh_s: float, prune_every_s: float,
                 costs: CostBook | None = None, outage_grace_s: float = 30.0) -> None:
        self._reader = reader
        self._outage_grace_s = outage_grace_s
        self._last_good: tuple[NodeView, float] | None = None  # (view, monotonic time read)
        self._outage = False  # a read failed and no node has been read since
        self._costs = costs
        # Each decode node's own step times: NodeInfo.step_best_s for placement's straggler check.
        self.steps = StepHistory()
        self._step_cursor: dict[str, str] = {}  # node id -> last step report id read
        self._refresh_s = refresh_s
        self._prune_every_s = prune_every_s
        self._view = NodeView()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-node-refresh", daemon=True)

    @property
    def view(self) -> NodeView:
        return self._view  # one attribute read: the snapshot is replaced, never mutated

    def refresh_once(self) -> NodeView:
        try:
            view = build_view(self._reader.live_nodes())
            view = replace(view, nodes=self.steps.annotate(view.nodes, time.monotonic()))
        except Exception as e:  # redis down: the last nodes for a while, then nothing
            log.warning("node registry unreadable: %s", e)
            self._outage = True
            self._view = self._last_nodes(f"node registry unreadable: {e}")
            return self._view
        if not view.nodes and self._outage:
            # Redis is back but empty (restarted): the nodes register again with their next
            # heartbeat. Until one has, the last nodes read are the better guess.
            self._view = self._last_nodes("node registry empty after an outage")
        else:
            self._view, self._outage = view, False
            self._last_good = (view, time.monotonic())
            if self._costs is not None:  # a pair's transport before its first transfer
                self._costs.note_endpoints({n.node_id: n.kv_endpoints for n in view.nodes})
        if self._costs is not None:
            self._read_steps()
        return self._view

    def _last_nodes(self, why: str) -> NodeView:
        last = self._last_good
        if last is not None and last[0].nodes and time.monotonic() - last[1] <= self._outage_grace_s:
            return replace(last[0], error=f"{why}; placing on the {len(last[0].nodes)} nodes last read, by load only")
        return NodeView(error=why)

    def _read_steps(self) -> None:
        ids = [n.node_id for n in self._view.nodes if n.role == Role.PREFILL]
        try:
            got = self._reader.read_steps({nid: self._step_cursor.get(nid, "0-0") for nid in ids})
        except Exception as e:  # the fit keeps its last state; the reports stay in the stream
            log.warning("step reports unreadable: %s", e)
            return
        for nid, (reports, last) in got.items():
            self._step_cursor[nid] = last
            for rep in reports:
                self._costs.add_step(nid, rep)

    def start(self) -> None:
        self._thread.start()
        self._first.wait(timeout=5.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        last_prune = time.monotonic()
        while not self._stop.is_set():
            self.refresh_once()
            self._first.set()
            if time.monotonic() - last_prune >= self._prune_every_s:
                last_prune = time.monotonic()
                try:
                    dead = self._reader.prune_dead()
                    if dead:
                        log.info("pruned dead nodes from the index: %s", dead)
                except Exception as e:
                    log.warning("prune_dead failed: %s", e)
            self._stop.wait(self._refresh_s)


class IndexAccuracy:
    """Predicted cached tokens (from the index, at placement) vs the tokens the prefill node
    actually reused, per request (the last ``keep``) and aggregated. Thread-safe."""

    def __init__(self, keep: int = 1024) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.exact = 0
        self.predicted_tokens = 0
        self.reused_tokens = 0
        self.abs_error_tokens = 0
        self.recent: dict[str, tuple[int, int]] = {}  # client request id -> (predicted, reused)
        self._keep = keep

    def record(self, request_id: str, predicted: int, reused: int) -> None:
        with self._lock:
            self.requests += 1
            self.exact += predicted == reused
            self.predicted_tokens += predicted
            self.reused_tokens += reused
            self.abs_error_tokens += abs(predicted - reused)
            self.recent[request_id] = (predicted, reused)
            if len(self.recent) > self._keep:
                self.recent.pop(next(iter(self.recent)))

    def summary(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "exact_fraction": self.exact / self.requests if self.requests else 1.0,
                    "predicted_tokens": self.predicted_tokens, "reused_tokens": self.reused_tokens,
                    "mean_abs_error_tokens": self.abs_error_tokens / self.requests if self.requests else 0.0}


class PrefillLedger:
    """This router's own view of each prefill node's queue: predicted prefill seconds of the
    requests it sent there and that have not returned. Another replica's requests show up only
    through the nodes' heartbeats (the policy's fallback when a node is not in the ledger)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, float]] = {}

    def add(self, node_id: str, request_id: str, seconds: float) -> None:
        with self._lock:
            self._by_node.setdefault(node_id, {})[request_id] = seconds

    def done(self, node_id: str, request_id: str) -> None:
        with self._lock:
            self._by_node.get(node_id, {}).pop(request_id, None)

    def backlog_s(self) -> dict[str, float]:
        with self._lock:
            return {nid: sum(v.values()) for nid, v in self._by_node.items()}
