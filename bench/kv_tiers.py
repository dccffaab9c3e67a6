"""`pdserve bench kv-tiers`: KV blocks moved down to each tier and back through the engine's own
tier code, against a plain copy of the same bytes in the same run.

The blocks have the KV shape of a real model (SmolLM2-135M by default: 30 layers, 3 KV heads,
head dim 64, 16-token blocks, float32, 720 KiB a block); no weights are loaded. One device pool
and one set of tiers (bench/kv_tiers_rig.py: engine/kv_tiers/ under a real ``KVCacheManager``)
hold them::

    host  offload   blocks become cached -> the copier thread copies them into host slots
                    (KVTiers.service until every block is a ready host entry)
          onboard   a prefix lookup finds them in host slots -> swap-ins copied into fresh
                    device blocks (ModelRunner.swap_in's copy)
          baseline  memcpy: one torch copy of a contiguous buffer of the same bytes
          fragmented  the same after churn: the block table scattered, no two blocks adjacent
    disk  offload   every host entry evicted -> the writer thread writes one checksummed block
                    file each (temporary file, rename), then each file is fdatasynced
          onboard   the files dropped from the page cache; a prefix lookup reads every file back
                    into host slots (header and payload checked); the swap-ins into the pool that
                    follow are the host tier's part
          baseline  the device's own sequential bandwidth: one file of the same bytes written in
                    4 MiB chunks and fdatasynced, dropped from the page cache, read back in 4 MiB
                    chunks (dd bs=4M)

Reads are cold by default, and proven so: ``read_bytes`` of /proc/self/io must grow by the bytes
read, on both sides (bench/kv_tiers_cold.py). A side whose proof fails (tmpfs, or a kernel that
kept the pages) says ``cold_proven: false`` and the disk target is then neither met nor missed
(``met: null``). ``--warm`` skips the drop: page cache against page cache, for comparison.

``ratio`` is the lower of offload / baseline and onboard / baseline (target >= 0.5). Each figure
is the median of ``--repeats`` rounds. ``bit_exact``: the blocks back in the pool equal the ones
written, in every round, contiguous and fragmented.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.kv_tiers_cold import cold_proof, combine, drop_cached_pages, filesystem_info, read_proc_io
from bench.kv_tiers_rig import BLOCK_SHAPES, Rig

TARGET = 0.5  # each tier's ratio against its baseline
CHUNK = 4 << 20  # the sequential baseline's write and read size
QUICK_BLOCKS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(BLOCK_SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=256, help="blocks moved per round (720 KiB each by default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temporary one, removed)")
    parser.add_argument("--warm", action="store_true",
                        help="read the files from the page cache (no drop): not a disk figure")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: at most {QUICK_BLOCKS} blocks, one round")
    parser.add_argument("--plot", metavar="FILE.png", default=None)


def _host_round(rig: Rig, seed: int | None):
    """The pool laid out by ``seed`` (None: in id order), a prompt's blocks down to the host tier
    and back -> (figures, the tokens, their KV before, whether it came back exact)."""
    import torch

    rig.lay_out(seed)
    tokens = rig.new_blocks()
    original = rig.pool[:, rig.block_ids(tokens)].clone()
    out = {"host_offload_s": rig.offload_host()}
    rig.evict_device(tokens)
    _, out["host_onboard_s"], ids, out["copy_runs"] = rig.onboard(tokens)
    return out, tokens, original, torch.equal(rig.pool[:, ids], original)


def _round(rig: Rig, cold: bool) -> dict:
    """One round on a pool in id order (the prompt's blocks one run): host down and back, then
    disk down and back."""
    import torch

    out, tokens, original, exact = _host_round(rig, None)
    rig.evict_device(tokens)
    out["disk_offload_unsynced_s"], out["disk_offload_s"] = rig.spill_all(tokens)
    rig.tiers.host.clear()
    if cold:
        rig.drop_files(tokens)
    rig.evict_device(tokens)
    before = read_proc_io()
    out["disk_onboard_s"], _, ids, _ = rig.onboard(tokens)  # the files into host slots; then the host's copy in
    out["proof"] = cold_proof(rig.n * rig.file_bytes, before, read_proc_io())
    out["bit_exact"] = exact and torch.equal(rig.pool[:, ids], original)
    rig.clear_disk()
    rig.tiers.host.clear()
    return out


def _fragmented_round(rig: Rig, seed: int) -> dict:
    """Host down and back with the prompt's blocks scattered over the pool (after churn)."""
    out, _, _, out["bit_exact"] = _host_round(rig, seed)
    rig.tiers.host.clear()
    return out


def _baselines(nbytes: int, directory: Path, cold: bool) -> dict:
    """memcpy of ``nbytes``, and the device's sequential bandwidth: one file of them written and
    fdatasynced, then (dropped from the page cache) read back, both in ``CHUNK``s."""
    import torch

    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages first, as the tiers' buffers are touched
    t0 = time.perf_counter()
    dst.copy_(src)
    out = {"memcpy_s": time.perf_counter() - t0}
    path = directory / "baseline.bin"
    view, back = memoryview(src.numpy()), memoryview(dst.numpy())
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for off in range(0, nbytes, CHUNK):
            chunk = view[off:off + CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        out["write_unsynced_s"] = time.perf_counter() - t0
        os.fdatasync(fd)
    finally:
        os.close(fd)
    out["write_s"] = time.perf_counter() - t0
    if cold:
        drop_cached_pages([path])
    before = read_proc_io()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        off = 0
        while off < nbytes:
            n = f.readinto(back[off:off + CHUNK])
            assert n, f"{path} is shorter than {nbytes} bytes"
            off += n
    out["read_s"] = time.perf_counter() - t0
    out["proof"] = cold_proof(nbytes, before, read_proc_io())
    path.unlink()
    return out


def _run_rounds(args, rig: Rig, directory: Path, report) -> tuple[list, list, list]:
    nbytes = rig.n * rig.block_bytes
    rounds, bases, frags = [], [], []
    for i in range(args.repeats):
        rounds.append(_round(rig, not args.warm))
        bases.append(_baselines(nbytes, directory, not args.warm))
        frags.append(_fragmented_round(rig, seed=i))
        r, b, f = rounds[-1], bases[-1], frags[-1]
        report.progress(f"round {i + 1}: host {_gbps(nbytes, r['host_offload_s']):.2f} down / "
                        f"{_gbps(nbytes, r['host_onboard_s']):.2f} back GB/s, fragmented "
                        f"{_gbps(nbytes, f['host_offload_s']):.2f} / {_gbps(nbytes, f['host_onboard_s']):.2f} "
                        f"({f['copy_runs']} copies; memcpy {_gbps(nbytes, b['memcpy_s']):.2f}); disk "
                        f"{_gbps(nbytes, r['disk_offload_s']):.2f} / {_gbps(nbytes, r['disk_onboard_s']):.2f} "
                        f"(file {_gbps(nbytes, b['write_s']):.2f} / {_gbps(nbytes, b['read_s']):.2f}); "
                        f"storage/read bytes {_ratio_text(r['proof'])} ours, {_ratio_text(b['proof'])} baseline")
    return rounds, bases, frags


def run(args: argparse.Namespace, report) -> dict:
    if args.quick:
        args.blocks, args.repeats = min(args.blocks, QUICK_BLOCKS), 1
    own_dir = args.dir is None
    directory = Path(args.dir or tempfile.mkdtemp(prefix="pdserve-kv-tiers-"))
    directory.mkdir(parents=True, exist_ok=True)
    fs = filesystem_info(directory)
    rig = Rig(args, directory / "tier")
    nbytes = rig.n * rig.block_bytes
    report.progress(f"{rig.n} blocks of {rig.block_bytes / 2**10:.0f} KiB ({nbytes / 2**20:.0f} MiB) per round, "
                    f"{args.repeats} rounds, disk in {directory} ({fs['fstype']} on {fs['source']}), "
                    f"{'warm reads (page cache)' if args.warm else 'cold reads'}")
    try:
        rounds, bases, frags = _run_rounds(args, rig, directory, report)
    finally:
        rig.close()
        if own_dir:
            _rmtree(directory)
    tiers = _summarize(nbytes, rounds, bases, frags)
    rows = [[name, t["offload_gbps"], t["baseline_offload_gbps"], t["onboard_gbps"], t["baseline_onboard_gbps"],
             t["ratio"], t["met"]] for name, t in tiers.items()]
    report.table(["tier", "down GB/s", "baseline", "back GB/s", "baseline", "ratio", "met"], rows)
    proof = tiers["disk"]["cold_proof"]
    report.progress(f"cold proven: ours {proof['ours']['cold_proven']}, baseline {proof['baseline']['cold_proven']}")
    if args.plot:
        _plot(tiers, args.plot)
        report.progress(f"plot written to {args.plot}")
    return {"tiers": tiers, "bit_exact": all(r["bit_exact"] for r in rounds + frags), "blocks": rig.n,
            "block_bytes": rig.block_bytes, "cold": not args.warm,
            "cold_proven": proof["ours"]["cold_proven"] and proof["baseline"]["cold_proven"],
            "write_sync": "fdatasync", "filesystem": fs, "target": TARGET,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "repeats": args.repeats}


def _summarize(nbytes: int, rounds: list, bases: list, frags: list) -> dict:
    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    memcpy = med(bases, "memcpy_s")
    host = _tier(nbytes, med(rounds, "host_offload_s"), med(rounds, "host_onboard_s"), memcpy, memcpy)
    host["copy_runs"] = max(r["copy_runs"] for r in rounds)
    frag = _tier(nbytes, med(frags, "host_offload_s"), med(frags, "host_onboard_s"), memcpy, memcpy)
    frag["copy_runs"] = min(f["copy_runs"] for f in frags)
    disk = _tier(nbytes, med(rounds, "disk_offload_s"), med(rounds, "disk_onboard_s"), med(bases, "write_s"),
                 med(bases, "read_s"))
    ours, base = combine(r["proof"] for r in rounds), combine(b["proof"] for b in bases)
    disk["offload_unsynced_gbps"] = round(_gbps(nbytes, med(rounds, "disk_offload_unsynced_s")), 3)
    disk["baseline_offload_unsynced_gbps"] = round(_gbps(nbytes, med(bases, "write_unsynced_s")), 3)
    disk["cold_proof"] = {"ours": ours.as_dict(), "baseline": base.as_dict()}
    if not (ours.cold_proven and base.cold_proven):
        disk["met"] = None  # not a comparison with the device: neither met nor missed
    return {"host": host, "host_fragmented": frag, "disk": disk}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _ratio_text(proof) -> str:
    ratio = proof.storage_ratio
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _tier(nbytes, offload_s, onboard_s, base_offload_s, base_onboard_s) -> dict:
    down, back = _gbps(nbytes, offload_s), _gbps(nbytes, onboard_s)
    base_down, base_back = _gbps(nbytes, base_offload_s), _gbps(nbytes, base_onboard_s)
    ratio = round(min(down / base_down, back / base_back), 3)
    return {"offload_gbps": round(down, 3), "onboard_gbps": round(back, 3),
            "baseline_offload_gbps": round(base_down, 3), "baseline_onboard_gbps": round(base_back, 3),
            "offload_ratio": round(down / base_down, 3), "onboard_ratio": round(back / base_back, 3),
            "ratio": ratio, "met": ratio >= TARGET}


def _plot(tiers: dict, path: str) -> None:
    from bench.plotting import figure

    with figure(path, figsize=(8, 3.5)) as (_, ax):
        labels, ours, base = [], [], []
        for name, t in tiers.items():
            for way in ("offload", "onboard"):
                labels.append(f"{name.replace('_', ' ')} {'down' if way == 'offload' else 'back'}")
                ours.append(t[f"{way}_gbps"])
                base.append(t[f"baseline_{way}_gbps"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="tiers")
        ax.bar([i + 0.2 for i in x], base, 0.4, label="memcpy / sequential file (fdatasync, cold)")
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("GB/s")
        ax.legend()


def _rmtree(directory: Path) -> None:
    import shutil

    shutil.rmtree(directory, ignore_errors=True)
