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

from kv_index.nodes import NodeInfo, OnboardTotals, Role
from kv_index.reader import IndexReader
from router.cost_model import CostBook
from router.index_guard import GuardedLookup
from router.step_history import StepHistory
from telemetry.log_limit import RateLimitedLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeView:
    """An immutable snapshot of the live nodes of the served model; replaced whole."""

    nodes: tuple[NodeInfo, ...] = ()
    fingerprint: str | None = None
    block_size: int | None = None
    error: str | None = None  # why the registry could not be read, if it could not
    # (node id, address) of every node registered when read, draining or excluded ones too: a
    # node missing here has lost its lease, and its open streams move (router/relay.py).
    # None: not read from the registry.
    live: frozenset[tuple[str, str]] | None = None

    @property
    def has_decode(self) -> bool:
        return any(n.role == Role.DECODE for n in self.nodes)


def build_view(nodes: dict[str, NodeInfo]) -> NodeView:
    """Keep the nodes of one model. Mixed fingerprints mean a misconfigured cluster (KV of one
    model is garbage to another): the fingerprint with the most decode nodes wins, the rest
    are excluded and logged. A draining node (finishing its requests before it stops) is left
    out: nothing new is placed there."""
    live = frozenset((n.node_id, n.grpc_address) for n in nodes.values())
    nodes = {nid: n for nid, n in nodes.items() if not n.draining}
    if not nodes:
        return NodeView(live=live)
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
    return NodeView(keep, fp, bs, live=live)


class NodeRefresher:
    """Reads the registry every ``refresh_s`` on its own thread; ``view`` is the latest
    snapshot. A node whose lease lapses leaves the view within lease + refresh_s, and its
    streams in flight move then (``NodeView.live``, router/relay.py).

    A registry that cannot be read is not a registry that is empty: a lapsed lease means the
    node stopped heartbeating, a failed read means nothing about the nodes. So while Redis
    cannot be read (down, hung, restarting) the view keeps the last nodes it read, with
    ``error`` set (for ``outage_grace_s``; None: as long as the outage lasts): requests go on
    being placed by those nodes' last known load, without the index (``lookup``'s breaker is
    opened too), and a node that died meanwhile is found out by its failed call (the router
    migrates). Once Redis answers again, a node of the last view that is missing from the
    registry (Redis restarted empty, or its lease ran out while Redis was frozen) is kept for
    ``settle_s`` more: its next heartbeat registers it again and its publisher resyncs its
    index entries from its snapshot (node/publisher.py). No dead node is pruned meanwhile.
    ``degraded`` says why the router is placing without the full picture, or None."""

    def __init__(self, reader: IndexReader, refresh_s: float, prune_every_s: float,
                 costs: CostBook | None = None, outage_grace_s: float | None = None,
                 lookup: GuardedLookup | None = None, settle_s: float = 5.0) -> None:
        self._reader = reader
        self._outage_grace_s = outage_grace_s
        self._lookup = lookup  # probed from this thread while its breaker is open
        self._outage_log = RateLimitedLog(log)  # every refresh fails while Redis is out
        self._settle_s = settle_s
        self._last_good: tuple[NodeView, float] | None = None  # (view, monotonic time read)
        self._outage_since: float | None = None  # when the registry became unreadable; None: readable
        # After an outage: the nodes read before it, kept until they register again or until then.
        self._settling: tuple[dict[str, NodeInfo], float] | None = None
        self._costs = costs
        # Each decode node's own step times: NodeInfo.step_best_s for placement's straggler check.
        self.steps = StepHistory()
        self._step_cursor: dict[str, str] = {}  # node id -> last step report id read
        self._onboards: dict[tuple[str, str], OnboardTotals] = {}  # (node id, tier) -> totals last read
        self._refresh_s = refresh_s
        self._prune_every_s = prune_every_s
        self._view = NodeView()
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-node-refresh", daemon=True)

    @property
    def view(self) -> NodeView:
        return self._view  # one attribute read: the snapshot is replaced, never mutated

    @property
    def degraded(self) -> str | None:
        """Why this router places without the whole picture (the registry unreadable, nodes
        kept from before an outage, index lookups skipped), or None. It still serves."""
        lookup = self._lookup.degraded if self._lookup is not None else None
        return "; ".join(r for r in (self._view.error, lookup) if r) or None

    def refresh_once(self) -> NodeView:
        now = time.monotonic()
        try:
            read = self._reader.live_nodes()
        except Exception as e:  # redis down or hung: the last nodes read, by load only
            self._outage_log.warning("registry", "node registry unreadable: %s", e)
            why = f"node registry unreadable: {e}"
            if self._outage_since is None:
                self._outage_since = now
            self._settling = None
            if self._lookup is not None:  # no request should wait for a lookup that fails too
                self._lookup.trip(why)
            self._view = self._last_nodes(why, now)
            return self._view
        nodes, kept = self._settle(read, now)
        view = build_view(nodes)
        view = replace(view, nodes=self.steps.annotate(view.nodes, now), error=kept)
        self._view = view
        if kept is None:
            self._last_good = (view, now)
        if self._costs is not None:  # a pair's transport before its first transfer
            self._costs.note_endpoints({n.node_id: n.kv_endpoints for n in view.nodes})
            self._read_steps()
            self._learn_onboards(read)
        return self._view

    def _settle(self, read: dict[str, NodeInfo], now: float) -> tuple[dict[str, NodeInfo], str | None]:
        """``read`` plus, just after an outage, the nodes of the last good view that have not
        registered again yet (with the reason they are kept), until ``settle_s`` has passed."""
        if self._outage_since is not None:  # Redis answers again
            self._outage_since = None
            before = {n.node_id: n for n in self._last_good[0].nodes} if self._last_good is not None else {}
            self._settling = (before, now + self._settle_s)
        if self._settling is None:
            return read, None
        before, until = self._settling
        missing = {nid: n for nid, n in before.items() if nid not in read}
        if not missing or now >= until:
            self._settling = None
            return read, None
        return {**missing, **read}, (f"Redis answers again; {len(missing)} nodes of the last view are kept until "
                                     f"they register again ({', '.join(sorted(missing))})")

    def _last_nodes(self, why: str, now: float) -> NodeView:
        last = self._last_good
        grace = self._outage_grace_s
        if last is not None and last[0].nodes and (grace is None or now - last[1] <= grace):
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

    def _learn_onboards(self, read: dict[str, NodeInfo]) -> None:
        """Each node's host and disk onboards since the last refresh, from its heartbeat's
        cumulative totals, into the cost book's per (node, tier) fit."""
        for nid, node in read.items():
            for tier in ("host", "disk"):
                now = getattr(node, f"onboard_{tier}")
                done = now.since(self._onboards.get((nid, tier), OnboardTotals()))
                self._onboards[nid, tier] = now
                if done.runs > 0 and done.bytes > 0 and done.seconds > 0:
                    self._costs.add_onboard(nid, tier, done.bytes, done.seconds, done.runs)

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
            if self._lookup is not None:
                self._lookup.probe()
            # Not while the registry is unreadable or settling: a lease that ran out while Redis
            # was frozen is a node about to register again, not a dead one.
            if self._view.error is None and time.monotonic() - last_prune >= self._prune_every_s:
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
    requests it sent there and that have not returned, plus what the other router replicas last
    published of theirs (``set_others``, router/replicas.py). Without that, another replica's
    requests show up only through the nodes' heartbeats, and only for a node this router never
    used (the policy's fallback when a node is not in the ledger)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, float]] = {}
        self._others: dict[str, float] = {}  # node id -> the other replicas' backlog seconds, summed

    def add(self, node_id: str, request_id: str, seconds: float) -> None:
        with self._lock:
            self._by_node.setdefault(node_id, {})[request_id] = seconds

    def done(self, node_id: str, request_id: str) -> None:
        with self._lock:
            self._by_node.get(node_id, {}).pop(request_id, None)

    def own_backlog_s(self) -> dict[str, float]:
        """This replica's requests alone (what it publishes to the others)."""
        with self._lock:
            return {nid: sum(v.values()) for nid, v in self._by_node.items()}

    def set_others(self, others: dict[str, float]) -> None:
        """The other replicas' backlog per node, as last read; replaced whole."""
        self._others = dict(others)  # one attribute store: readers see the old or the new

    def backlog_s(self) -> dict[str, float]:
        """What placement and admission see: this replica's backlog plus the others'."""
        own, others = self.own_backlog_s(), self._others
        if not others:
            return own
        return {nid: own.get(nid, 0.0) + others.get(nid, 0.0) for nid in own.keys() | others.keys()}
