"""Layer-wise KV streaming of one prefill: push each layer of each finished chunk while the
engine computes the later layers and chunks (docs/cluster.md, "KV data plane").

The engine thread reports progress (``on_layer``: after layer l of a step, blocks [0, E) are
final for layers 0..l); one sender thread per request turns what is ready and not yet sent into
rectangles (a layer range x a block range) and pushes each through the node's KV sender as soon
as the previous push returned::

    layer   0 1 2 ... l ... L-1
    chunk 1 ###################    sent
    chunk 2 #######.............   layers 0..l ready: the next push is that rectangle
    chunk 3 ...................    not computed yet

Everything that piled up while a push was on the wire goes out in the next one, so pushes grow
when layers finish faster than they can be sent, and a push smaller than ``min_push_units``
(layer, block) units waits for more unless the prefill has finished. Blocks below ``skip`` (the
decode node's cached leading blocks) are never sent.

A preemption (``KV_PREEMPTED``) voids what was reported and sent: the request recomputes into
other blocks, so sending restarts from ``skip`` (a push in flight then may have read blocks
reused by another request; the later pushes overwrite everything it wrote). Nothing here touches
the engine: the engine thread only calls ``on_layer``.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc

from engine.model_runner import KV_PREEMPTED
from kv_transfer.transport import PushResult, TransferError

# push(layers, first block, end block, source block table covering [0, end)) -> PushResult
PushFn = Callable[[range, int, int, tuple[int, ...]], PushResult]


class KVStreamer:
    def __init__(self, push: PushFn, *, num_layers: int, num_blocks: int, skip: int,
                 min_push_units: int = 1, name: str = "kv-stream", start: bool = True) -> None:
        """``num_blocks``: the prompt's blocks; [skip, num_blocks) of every layer go out."""
        if not 0 <= skip <= num_blocks:
            raise ValueError(f"need 0 <= skip ({skip}) <= num_blocks ({num_blocks})")
        self._push = push
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.skip = skip
        self.min_push_units = max(1, min_push_units)
        self._cond = threading.Condition()
        self._ready = [0] * num_layers  # per layer: blocks [0, ready) hold final KV
        self._sent = [skip] * num_layers  # per layer: blocks [skip, sent) landed
        self._table: tuple[int, ...] = ()
        self._generation = 0  # bumped by a preemption: pushes of an older one do not count
        self._finished = False
        self._cancelled = False
        self.error: TransferError | None = None
        self.on_error: Callable[[], object] | None = None  # called once a push failed (stop the compute)
        # What the response reports.
        self.pushes = 0
        # summed wall time of the pushes' attempts that landed (a failed fast attempt before a
        # fallback is counted in fallbacks, its time left out: PushResult.seconds)
        self.transfer_s = 0.0
        self.fallbacks = 0
        self.bytes_sent = 0
        self.last_landed: float | None = None  # time.monotonic() when the last push returned
        self._bytes_by_transport: Counter[str] = Counter()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    # ---- engine thread
    def on_layer(self, layer: int, ready_blocks: int, table: tuple[int, ...]) -> None:
        """The engine's KVLayerListener for this request (engine/model_runner.py)."""
        with self._cond:
            if layer == KV_PREEMPTED:
                self._generation += 1
                self._ready = [0] * self.num_layers
                self._sent = [self.skip] * self.num_layers
                self._table = ()
                return
            ready = min(ready_blocks, self.num_blocks)
            if ready <= self._ready[layer]:
                return
            if len(table) > len(self._table):
                self._table = table[: self.num_blocks]
            self._ready[layer] = ready  # layers run in order: the earlier ones were told as much
            self._cond.notify()

    # ---- the RPC's thread
    def finish(self, table: Callable[[], list[int]]) -> None:
        """The prefill finished: every block of every layer is final; send the rest. ``table``
        gives the request's block table when the engine's reports did not cover it all."""
        with self._cond:
            need_table = len(self._table) < self.num_blocks
        full = tuple(table()[: self.num_blocks]) if need_table else None
        with self._cond:
            if full is not None:
                self._table = full
            self._ready = [self.num_blocks] * self.num_layers
            self._finished = True
            self._cond.notify()

    def cancel(self) -> None:
        """Stop after the push in flight (the request failed or went away)."""
        with self._cond:
            self._cancelled = True
            self._cond.notify()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the sender to stop; False if it still runs after ``timeout``."""
        if self._thread.ident is not None:  # never started: nothing to wait for
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        """Every (layer, block) landed."""
        with self._cond:
            return self._finished and all(s >= self.num_blocks for s in self._sent)

    @property
    def transport(self) -> str:
        """What carried most of the bytes ("" before any push)."""
        most = self._bytes_by_transport.most_common(1)
        return most[0][0] if most else ""

    # ---- sender thread
    def _next(self) -> tuple[range, int, int] | None:
        """The next rectangle to push (layers, first block, end block), or None. Called with
        the lock held."""
        for l0 in range(self.num_layers):
            a, b = self._sent[l0], self._ready[l0]
            if b > a:
                break
        else:
            return None
        l1 = l0 + 1
        while l1 < self.num_layers and self._sent[l1] == a and self._ready[l1] >= b:
            l1 += 1
        return range(l0, l1), a, b

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._cancelled or self.error is not None:
                        return
                    rect = self._next()
                    if rect is None:
                        if self._finished:
                            return  # everything landed
                    elif self._finished or len(rect[0]) * (rect[2] - rect[1]) >= self.min_push_units:
                        break
                    self._cond.wait()
                layers, a, b = rect
                table, generation = self._table[:b], self._generation
            t0 = time.monotonic()
            try:
                result = self._push(layers, a, b, table)
            except TransferError as err:
                self._fail(err)
                return
            except Exception as err:  # a bug here must still end the RPC, not hang it
                self._fail(TransferError(grpc.StatusCode.INTERNAL, f"KV streaming failed: {err!r}"))
                return
            t1 = time.monotonic()
            with self._cond:
                self.pushes += 1
                self.transfer_s += result.seconds or t1 - t0
                self.fallbacks += result.fallbacks
                self.bytes_sent += result.bytes_written
                self._bytes_by_transport[result.transport] += result.bytes_written
                self.last_landed = t1
                if generation == self._generation:
                    for layer in layers:
                        self._sent[layer] = max(self._sent[layer], b)
                self._cond.notify_all()

    def _fail(self, err: TransferError) -> None:
        with self._cond:
            self.error = err
            self._cond.notify_all()
            on_error = self.on_error
        if on_error is not None:
            try:
                on_error()
            except Exception:  # the RPC still sees self.error
                pass
