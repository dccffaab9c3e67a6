"""`pdserve bench kv-tiers`: KV blocks moved down to each tier and back through the engine's own
tier code, against a plain copy of the same bytes in the same run.

The blocks have the KV shape of a real model (SmolLM2-135M by default: 30 layers, 3 KV heads,
head dim 64, 16-token blocks, float32, 720 KiB a block); no weights are loaded. One device pool
and one set of tiers (engine/kv_tiers/build.py, wired to a real ``KVCacheManager``) hold them::

    host  offload   blocks become cached -> the copier thread copies them into host slots
                    (KVTiers.service until every block is a ready host entry)
          onboard   a prefix lookup finds them in host slots -> swap-ins copied into fresh
                    device blocks (ModelRunner.swap_in's copy)
          baseline  memcpy: one torch copy of a contiguous buffer of the same bytes
    disk  offload   every host entry evicted -> the writer thread writes one checksummed block
                    file each (temporary file, rename)
          onboard   a prefix lookup reads every file back into host slots (header and payload
                    checked); the swap-ins into the pool that follow are the host tier's part
          baseline  one file of the same bytes written, then read back, sequentially

``ratio`` is the lower of offload / baseline and onboard / baseline (target >= 0.5). Each figure
is the median of ``--repeats`` rounds. ``--cold`` drops the files from the page cache before
they are read (fsync + POSIX_FADV_DONTNEED, both the block files and the baseline's), so the
disk is read, not memory. ``bit_exact``: the blocks back in the pool equal the ones written.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

BLOCK_SHAPES = {"smollm2-135m": (30, 3, 64)}  # layers, KV heads, head dim


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(BLOCK_SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per round (720 KiB each by default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one, removed)")
    parser.add_argument("--cold", action="store_true", help="drop the files from the page cache before reading")
    parser.add_argument("--plot", metavar="FILE.png", default=None)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Rig:
    """A device pool of ``n`` blocks filled with random KV, a KVCacheManager over it and tiers
    with room for all of them in host memory and on disk."""

    def __init__(self, args, directory: Path) -> None:
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
        # Twice the blocks: the second half is where blocks come back to.
        self.pool = torch.randn(kv_cache_shape(cfg, 2 * n, bs), generator=g).to(dtype)
        layout = kv_layout(self.pool, f"bench-{args.shape}-{args.dtype}")
        self.block_bytes = layout.block_bytes
        self.copies = TierCopies(self.pool, n + 1)
        self.copies.host.tensor.zero_()  # steady state: a node touches its host pages once, on first use
        disk = DiskTier(directory, 4 * n * (layout.block_bytes + 4096), layout, element_size_of)
        self.tiers = KVTiers(HostTier(n + 1), disk, layout.block_bytes, self.copies.copy_out,
                             self.copies.host.slot_view, max_inflight=n)
        self.tiers.spill_ahead = 0  # the bench spills on purpose, all at once
        self.kv = KVCacheManager(2 * n, bs, tiers=self.tiers)
        self.round = 0

    def close(self) -> None:
        self.tiers.close()

    def new_blocks(self) -> list[int]:
        """Fresh prompt tokens whose n blocks are computed (random KV already there) and cached."""
        self.round += 1
        tokens = [(self.round * 7919 + i) % 49000 + 3 for i in range(self.n * self.bs)]
        self.kv.allocate_slots(f"r{self.round}", 0, len(tokens))
        self.kv.cache_computed_blocks(f"r{self.round}", tokens, len(tokens))
        self.kv.free(f"r{self.round}")
        return tokens

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

    def onboard(self, tokens: list[int]) -> tuple[float, float, list[int]]:
        """(seconds of the lookup, which reads disk hits; seconds of the swap-ins; block ids)."""
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
        return t1 - t0, t3 - t2, ids

    def spill_all(self) -> float:
        t0 = time.perf_counter()
        for entry in self.tiers.host.lru():
            self.tiers._evict_host(entry)
        self.settle()
        return time.perf_counter() - t0


def _one_round(rig: _Rig, cold: bool, directory: Path) -> dict:
    import torch

    tokens = rig.new_blocks()
    src = [rig.kv.pool.cached[h].block_id for h in _hashes(rig, tokens)]
    original = rig.pool[:, src].clone()
    out = {"host_offload_s": rig.offload_host()}
    rig.evict_device(tokens)
    _, out["host_onboard_s"], ids = rig.onboard(tokens)
    exact = torch.equal(rig.pool[:, ids], original)
    rig.evict_device(tokens)
    out["disk_offload_s"] = rig.spill_all()
    rig.tiers.host.clear()
    if cold:
        for h in _hashes(rig, tokens):
            _drop_cache(rig.tiers.disk.path(h))
    rig.evict_device(tokens)
    out["disk_onboard_s"], _, ids = rig.onboard(tokens)  # the files into host slots; then the host's copy in
    out["bit_exact"] = exact and torch.equal(rig.pool[:, ids], original)
    for e in rig.tiers.disk.clear():  # the next round writes its own files
        os.unlink(rig.tiers.disk.path(e.block_hash))
    rig.tiers.host.clear()
    return out


def _hashes(rig: _Rig, tokens: list[int]) -> list[int]:
    from tokens.block_hash import hash_prompt_blocks

    return hash_prompt_blocks(tokens, rig.bs)[: rig.n]


def _baselines(nbytes: int, directory: Path, cold: bool) -> dict:
    """memcpy, and a sequential write then read of one file, of ``nbytes``."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first, as the tiers' buffers are touched
    t0 = time.perf_counter()
    dst.copy_(src)
    memcpy_s = time.perf_counter() - t0
    path = directory / "baseline.bin"
    view = memoryview(src.numpy())
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(view)
    write_s = time.perf_counter() - t0
    if cold:
        _drop_cache(path)
    back = memoryview(dst.numpy())
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        f.readinto(back)
    read_s = time.perf_counter() - t0
    path.unlink()
    return {"memcpy_s": memcpy_s, "write_s": write_s, "read_s": read_s}


def run(args: argparse.Namespace, report) -> dict:
    own_dir = args.dir is None
    directory = Path(args.dir or tempfile.mkdtemp(prefix="pdserve-kv-tiers-"))
    rig = _Rig(args, directory / "tier")
    nbytes = rig.n * rig.block_bytes
    report.progress(f"{rig.n} blocks of {rig.block_bytes / 2**10:.0f} KiB ({nbytes / 2**20:.0f} MiB) per round, "
                    f"{args.repeats} rounds, disk in {directory}{' (cold reads)' if args.cold else ''}")
    rounds, bases = [], []
    try:
        for i in range(args.repeats):
            rounds.append(_one_round(rig, args.cold, directory))
            bases.append(_baselines(nbytes, directory, args.cold))
            r, b = rounds[-1], bases[-1]
            report.progress(f"round {i + 1}: host {_gbps(nbytes, r['host_offload_s']):.2f} down / "
                            f"{_gbps(nbytes, r['host_onboard_s']):.2f} back GB/s (memcpy "
                            f"{_gbps(nbytes, b['memcpy_s']):.2f}); disk {_gbps(nbytes, r['disk_offload_s']):.2f} / "
                            f"{_gbps(nbytes, r['disk_onboard_s']):.2f} (file {_gbps(nbytes, b['write_s']):.2f} / "
                            f"{_gbps(nbytes, b['read_s']):.2f})")
    finally:
        rig.close()
        if own_dir:
            _rmtree(directory)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "bit_exact"}
    base = {k: statistics.median(b[k] for b in bases) for k in bases[0]}
    tiers = {
        "host": _tier(nbytes, med["host_offload_s"], med["host_onboard_s"], base["memcpy_s"], base["memcpy_s"]),
        "disk": _tier(nbytes, med["disk_offload_s"], med["disk_onboard_s"], base["write_s"], base["read_s"]),
    }
    rows = [[name, t["offload_gbps"], t["baseline_offload_gbps"], t["onboard_gbps"], t["baseline_onboard_gbps"],
             t["ratio"]] for name, t in tiers.items()]
    report.table(["tier", "down GB/s", "baseline", "back GB/s", "baseline", "ratio"], rows)
    if args.plot:
        _plot(tiers, args.plot)
        report.progress(f"plot written to {args.plot}")
    return {"tiers": tiers, "bit_exact": all(r["bit_exact"] for r in rounds), "blocks": rig.n,
            "block_bytes": rig.block_bytes, "cold": args.cold, "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} CPUs", "repeats": args.repeats}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _tier(nbytes, offload_s, onboard_s, base_offload_s, base_onboard_s) -> dict:
    down, back = _gbps(nbytes, offload_s), _gbps(nbytes, onboard_s)
    base_down, base_back = _gbps(nbytes, base_offload_s), _gbps(nbytes, base_onboard_s)
    return {"offload_gbps": round(down, 3), "onboard_gbps": round(back, 3),
            "baseline_offload_gbps": round(base_down, 3), "baseline_onboard_gbps": round(base_back, 3),
            "offload_ratio": round(down / base_down, 3), "onboard_ratio": round(back / base_back, 3),
            "ratio": round(min(down / base_down, back / base_back), 3)}


def _plot(tiers: dict, path: str) -> None:
    from bench.plotting import figure

    with figure(path, figsize=(7, 3.5)) as (_, ax):
        labels, ours, base = [], [], []
        for name, t in tiers.items():
            for way in ("offload", "onboard"):
                labels.append(f"{name} {'down' if way == 'offload' else 'back'}")
                ours.append(t[f"{way}_gbps"])
                base.append(t[f"baseline_{way}_gbps"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="tiers")
        ax.bar([i + 0.2 for i in x], base, 0.4, label="memcpy / sequential file")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("GB/s")
        ax.legend()


def _rmtree(directory: Path) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
