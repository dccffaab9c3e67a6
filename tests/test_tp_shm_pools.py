"""The tensor-parallel ranks' KV pools in /dev/shm (engine/parallel/kv_regroup.py SharedPools,
issue 49): a /dev/shm too small for them is refused at start by name and sizes (the pool files
are sparse: otherwise the node dies of SIGBUS under load), and pool files a SIGKILLed rank 0
left behind are removed at the next start, while a live creator's are not."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from engine.parallel.kv_regroup import SharedPools, remove_leftovers, shm_room_error
from engine.parallel.plan import TensorParallelError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_room_check_passes_a_pool_that_fits_and_names_the_sizes_of_one_that_does_not() -> None:
    assert shm_room_error("/dev/shm", free_bytes=3 << 30, pool_bytes=1 << 30, ranks=4) is None  # 3 x 1 GiB fits
    why = shm_room_error("/dev/shm", free_bytes=1 << 30, pool_bytes=1 << 30, ranks=3)
    assert why is not None
    for part in ("/dev/shm", str(2 << 30), "2 ranks x 1073741824 bytes", str(1 << 30), "shmSize"):
        assert part in why, (part, why)


def test_a_pool_larger_than_dev_shm_is_refused_at_start_and_leaves_nothing() -> None:
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if directory is None:
        pytest.skip("no /dev/shm here")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    before = set(os.listdir(directory))
    rows = free // 4 + (1 << 20)  # one rank's pool of float32: more than the whole of /dev/shm
    with pytest.raises(TensorParallelError) as err:
        SharedPools(2, (rows,), torch.float32)
    assert directory in str(err.value) and str(rows * 4) in str(err.value)
    assert not {n for n in set(os.listdir(directory)) - before if n.startswith("pdserve-tp-")}


_CHILD = """
import sys, time, torch
from engine.parallel.kv_regroup import SharedPools
pools = SharedPools(3, (4, 1024), torch.float32, directory=sys.argv[1])
print(" ".join(pools.paths), flush=True)
time.sleep(60)
"""


def test_files_of_a_sigkilled_rank0_are_removed_at_the_next_start_and_a_live_ones_are_kept(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        leaked = child.stdout.readline().split()
        assert len(leaked) == 2 and all(os.path.exists(p) for p in leaked)
        assert remove_leftovers(str(tmp_path)) == []  # its creator is alive (and holds the lock)
        os.kill(child.pid, signal.SIGKILL)  # as during a model load
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    assert all(os.path.exists(p) for p in leaked)  # nothing removed their names
    live = SharedPools(2, (4, 1024), torch.float32, directory=str(tmp_path))  # the next start
    try:
        assert not any(os.path.exists(p) for p in leaked)
        assert all(os.path.exists(p) for p in live.paths)
        assert remove_leftovers(str(tmp_path)) == []  # this process's own pools are kept
        assert os.stat(live.paths[0]).st_blocks * 512 >= 4 * 1024 * 4  # allocated, not sparse
    finally:
        live.unlink()
    assert os.listdir(tmp_path) == []
