"""A worker rank (1 .. N-1): ``python -m engine.parallel.worker``, started by rank 0's executor.

It loads its shard, maps its own paged KV pool (a shared-memory file rank 0 made and maps too),
joins the gloo group over rank 0's TCPStore on loopback, then runs every step rank 0
broadcasts: the same forward on its heads (the all-reduces inside pair it with the other
ranks), no sampling. It exits when rank 0 says stop,
when its stdin closes (rank 0 is gone), or with an error when a collective fails or times out.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from engine.attention import get_attention_backend
from engine.attention.kv_cache import copy_blocks, kv_cache_shape
from engine.attention.metadata import AttentionMetadata
from engine.device import torch_dtype
from engine.parallel.kv_regroup import map_pool
from engine.parallel.shard import load_shard, make_row_parallel
from engine.parallel.step import HEADER_LEN, OP_STOP, broadcast, payload_len, unpack

STORE_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    rank: int
    size: int
    store_port: int  # rank 0's TCPStore, on loopback only
    model_dir: str  # the resolved local HF directory (same checkpoint as rank 0)
    dtype: str
    num_blocks: int
    block_size: int
    num_threads: int
    start_timeout_s: float
    step_timeout_s: float
    idle_timeout_s: float
    kv_path: str  # this rank's pool file, made by rank 0 (engine/parallel/kv_regroup.py SharedPools)

    def argv(self) -> list[str]:
        return [f"--{f.replace('_', '-')}={getattr(self, f)}" for f in self.__slots__]

    @staticmethod
    def parse(argv: list[str]) -> "WorkerSpec":
        p = argparse.ArgumentParser(prog="python -m engine.parallel.worker")
        for f, kind in (("rank", int), ("size", int), ("store_port", int), ("model_dir", str), ("dtype", str),
                        ("num_blocks", int), ("block_size", int), ("num_threads", int),
                        ("start_timeout_s", float), ("step_timeout_s", float), ("idle_timeout_s", float),
                        ("kv_path", str)):
            p.add_argument(f"--{f.replace('_', '-')}", type=kind, required=True)
        return WorkerSpec(**vars(p.parse_args(argv)))


def open_store(port: int, size: int, is_master: bool, start_timeout_s: float):
    """Rank 0's TCPStore on loopback (``is_master``; port 0: the kernel picks one), or a client of
    it; where the ranks find each other."""
    import torch.distributed as dist

    fd = None
    if is_master:
        # TCPStore's own listener takes every interface whatever host it is given, and the store
        # has no authentication: anyone on the network could rewrite where the ranks meet. Bound
        # here to loopback only (all ranks are processes of this host); the store owns the socket.
        listener = socket.create_server((STORE_HOST, port))
        port, fd = listener.getsockname()[1], listener.detach()
    return dist.TCPStore(STORE_HOST, port, size, is_master, timeout=timedelta(seconds=start_timeout_s),
                         wait_for_workers=False, **({} if fd is None else {"master_listen_fd": fd}))


def make_group(store, rank: int, size: int, join_timeout_s: float):
    """The gloo group over ``store`` (no init_process_group: no global state); returns once
    every rank joined, or raises after ``join_timeout_s``. That is also the group's default
    timeout, which no collective uses: each passes its own (the step timeout). A join bounded
    by the step timeout failed on a loaded machine while a worker still loaded its shard."""
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore("pdserve-tp", store), rank, size,
                                 timedelta(seconds=join_timeout_s))


def _exit_when_stdin_closes() -> None:
    # Rank 0 holds our stdin: EOF means it is gone (killed or crashed), and nothing else would
    # end a worker waiting for its next step.
    # Raw reads: a daemon thread inside the buffered reader would block interpreter shutdown.
    while os.read(0, 4096):
        pass
    os._exit(3)


def serve(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.num_threads)
    device = torch.device("cpu")
    dtype = torch_dtype(spec.dtype)
    # The fingerprint is rank 0's business (it owns the KV cache manager).
    loaded = load_shard(Path(spec.model_dir), spec.rank, spec.size, dtype, device, fingerprint="")
    cfg = loaded.config
    # In shared memory that rank 0 maps too: it gathers a request's KV heads from every rank
    # before a send and scatters received ones (engine/parallel/kv_regroup.py).
    shape = kv_cache_shape(cfg, spec.num_blocks, spec.block_size)  # [L, N, 2, bs, H_kv/TP, D]
    kv_cache = map_pool(spec.kv_path, shape, dtype)
    backend = get_attention_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype)
    store = open_store(spec.store_port, spec.size, False, spec.start_timeout_s)
    group = make_group(store, spec.rank, spec.size, spec.start_timeout_s)
    make_row_parallel(loaded.model, group, spec.step_timeout_s)
    step_timeout, idle_timeout = timedelta(seconds=spec.step_timeout_s), timedelta(seconds=spec.idle_timeout_s)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)  # [5]
    with torch.inference_mode():
        while True:
            broadcast(group, header, idle_timeout)
            if int(header[0]) == OP_STOP:
                return
            payload = torch.zeros(payload_len(header), dtype=torch.int64)
            broadcast(group, payload, step_timeout)
            step = unpack(header, payload)
            copy_blocks(kv_cache, step.block_copies)
            backend.begin_step(AttentionMetadata.build(step.q_lens, step.seq_lens, step.block_tables,
                                                       spec.block_size, device))
            ids = torch.tensor(step.input_ids, dtype=torch.long)  # [T]
            pos = torch.tensor(step.positions, dtype=torch.long)  # [T]
            loaded.model.forward(ids, pos, kv_cache, backend)


def main(argv: list[str] | None = None) -> int:
    spec = WorkerSpec.parse(sys.argv[1:] if argv is None else argv)
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    try:
        serve(spec)
    except Exception as e:  # a failed collective or load: say which rank, exit non-zero
        print(f"pdserve tensor-parallel rank {spec.rank}/{spec.size}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
