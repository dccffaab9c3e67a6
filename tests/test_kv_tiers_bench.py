"""`pdserve bench kv-tiers`: the cold-read proof (bench/kv_tiers_cold.py) on hand-built
/proc/self/io readings and mount tables, and one quick run on a real temporary directory."""
from __future__ import annotations

import argparse
import io
import os

import pytest

from bench.kv_tiers_cold import ColdProof, cold_proof, combine, mount_of, parse_proc_io, read_proc_io

PROC_IO = """rchar: 6976
wchar: 0
syscr: 10
syscw: 0
read_bytes: {read}
write_bytes: 0
cancelled_write_bytes: 0
"""
MIB = 1 << 20


def _io(read_bytes: int) -> dict[str, int]:
    return parse_proc_io(PROC_IO.format(read=read_bytes))


def test_proc_io_text_is_parsed_into_counters():
    assert _io(12288) == {"rchar": 6976, "wchar": 0, "syscr": 10, "syscw": 0, "read_bytes": 12288,
                          "write_bytes": 0, "cancelled_write_bytes": 0}


def test_a_read_that_storage_served_is_proven_cold():
    p = cold_proof(64 * MIB, _io(4096), _io(4096 + 64 * MIB + 8192))  # readahead and page rounding: a bit more
    assert p == ColdProof(64 * MIB, 64 * MIB + 8192, True)
    assert p.as_dict() == {"cold_proven": True, "logical_bytes": 64 * MIB, "storage_read_bytes": 64 * MIB + 8192,
                           "storage_ratio": 1.0}


def test_a_warm_read_with_no_storage_bytes_is_not_proven():
    p = cold_proof(64 * MIB, _io(4096), _io(4096))
    assert p.cold_proven is False and p.storage_read_bytes == 0 and p.storage_ratio == 0.0


def test_a_partly_cached_read_is_not_proven():
    assert cold_proof(100 * MIB, _io(0), _io(94 * MIB)).cold_proven is False  # under 0.95 of the bytes
    assert cold_proof(100 * MIB, _io(0), _io(95 * MIB)).cold_proven is True


def test_missing_counters_prove_nothing():
    assert cold_proof(MIB, None, _io(MIB)) == ColdProof(MIB, None, False)
    assert cold_proof(MIB, {"rchar": 1}, {"rchar": MIB}).storage_read_bytes is None
    assert cold_proof(0, _io(0), _io(0)).cold_proven is False  # an empty read proves nothing
    assert ColdProof(MIB, None, False).as_dict()["storage_ratio"] is None


def test_rounds_combine_into_one_proof_only_when_every_one_is_cold():
    cold, warm = ColdProof(10, 10, True), ColdProof(10, 0, False)
    assert combine([cold, cold]) == ColdProof(20, 20, True)
    assert combine([cold, warm]) == ColdProof(20, 10, False)
    assert combine([cold, ColdProof(10, None, False)]).storage_read_bytes is None
    assert combine([]).cold_proven is False


MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,relatime 0 0
overlay /data overlay rw,lowerdir=/a 0 0
/dev/vdb /data ext4 rw 0 0
tmpfs /mnt/with\\040space tmpfs rw 0 0
"""


def test_the_mount_of_a_path_is_its_longest_mount_point():
    assert mount_of("/tmp/x", MOUNTS)["fstype"] == "ext4"
    assert mount_of("/dev/shm/pdserve", MOUNTS) == {"mount_point": "/dev/shm", "fstype": "tmpfs",
                                                     "source": "tmpfs", "options": "rw,relatime"}
    assert mount_of("/dev/shmx", MOUNTS)["mount_point"] == "/"  # a prefix of the name is not a parent
    assert mount_of("/data/kv", MOUNTS)["source"] == "/dev/vdb"  # mounted last on the point: the visible one
    assert mount_of("/mnt/with space/kv", MOUNTS)["mount_point"] == "/mnt/with space"
    assert mount_of("/x", "") is None


def test_rereading_a_file_in_the_page_cache_is_not_proven_cold(tmp_path):
    if read_proc_io() is None:
        pytest.skip("no /proc/self/io")
    path = tmp_path / "warm.bin"
    path.write_bytes(os.urandom(4 * MIB))
    path.read_bytes()  # in the page cache now, whatever the filesystem
    before = read_proc_io()
    assert len(path.read_bytes()) == 4 * MIB
    assert cold_proof(4 * MIB, before, read_proc_io()).cold_proven is False


def test_a_quick_run_reports_every_figure_with_its_cold_proof(tmp_path):
    from bench import Reporter, kv_tiers

    parser = argparse.ArgumentParser()
    kv_tiers.add_arguments(parser)
    args = parser.parse_args(["--quick", "--blocks", "4", "--dir", str(tmp_path)])
    out = kv_tiers.run(args, Reporter(io.StringIO()))
    assert out["bit_exact"] is True and out["blocks"] == 4 and out["repeats"] == 1 and out["cold"] is True
    assert set(out["tiers"]) == {"host", "host_fragmented", "disk"}
    for t in out["tiers"].values():
        assert t["offload_gbps"] > 0 and t["onboard_gbps"] > 0 and t["ratio"] == min(t["offload_ratio"],
                                                                                      t["onboard_ratio"])
    assert out["tiers"]["host"]["copy_runs"] <= 2  # one run of blocks (a slot may wrap)
    disk = out["tiers"]["disk"]
    assert disk["offload_unsynced_gbps"] > 0 and disk["baseline_offload_unsynced_gbps"] > 0
    ours, base = disk["cold_proof"]["ours"], disk["cold_proof"]["baseline"]
    assert ours["logical_bytes"] > 4 * out["block_bytes"] and base["logical_bytes"] == 4 * out["block_bytes"]
    assert out["cold_proven"] == (ours["cold_proven"] and base["cold_proven"])
    assert disk["met"] == (disk["ratio"] >= 0.5 if out["cold_proven"] else None)
    fs = out["filesystem"]
    assert fs["path"] == os.path.realpath(tmp_path) and fs["block_size"] > 0 and "fstype" in fs
    if fs["fstype"] in ("tmpfs", "ramfs"):
        assert out["cold_proven"] is False  # no storage under it: never reported cold
