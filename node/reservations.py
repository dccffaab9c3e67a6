"""A node's KV reservations: which of its blocks a peer may push into, for how long, and
whether the KV has all arrived. Plain bookkeeping under one lock (gRPC threads share it). A
decode node reserves for the prompts prefill nodes push to it (ReserveBlocks); any node that
fetches a prefix from its holder reserves for the blocks fetched (node/prefix_fetch.py).

Life of one reservation::

    reserve -> add ----------> pushes (begin_push .. end_push, received (layers x blocks) recorded)
                       |                     \
                       |                      Decode -> take (every layer of every block in,
                       |                                      no push in flight)
                       |                      a fetch -> close_prefix (leading blocks in;
                       |                                 closed to every later push at once)
                       '-- ReleaseReservation / AbortDecode / lease expiry -> drop
                       (RenewReservation restarts the lease while the prefill is queued)

A reservation's blocks may only go back to the engine when no PushBlocks is writing into them:
``drop`` of a reservation with a push in flight only hides it (new pushes are refused), and
the push's ``end_push`` then says the blocks can be released.

Each reservation has its lease (``add``'s ``lease_s``; the table's by default): a fetch's
covers the fetch's own bound, which may be longer than a decode node's wait for its prefill.

A push carries a rectangle of the KV: a layer range x a contiguous run of the reserved blocks
(one push of everything, or many as a prefill node streams layers of finished chunks). The table
keeps, per layer, a bitmap of the reserved blocks received, so a request is only admitted once
every (layer, block) landed, however the pushes cut it up.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.validate import Reservation


@dataclass(slots=True)
class _Entry:
    reservation: Reservation
    prompt_token_ids: tuple[int, ...]
    deadline: float
    lease_s: float  # how long it waits for its next push (or Decode) before it expires
    # Per layer: bit i set = reserved block i (block_ids[i]) received for that layer.
    received: list[int] = field(default_factory=list)
    in_flight: int = 0
    dropped: bool = False


class NotReadyError(RuntimeError):
    """Decode came before the reservation's KV had all arrived."""


class ReservationTable:
    def __init__(self, num_layers: int, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_layers = num_layers
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        with self._lock:
            return sum(not e.dropped for e in self._entries.values())

    def ids(self) -> list[str]:
        """The request ids of every reservation not yet dropped."""
        with self._lock:
            return [rid for rid, e in self._entries.items() if not e.dropped]

    def add(self, request_id: str, reservation: Reservation, prompt_token_ids: tuple[int, ...],
            lease_s: float | None = None) -> None:
        """``lease_s``: this reservation's lease (None: the table's)."""
        lease = self.lease_s if lease_s is None else lease_s
        if not lease > 0:
            raise ValueError(f"a reservation's lease must be > 0 s, got {lease_s}")
        with self._lock:
            if request_id in self._entries:
                raise KeyError(f"request {request_id!r} already has a reservation")
            # No reserved blocks (every block already cached here): nothing to receive.
            self._entries[request_id] = _Entry(reservation, prompt_token_ids, self._clock() + lease, lease,
                                               [0] * self.num_layers)

    def get(self, request_id: str) -> Reservation | None:
        """What KVReceiver checks a push against; None once dropped."""
        with self._lock:
            e = self._entries.get(request_id)
            return None if e is None or e.dropped else e.reservation

    def begin_push(self, request_id: str) -> bool:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                return False
            e.in_flight += 1
            return True

    def received(self, request_id: str, layers: range, first_block_index: int | None = None,
                 num_blocks: int | None = None) -> None:
        """A push's blocks are in the pool: layers ``layers`` of the ``num_blocks`` reserved
        blocks from prompt block ``first_block_index`` on (None: all reserved blocks; the
        receiver validated the range against the reservation). The lease restarts, now waiting
        for the rest or for Decode."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                return
            res = e.reservation
            offset = 0 if first_block_index is None else first_block_index - res.first_block_index
            n = len(res.block_ids) - offset if num_blocks is None else num_blocks
            if offset < 0 or n < 0 or offset + n > len(res.block_ids):
                raise ValueError(f"request {request_id!r}: blocks [{offset}, {offset + n}) are outside its "
                                 f"{len(res.block_ids)} reserved blocks")
            mask = ((1 << n) - 1) << offset
            for layer in layers:
                e.received[layer] |= mask
            e.deadline = self._clock() + e.lease_s

    def renew(self, request_id: str) -> bool:
        """Restart the lease of a live reservation (its request waits in a prefill queue)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                return False
            e.deadline = max(e.deadline, self._clock() + e.lease_s)
            return True

    def end_push(self, request_id: str) -> bool:
        """Returns True when the reservation was dropped meanwhile and its blocks can now be
        released (the caller releases them)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None:
                return False
            e.in_flight -= 1
            if e.dropped and e.in_flight == 0:
                del self._entries[request_id]
                return True
            return False

    def take(self, request_id: str, prompt_token_ids: tuple[int, ...]) -> Reservation:
        """For Decode: remove and return a complete reservation. Raises KeyError (none),
        ValueError (another prompt) or NotReadyError (KV still missing or arriving)."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                raise KeyError(f"no KV reservation for request {request_id!r} (never made, released or expired)")
            if e.prompt_token_ids != prompt_token_ids:
                raise ValueError(f"request {request_id!r}: the prompt differs from the one its KV was reserved for")
            full = (1 << len(e.reservation.block_ids)) - 1
            missing = sum((full & ~got).bit_count() for got in e.received)
            if e.in_flight or missing:
                total = self.num_layers * len(e.reservation.block_ids)
                raise NotReadyError(
                    f"request {request_id!r}: KV not complete ({missing} of {total} (layer, block) units "
                    f"missing, {e.in_flight} pushes in flight)"
                )
            del self._entries[request_id]
            return e.reservation

    def complete_prefix(self, request_id: str) -> int:
        """Leading reserved blocks received in every layer (0 while a push is in flight, or
        for no reservation): what a fetch may register once its holder answered, which may be
        fewer blocks than reserved when the holder no longer held them all."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped or e.in_flight:
                return 0
            return _leading_landed(e)

    def close_prefix(self, request_id: str) -> int | None:
        """For a fetch whose holder answered (or gave up): take the reservation off the table
        at once -> its leading blocks received in every layer (0: none, or no reservation), so
        that no push after this writes into blocks about to be registered as shared cache. With
        a push still in flight: None, the reservation hidden (new pushes refused) and that
        push's ``end_push`` reports its blocks free to release."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                return 0
            if e.in_flight:
                e.dropped = True
                return None
            del self._entries[request_id]
            return _leading_landed(e)

    def drop(self, request_id: str) -> tuple[bool, bool]:
        """Forget a reservation -> (found, release_now). With a push in flight, release_now
        is False and that push's ``end_push`` reports it instead."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.dropped:
                return False, False
            if e.in_flight:
                e.dropped = True
                return True, False
            del self._entries[request_id]
            return True, True

    def expire(self) -> list[str]:
        """Drop reservations whose lease passed; returns the ids to release now."""
        now = self._clock()
        with self._lock:
            late = [rid for rid, e in self._entries.items() if not e.dropped and e.deadline <= now]
        release = []
        for rid in late:
            _, now_ = self.drop(rid)
            if now_:
                release.append(rid)
        return release


def _leading_landed(e: _Entry) -> int:
    """Leading reserved blocks of ``e`` received in every layer."""
    every = (1 << len(e.reservation.block_ids)) - 1
    for got in e.received:
        every &= got
    return (every ^ (every + 1)).bit_length() - 1  # its trailing one bits
