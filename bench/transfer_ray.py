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

        def clear(self, rows: np.ndarray) -> None:
            self.rows[rows] = 0xFF  # not what a randn source holds: a push that writes nothing shows

        def digest(self, rows: np.ndarray) -> str:
            return xxhash.xxh3_64(np.ascontiguousarray(self.rows[rows])).hexdigest()

    unit = 2 * shape[3] * shape[4] * shape[5] * 4
    actor = Receiver.remote(tuple(shape), unit)
    ray.get(actor.digest.remote(np.arange(1)))  # started
    return ray, actor


class RayPath:
    """The Ray path over a bench source pool [layers, blocks, 2, block, heads, dim]: the same
    blocks as a case's transports, layer-major like the wire, into the same rows."""

    def __init__(self, src_pool) -> None:
        self.ray, self.actor = start(tuple(src_pool.shape))
        layers, num_blocks = src_pool.shape[:2]
        self.src_rows = src_pool.numpy().view(np.uint8).reshape(layers * num_blocks, -1)  # [layers * blocks, unit]
        self.layer_rows = np.arange(layers)[:, None] * num_blocks  # [layers, 1]

    def _rows(self, block_ids: list[int]) -> np.ndarray:
        return (self.layer_rows + np.asarray(block_ids)).ravel()

    def transfer_fn(self, case: dict):
        return transfer_fn(self.ray, self.actor, self.src_rows, self._rows(case["src_ids"]),
                           self._rows(case["dst_ids"]))

    def verify(self, case: dict) -> bool:
        """Clear the destination rows, run ``case["ray"]`` once, compare the digests."""
        dst = self._rows(case["dst_ids"])
        self.ray.get(self.actor.clear.remote(dst))
        case["ray"]()
        want = xxhash.xxh3_64(np.ascontiguousarray(self.src_rows[self._rows(case["src_ids"])])).hexdigest()
        return self.ray.get(self.actor.digest.remote(dst)) == want

    def shutdown(self) -> None:
        self.ray.shutdown()


def transfer_fn(ray, actor, src_rows: np.ndarray, src_idx: np.ndarray, dst_idx: np.ndarray):
    """One transfer of rows ``src_idx`` of ``src_rows`` into rows ``dst_idx`` of the actor's pool."""

    def once() -> None:
        payload = np.take(src_rows, src_idx, axis=0, mode="clip").reshape(-1)  # the gather
        ref = ray.put(payload)  # the copy into the object store
        ray.get(actor.receive.remote(ref, dst_idx, xxhash.xxh3_64(payload).intdigest()))

    return once
