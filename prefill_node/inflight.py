"""The prefills in progress on one prefill node: how many (``stats``, and whether a prefill ran
alone) and which of them stream their KV layer by layer.

Shared by the gRPC threads that run the prefills and the engine thread that reports their
layers. One lock guards the count and every change to the streamers; the engine thread's
lookup (``streamer_for``) takes no lock, so a layer report never waits for a gRPC thread.

Why "alone" matters: a prefill's wall time is a clean sample of the node's compute speed (a
``StepReport`` for the router's cost model) only when no other prefill shared the engine with
it, neither one already running when it began nor one started before it ended::

    prefill A   |------------------|        alone: nothing else in progress, nothing started
    prefill B        |-------|              not alone (A was running), and A is not alone either
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prefill_node.kv_streamer import KVStreamer


@dataclass(slots=True)
class PrefillRun:
    """One tracked prefill; ``alone`` is known once its ``track`` block has exited."""

    alone: bool = False


class InflightPrefills:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._starts = 0  # prefills ever started: a changed value means one started meanwhile
        self._streamers: dict[str, KVStreamer] = {}  # request id -> its streamer, while it runs

    @property
    def count(self) -> int:
        """Prefills in progress now (one attribute read: any thread)."""
        return self._count

    @contextmanager
    def track(self) -> Iterator[PrefillRun]:
        """Count one prefill as in progress for the ``with`` block; the count goes down on exit
        whatever the block raises. On exit the yielded run's ``alone`` says whether no other
        prefill was in progress when it began and none started before it ended (see the module
        docstring). Both ends take the lock; safe from any number of threads."""
        with self._lock:
            self._count += 1
            self._starts += 1
            alone, starts = self._count == 1, self._starts
        run = PrefillRun()
        try:
            yield run
        finally:
            with self._lock:
                self._count -= 1
                run.alone = alone and self._starts == starts

    # ---- layer-wise streaming
    def add_streamer(self, request_id: str, streamer: KVStreamer) -> bool:
        """Register ``streamer`` for the engine's layer reports of ``request_id``. False (and
        nothing registered) when another streamer holds that id: its request is still running,
        and the engine refuses a second one with the same id."""
        with self._lock:
            return self._streamers.setdefault(request_id, streamer) is streamer

    def streamer_for(self, request_id: str) -> KVStreamer | None:
        """The registered streamer of ``request_id``, if any. Lock-free (one dict read): the
        engine thread calls it after every layer."""
        return self._streamers.get(request_id)

    def remove_streamer(self, request_id: str, streamer: KVStreamer) -> None:
        """Unregister ``streamer``; idempotent, and a no-op when another streamer holds the id
        (the one this request failed to register beside)."""
        with self._lock:
            if self._streamers.get(request_id) is streamer:
                del self._streamers[request_id]

    @property
    def num_streamers(self) -> int:
        """Streamers registered now: 0 once every streamed prefill has ended."""
        return len(self._streamers)
