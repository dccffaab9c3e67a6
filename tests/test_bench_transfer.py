"""`pdserve bench transfer`'s checks and ceilings: each transport's bit-exactness is checked on
its own (a broken transport fails, whatever the others wrote), the memcpy ceiling's ways copy
the bytes, and the summary's chat-sized ratio covers only the sizes it names."""
from __future__ import annotations

import argparse
import os

import pytest

from bench import transfer
from bench.transfer_memcpy import MemcpyCeilings, chunk_bounds
from bench.transfer_rig import TRANSPORTS, Rig, exact_by_transport


@pytest.fixture(scope="module")
def rig():
    r = Rig(num_blocks=12)  # 12 blocks of SmolLM2-135M's KV shape: 8.8 MiB per pool
    yield r
    r.close()


def test_each_transport_is_checked_on_its_own(rig: Rig) -> None:
    """The real receiver process and senders; tcp's push writes nothing, shm's sends a source
    with one value changed (its checksum matches what it sends, so the receiver accepts it).
    Both fail, though grpc before them and dist after wrote the right bytes to the same blocks
    (without the clearing, tcp would see grpc's bytes and pass)."""
    c = rig.case(3)
    tampered = rig.src_pool.clone()
    tampered[7, c["src_ids"][1], 1, 2, 0, 5] += 1.0
    c["tcp"] = lambda: None
    c["shm"] = lambda: rig.shm.push(rig.receiver.shm_endpoint, tampered, **c["blocks"])
    assert rig.verify(c) == {"grpc": True, "tcp": False, "shm": False, "dist": True}


def test_untouched_transports_are_bit_exact(rig: Rig) -> None:
    for n in (1, 4):
        assert rig.verify(rig.case(n)) == dict.fromkeys(TRANSPORTS, True)


def test_a_transport_is_exact_only_if_every_check_passed() -> None:
    checks = [{"grpc": True, "shm": True}, {"grpc": True, "shm": False}, {"grpc": True, "ray_object_store": True}]
    assert exact_by_transport(checks) == {"grpc": True, "shm": False, "ray_object_store": True}


def test_every_memcpy_way_copies_the_bytes() -> None:
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)] and chunk_bounds(1, 4) == [(0, 1)]
    payload = os.urandom((3 << 20) + 7)
    ceilings = MemcpyCeilings(4 << 20, threads=3)
    try:
        fns = ceilings.fns(payload)
        assert set(fns) == {"memcpy_one_thread", "memcpy_threads", "memcpy_two_process"}
        ceilings._dst[:] = 0  # the two-process way copies between the shared buffers
        fns["memcpy_two_process"]()
        assert ceilings._dst[: len(payload)].tobytes() == payload
        fns["memcpy_threads"]()  # the thread pool's pieces ran (errors would raise here)
    finally:
        ceilings.close()


def test_default_sizes_include_chat_sized_transfers() -> None:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    lo, hi = transfer.CHAT_SIZED_MIB
    assert len([m for m in parser.parse_args([]).sizes_mib if lo <= m <= hi]) >= 3


def _size(mib: int, tcp: float, socket: float, memcpy: dict[str, float]) -> dict:
    ways = {f"memcpy_{w}_gbps": g for w, g in memcpy.items()}
    return {"mib": mib, "bytes": mib << 20, **dict.fromkeys(("grpc_gbps", "shm_gbps", "dist_gbps"), 1.0),
            "tcp_gbps": tcp, "socket_gbps": socket, **ways, "memcpy_gbps": max(memcpy.values())}


def test_summary_weighs_all_sizes_and_chat_sized_ones_apart() -> None:
    per_size = [_size(1, 0.5, 2.0, {"one_thread": 10.0, "threads": 8.0, "two_process": 5.0}),
                _size(4, 2.0, 2.5, {"one_thread": 12.0, "threads": 16.0, "two_process": 20.0}),
                _size(64, 3.0, 3.0, {"one_thread": 10.0, "threads": 18.0, "two_process": 16.0})]
    exact = dict.fromkeys(TRANSPORTS, True) | {"shm": False}
    transports, memcpy = transfer._summary(per_size, exact, threads=2, ray=False)
    assert transports["tcp"]["ratio_chat_sized"] == 0.8  # the 4 MiB point only
    assert transports["tcp"]["ratio"] == round(transports["tcp"]["gbps"] / transports["tcp"]["ceiling_gbps"], 3)
    assert transports["shm"]["bit_exact"] is False and transports["tcp"]["bit_exact"] is True
    # The ceiling is the best way per size, so at least the best way over all sizes.
    assert memcpy["fastest"] == "threads" and memcpy["threads"] == 2
    assert memcpy["best_gbps"] == transports["shm"]["ceiling_gbps"] > memcpy["threads_gbps"]
