"""The tensors and threads behind the tiers: the host buffer, the copies in and out of the device
pool, and the worker threads that run copies and file writes off the engine's step.

Host buffer layout, one slot per block (a slot is one contiguous run of bytes, which is what a
block file's payload is)::

    host: [num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]
    pool: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]   (engine/attention/kv_cache.py)
          block b of the pool = pool[:, b]: num_layers strided chunks  <->  host[slot]

On CUDA the host buffer is pinned, copies out of the pool run on a side stream after an event
the engine thread recorded when it handed the blocks over (their KV was written by then), and
copies into the pool are issued on the step's stream before the forward pass that reads them.
On CPU a copy is a memcpy on the worker thread (torch releases the GIL for it).

The threads that call ``copy_out`` are ``engine/kv_tiers/worker.py``'s.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class HostBuffer:
    def __init__(self, num_slots: int, block_shape: Sequence[int], dtype: torch.dtype, pin: bool) -> None:
        # [num_slots, L, 2, bs, H_kv, D]; pages are touched on first write, not here.
        self.tensor = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin)
        self._bytes = self.tensor.view(torch.uint8).reshape(num_slots, -1).numpy()  # [num_slots, block_bytes]
        self.block_bytes = self._bytes.shape[1]

    def slot_view(self, slot: int) -> memoryview:
        """The slot's bytes, writable (disk reads land here; disk writes read from here)."""
        return memoryview(self._bytes[slot])


def runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``pairs`` (a, b) grouped into maximal runs where both a and b step by one: (a, b, length).

    One copy per run instead of one per block: on CPU every ``copy_`` is a parallel region of
    torch's thread pool, and with the tiers' worker threads holding OpenMP teams of their own a
    region's start and end cost as much as a 720 KiB block's bytes (256 blocks one by one moved
    8-9 GB/s against memcpy's 19; as one run, ad hoc, 27 GB/s). Blocks allocated together and
    slots taken from the free list in order form runs."""
    out: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if out and a == out[-1][0] + out[-1][2] and b == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


def copy_out(pool: torch.Tensor, host: torch.Tensor, pairs: Sequence[tuple[int, int]],
             ready: Any = None, stream: Any = None) -> None:
    """Copy device blocks into host slots: ``pairs`` of (block id, slot). ``ready``: a CUDA event
    after which the blocks' KV is final; ``stream``: the side stream to copy on (CUDA)."""
    if stream is None:
        for block, slot, k in runs(pairs):
            host[slot:slot + k].copy_(pool[:, block:block + k].transpose(0, 1))  # [k, L, 2, bs, H_kv, D]
        return
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        for block, slot, k in runs(pairs):
            host[slot:slot + k].copy_(pool[:, block:block + k].transpose(0, 1), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    done.synchronize()


def copy_in(pool: torch.Tensor, host: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy host slots into device blocks: ``pairs`` of (slot, block id), on the current stream
    (the forward pass that reads them follows on it). The slots must stay untouched until the
    stream passed this point: the engine unpins them after the step, whose sampling synchronizes."""
    non_blocking = pool.device.type == "cuda"
    for slot, block, k in runs(pairs):
        pool[:, block:block + k].copy_(host[slot:slot + k].transpose(0, 1), non_blocking=non_blocking)


def ready_event(device: torch.device) -> Any:
    """A CUDA event on the current stream (None on CPU): what ``copy_out`` waits for."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev
