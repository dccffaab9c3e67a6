"""Receiver-side checks of a KV transfer, run before a byte is written into the pool, shared
by both receivers (grpc_transport.KVReceiver, receiver.TcpKVServer): what a transfer is
checked against (``Reservation``), how its first message is taken (``HeaderGate``), the
status a refusal is answered with, and what a landed transfer is handed on as
(``ReceivedBlocks``).

Every check names the field and both values (the token aside: it is never shown). Header
checks run when the header arrives (so a bad stream is refused before its chunks are
buffered); byte count and checksum run once the trailer arrives, still before the pool is
touched.

Who may write: a reservation holds a random token (``new_token``, issued by ReserveBlocks and
carried to the prefill node in its PrefillRequest); a transfer's header must carry it, and it
is compared in constant time before any other check, so a peer that only knows a request id
learns nothing about the reservation and writes nothing (``check_token``).
"""
from __future__ import annotations

import hmac
import secrets
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import grpc

from kv_transfer import checksum
from kv_transfer.layout import PoolLayout, dtype_from_wire
from protos.pdserve.v1 import kv_pb2


class KVValidationError(ValueError):
    """A transfer that does not fit the receiving pool or its reservation; nothing was written."""


class KVDataLossError(KVValidationError):
    """The payload arrived damaged or incomplete (checksum, missing bytes or trailer)."""


class KVNotReservedError(KVValidationError):
    """No reservation exists for the request (never made, released or expired)."""


class KVUnauthenticatedError(KVValidationError):
    """The transfer carried no reservation token."""


class KVPermissionError(KVValidationError):
    """The transfer's token is not its reservation's."""


# Bytes of a reservation token: 128 bits, beyond guessing within any reservation's lease.
TOKEN_BYTES = 16


def new_token() -> bytes:
    """A fresh reservation token (``Reservation.token``, ReserveBlocksResponse.token)."""
    return secrets.token_bytes(TOKEN_BYTES)


class Reservation(NamedTuple):
    """What the decode node promised to receive for one request (from ReserveBlocks)."""

    first_block_index: int  # leading blocks it already held; not sent
    block_ids: tuple[int, ...]  # destination ids of the sent blocks, in order
    block_hashes: tuple[int, ...]  # chained hashes of the sent full blocks, in order
    token: bytes  # what every transfer into it must carry (KVHeader.token); never logged


class ReceivedBlocks(NamedTuple):
    """Handed to ``on_received`` once a transfer is in the pool."""

    request_id: str
    layers: range
    first_block_index: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_tokens: int

    @classmethod
    def of(cls, header: kv_pb2.KVHeader) -> ReceivedBlocks:
        """What the (validated) ``header`` says landed."""
        return cls(
            request_id=header.request_id,
            layers=range(header.layer_start, header.layer_start + header.layer_count),
            first_block_index=header.first_block_index,
            block_ids=tuple(header.dest_block_ids),
            block_hashes=tuple(header.block_hashes),
            num_tokens=header.num_tokens,
        )


def status_code(err: KVValidationError) -> grpc.StatusCode:
    """The status a refused transfer is answered with, whichever transport carried it."""
    if isinstance(err, KVDataLossError):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(err, KVNotReservedError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, KVUnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(err, KVPermissionError):
        return grpc.StatusCode.PERMISSION_DENIED
    return grpc.StatusCode.INVALID_ARGUMENT


def check_token(given: bytes, reservation: Reservation) -> None:
    """Refuse a transfer (or a shared-memory attach) whose token is not ``reservation``'s.
    Constant time in the token's bytes; a reservation without a token admits nobody."""
    if not given:
        raise KVUnauthenticatedError("token: missing (a transfer must carry its reservation's token)")
    if not reservation.token or not hmac.compare_digest(given, reservation.token):
        raise KVPermissionError("token: not this reservation's")


class HeaderGate:
    """How a receiver takes a transfer's first message:

        1. it must be a header                                  else KVValidationError
        2. its request must hold a reservation                  else KVNotReservedError
        3. it must carry that reservation's token (check_token) else KVUnauthenticatedError,
                                                                     KVPermissionError
        4. the header must fit the pool, the model and that
           reservation (validate_header)                        else KVValidationError

    ``accept`` runs all four. The data port (receiver.py) brackets each transfer with the
    decode node's begin_push / end_push, so that a reservation is not released while blocks
    are written into it; the bracket needs the request id (after 1) and must hold before the
    reservation is looked up (2), or it could be released in between. That receiver calls
    ``header`` and ``admit`` on either side of its begin_push and refuses a false one with
    ``not_reserved``.
    """

    def __init__(self, layout: PoolLayout, fingerprint: str,
                 reservation_for: Callable[[str], Reservation | None]) -> None:
        self._layout = layout
        self._fingerprint = fingerprint
        self._reservation_for = reservation_for

    def accept(self, first: kv_pb2.KVBlockMessage | None) -> kv_pb2.KVHeader:
        """Steps 1-4 on the first message (None: the stream ended before it)."""
        header = self.header(first)
        self.admit(header)
        return header

    @staticmethod
    def header(first: kv_pb2.KVBlockMessage | None) -> kv_pb2.KVHeader:
        """Step 1: the first message's header."""
        kind = "end of stream" if first is None else first.WhichOneof("kind")
        if kind != "header":
            raise KVValidationError(f"first message: got {kind}, expected header")
        return first.header

    def admit(self, header: kv_pb2.KVHeader) -> None:
        """Steps 2 to 4."""
        reservation = self.authenticate(header.request_id, header.token)
        validate_header(header, self._layout, self._fingerprint, reservation)

    def authenticate(self, request_id: str, token: bytes) -> Reservation:
        """Steps 2 and 3: the reservation ``token`` opens (also what a shared-memory attach
        must pass before the receiver opens a file)."""
        reservation = self._reservation_for(request_id)
        if reservation is None:
            raise self.not_reserved(request_id)
        check_token(token, reservation)
        return reservation

    @staticmethod
    def not_reserved(request_id: str) -> KVNotReservedError:
        return KVNotReservedError(f"request_id: no reservation for {request_id!r}")


_SHOWN_CHARS = 200  # of a value in an error: a peer's header may list a million block ids


def _shown(value: object) -> str:
    text = value if isinstance(value, str) else repr(value)  # a condition ("unique") or a value
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _require(ok: bool, field: str, got: object, want: object) -> None:
    if not ok:
        raise KVValidationError(f"{field}: got {_shown(repr(got))}, expected {_shown(want)}")


def _enum_name(enum, value: int) -> str:
    return enum.Name(value) if value in enum.values() else f"unknown enum value {value}"


def validate_header(
    header: kv_pb2.KVHeader, layout: PoolLayout, fingerprint: str, reservation: Reservation
) -> None:
    """Check a KVHeader against the local pool, model and reservation."""
    _require(header.model_fingerprint == fingerprint, "model_fingerprint", header.model_fingerprint, fingerprint)
    got_dtype = dtype_from_wire(header.dtype)
    got_name = str(got_dtype) if got_dtype is not None else f"unknown enum value {header.dtype}"
    _require(got_dtype == layout.dtype, "dtype", got_name, str(layout.dtype))
    _require(header.block_size == layout.block_size, "block_size", header.block_size, layout.block_size)
    _require(
        tuple(header.block_shape) == layout.block_shape, "block_shape", tuple(header.block_shape), layout.block_shape
    )
    _require(header.num_layers == layout.num_layers, "num_layers", header.num_layers, layout.num_layers)
    _require(header.layer_count >= 1, "layer_count", header.layer_count, ">= 1")
    end = header.layer_start + header.layer_count
    _require(
        end <= layout.num_layers,
        "layer_start + layer_count",
        end,
        f"<= num_layers={layout.num_layers}",
    )
    _require(
        header.checksum_algorithm in checksum.supported(),
        "checksum_algorithm",
        _enum_name(kv_pb2.ChecksumAlgorithm, header.checksum_algorithm),
        f"one of {[_enum_name(kv_pb2.ChecksumAlgorithm, a) for a in checksum.supported()]}",
    )

    ids = list(header.dest_block_ids)
    n = len(ids)
    _require(n >= 1, "len(dest_block_ids)", n, ">= 1")
    bad = [b for b in ids if b >= layout.num_blocks]
    _require(not bad, "dest_block_ids out of range", bad, f"< num_blocks={layout.num_blocks}")
    if len(set(ids)) != n:  # ids.count per id would be quadratic in a peer's id list
        _require(False, "dest_block_ids duplicated", sorted(b for b, k in Counter(ids).items() if k > 1), "unique")

    # The sent blocks cover token positions [first * bs, (first + n) * bs); the last one may be
    # partial and only full blocks carry a hash.
    first = header.first_block_index
    bs = layout.block_size
    lo, hi = (first + n - 1) * bs + 1, (first + n) * bs
    _require(lo <= header.num_tokens <= hi, "num_tokens", header.num_tokens, f"in [{lo}, {hi}]")
    full_blocks = header.num_tokens // bs - first
    _require(len(header.block_hashes) == full_blocks, "len(block_hashes)", len(header.block_hashes), full_blocks)

    # A push may carry any contiguous run of the reserved blocks (layer-wise streaming sends a
    # request's blocks in several pushes as prefill finishes them): [offset, offset + n) of the
    # reservation, with exactly the reserved ids and the reserved hashes of its full blocks.
    _require(
        header.first_block_index >= reservation.first_block_index,
        "first_block_index (reserved)",
        header.first_block_index,
        f">= {reservation.first_block_index}",
    )
    offset = header.first_block_index - reservation.first_block_index
    reserved = len(reservation.block_ids)
    _require(
        offset + n <= reserved,
        "first_block_index + len(dest_block_ids) (reserved)",
        header.first_block_index + n,
        f"<= {reservation.first_block_index + reserved}",
    )
    want_ids = tuple(reservation.block_ids[offset : offset + n])
    _require(tuple(ids) == want_ids, "dest_block_ids (reserved)", ids, list(want_ids))
    want_hashes = tuple(reservation.block_hashes[offset : offset + n])
    _require(
        tuple(header.block_hashes) == want_hashes,
        "block_hashes (reserved)",
        [f"{h:016x}" for h in header.block_hashes],
        [f"{h:016x}" for h in want_hashes],
    )

    want_bytes = header.layer_count * n * layout.block_bytes
    _require(header.payload_bytes == want_bytes, "payload_bytes", header.payload_bytes, want_bytes)


def check_payload(header: kv_pb2.KVHeader, received_bytes: int, computed: int, trailer_checksum: int) -> None:
    """Byte count and checksum of a complete payload."""
    check_payload_bytes(header, received_bytes)
    if computed != trailer_checksum:
        raise KVDataLossError(f"checksum: computed {computed:#x}, trailer says {trailer_checksum:#x}")


def check_payload_bytes(header: kv_pb2.KVHeader, received_bytes: int) -> None:
    """Byte count of a complete payload (the data port checks each chunk's checksum as it
    arrives, so at its trailer only the count is left)."""
    if received_bytes != header.payload_bytes:
        raise KVDataLossError(f"payload bytes: got {received_bytes}, header declared {header.payload_bytes}")
