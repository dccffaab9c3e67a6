"""Each decode node's own recent step times, so a node that slowed down can be told apart
from its peers' figures alone: a peer that just restarted (no measurement yet) or a cluster of
one decode node gives no comparison, but the node's own earlier speed does.

The router's node view (router/node_view.py) feeds every heartbeat it reads in and writes the
result into ``NodeInfo.step_best_s``; placement (``without_stragglers``) compares ``step_s``
with it. Plain data, time passed in: no thread, no clock of its own.

A step's time grows with the batch it runs, so a node is compared with itself at a comparable
batch: samples are kept per power-of-two bucket of running sequences (1, 2-3, 4-7, ...), within
which the batch differs by less than 2x. "Best" is the ``MIN_SAMPLES``-th fastest sample of the
bucket in the window, so a few unusually fast steps cannot set it; fewer samples than that
give no figure (0).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from kv_index.nodes import NodeInfo, Role

# How far back "recent" reaches: long enough to remember a node's speed across a slowdown's
# detection, short enough that a node that is now permanently slower (a different device, a
# heavier model revision) stops being judged by a speed it no longer has.
WINDOW_S = 300.0
# Heartbeats in a batch bucket before the node's own best counts (one per heartbeat, ~1 s apart).
MIN_SAMPLES = 5
# Per node and bucket, at most this many samples (a heartbeat a second over the window is 300).
MAX_SAMPLES = 512


def batch_bucket(running: int) -> int:
    """1 -> 1, 2-3 -> 2, 4-7 -> 3, ...: batches within a bucket differ by less than 2x."""
    return max(running, 1).bit_length()


class StepHistory:
    """Per decode node life (id and address: Ray restarts a killed actor under the same id on a
    new port, and that new life starts with no history) and batch bucket, the step times its
    heartbeats reported over the last ``window_s``."""

    def __init__(self, window_s: float = WINDOW_S, min_samples: int = MIN_SAMPLES) -> None:
        self.window_s = window_s
        self.min_samples = min_samples
        # (node id, address) -> bucket -> (time, step_s), oldest first
        self._samples: dict[tuple[str, str], dict[int, deque[tuple[float, float]]]] = {}
        self._last_update: dict[tuple[str, str], float] = {}  # the heartbeat last taken (updated_at)

    def observe(self, nodes: Iterable[NodeInfo], now: float) -> None:
        """Take each decode node's heartbeat once (a heartbeat read twice is one sample); drop
        what is older than the window, and nodes with nothing left."""
        for n in nodes:
            if n.role != Role.DECODE or n.step_s <= 0:
                continue
            key = (n.node_id, n.grpc_address)
            if self._last_update.get(key) == n.updated_at:
                continue
            self._last_update[key] = n.updated_at
            buckets = self._samples.setdefault(key, {})
            buckets.setdefault(batch_bucket(n.running), deque(maxlen=MAX_SAMPLES)).append((now, n.step_s))
        self._expire(now)

    def best(self, node: NodeInfo, now: float) -> float:
        """The node's own best recent step time at its current batch bucket (0: too few samples)."""
        samples = self._samples.get((node.node_id, node.grpc_address), {}).get(batch_bucket(node.running))
        if not samples:
            return 0.0
        times = sorted(s for t, s in samples if now - t <= self.window_s)
        return times[self.min_samples - 1] if len(times) >= self.min_samples else 0.0

    def annotate(self, nodes: Iterable[NodeInfo], now: float) -> tuple[NodeInfo, ...]:
        """``observe``, then each decode node with its ``step_best_s`` filled in."""
        nodes = tuple(nodes)
        self.observe(nodes, now)
        return tuple(replace(n, step_best_s=self.best(n, now)) if n.role == Role.DECODE else n for n in nodes)

    def _expire(self, now: float) -> None:
        for key in list(self._samples):
            buckets = self._samples[key]
            for b in list(buckets):
                q = buckets[b]
                while q and now - q[0][0] > self.window_s:
                    q.popleft()
                if not q:
                    del buckets[b]
            if not buckets:
                del self._samples[key]
                self._last_update.pop(key, None)
