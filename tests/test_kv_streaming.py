"""Layer-wise KV streaming (issue 13 part 1): the receiver's sub-range checks, the reservation
table's (layer, block) bookkeeping, the prefill node's streamer (prefill_node/kv_streamer.py),
the engine's per-layer hook, and streamed vs whole transfers between live nodes (bit-identical
KV on the decode node, the same greedy output, failures that free every block)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from engine.model_runner import KV_PREEMPTED, final_blocks
from kv_transfer.layout import PoolLayout
from kv_transfer.transport import PushResult, TransferError
from kv_transfer.validate import KVValidationError, Reservation, new_token, validate_header
from kv_transfer.wire import build_header
from node.reservations import NotReadyError, ReservationTable
from prefill_node.kv_streamer import KVStreamer

# ----------------------------------------------------------------------------- validation
# [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
SHAPE = (3, 16, 2, 4, 2, 4)
FP = "model-a"
LAYOUT = PoolLayout.of(torch.zeros(SHAPE))
# Prompt of 18 tokens = 5 blocks (4 full + 2 tokens); the decode node caches block 0.
TOKEN = new_token()
RES = Reservation(1, (9, 3, 12, 7), (0xB1, 0xB2, 0xB3), TOKEN)


def header(first: int, ids, hashes, num_tokens: int, layers=range(3)):
    return build_header(request_id="r", fingerprint=FP, layout=LAYOUT, dest_block_ids=list(ids),
                        block_hashes=list(hashes), num_tokens=num_tokens, layers=layers, first_block_index=first,
                        token=TOKEN)


@pytest.mark.parametrize("first, ids, hashes, num_tokens, layers", [
    (1, (9, 3, 12, 7), (0xB1, 0xB2, 0xB3), 18, range(3)),  # the whole reservation
    (1, (9,), (0xB1,), 8, range(0, 1)),  # its head, one layer
    (2, (3, 12), (0xB2, 0xB3), 16, range(1, 3)),  # a middle run
    (4, (7,), (), 18, range(2, 3)),  # the partial tail block
    (3, (12, 7), (0xB3,), 17, range(3)),  # a tail (the partial block may carry 17..19 tokens)
])
def test_a_contiguous_sub_range_of_the_reservation_is_accepted(first, ids, hashes, num_tokens, layers):
    validate_header(header(first, ids, hashes, num_tokens, layers), LAYOUT, FP, RES)


@pytest.mark.parametrize("first, ids, hashes, num_tokens, words", [
    (0, (5, 9), (0xB0, 0xB1), 8, "first_block_index (reserved): got 0, expected >= 1"),  # a cached block
    (2, (9,), (0xB1,), 12, "dest_block_ids (reserved): got [9], expected [3]"),  # shifted ids
    (2, (3, 9), (0xB2, 0xB1), 16, "dest_block_ids (reserved)"),  # not contiguous
    (2, (3, 12), (0xB2, 0xB9), 16, "block_hashes (reserved)"),  # another prompt's block
    (4, (7, 1), (0xB4,), 21, "first_block_index + len(dest_block_ids) (reserved): got 6, expected <= 5"),  # past the end
    (2, (3, 12), (0xB2,), 14, "block_hashes (reserved)"),  # a middle run claiming a partial block
    (1, (9, 3), (0xB1,), 8, "num_tokens"),  # tokens that do not reach the last block
])
def test_a_bad_sub_range_is_refused_by_name(first, ids, hashes, num_tokens, words):
    with pytest.raises(KVValidationError) as err:
        validate_header(header(first, ids, hashes, num_tokens), LAYOUT, FP, RES)
    assert words in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- reservations
def test_reservation_is_taken_only_when_every_layer_of_every_block_landed():
    table = ReservationTable(num_layers=2, lease_s=10.0, clock=lambda: 0.0)
    prompt = tuple(range(18))
    table.add("r", RES, prompt)
    # Chunk 1 (blocks 1..2) layer 0, then layer 1; chunk 2 (blocks 3..4) both layers at once.
    for layers, first, n in ((range(0, 1), 1, 2), (range(1, 2), 1, 2), (range(0, 2), 3, 1)):
        assert table.begin_push("r")
        table.received("r", layers, first, n)
        assert table.end_push("r") is False
        with pytest.raises(NotReadyError, match=r"\d+ of 8 \(layer, block\) units missing"):
            table.take("r", prompt)
    assert table.begin_push("r")
    table.received("r", range(0, 2), 4, 1)  # the last (layer, block)
    with pytest.raises(NotReadyError, match="1 pushes in flight"):
        table.take("r", prompt)  # complete, but a push is still writing
    table.end_push("r")
    assert table.take("r", prompt) == RES
    # A range outside the reservation is a bug in the receiver's caller, never silently kept.
    table.add("s", RES, prompt)
    with pytest.raises(ValueError, match="outside"):
        table.received("s", range(2), 3, 3)
    # Nothing reserved (all cached on the decode node): complete from the start.
    table.add("cached", Reservation(5, (), (), TOKEN), prompt)
    assert table.take("cached", prompt) == Reservation(5, (), (), TOKEN)


# ----------------------------------------------------------------------------- the streamer
class FakeSender:
    """Records the rectangles pushed; ``fail_at`` (push index) raises a transfer failure."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.rects: list[tuple[range, int, int, tuple[int, ...]]] = []
        self.fail_at = fail_at
        self.gate = gate

    def __call__(self, layers: range, a: int, b: int, table) -> PushResult:
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail_at is not None and len(self.rects) == self.fail_at:
            raise TransferError(grpc.StatusCode.DATA_LOSS, "checksum: computed 0x1, frame says 0x2")
        self.rects.append((layers, a, b, tuple(table)))
        return PushResult(b - a, len(layers) * (b - a), "tcp")

    def units(self, num_layers: int, num_blocks: int) -> set[tuple[int, int]]:
        got = set()
        for layers, a, b, table in self.rects:
            assert len(table) == b  # the source table always covers [0, b)
            for layer in layers:
                for blk in range(a, b):
                    assert (layer, blk) not in got, "a unit was sent twice"
                    got.add((layer, blk))
        return got


TABLE = tuple(range(100, 110))


def test_streamer_pushes_ready_rectangles_and_skips_cached_blocks():
    gate = threading.Event()
    sender = FakeSender(gate=gate)
    s = KVStreamer(sender, num_layers=4, num_blocks=10, skip=2)
    # Chunk 1 ends inside block 4 (blocks 0..3 final), layer by layer, while the first push is held.
    for layer in range(4):
        s.on_layer(layer, 4, TABLE[:4])
    # Chunk 2 ran two layers: blocks up to 7 for layers 0..1.
    s.on_layer(0, 7, TABLE[:7])
    s.on_layer(1, 7, TABLE[:7])
    gate.set()
    s.finish(lambda: list(TABLE))  # the prefill ended: the rest of the table from the engine
    assert s.wait(10) and s.error is None and s.done
    assert sender.units(4, 10) == {(la, b) for la in range(4) for b in range(2, 10)}
    assert all(a >= 2 for _, a, _, _ in sender.rects)
    assert s.pushes == len(sender.rects) and s.transport == "tcp"
    assert s.pushes <= 5  # coalesced: what piled up went out together, not one push per layer


def test_streamer_waits_for_min_push_units_until_finished():
    sender = FakeSender()
    s = KVStreamer(sender, num_layers=2, num_blocks=6, skip=0, min_push_units=8)
    s.on_layer(0, 2, TABLE[:2])
    s.on_layer(1, 2, TABLE[:2])  # 4 units ready: below the minimum
    time.sleep(0.05)
    assert sender.rects == []
    s.on_layer(0, 4, TABLE[:4])
    s.on_layer(1, 4, TABLE[:4])  # 8 units: one push of layers 0..1 x blocks 0..4
    deadline = time.monotonic() + 10
    while not sender.rects and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sender.rects == [(range(0, 2), 0, 4, TABLE[:4])]
    s.finish(lambda: list(TABLE[:6]))
    assert s.wait(10) and s.done
    assert sender.rects[-1] == (range(0, 2), 4, 6, TABLE[:6])  # the rest, however small


def test_streamer_restarts_after_a_preemption():
    gate = threading.Event()
    sender = FakeSender(gate=gate)
    s = KVStreamer(sender, num_layers=2, num_blocks=4, skip=0)
    s.on_layer(0, 2, TABLE[:2])
    s.on_layer(1, 2, TABLE[:2])
    s.on_layer(KV_PREEMPTED, 0, ())  # the blocks went back; the recompute uses others
    other = (7, 6, 5, 4)
    s.on_layer(0, 3, other[:3])
    s.on_layer(1, 3, other[:3])
    gate.set()
    s.finish(lambda: list(other))
    assert s.wait(10) and s.done
    # Whatever went out before the preemption was sent again from the new blocks.
    final = {}
    for layers, a, b, table in sender.rects:
        for layer in layers:
            for blk in range(a, b):
                final[layer, blk] = table[blk]
    assert final == {(la, b): other[b] for la in range(2) for b in range(4)}


def test_streamer_failure_stops_it_and_calls_on_error():
    sender = FakeSender(fail_at=1)
    s = KVStreamer(sender, num_layers=2, num_blocks=4, skip=0, start=False)
    stopped = threading.Event()
    s.on_error = stopped.set
    s.start()
    for ready in (1, 2, 3):
        s.on_layer(0, ready, TABLE[:ready])
        s.on_layer(1, ready, TABLE[:ready])
        time.sleep(0.01)
    assert stopped.wait(10) and s.wait(10)
    assert s.error.code == grpc.StatusCode.DATA_LOSS and not s.done
    s.finish(lambda: list(TABLE[:4]))  # nothing more goes out after a failure
    assert len(sender.rects) == 1


def test_final_blocks():
    assert final_blocks(0, 8, False, 4) == 2  # an intermediate chunk: full blocks only
    assert final_blocks(0, 9, False, 4) == 2
    assert final_blocks(8, 2, True, 4) == 3  # the prompt's end: the partial block is final too


# ----------------------------------------------------------------------------- the engine hook
BS = 4


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    from engine.models.tiny import save_tiny_model

    # Four layers, so a step has layers before and after any one of them.
    return save_tiny_model(tmp_path_factory.mktemp("tiny4") / "llama", arch="llama", seed=0, num_hidden_layers=4)


def engine_config(path, num_blocks: int = 64, chunk: int = 12, prefix_caching: bool = True):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(model=str(path), dtype="float32", device="cpu", num_threads=1, cpu_kernels="torch",
                        cache=CacheConfig(block_size=BS, num_blocks=num_blocks, enable_prefix_caching=prefix_caching),
                        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=8))


def make_engine(path, **kw):
    from engine.engine import LLMEngine

    return LLMEngine(engine_config(path, **kw), load_tokenizer=False)


def greedy(max_tokens: int = 8):
    from tokens.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def test_engine_reports_final_blocks_layer_by_layer_over_chunks(tiny4_dir):
    eng = make_engine(tiny4_dir, chunk=12)
    calls = []

    def listener(rid, layer, ready, table):
        # What the listener may send now must already be the KV the request ends with.
        calls.append((rid, layer, ready, table, eng.kv_cache[layer, list(table[:ready])].clone()))

    eng.set_kv_layer_listener(listener)
    prompt = list(range(30, 60))  # 30 tokens: chunks of 12, 12, 6; 8 blocks, the last partial
    eng.add_request("s", prompt_token_ids=prompt, params=greedy(1), hold_kv=True, stream_kv=True)
    # Shares the last step with "s" (after it in the queue, so "s" gets the 12-token chunks).
    eng.add_request("plain", prompt_token_ids=list(range(100, 120)), params=greedy(1), hold_kv=True)
    while eng.has_unfinished_requests():
        eng.step()
    assert {c[0] for c in calls} == {"s"}  # only the streaming request is reported
    table = eng.held_block_table("s")
    per_layer = {}
    for _, layer, ready, reported, kv in calls:
        assert reported[:ready] == tuple(table[:ready])
        assert torch.equal(kv, eng.kv_cache[layer, table[:ready]]), "reported blocks changed afterwards"
        per_layer.setdefault(layer, []).append(ready)
    # Chunk ends at 12, 24, 30 tokens: 3, 6 full blocks, then all 8 at the prompt's end.
    assert per_layer == {layer: [3, 6, 8] for layer in range(4)}
    assert [c[1] for c in calls[:4]] == [0, 1, 2, 3]  # layer after layer within a step


def test_engine_reports_a_preemption(tiny4_dir):
    # A pool too small for both prompts at once: the newer running one is preempted.
    eng = make_engine(tiny4_dir, num_blocks=10, chunk=8, prefix_caching=False)
    events = []
    eng.set_kv_layer_listener(lambda rid, layer, ready, table: events.append((rid, layer)))
    eng.add_request("a", prompt_token_ids=list(range(30, 52)), params=greedy(8), stream_kv=True)
    eng.add_request("b", prompt_token_ids=list(range(60, 82)), params=greedy(8), stream_kv=True)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_preemptions >= 1
    assert any(layer == KV_PREEMPTED for _, layer in events)


# ----------------------------------------------------------------------------- live nodes
class Pair:
    """One prefill node and decode nodes, in-process, on the tiny four-layer model."""

    def __init__(self, path, redis_url: str, decode_nodes: int = 1, prefill_caching: bool = False,
                 kv_data_port: int | None = 0, chunk: int = 12) -> None:
        import uuid

        from tests.clusters import start_node

        ns = f"test-{uuid.uuid4().hex[:8]}"
        kw = dict(redis_url=redis_url, namespace=ns, lease_s=1.0, heartbeat_s=0.1)
        self.prefill = start_node("prefill", "p0", make_engine(path, chunk=chunk, prefix_caching=prefill_caching),
                                  **kw)
        self.prefill.kv_stream_min_push_bytes = 0  # tiny blocks: push whatever is ready
        self.decodes = [start_node("decode", f"d{i}", make_engine(path, chunk=chunk), kv_data_port=kv_data_port,
                                   **kw) for i in range(decode_nodes)]
        self.channels = []
        self.fp = self.prefill.engine.fingerprint

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for node in (self.prefill, *self.decodes):
            if node.aengine.alive:
                node.stop()

    def _channel(self, address):
        from kv_transfer.grpc_transport import KV_GRPC_OPTIONS

        ch = grpc.insecure_channel(address, options=KV_GRPC_OPTIONS)
        self.channels.append(ch)
        return ch

    def reserve(self, decode, rid, prompt):
        from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
        from tokens.block_hash import hash_prompt_blocks

        stub = kv_pb2_grpc.KVTransferStub(self._channel(decode.address))
        return stub.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
            request_id=rid, model_fingerprint=self.fp, block_size=BS, num_tokens=len(prompt),
            block_hashes=hash_prompt_blocks(prompt, BS, self.fp.encode()), prompt_token_ids=prompt), timeout=10)

    def prefill_rpc(self, decode, rid, prompt, params, reservation, resumed: int = 0):
        from protos.convert import sampling_to_proto
        from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

        stub = kv_pb2_grpc.PrefillNodeStub(self._channel(self.prefill.address))
        return stub.Prefill(kv_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            decode_address=decode.address, reservation=reservation, resumed_output_tokens=resumed), timeout=60)

    def decode_rpc(self, decode, rid, prompt, params, first=(), cached=0, resumed: int = 0) -> list[int]:
        from protos.convert import sampling_to_proto
        from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc

        stub = kv_pb2_grpc.DecodeNodeStub(self._channel(decode.address))
        msgs = stub.Decode(kv_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            first_token_ids=list(first), cached_prompt_tokens=cached, resumed_output_tokens=resumed), timeout=60)
        return [t for m in msgs if m.WhichOneof("kind") == "chunk" for t in m.chunk.token_ids]

    @staticmethod
    def free_blocks(node) -> int:
        return node.aengine.run(lambda e: e.kv.num_free_blocks)


def _only(pair: Pair, transport: str) -> None:
    """Make the prefill node use one transport (shm is the default's first choice)."""
    from kv_transfer.grpc_transport import GrpcKVSender
    from kv_transfer.tcp_transport import TcpKVSender
    from kv_transfer.transport import FallbackKVSender

    if transport == "tcp":
        pair.prefill.kv_sender.close()
        pair.prefill.kv_sender = FallbackKVSender([TcpKVSender()], GrpcKVSender())


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_streamed_and_whole_transfers_leave_the_same_kv_and_output(tiny4_dir, redis_url, transport):
    prompt = list(range(40, 78))  # 38 tokens: 4 chunks of <= 12, 10 blocks (the last partial)
    ref = make_engine(tiny4_dir, chunk=12).generate([prompt], greedy())[0].outputs[0].token_ids
    pair = Pair(tiny4_dir, redis_url, decode_nodes=2, kv_data_port=None if transport == "grpc" else 0)
    try:
        _only(pair, transport)
        kv, tokens = {}, {}
        for streaming, decode in ((False, pair.decodes[0]), (True, pair.decodes[1])):
            # The decode node already holds the prompt's first two blocks: they are not sent.
            pair.decode_rpc(decode, f"warm-{streaming}", prompt[:9], greedy(1))
            rid = f"r-{streaming}"
            res = pair.reserve(decode, rid, prompt)
            assert res.num_cached_blocks == 2 and len(res.block_ids) == 8
            pair.prefill.kv_streaming = streaming
            if streaming:
                hold_engine_until_first_push(pair.prefill)
            pre = pair.prefill_rpc(decode, rid, prompt, greedy(), res)
            assert pre.kv_streamed is streaming and pre.transport == transport
            assert pre.blocks_sent == 8 and pre.transfer_exposed_s >= 0 and pre.transfer_s > 0
            if streaming:  # chunk by chunk, layer groups at a time
                assert pre.kv_pushes > 1, pre
            else:
                # exposed: the whole push as the request waited for it; transfer_s: the attempt alone
                assert pre.kv_pushes == 1 and pre.kv_fallbacks == 0 and pre.transfer_exposed_s >= pre.transfer_s
            kv[streaming] = decode.engine.kv_cache[:, list(res.block_ids)].clone()
            tokens[streaming] = pair.decode_rpc(decode, rid, prompt, greedy(), pre.first_token_ids, pre.cached_tokens)
        assert torch.equal(kv[True], kv[False])  # bit-identical KV on the decode nodes
        assert tokens[True] == tokens[False] == ref
        assert Pair.free_blocks(pair.prefill) == pair.prefill.engine.num_blocks
        assert pair.prefill.inflight.num_streamers == 0
    finally:
        pair.close()


def test_streaming_with_prefill_prefix_hits_and_a_resumed_request(tiny4_dir, redis_url):
    pair = Pair(tiny4_dir, redis_url, prefill_caching=True)
    decode = pair.decodes[0]
    try:
        ref_engine = make_engine(tiny4_dir, chunk=12)
        # The prefill node has the head of the prompt cached: its blocks are final from step one.
        prompt = list(range(200, 237))
        ref = ref_engine.generate([prompt], greedy())[0].outputs[0].token_ids
        res = pair.reserve(decode, "head", prompt[:17])
        pre = pair.prefill_rpc(decode, "head", prompt[:17], greedy(), res)
        pair.decode_rpc(decode, "head", prompt[:17], greedy(), pre.first_token_ids, pre.cached_tokens)
        res = pair.reserve(pair.decodes[0], "hit", prompt)
        pre = pair.prefill_rpc(decode, "hit", prompt, greedy(), res)
        assert pre.cached_tokens == 16 and pre.kv_streamed
        got = pair.decode_rpc(decode, "hit", prompt, greedy(), pre.first_token_ids, pre.cached_tokens)
        assert got == ref
        # A migrated request: the prompt carries 3 outputs already produced elsewhere.
        prompt2 = list(range(300, 331))
        full = ref_engine.generate([prompt2], greedy(8))[0].outputs[0].token_ids
        resumed = prompt2 + full[:3]
        res = pair.reserve(decode, "moved", resumed)
        pre = pair.prefill_rpc(decode, "moved", resumed, greedy(8), res, resumed=3)
        assert pre.kv_streamed and list(pre.first_token_ids) == full[3:4]
        got = pair.decode_rpc(decode, "moved", resumed, greedy(8), pre.first_token_ids, pre.cached_tokens, resumed=3)
        assert got == full[3:]
    finally:
        pair.close()


class GatedSender:
    """The node's own sender, watched: ``landed`` is set once a push returned; push number
    ``fail_at`` fails as a damaged stream instead."""

    def __init__(self, real, fail_at: int | None = None) -> None:
        self.real, self.fail_at, self.pushes = real, fail_at, 0
        self.landed = threading.Event()

    def push(self, address, pool, **blocks):
        self.pushes += 1
        if self.pushes == self.fail_at:
            raise TransferError(grpc.StatusCode.DATA_LOSS, "chunk 0 checksum: computed 0x1, frame says 0x2")
        result = self.real.push(address, pool, **blocks)
        self.landed.set()
        return result

    def close(self):
        self.real.close()


def hold_engine_until_first_push(node) -> GatedSender:
    """Make a streamed prefill push at least twice, whatever the threads' timing: the engine
    thread waits at its first layer report until that layer's push landed (the rest follows)."""
    sender = node.kv_sender if isinstance(node.kv_sender, GatedSender) else GatedSender(node.kv_sender)
    node.kv_sender = sender
    real = node._on_kv_layer

    def listener(rid, layer, ready, table):
        real(rid, layer, ready, table)
        if ready > 0 and not sender.landed.is_set():
            sender.landed.wait(10)

    node.engine.set_kv_layer_listener(listener)
    return sender


def test_a_push_failure_mid_stream_frees_every_block_on_both_sides(tiny4_dir, redis_url):
    pair = Pair(tiny4_dir, redis_url, chunk=8)
    decode = pair.decodes[0]
    try:
        prompt = list(range(400, 438))
        ref = make_engine(tiny4_dir, chunk=8).generate([prompt], greedy())[0].outputs[0].token_ids
        pair.prefill.kv_sender = GatedSender(pair.prefill.kv_sender, fail_at=2)
        failing = hold_engine_until_first_push(pair.prefill)
        res = pair.reserve(decode, "f", prompt)
        with pytest.raises(grpc.RpcError) as err:
            pair.prefill_rpc(decode, "f", prompt, greedy(), res)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details()
        assert failing.pushes == 2  # the first push landed, the second failed, nothing after
        assert pair.prefill.num_transfer_failures == 1
        assert Pair.free_blocks(pair.prefill) == pair.prefill.engine.num_blocks
        assert pair.prefill.inflight.num_streamers == 0
        # The decode node holds part of the KV: never admitted on it ...
        with pytest.raises(grpc.RpcError) as err:
            pair.decode_rpc(decode, "f", prompt, greedy(), first=[5])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "units missing" in err.value.details()
        # ... and the router's recompute drops the reservation, freeing every block written so far.
        assert pair.decode_rpc(decode, "f", prompt, greedy()) == ref
        assert Pair.free_blocks(decode) == decode.engine.num_blocks
    finally:
        pair.close()
