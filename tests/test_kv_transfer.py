"""kv_transfer over a real gRPC server on 127.0.0.1: bit-exact round trips, skipped leading
blocks, and every kind of bad transfer refused with the destination pool untouched."""
from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from kv_transfer import checksum
from kv_transfer.buffers import BufferPool
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, PUSH_BLOCKS_PATH, KVReceiver, push_blocks
from kv_transfer.layout import PoolLayout
from kv_transfer.validate import KVValidationError, ReceivedBlocks, Reservation, new_token, validate_header
from kv_transfer.wire import build_header, encode_chunk, iter_wire_messages, payload_units, unit_rows
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

# [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
SHAPE = (4, 12, 2, 4, 2, 8)
BLOCK_SIZE = SHAPE[3]
FP = "model-a"
TOKEN = new_token()  # every reservation's here: what an honest sender carries


def make_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


class Node:
    """A decode-node stand-in: one pool, a reservation table, a real gRPC server."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.pool = make_pool(dtype, seed=1)
        self.before = self.pool.clone()
        self.reservations: dict[str, Reservation] = {}
        self.received: list[ReceivedBlocks] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=KV_GRPC_OPTIONS)
        receiver = KVReceiver(self.pool, FP, self.received.append, self.reservations.get, BufferPool())
        kv_pb2_grpc.add_KVTransferServicer_to_server(receiver, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address, options=KV_GRPC_OPTIONS)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)

    def unchanged(self) -> bool:
        return torch.equal(self.pool, self.before) and not self.received


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def node(request):
    n = Node(request.param)
    yield n
    n.close()


def send_raw(channel: grpc.Channel, messages: list[bytes]) -> kv_pb2.PushBlocksResponse:
    return channel.stream_unary(PUSH_BLOCKS_PATH, response_deserializer=kv_pb2.PushBlocksResponse.FromString)(
        iter(messages), timeout=10
    )


def test_round_trip_bit_exact_noncontiguous_blocks_layer_range(node: Node) -> None:
    src = make_pool(node.pool.dtype, seed=2)
    src_ids, dest_ids = [7, 2, 9], [5, 0, 11]
    num_tokens = 3 * BLOCK_SIZE - 1  # last block partial: no hash for it
    hashes = [0xAAAA, 0xBBBB]
    node.reservations["r1"] = Reservation(0, tuple(dest_ids), tuple(hashes), TOKEN)

    resp = push_blocks(
        node.channel, src, request_id="r1", fingerprint=FP, src_block_ids=src_ids, block_hashes=hashes,
        num_tokens=num_tokens, dest_block_ids=dest_ids, token=TOKEN, layers=range(1, 3),
        chunk_bytes=700,  # several chunks, each of whole block-layers
    )

    assert resp.blocks_written == 3 and resp.bytes_written == 2 * 3 * PoolLayout.of(src).block_bytes
    expected = node.before.clone()
    expected[1:3, dest_ids] = src[1:3, src_ids]
    assert torch.equal(node.pool, expected)  # written blocks bit-exact, nothing else touched
    assert node.received == [ReceivedBlocks("r1", range(1, 3), 0, tuple(dest_ids), tuple(hashes), num_tokens)]


def test_skip_leading_blocks(node: Node) -> None:
    src = make_pool(node.pool.dtype, seed=3)
    request_blocks = [3, 8, 1, 6]  # blocks 3 and 8 are already on the decode node
    hashes = [11, 22, 33, 44]
    num_tokens = 4 * BLOCK_SIZE
    node.reservations["r2"] = Reservation(2, (4, 9), (33, 44), TOKEN)

    push_blocks(
        node.channel, src, request_id="r2", fingerprint=FP, src_block_ids=request_blocks, block_hashes=hashes,
        num_tokens=num_tokens, dest_block_ids=[4, 9], token=TOKEN, skip_leading_blocks=2,
    )

    expected = node.before.clone()
    expected[:, [4, 9]] = src[:, [1, 6]]
    assert torch.equal(node.pool, expected)
    got = node.received[0]
    assert (got.first_block_index, got.block_ids, got.block_hashes, got.layers) == (2, (4, 9), (33, 44), range(4))


@pytest.mark.parametrize("algorithm", ["CHECKSUM_ALGORITHM_CRC32", "CHECKSUM_ALGORITHM_XXH3_64"])
def test_checksum_algorithms(node: Node, algorithm: str) -> None:
    value = kv_pb2.ChecksumAlgorithm.Value(algorithm)
    if value not in checksum.supported():
        pytest.skip("xxhash is not installed")
    src = make_pool(node.pool.dtype, seed=5)
    node.reservations["r3"] = Reservation(0, (3,), (), TOKEN)
    push_blocks(
        node.channel, src, request_id="r3", fingerprint=FP, src_block_ids=[6], block_hashes=[], num_tokens=2,
        dest_block_ids=[3], token=TOKEN, chunk_bytes=300, checksum_algorithm=value,
    )
    assert torch.equal(node.pool[:, 3], src[:, 6])


def _messages(src: torch.Tensor, *, dest_ids=(5, 0), src_ids=(7, 2), fingerprint=FP, **header_lies) -> list[bytes]:
    """A well-formed stream of two blocks x 4 layers (several chunks); ``header_lies`` replace
    fields of the header as sent, while the payload stays the honest one."""
    header = build_header(
        request_id="bad", fingerprint=fingerprint, layout=PoolLayout.of(src), dest_block_ids=list(dest_ids),
        block_hashes=[1, 2], num_tokens=2 * BLOCK_SIZE, layers=range(4), token=TOKEN,
    )
    messages = list(iter_wire_messages(header, payload_units(src, list(src_ids), range(4)), chunk_bytes=1000))
    if header_lies:
        for field, value in header_lies.items():
            if isinstance(value, list):
                del getattr(header, field)[:]
                getattr(header, field).extend(value)
            else:
                setattr(header, field, value)
        messages[0] = kv_pb2.KVBlockMessage(header=header).SerializeToString()
    return messages


def _flip_byte_in_first_chunk(messages: list[bytes]) -> list[bytes]:
    chunk = bytearray(messages[1])
    chunk[-1] ^= 0x01
    return [messages[0], bytes(chunk), *messages[2:]]


def _wrong_trailer(messages: list[bytes]) -> list[bytes]:
    crc = kv_pb2.KVBlockMessage.FromString(messages[-1]).trailer.checksum
    return [*messages[:-1], kv_pb2.KVBlockMessage(trailer=kv_pb2.KVTrailer(checksum=crc ^ 1)).SerializeToString()]


def _extra_chunk(messages: list[bytes]) -> list[bytes]:
    seq = len(messages) - 2
    extra, _ = encode_chunk(seq, [b"\x00" * 64])
    return [*messages[:-1], extra, messages[-1]]


CORRUPTIONS = {
    # name: (build the stream from (src pool, node), expected status, words in the message)
    "checksum_trailer": (lambda s, n: _wrong_trailer(_messages(s)), grpc.StatusCode.DATA_LOSS, "checksum"),
    "checksum_flipped_byte": (lambda s, n: _flip_byte_in_first_chunk(_messages(s)), grpc.StatusCode.DATA_LOSS,
                              "checksum"),
    "block_shape": (lambda s, n: _messages(s, block_shape=[2, BLOCK_SIZE, 1, 16]), grpc.StatusCode.INVALID_ARGUMENT,
                    "block_shape"),
    "fingerprint": (lambda s, n: _messages(s, fingerprint="model-b"), grpc.StatusCode.INVALID_ARGUMENT,
                    "model_fingerprint"),
    "dtype": (lambda s, n: _messages(s.to(torch.float16)), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    "truncated_payload": (lambda s, n: (lambda m: [*m[:-2], m[-1]])(_messages(s)), grpc.StatusCode.DATA_LOSS,
                          "payload bytes"),
    "no_trailer": (lambda s, n: _messages(s)[:-1], grpc.StatusCode.DATA_LOSS, "without trailer"),
    "oversize_payload": (lambda s, n: _extra_chunk(_messages(s)), grpc.StatusCode.INVALID_ARGUMENT,
                         "payload bytes"),
    "declared_size_lies": (lambda s, n: _messages(s, payload_bytes=10**12), grpc.StatusCode.INVALID_ARGUMENT,
                           "payload_bytes"),
    "block_id_out_of_range": (lambda s, n: _messages(s, dest_ids=(5, 99)), grpc.StatusCode.INVALID_ARGUMENT,
                              "out of range"),
    "block_id_duplicated": (lambda s, n: _messages(s, dest_ids=(5, 5)), grpc.StatusCode.INVALID_ARGUMENT,
                            "duplicated"),
    "not_the_reserved_ids": (lambda s, n: _messages(s, dest_ids=(0, 5)), grpc.StatusCode.INVALID_ARGUMENT,
                             "reserved"),
    "chunk_out_of_order": (lambda s, n: (lambda m: [m[0], m[2], m[1], *m[3:]])(_messages(s)),
                           grpc.StatusCode.INVALID_ARGUMENT, "seq"),
    "no_reservation": (lambda s, n: _messages(s, request_id="nobody"), grpc.StatusCode.NOT_FOUND, "reservation"),
    # A peer that knows the request id but not its reservation's token writes nothing.
    "token_missing": (lambda s, n: _messages(s, token=b""), grpc.StatusCode.UNAUTHENTICATED, "token: missing"),
    "token_wrong": (lambda s, n: _messages(s, token=new_token()), grpc.StatusCode.PERMISSION_DENIED,
                    "not this reservation's"),
    "checksum_algorithm_unset": (lambda s, n: _messages(s, checksum_algorithm=0), grpc.StatusCode.INVALID_ARGUMENT,
                                 "checksum_algorithm"),
    "chunk_before_header": (lambda s, n: _messages(s)[1:], grpc.StatusCode.INVALID_ARGUMENT, "expected header"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_bad_transfer_rejected_and_pool_unchanged(node: Node, case: str) -> None:
    build, code, words = CORRUPTIONS[case]
    # The reservation matches the well-formed stream: each case breaks exactly one thing.
    node.reservations["bad"] = Reservation(0, (5, 99) if case == "block_id_out_of_range" else (5, 0), (1, 2), TOKEN)
    src = make_pool(node.pool.dtype, seed=4)
    messages = build(src, node)
    assert len(messages) > 3, "the stream must have several chunks for the cases to mean something"

    with pytest.raises(grpc.RpcError) as err:
        send_raw(node.channel, messages)

    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    assert node.unchanged()


@pytest.mark.parametrize("mode", ["flip", "cut"])
def test_the_corrupting_sender_is_refused_by_checksum_not_by_token(node: Node, mode: str) -> None:
    """corrupt-kv (prefill_node/faults.py) carries the reservation's token: what refuses its
    transfers must be the payload checks, or the chaos scenario would test the wrong thing."""
    from kv_transfer.transport import TransferError
    from prefill_node.faults import CorruptingKVSender

    node.reservations["c"] = Reservation(0, (5, 0), (1,), TOKEN)
    sender = CorruptingKVSender(mode)
    try:
        with pytest.raises(TransferError) as err:
            sender.push(node.address, make_pool(node.pool.dtype, seed=6), request_id="c", fingerprint=FP,
                        src_block_ids=[7, 2], block_hashes=[1], num_tokens=BLOCK_SIZE + 1, dest_block_ids=[5, 0],
                        token=TOKEN, timeout=10)
    finally:
        sender.close()
    assert err.value.code == grpc.StatusCode.DATA_LOSS, err.value
    assert node.unchanged()


def test_a_reservation_without_a_token_admits_nobody() -> None:
    from kv_transfer.validate import KVPermissionError, KVUnauthenticatedError, check_token

    check_token(TOKEN, Reservation(0, (1,), (), TOKEN))
    with pytest.raises(KVUnauthenticatedError):
        check_token(b"", Reservation(0, (1,), (), b""))
    with pytest.raises(KVPermissionError):
        check_token(b"anything", Reservation(0, (1,), (), b""))
    with pytest.raises(KVPermissionError) as err:
        check_token(TOKEN[:-1], Reservation(0, (1,), (), TOKEN))  # a prefix is not the token
    assert TOKEN.hex() not in str(err.value) and repr(TOKEN) not in str(err.value)


def test_encode_chunk_is_the_protobuf_encoding() -> None:
    for seq, data in [(0, b""), (0, b"abc"), (1, b"x" * 200), (300, bytes(range(256)) * 5000)]:
        encoded, data_at = encode_chunk(seq, [data[: len(data) // 2], data[len(data) // 2 :]])
        assert kv_pb2.KVBlockMessage.FromString(encoded) == kv_pb2.KVBlockMessage(chunk=kv_pb2.KVChunk(seq=seq, data=data))
        assert encoded[data_at:] == data
        if data:  # proto3 leaves an empty bytes field out; chunks are never empty
            assert encoded == kv_pb2.KVBlockMessage(chunk=kv_pb2.KVChunk(seq=seq, data=data)).SerializeToString()


def test_validation_error_names_field_and_both_values() -> None:
    pool = make_pool(torch.float32, seed=0)
    header = build_header(
        request_id="r", fingerprint=FP, layout=PoolLayout.of(pool), dest_block_ids=[1], block_hashes=[],
        num_tokens=3, layers=range(4), token=TOKEN,
    )
    with pytest.raises(KVValidationError) as err:
        validate_header(header, PoolLayout.of(pool.to(torch.bfloat16)), FP, Reservation(0, (1,), (), TOKEN))
    assert isinstance(err.value, ValueError)
    assert "dtype" in str(err.value) and "torch.float32" in str(err.value) and "torch.bfloat16" in str(err.value)


def test_buffer_pool_reuses_by_identity() -> None:
    buffers = BufferPool(max_cached_bytes=100)
    a, b = buffers.acquire(10), buffers.acquire(10)  # equal contents, distinct objects
    buffers.release(a)
    buffers.release(b)
    assert {id(buffers.acquire(5)), id(buffers.acquire(5))} == {id(a), id(b)}
    buffers.release(buffers.acquire(200))  # over the budget: not kept
    assert len(buffers.acquire(150)) == 150


def test_unit_rows_are_the_payload_units_in_wire_order():
    """The row index both raw-stream ends slice per chunk is the payload's unit order."""
    pool = torch.arange(5 * 9 * 2 * 2 * 1 * 1, dtype=torch.float32).view(5, 9, 2, 2, 1, 1)
    layout = PoolLayout.of(pool)
    ids, layers = [7, 0, 3], range(1, 4)
    rows = pool.view(-1).view(torch.uint8).view(-1, layout.block_bytes).numpy()
    got = unit_rows(layers.start, len(layers), ids, layout.num_blocks)
    assert got.tolist() == [lay * 9 + b for lay in layers for b in ids]
    assert all((rows[r] == u).all() for r, u in zip(got, payload_units(pool, ids, layers), strict=True))
