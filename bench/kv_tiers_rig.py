"""The engine side of `pdserve bench kv-tiers`: a device pool, a real ``KVCacheManager`` and the
tiers under it (engine/kv_tiers/), driven block by block the way the engine drives them.

Two pool layouts. Fresh, the free queue is in id order, so a prompt's blocks are one unbroken run
of ids and land in host slots taken in order: every copy between pool and host is one strided
``copy_`` (engine/kv_tiers/mover.py ``runs``). After churn (``lay_out``: one-block sequences
freed in a shuffled order, as many requests of different lengths leave a pool), the free queue is
a permutation and a prompt's block table is scattered::

    fresh      block table [0 1 2 3 4 5 ...]     -> runs (0, slot 0, n)              one copy
    fragmented block table [41 7 300 12 95 ...]  -> runs (41, 0, 1) (7, 1, 1) ...   n copies
"""
from __future__ import annotations

import argparse
import random
import time

from bench.kv_tiers_cold import drop_cached_pages, fdatasync_files

BLOCK_SHAPES = {"smollm2-135m": (30, 3, 64)}  # layers, KV heads, head dim


class Rig:
    """A device pool of ``2 n`` blocks filled with random KV (the second half is where blocks come
    back to), a KVCacheManager over it and tiers with room for ``n`` blocks in host memory and
    on disk."""

    def __init__(self, args: argparse.Namespace, directory) -> None:
        import torch

        from engine.attention.kv_cache import kv_cache_shape
        from engine.kv_cache_manager import KVCacheManager
        from engine.kv_tiers.build import TierCopies, element_size_of, kv_layout
        from engine.kv_tiers.disk import DiskTier
        from engine.kv_tiers.host import HostTier
        from engine.kv_tiers.tiers import KVTiers

        layers, heads, head_dim = BLOCK_SHAPES[args.shape]
        cfg = argparse.Namespace(num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
        n, bs = args.blocks, args.block_size
        self.n, self.bs = n, bs
        dtype = getattr(torch, args.dtype)
        g = torch.Generator().manual_seed(0)
        self.pool = torch.randn(kv_cache_shape(cfg, 2 * n, bs), generator=g).to(dtype)
        layout = kv_layout(self.pool, f"bench-{args.shape}-{args.dtype}")
        self.block_bytes = layout.block_bytes
        self.copies = TierCopies(self.pool, n + 1)
        self.copies.host.tensor.zero_()  # steady state: a node touches its host pages once, on first use
        self.disk = DiskTier(directory, 4 * n * (layout.block_bytes + 4096), layout, element_size_of)
        self.tiers = KVTiers(HostTier(n + 1), self.disk, layout.block_bytes, self.copies.copy_out,
                             self.copies.host.slot_view, max_inflight=n)
        self.tiers.spill_ahead = 0  # the bench spills on purpose, all at once
        self.kv = KVCacheManager(2 * n, bs, tiers=self.tiers)
        self.round = 0

    def close(self) -> None:
        self.tiers.close()

    @property
    def file_bytes(self) -> int:
        """Bytes of one block file: header and payload."""
        return self.disk.file_bytes

    def lay_out(self, shuffle_seed: int | None) -> None:
        """Churn the pool: every block taken by a one-block sequence, the sequences freed in a
        shuffled order (the free queue, and so the next prompt's block table, is scattered) or,
        with no seed, in block id order (a fresh pool's queue)."""
        seqs = [f"churn{i}" for i in range(2 * self.n)]
        for seq in seqs:
            assert self.kv.allocate_slots(seq, 0, self.bs)
        if shuffle_seed is None:
            seqs.sort(key=lambda seq: self.kv.get_block_table(seq)[0])
        else:
            random.Random(shuffle_seed).shuffle(seqs)
        for seq in seqs:
            self.kv.free(seq)

    def new_blocks(self) -> list[int]:
        """Fresh prompt tokens whose n blocks are computed (random KV already there) and cached."""
        self.round += 1
        tokens = [(self.round * 7919 + i) % 49000 + 3 for i in range(self.n * self.bs)]
        self.kv.allocate_slots(f"r{self.round}", 0, len(tokens))
        self.kv.cache_computed_blocks(f"r{self.round}", tokens, len(tokens))
        self.kv.free(f"r{self.round}")
        return tokens

    def hashes(self, tokens: list[int]) -> list[int]:
        from tokens.block_hash import hash_prompt_blocks

        return hash_prompt_blocks(tokens, self.bs)[: self.n]

    def block_ids(self, tokens: list[int]) -> list[int]:
        return [self.kv.pool.cached[h].block_id for h in self.hashes(tokens)]

    def settle(self) -> None:
        t = self.tiers
        while True:
            t.copier.wait_idle(60)
            t.writer.wait_idle(60)
            t.service()
            if not t.busy:
                return

    def offload_host(self) -> float:
        t0 = time.perf_counter()
        self.settle()
        assert self.tiers.host.num_ready == self.n, self.tiers.host.num_ready
        return time.perf_counter() - t0

    def evict_device(self, tokens: list[int]) -> None:
        """Push the prompt's blocks out of the device pool (the other half of it is allocated)."""
        self.kv.allocate_slots("evict", 0, 2 * self.n * self.bs)
        self.kv.free("evict")
        assert self.kv.held_tiers(tokens)[0] != 0

    def onboard(self, tokens: list[int]) -> tuple[float, float, list[int], int]:
        """(seconds of the lookup, which reads disk hits; seconds of the swap-ins; block ids;
        copies the swap-ins took: runs of consecutive (slot, block) pairs)."""
        from engine.kv_tiers.mover import runs

        t0 = time.perf_counter()
        hit = self.kv.lookup_prefix(tokens + [1])
        t1 = time.perf_counter()
        assert len(hit.lower) == self.n, len(hit.lower)
        assert self.kv.allocate_slots("back", hit.num_tokens, hit.num_tokens + 1, hit)
        pairs = self.kv.take_swap_ins()
        t2 = time.perf_counter()
        self.copies.copy_in(pairs)
        t3 = time.perf_counter()
        self.kv.finish_swap_ins()
        ids = self.kv.get_block_table("back")[: self.n]
        self.kv.free("back")
        return t1 - t0, t3 - t2, ids, len(runs(pairs))

    def spill_all(self, tokens: list[int]) -> tuple[float, float]:
        """Every host entry written to disk by the writer thread, then every file fdatasynced:
        (seconds until the writer finished, seconds until the data was on storage)."""
        t0 = time.perf_counter()
        for entry in self.tiers.host.lru():
            self.tiers._evict_host(entry)
        self.settle()
        t1 = time.perf_counter()
        fdatasync_files(self.disk.path(h) for h in self.hashes(tokens))
        return t1 - t0, time.perf_counter() - t0

    def drop_files(self, tokens: list[int]) -> None:
        drop_cached_pages(self.disk.path(h) for h in self.hashes(tokens))

    def clear_disk(self) -> None:
        """Forget and delete every block file (each round writes its own)."""
        import os

        for e in self.disk.clear():
            os.unlink(self.disk.path(e.block_hash))
