"""The receiving process of `pdserve bench transfer`: a decode node's data plane without its
engine, in its own process as on a real node (a sender and a receiver in one process would
share one GIL and measure its contention instead).

It serves, on 127.0.0.1: gRPC (KVReceiver's PushBlocks and a bytes-only sink), the raw data
stream (TcpKVServer: tcp, shm and dist transfers) and a plain socket that receives length-prefixed
bytes into a reused buffer and acks each with one byte (the ceiling). It prints one JSON line
with the ports, then answers JSON-line commands on stdin, one reply line each:

    {"reserve": rid, "first": k, "dest": [...], "hashes": [...]}   -> {"ok": true}
    {"digest": [block ids]}   -> {"xxh3": hex of the destination pool's bytes of those blocks}
    {"clear": [block ids]}    -> {"ok": true}, those blocks filled with SENTINEL

``clear`` lets the bench check each transport on its own: every transport writes the same
bytes into the same blocks, so without it a digest would only see the last writer.
"""
from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
from concurrent import futures

import grpc
import torch
import xxhash

from kv_transfer.data_port import tune_socket
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, KVReceiver
from kv_transfer.receiver import TcpKVServer
from kv_transfer.validate import Reservation
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

SINK_SERVICE, SINK_METHOD = "pdserve.bench.Sink", "PushBlocks"
RAW_LEN = struct.Struct("!Q")
# What ``clear`` writes: NaN, which randn source blocks never hold, so a transport that writes
# nothing (or only part of a block) cannot match the source's digest.
SENTINEL = float("nan")


RAW_MODES = ("default", "tuned", "warm")


def set_raw_options(sock: socket.socket, mode: str) -> None:
    """Socket options of a raw-ceiling connection (either end): the data port's for "tuned",
    else the kernel's defaults (plus no Nagle delay)."""
    if mode == "tuned":
        tune_socket(sock)
    else:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _sink(request_iterator, context) -> bytes:
    for _ in request_iterator:  # read every message, keep nothing
        pass
    return kv_pb2.PushBlocksResponse().SerializeToString()


def _raw_server(listener: socket.socket, mode: str) -> None:
    """Length-prefixed payloads, a 1-byte ack after each. ``mode``: "default" (the kernel's
    socket options, the payload into one reused buffer of its size), "tuned" (the data port's
    options, 4 MiB buffers), "warm" (default options, read 1 MiB at a time into one reused,
    cache-warm 1 MiB buffer: moves the bytes without placing them anywhere)."""
    conn, _ = listener.accept()
    set_raw_options(conn, mode)
    buf = bytearray(1 << 20)
    head = bytearray(RAW_LEN.size)
    while True:
        if conn.recv_into(head, RAW_LEN.size, socket.MSG_WAITALL) < RAW_LEN.size:
            return
        (n,) = RAW_LEN.unpack(head)
        if len(buf) < n and mode != "warm":
            buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = conn.recv_into(view[: n - got] if mode == "warm" else view[got:n])
            if k == 0:
                return
            got += k
        conn.sendall(b"\x01")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", type=int, nargs=6, required=True)
    args = p.parse_args()
    pool = torch.zeros(args.shape)  # [layers, blocks, 2, block, heads, dim] float32
    reservations: dict[str, Reservation] = {}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=KV_GRPC_OPTIONS)
    kv_pb2_grpc.add_KVTransferServicer_to_server(
        KVReceiver(pool, "bench", on_received=lambda r: None, reservation_for=reservations.get), server)
    sink = grpc.stream_unary_rpc_method_handler(_sink)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SINK_SERVICE, {SINK_METHOD: sink}),))
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    data = TcpKVServer(pool, "bench", on_received=lambda r: None, reservation_for=reservations.get, dist=True)
    data_port = data.start()
    raw = {}
    for mode in RAW_MODES:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_raw_server, args=(listener, mode), daemon=True).start()
        raw[f"raw_{mode}"] = listener.getsockname()[1]
    print(json.dumps({"grpc": grpc_port, "data": data_port, **raw}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "reserve" in cmd:
            reservations[cmd["reserve"]] = Reservation(cmd["first"], tuple(cmd["dest"]), tuple(cmd["hashes"]),
                                                       bytes.fromhex(cmd["token"]))
            out = {"ok": True}
        elif "clear" in cmd:
            pool[:, cmd["clear"]] = SENTINEL
            out = {"ok": True}
        else:
            blocks = pool[:, cmd["digest"]].contiguous()
            out = {"xxh3": xxhash.xxh3_64(blocks.numpy().tobytes()).hexdigest()}
        print(json.dumps(out), flush=True)
    data.stop()
    server.stop(grace=None)


if __name__ == "__main__":
    main()
