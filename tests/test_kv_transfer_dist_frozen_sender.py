"""A dist receiver whose SENDER freezes mid-push (SIGSTOP on the sending process, SIGCONT in a
finally): the receiver's wait on the group is bounded, so the transfer ends as a failure (counted
once by ``on_outcome``), and its reservation is no longer held by a push in flight (a drop frees
the blocks at once). The receiver is a real data port with process groups in this process, the
sender a real DistKVSender in a child process, over a real gloo group on 127.0.0.1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

from kv_transfer.dist_transport import dist_endpoint
from kv_transfer.receiver import TcpKVServer
from kv_transfer.validate import Reservation, new_token
from node.reservations import ReservationTable
from tests.helpers import REPO

# [layers, blocks, 2, block, heads, dim] float32: 64 KiB per block-layer, 128 MiB in all, sent in
# 64 KiB chunks: ~2000 group receives, far more than the moment between the header and the stop.
SHAPE = (8, 256, 2, 16, 8, 64)
FP = "frozen"
BOUND_S = 1.0  # the receiver's bounds here: a group wait and a stalled socket

SENDER = textwrap.dedent("""
    import json, sys
    import torch
    from kv_transfer.dist_transport import DistKVSender
    a = json.loads(sys.argv[1])
    pool = torch.full(a["shape"], 0.5)
    s = DistKVSender(chunk_bytes=65536, progress_timeout_s=60.0)
    n = a["shape"][1]
    try:
        s.push(a["endpoint"], pool, request_id="r", fingerprint=a["fp"], src_block_ids=list(range(n)),
               block_hashes=list(range(1, n + 1)), num_tokens=n * a["shape"][3], dest_block_ids=list(range(n)),
               token=bytes.fromhex(a["token"]), timeout=60.0)
        print("landed", flush=True)
    except Exception as e:
        print("failed", type(e).__name__, e, flush=True)
""")


def test_a_frozen_sender_fails_the_transfer_within_the_receivers_bound_and_frees_its_reservation():
    n = SHAPE[1]
    table = ReservationTable(SHAPE[0], lease_s=60.0)
    token = new_token()
    table.add("r", Reservation(0, tuple(range(n)), tuple(range(1, n + 1)), token), tuple(range(n * SHAPE[3])))
    began = threading.Event()
    outcomes: list[tuple[bool, float]] = []

    def begin(rid: str) -> bool:
        ok = table.begin_push(rid)
        began.set()
        return ok

    server = TcpKVServer(torch.zeros(SHAPE), FP, on_received=lambda r: None, reservation_for=table.get,
                         begin_push=begin, end_push=table.end_push, stall_timeout_s=BOUND_S, dist=True,
                         on_outcome=lambda ok, nbytes, seconds: outcomes.append((ok, time.monotonic())))
    server.dist.timeout_s = BOUND_S  # every wait on a group (the default is 5 s)
    port = server.start()
    args = {"shape": list(SHAPE), "endpoint": dist_endpoint(f"127.0.0.1:{port}"), "fp": FP, "token": token.hex()}
    proc = subprocess.Popen([sys.executable, "-c", SENDER, json.dumps(args)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert began.wait(60), "the sender's header never arrived"
        os.kill(proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        deadline = frozen_at + BOUND_S + 5.0
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert outcomes, "the receiver still waits on a frozen sender"
        (ok, at), = outcomes
        assert not ok, "the push landed before the sender froze: make it larger"
        assert at - frozen_at < BOUND_S + 5.0
        assert table.drop("r") == (True, True)  # no push in flight holds the blocks any more
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
        server.stop()
