"""`pdserve bench transfer --ray`: Ray's object store with numpy views as a same-host KV path,
measured beside kv_transfer's shared-memory transport on the same blocks.

The path a node could take through Ray: the sender gathers the blocks into one array
(np.take) and checksums it, ``ray.put`` copies it into the object store, the receiving actor
(another process) gets a zero-copy numpy view of it, checksums it and scatters it into its
pool. Against the shm transport that is one more copy (Ray cannot put into a buffer the caller
filled in place) and a Ray task round trip per transfer.
"""
from __future__ import annotations

import os

import numpy as np
import xxhash


def start(shape: tuple[int, ...]):
    """A local Ray (2 CPUs, no dashboard) and the receiving actor; returns (ray, actor)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self, shape: tuple[int, ...], unit: int) -> None:
            self.rows = np.zeros(int(np.prod(shape)) * 4, dtype=np.uint8).reshape(-1, unit)

        def receive(self, payload: np.ndarray, rows: np.ndarray, checksum: int) -> int:
            # payload: [n_units * unit] uint8, a read-only view into the object store
            if xxhash.xxh3_64(payload).intdigest() != checksum:
                raise ValueError("checksum mismatch")
            self.rows[rows] = payload.reshape(len(rows), -1)
            return len(rows)

        def digest(self, rows: np.ndarray) -> str:
            return xxhash.xxh3_64(np.ascontiguousarray(self.rows[rows])).hexdigest()

    unit = 2 * shape[3] * shape[4] * shape[5] * 4
    actor = Receiver.remote(tuple(shape), unit)
    ray.get(actor.digest.remote(np.arange(1)))  # started
    return ray, actor


def transfer_fn(ray, actor, src_rows: np.ndarray, src_idx: np.ndarray, dst_idx: np.ndarray):
    """One transfer of rows ``src_idx`` of ``src_rows`` into rows ``dst_idx`` of the actor's pool."""

    def once() -> None:
        payload = np.take(src_rows, src_idx, axis=0, mode="clip").reshape(-1)  # the gather
        ref = ray.put(payload)  # the copy into the object store
        ray.get(actor.receive.remote(ref, dst_idx, xxhash.xxh3_64(payload).intdigest()))

    return once
