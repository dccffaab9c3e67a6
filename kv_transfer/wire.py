"""The KV block wire format: header, payload byte order, chunking, and its inverse.

A transfer carries blocks ``dest_block_ids`` (receiver's ids) for layers
[layer_start, layer_start + layer_count). The payload is the C-order bytes of

    payload: [layer_count, n_blocks, 2, block_size, num_kv_heads, head_dim]

layer-major, then block in header order, then K/V, token, head, dim: a sequence of "units",
unit (l, i) = pool[l, block_ids[i]], each ``PoolLayout.block_bytes`` long. The receiver
scatters it with one ``pool[l0:l1].index_copy_(1, dest_ids, payload)``.

On the stream: one KVHeader, KVChunks of whole units (~1 MiB, seq 0, 1, ...), one KVTrailer
with the checksum of the payload (computed while streaming, so the header need not wait for it).

Sender copies: the units are joined straight from the pool into each chunk's protobuf
encoding (one copy, no gathered staging tensor); gRPC then copies that into its buffers.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kv_transfer.checksum import new_checksum
from kv_transfer.layout import PoolLayout, dtype_to_wire
from kv_transfer.validate import KVValidationError, check_payload
from protos.pdserve.v1 import kv_pb2

# ~1 MiB per KVChunk, on every transport: large enough that per-chunk work (HTTP/2 framing or
# a data-port frame, a checksum call, a scatter, Python calls) is small next to the copies;
# far below gRPC's 4 MiB default message limit, and small enough that the data port's
# receive buffer stays cache-warm.
CHUNK_BYTES = 1 << 20


def build_header(
    *,
    request_id: str,
    fingerprint: str,
    layout: PoolLayout,
    dest_block_ids: Sequence[int],
    block_hashes: Sequence[int],
    num_tokens: int,
    layers: range,
    token: bytes,
    first_block_index: int = 0,
    checksum_algorithm: int = kv_pb2.CHECKSUM_ALGORITHM_CRC32,
) -> kv_pb2.KVHeader:
    """Header for sending ``len(dest_block_ids)`` blocks of layers ``layers`` (step 1) into
    the reservation ``token`` opens (ReserveBlocksResponse.token)."""
    if layers.step != 1 or not layers or layers.start < 0 or layers.stop > layout.num_layers:
        raise ValueError(f"layers must be a non-empty step-1 range within [0, {layout.num_layers}), got {layers}")
    return kv_pb2.KVHeader(
        request_id=request_id,
        model_fingerprint=fingerprint,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        layer_start=layers.start,
        layer_count=len(layers),
        dtype=dtype_to_wire(layout.dtype),
        block_shape=layout.block_shape,
        first_block_index=first_block_index,
        dest_block_ids=dest_block_ids,
        block_hashes=block_hashes,
        num_tokens=num_tokens,
        payload_bytes=len(layers) * len(dest_block_ids) * layout.block_bytes,
        checksum_algorithm=checksum_algorithm,
        token=token,
    )


def payload_units(pool: torch.Tensor, block_ids: Sequence[int], layers: range) -> list[np.ndarray]:
    """Zero-copy byte views of the payload's units, in wire order (layer-major, then block).

    A CPU pool is viewed in place. Any other device is first gathered with one index_select
    and copied to host once (the views then point into that copy).
    """
    layout = PoolLayout.of(pool)
    if pool.device.type != "cpu":
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
        # [layer_count, n_blocks, 2, block_size, num_kv_heads, head_dim] on the host
        pool = pool[layers.start : layers.stop].index_select(1, idx).cpu()
        block_ids, layers = range(len(block_ids)), range(len(layers))
    # [num_layers, num_blocks, block_bytes] uint8 view of the same memory (bfloat16 included)
    raw = pool.view(-1).view(torch.uint8).numpy().reshape(pool.shape[0], pool.shape[1], layout.block_bytes)
    return [raw[layer, b] for layer in layers for b in block_ids]


def unit_rows(layer_start: int, layer_count: int, block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    """The pool row of every payload unit, in wire order, where the pool is viewed as
    ``[num_layers * num_blocks, block_bytes]`` (unit (l, b) at row l * num_blocks + b).

    Computed once per transfer, so a chunk's rows are a slice: per chunk, index arithmetic on
    small arrays costs several numpy calls, a real share of a ~1 MiB chunk's time in shared
    memory (docs/cluster.md, "KV data plane")."""
    layers = np.arange(layer_start, layer_start + layer_count, dtype=np.int64) * num_blocks  # [layer_count]
    # [layer_count, n_blocks] -> [layer_count * n_blocks]: layer-major, as the payload
    return (layers[:, None] + np.asarray(block_ids, dtype=np.int64)[None, :]).reshape(-1)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(seq: int, parts: Sequence[np.ndarray | bytes]) -> tuple[bytes, int]:
    """``KVBlockMessage(chunk=KVChunk(seq=seq, data=b"".join(parts))).SerializeToString()``,
    built with a single copy of the data; returns (message bytes, offset of the data in it).

    Field numbers: KVBlockMessage.chunk = 2, KVChunk.seq = 1, KVChunk.data = 2; both
    length-delimited fields use wire type 2, seq is a varint left out when 0 (proto3).
    tests/test_kv_transfer.py checks the result parses back with the generated class.
    """
    n = sum(len(memoryview(p).cast("B")) for p in parts)
    seq_field = b"\x08" + _varint(seq) if seq else b""
    inner_head = seq_field + b"\x12" + _varint(n)
    head = b"\x12" + _varint(len(inner_head) + n) + inner_head
    return b"".join([head, *parts]), len(head)


def iter_wire_messages(
    header: kv_pb2.KVHeader, units: Sequence[np.ndarray], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes]:
    """The serialized KVBlockMessages of one transfer: header, chunks, trailer with the checksum.

    A chunk holds max(1, chunk_bytes // unit bytes) whole units.
    """
    unit_bytes = units[0].nbytes if units else 0
    if len(units) * unit_bytes != header.payload_bytes:
        raise ValueError(f"payload has {len(units) * unit_bytes} bytes, header declares {header.payload_bytes}")
    yield kv_pb2.KVBlockMessage(header=header).SerializeToString()
    per_chunk = max(1, chunk_bytes // max(unit_bytes, 1))
    checksum = new_checksum(header.checksum_algorithm)
    for seq, start in enumerate(range(0, len(units), per_chunk)):
        message, data_at = encode_chunk(seq, units[start : start + per_chunk])
        checksum.update(memoryview(message)[data_at:])
        yield message
    yield kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer(checksum=checksum.value())).SerializeToString()


class PayloadAssembler:
    """Receiver side of one stream after its header was validated: chunks -> one buffer.

    ``buffer`` (at least payload_bytes long, e.g. from a BufferPool) is filled from the start;
    a chunk that would run past the header's validated payload_bytes is refused before it
    is copied, so a sender cannot write past what the header declared.
    """

    def __init__(self, header: kv_pb2.KVHeader, buffer: bytearray) -> None:
        if len(buffer) < header.payload_bytes:
            raise ValueError(f"buffer of {len(buffer)} bytes for a {header.payload_bytes}-byte payload")
        self.header = header
        self._view = memoryview(buffer)[: header.payload_bytes]
        # numpy copies release the GIL (memoryview slice assignment does not), so the copy
        # overlaps with gRPC's threads on the other core.
        self._array = np.frombuffer(buffer, dtype=np.uint8, count=header.payload_bytes)
        self.received = 0
        self._next_seq = 0
        self._checksum = new_checksum(header.checksum_algorithm)  # validated as supported

    def add(self, chunk: kv_pb2.KVChunk) -> None:
        if chunk.seq != self._next_seq:
            raise KVValidationError(f"chunk seq: got {chunk.seq}, expected {self._next_seq}")
        n = len(chunk.data)
        if self.received + n > self.header.payload_bytes:
            raise KVValidationError(
                f"payload bytes: chunk {chunk.seq} brings them to {self.received + n}, "
                f"header declared {self.header.payload_bytes}"
            )
        self._array[self.received : self.received + n] = np.frombuffer(chunk.data, dtype=np.uint8)
        self._checksum.update(chunk.data)
        self.received += n
        self._next_seq += 1

    def finish(self, trailer: kv_pb2.KVTrailer) -> memoryview:
        """Check count and checksum; the returned payload may then be written into the pool."""
        check_payload(self.header, self.received, self._checksum.value(), trailer.checksum)
        return self._view


def write_payload(pool: torch.Tensor, header: kv_pb2.KVHeader, payload: memoryview) -> None:
    """Scatter a validated payload into ``pool``: one index_copy_ over the layer range."""
    layout = PoolLayout.of(pool)
    n = len(header.dest_block_ids)
    # Zero-copy view of the received bytes: [layer_count, n_blocks, 2, block_size, heads, head_dim]
    src = torch.frombuffer(payload, dtype=layout.dtype).view(header.layer_count, n, *layout.block_shape)
    idx = torch.tensor(list(header.dest_block_ids), dtype=torch.long, device=pool.device)
    pool.narrow(0, header.layer_start, header.layer_count).index_copy_(1, idx, src.to(pool.device))
