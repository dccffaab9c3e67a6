"""Prefill and decode servers in-process (no Ray): the disaggregated path over real gRPC on
127.0.0.1 with a real Redis, driven by hand the way the router will drive it."""
from __future__ import annotations

import math
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.server import DecodeServer
from engine.engine import LLMEngine
from kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, fold_kv_events
from kv_transfer.grpc_transport import KV_GRPC_OPTIONS, push_blocks
from kv_transfer.validate import Reservation
from node.config import NodeConfig
from node.reservations import NotReadyError, ReservationTable
from protos.convert import sampling_to_proto
from protos.pdserve.v1 import kv_pb2, serving_pb2
from tests.helpers import node_engine_config, tokens_of, wait_for
from tests.node_pair import NodePair
from tokens.sampling_params import SamplingParams

BS = 4  # node_engine_config's block size
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


def make_engine(path, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(node_engine_config(path, num_blocks), load_tokenizer=False)


class Cluster(NodePair):
    """One prefill + one decode server, stubs for both, a Redis reader on a private namespace."""

    def __init__(self, path, redis_url: str, prefill_blocks=64, decode_blocks=64, **node_kw) -> None:
        super().__init__(make_engine(path, prefill_blocks), make_engine(path, decode_blocks), redis_url,
                         prefix="test", **node_kw)


@pytest.fixture()
def cluster(tiny_dir, redis_url):
    c = Cluster(tiny_dir, redis_url)
    yield c
    c.close()


def completes(msgs) -> list[serving_pb2.Complete]:
    return [m.complete for m in msgs if m.WhichOneof("kind") == "complete"]


def test_fold_kv_events_keeps_the_last_word_per_block():
    events = [BlockStored((1, 2), None, ((0,), (1,))), BlockRemoved((2,)), BlockRemoved((3,)), BlockStored((3,), 1, ((2,),))]
    assert fold_kv_events(events) == ([1, 3], [2], False)
    assert fold_kv_events([BlockStored((1,), None, ((0,),)), AllBlocksCleared(), BlockStored((4,), None, ((0,),))]) == (
        [4], [], True)


def test_reservation_table_defers_release_until_the_push_ends():
    now = [0.0]
    table = ReservationTable(num_layers=2, lease_s=1.0, clock=lambda: now[0])
    table.add("r", Reservation(1, (7, 8), (99,), b"token"), (1, 2, 3))
    with pytest.raises(NotReadyError):
        table.take("r", (1, 2, 3))
    assert table.begin_push("r")
    assert table.drop("r") == (True, False)  # push in flight: blocks stay reserved
    assert table.get("r") is None  # but no new push is accepted
    assert table.end_push("r") is True  # now the caller releases them
    table.add("r", Reservation(1, (7, 8), (99,), b"token"), (1, 2, 3))
    assert table.begin_push("r")
    table.received("r", range(0, 2))
    assert table.end_push("r") is False
    with pytest.raises(ValueError):
        table.take("r", (1, 2, 4))
    assert table.take("r", (1, 2, 3)) == Reservation(1, (7, 8), (99,), b"token")
    table.add("late", Reservation(0, (1,), (), b"token"), (5,))
    now[0] = 2.0
    assert table.expire() == ["late"] and len(table) == 0
    # Renewing restarts the lease of a waiting reservation, and of nothing else.
    table.add("queued", Reservation(0, (1,), (), b"token"), (5,))
    now[0] = 2.9
    assert table.renew("queued") and not table.renew("late")
    now[0] = 3.5
    assert table.expire() == []  # would have expired at 3.0
    now[0] = 3.95
    assert table.expire() == ["queued"] and not table.renew("queued")


def test_disaggregated_greedy_equals_one_engine(tiny_dir, cluster):
    long_prompt = list(range(20, 58))  # 38 tokens: 9 full blocks + a partial one
    prompts = {"long": long_prompt, "short": [7, 8, 9], "exact": list(range(100, 116)),
               "warm": list(range(300, 330))}
    ref_engine = make_engine(tiny_dir)
    ref = {k: ref_engine.generate([p], GREEDY)[0].outputs[0].token_ids for k, p in prompts.items()}

    # The decode node prefills the head of "warm" itself first: its 2 leading blocks are cached.
    warm_head = prompts["warm"][:9]
    cluster.decode_rpc("warmup", warm_head, SamplingParams(temperature=0.0, max_tokens=1))

    for name, prompt in prompts.items():
        res, pre, msgs = cluster.disaggregated(f"req-{name}", prompt, GREEDY)
        assert tokens_of(msgs) == ref[name], name
        n_blocks = math.ceil(len(prompt) / BS)
        assert pre.blocks_sent == n_blocks - res.num_cached_blocks == len(res.block_ids)
        assert pre.bytes_sent > 0 and pre.prefill_s > 0 and pre.transfer_s > 0
        (done,) = completes(msgs)
        assert done.finish_reason == serving_pb2.FINISH_REASON_LENGTH
        assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == 8
        assert done.timings.total_s > 0 and 0 <= done.timings.first_token_s <= done.timings.total_s
        if name == "warm":  # the decode node kept its 2 cached leading blocks: not sent
            assert res.num_cached_blocks == 2
    # Every block is back: prefill released its held KV, decode finished its requests.
    assert cluster.free_blocks(cluster.prefill) == cluster.prefill.engine.num_blocks
    assert cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks


def test_decode_node_cache_hit_sends_fewer_blocks(tiny_dir, cluster):
    prompt = list(range(30, 60))  # 30 tokens: 8 blocks
    ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    cluster.decode_rpc("head", prompt[:13], SamplingParams(temperature=0.0, max_tokens=1))
    res, pre, msgs = cluster.disaggregated("full", prompt, GREEDY)
    assert res.num_cached_blocks == 3  # 13 tokens -> 3 full blocks cached on the decode node
    assert pre.blocks_sent == 8 - 3
    assert tokens_of(msgs) == ref


def test_prefill_prefix_cache_hit_is_reported(tiny_dir, cluster):
    prompt = list(range(40, 61))
    ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    cluster.disaggregated("first", prompt, GREEDY)
    res, pre, msgs = cluster.disaggregated("second", prompt, GREEDY)
    assert pre.cached_tokens == 20  # 5 full blocks from the prefill node's own cache
    assert res.num_cached_blocks == 5  # and the decode node holds them too now
    assert tokens_of(msgs) == ref
    assert completes(msgs)[0].usage.cached_prompt_tokens == 20


def test_kv_events_reach_redis_and_vanish_on_eviction(tiny_dir, redis_url):
    c = Cluster(tiny_dir, redis_url, prefill_blocks=24)
    try:
        live = c.reader.live_nodes()
        assert set(live) == {"p0", "d0"}
        assert live["p0"].role == "prefill" and live["d0"].grpc_address == c.decode.address
        prompt = list(range(200, 222))  # 5 full blocks
        h = c.hashes(prompt)
        c.disaggregated("r1", prompt, GREEDY)
        assert wait_for(lambda: c.reader.match(h, ["p0"])["p0"].blocks == 5)
        assert wait_for(lambda: c.reader.match(h, ["d0"])["d0"].blocks == 5)
        # Two prompts that need every block of the prefill node evict the cached ones.
        for i, start in enumerate((300, 400)):
            c.prefill_rpc(f"evict{i}", list(range(start, start + 92)),
                          SamplingParams(temperature=0.0, max_tokens=1), kv_pb2.ReserveBlocksResponse())
        assert wait_for(lambda: c.reader.match(h, ["p0"])["p0"].blocks == 0)
        assert c.reader.match(h, ["d0"])["d0"].blocks == 5
        # Heartbeats carry the load.
        assert wait_for(lambda: c.reader.live_nodes()["p0"].free_blocks == 24)
    finally:
        c.close()


def test_corrupted_push_is_rejected_and_decode_recomputes(tiny_dir, cluster):
    prompt = list(range(60, 83))
    ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    res = cluster.reserve("bad", prompt)
    pool = cluster.decode.engine.kv_cache
    before = pool.clone()
    src = torch.randn_like(pool)
    blocks = dict(request_id="bad", src_block_ids=list(range(math.ceil(len(prompt) / BS))),
                  block_hashes=cluster.hashes(prompt), num_tokens=len(prompt), dest_block_ids=list(res.block_ids),
                  skip_leading_blocks=res.num_cached_blocks, timeout=10)
    assert len(res.token) >= 16  # the reservation's own secret (kv_transfer/validate.py, check_token)
    with grpc.insecure_channel(cluster.decode.address, options=KV_GRPC_OPTIONS) as ch:
        # A peer that knows the request id, not the token: refused before anything else.
        for token, code in ((b"", grpc.StatusCode.UNAUTHENTICATED), (bytes(16), grpc.StatusCode.PERMISSION_DENIED)):
            with pytest.raises(grpc.RpcError) as err:
                push_blocks(ch, src, fingerprint=cluster.fp, token=token, **blocks)
            assert err.value.code() == code, err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            push_blocks(ch, src, fingerprint="not-this-model", token=res.token, **blocks)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model_fingerprint" in err.value.details()
    assert torch.equal(pool, before)  # nothing written
    # Decode with a first token now would use KV that never arrived: refused.
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_rpc("bad", prompt, GREEDY, first=[5])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # The router falls back to recompute: Decode without first tokens drops the reservation.
    msgs = cluster.decode_rpc("bad", prompt, GREEDY)
    assert tokens_of(msgs) == ref
    assert cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks


def test_prefill_reports_a_refused_transfer_and_releases_its_blocks(cluster):
    prompt = list(range(60, 83))
    res = cluster.reserve("r", prompt)
    wrong = kv_pb2.ReserveBlocksResponse(num_cached_blocks=res.num_cached_blocks,
                                         block_ids=list(reversed(res.block_ids)), lease_s=res.lease_s,
                                         token=res.token)
    with pytest.raises(grpc.RpcError) as err:
        cluster.prefill_rpc("r", prompt, GREEDY, wrong)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "dest_block_ids (reserved)" in err.value.details()
    assert cluster.free_blocks(cluster.prefill) == cluster.prefill.engine.num_blocks
    # A decode node that is gone (data port and gRPC): UNAVAILABLE, so the router can recompute.
    gone_res = kv_pb2.ReserveBlocksResponse()
    gone_res.CopyFrom(res)
    gone_res.kv_endpoints[:] = ["tcp://127.0.0.1:1"]
    gone = kv_pb2.PrefillRequest(request_id="r2", prompt_token_ids=prompt, sampling=sampling_to_proto(GREEDY),
                                 decode_address="127.0.0.1:1", reservation=gone_res)
    with pytest.raises(grpc.RpcError) as err:
        cluster.prefill_stub.Prefill(gone, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert cluster.free_blocks(cluster.prefill) == cluster.prefill.engine.num_blocks


def test_bad_requests_are_invalid_argument(cluster):
    def code_of(fn):
        with pytest.raises(grpc.RpcError) as err:
            fn()
        return err.value.code(), err.value.details()

    code, msg = code_of(lambda: cluster.decode_rpc("e1", [], GREEDY))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in msg
    code, msg = code_of(lambda: cluster.decode_rpc("e2", [5, 6], SamplingParams(temperature=-1.0)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in msg
    code, msg = code_of(lambda: cluster.decode_rpc("e3", [5, 10**6], GREEDY))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, msg = code_of(lambda: cluster.prefill_rpc("e4", [5, 6], SamplingParams(n=2), kv_pb2.ReserveBlocksResponse()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n must be 1" in msg
    code, msg = code_of(lambda: cluster.prefill_rpc("e5", [5, 6], SamplingParams(max_tokens=5000),
                                                    kv_pb2.ReserveBlocksResponse()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in msg
    code, msg = code_of(lambda: cluster.decode_rpc("e6", [5, 6, 7], GREEDY, first=[9]))
    assert code == grpc.StatusCode.NOT_FOUND
    code, msg = code_of(lambda: cluster.decode_rpc("e8", [5, 6, 7], SamplingParams(n=2), first=[9]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n must be 1" in msg
    code, msg = code_of(lambda: cluster.kv_stub.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
        request_id="e7", model_fingerprint="other", block_size=BS, prompt_token_ids=[5, 6])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks
    assert cluster.free_blocks(cluster.prefill) == cluster.prefill.engine.num_blocks


def test_full_pool_is_resource_exhausted_with_a_retry_hint(tiny_dir, redis_url):
    c = Cluster(tiny_dir, redis_url, decode_blocks=8)
    try:
        c.reserve("big", list(range(3, 31)))  # 7 of 8 blocks
        with pytest.raises(grpc.RpcError) as err:
            c.reserve("more", list(range(40, 52)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(err.value.trailing_metadata())["retry-after-ms"] == "200"
        assert c.kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id="big")).found
        assert not c.kv_stub.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id="big")).found
        c.reserve("more", list(range(40, 52)))
    finally:
        c.close()


def test_reservation_lease_expires_without_decode(tiny_dir, redis_url):
    c = Cluster(tiny_dir, redis_url, reservation_lease_s=0.3)
    try:
        prompt = list(range(60, 83))
        res = c.reserve("slow", prompt)
        assert res.lease_s == pytest.approx(0.3)
        assert wait_for(lambda: c.free_blocks(c.decode) == c.decode.engine.num_blocks)
        with pytest.raises(grpc.RpcError) as err:
            c.prefill_rpc("slow", prompt, GREEDY, res)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # Renewed every lease/3 while "queued" for twice the lease, the reservation survives.
        res = c.reserve("renewed", prompt)
        for _ in range(6):
            time.sleep(0.1)
            assert c.kv_stub.RenewReservation(kv_pb2.RenewReservationRequest(request_id="renewed")).found
        assert c.prefill_rpc("renewed", prompt, GREEDY, res).blocks_sent > 0
        assert not c.kv_stub.RenewReservation(kv_pb2.RenewReservationRequest(request_id="never")).found
    finally:
        c.close()


def test_abort_decode_mid_stream_and_client_cancel_free_blocks(cluster):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = cluster.decode_stub.Decode(kv_pb2.DecodeRequest(
        request_id="a1", prompt_token_ids=list(range(5, 30)), sampling=sampling_to_proto(long)), timeout=30)
    assert next(stream).WhichOneof("kind") == "chunk"
    assert cluster.decode_stub.AbortDecode(serving_pb2.AbortRequest(request_id="a1")).found
    rest = list(stream)
    assert completes(rest)[-1].finish_reason == serving_pb2.FINISH_REASON_ABORT
    assert not cluster.decode_stub.AbortDecode(serving_pb2.AbortRequest(request_id="a1")).found

    stream = cluster.decode_stub.Decode(kv_pb2.DecodeRequest(
        request_id="a2", prompt_token_ids=list(range(5, 30)), sampling=sampling_to_proto(long)), timeout=30)
    next(stream)
    stream.cancel()  # the client goes away
    assert wait_for(lambda: cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks)


def test_health_and_lease_lapse_of_a_stopped_node(tiny_dir, redis_url):
    # A lease well past how long stop() may take (its gRPC grace alone is up to 1 s): with 0.5 s
    # the entry once lapsed before stop() returned on a loaded CI machine, and the check that
    # stop(deregister=False) left it in place failed.
    c = Cluster(tiny_dir, redis_url, lease_s=3.0, heartbeat_s=0.1)
    try:
        health = health_pb2_grpc.HealthStub(c.d_channel)
        for service in ("", "pdserve.v1.DecodeNode", "pdserve.v1.KVTransfer"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # KVHolder (PushPrefix) on every node; a prefill node's KVTransfer receives fetched prefixes.
        for channel, role_services in ((c.d_channel, {"pdserve.v1.DecodeNode", "pdserve.v1.KVTransfer"}),
                                       (c.p_channel, {"pdserve.v1.PrefillNode", "pdserve.v1.KVTransfer"})):
            assert _reflected_services(channel) == role_services | {"grpc.health.v1.Health", "pdserve.v1.KVHolder",
                                                                    "grpc.reflection.v1alpha.ServerReflection"}
        assert c.decode.stats()["role"] == "decode" and c.prefill.stats()["address"] == c.prefill.address
        assert set(c.reader.live_nodes()) == {"p0", "d0"}
        c.decode.stop(deregister=False)  # as a crash would: no goodbye, the lease runs out
        assert "d0" in c.reader.live_nodes()
        assert wait_for(lambda: "d0" not in c.reader.live_nodes(), timeout=6.0)
        c.prefill.stop()  # a clean stop leaves at once
        assert c.reader.live_nodes() == {}
    finally:
        c.close()


def _reflected_services(channel) -> set[str]:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    return {s.name for a in answers for s in a.list_services_response.service}


def test_a_server_refuses_a_config_of_another_role(tiny_dir, redis_url):
    with pytest.raises(ValueError, match="DecodeServer needs a decode-role config, got role='prefill'"):
        DecodeServer(NodeConfig(node_id="x", role="prefill", redis_url=redis_url), make_engine(tiny_dir))


def test_first_token_from_prefill_can_end_the_request(tiny_dir, cluster):
    prompt = list(range(70, 85))
    ref = make_engine(tiny_dir).generate([prompt], GREEDY)[0].outputs[0].token_ids
    one = SamplingParams(temperature=0.0, max_tokens=1)
    _, _, msgs = cluster.disaggregated("one", prompt, one)
    assert tokens_of(msgs) == ref[:1]
    assert [c.finish_reason for c in completes(msgs)] == [serving_pb2.FINISH_REASON_LENGTH]
    # The first token is a stop token: the decode node must not run past it.
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(ref[0],))
    _, _, msgs = cluster.disaggregated("stop", prompt, stop)
    assert tokens_of(msgs) == ref[:1]
    assert [c.finish_reason for c in completes(msgs)] == [serving_pb2.FINISH_REASON_STOP]
    assert cluster.free_blocks(cluster.decode) == cluster.decode.engine.num_blocks
