"""Cumulative figures of each tier, kept as plain numbers on the engine thread and read by the
node's metrics collector at scrape time (telemetry/metrics.py): the engine loop pays nothing for
metrics."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds to bring one block (disk) or one step's blocks (host) back into the device pool.
ONBOARD_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# kv_tier_errors_total's reason label: a corrupt file (either checksum), a file another engine
# wrote (another model, block size, shape, dtype or format), a full disk (ENOSPC, a quota, or a
# block larger than the whole budget), any other failed read or write.
ERROR_REASONS = ("checksum", "foreign", "no_space", "io_error")


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...] = ONBOARD_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(ONBOARD_BUCKETS) + 1))  # last: +Inf
    sum: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        """Cumulative bucket counts as Prometheus reads them: [(upper bound, count <= it)]."""
        total, cum = 0, []
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            total += n
            cum.append((bound, total))
        return {"buckets": cum, "sum": self.sum, "count": self.count}


@dataclass(slots=True)
class TierStats:
    offload_bytes: int = 0  # written into this tier (host: copied out of the pool; disk: files)
    onboard_bytes: int = 0  # brought back out of it (host: into the pool; disk: into host slots)
    hits: int = 0  # blocks a prefix lookup found here and used
    skipped: int = 0  # blocks this tier did not take (no free slot, not admitting)
    onboard_seconds: Histogram = field(default_factory=Histogram)
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_REASONS, 0))

    def error(self, reason: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1

    def snapshot(self, blocks: int, capacity_blocks: int, block_bytes: int) -> dict:
        return {"blocks": blocks, "capacity_blocks": capacity_blocks,
                "usage": blocks / capacity_blocks if capacity_blocks else 0.0,
                "used_bytes": blocks * block_bytes, "capacity_bytes": capacity_blocks * block_bytes,
                "offload_bytes": self.offload_bytes, "onboard_bytes": self.onboard_bytes, "hits": self.hits,
                "skipped": self.skipped, "errors": dict(self.errors), "onboard_seconds": self.onboard_seconds.snapshot()}
