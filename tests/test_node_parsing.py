"""Malformed request bytes to a node (node/request_parsing.py) over real gRPC: INVALID_ARGUMENT
naming the field, never gRPC's INTERNAL "Exception deserializing request!", and the node serves
on. First on a bare server with the interceptor (no model), then on live decode and prefill
nodes (tiny random model, real Redis)."""
from __future__ import annotations

import uuid
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from node.request_parsing import ParseRequestsInterceptor
from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc, serving_pb2

TRUNCATED = b"\x0a\x05ab"  # field 1, 5 bytes long, 2 left
BAD_UTF8 = b"\x0a\x03a\xffc"  # field 1 (a string in every request here) with invalid UTF-8
NOT_PROTOBUF = b"\x00\x01\x02"  # field number 0


def raw_unary(channel, path: str, data: bytes, stream: bool = False):
    call = (channel.unary_stream if stream else channel.unary_unary)(path)
    try:
        out = call(data, timeout=30)
        return grpc.StatusCode.OK, "", list(out) if stream else out
    except grpc.RpcError as e:
        return e.code(), e.details(), None


def raw_push(channel, messages: list[bytes]):
    try:
        return grpc.StatusCode.OK, "", channel.stream_unary(PUSH)(iter(messages), timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details(), None


PUSH = "/pdserve.v1.KVTransfer/PushBlocks"
HEALTH = "/grpc.health.v1.Health/Check"


class CountingPush(kv_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.seen: list[kv_pb2.KVBlockMessage] = []

    def PushBlocks(self, request_iterator, context):
        for m in request_iterator:
            self.seen.append(m)
        return kv_pb2.PushBlocksResponse()


@pytest.fixture
def bare_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=(ParseRequestsInterceptor(),))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    push = CountingPush()
    kv_pb2_grpc.add_KVTransferServicer_to_server(push, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch, push
    server.stop(0)


def test_bare_server_unary_and_client_streaming(bare_server):
    ch, push = bare_server
    code, details, out = raw_unary(ch, HEALTH, health_pb2.HealthCheckRequest().SerializeToString())
    assert code == grpc.StatusCode.OK  # a valid request is served as before
    code, details, _ = raw_unary(ch, HEALTH, BAD_UTF8)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(HEALTH) and "field service: " in details and "UTF-8" in details
    good = kv_pb2.KVBlockMessage(header=kv_pb2.KVHeader(request_id="r")).SerializeToString()
    code, _, _ = raw_push(ch, [good, good])
    assert code == grpc.StatusCode.OK and len(push.seen) == 2
    # the second message of a stream is broken: the call ends there, naming the field
    code, details, _ = raw_push(ch, [good, good[:-1], good])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "KVBlockMessage" in details and "header" in details, details
    assert len(push.seen) == 3  # the first message of that call reached the servicer, nothing after


# ----------------------------------------------------------------------------- live nodes
@pytest.fixture(scope="module")
def nodes(redis_url, tiny_model):
    from tests.clusters import start_node
    from tests.helpers import engine_config

    eng = engine_config(tiny_model, num_blocks=64)
    ns = f"parse-{uuid.uuid4().hex[:6]}"
    started = [start_node(role, f"{role}-0", eng, redis_url=redis_url, namespace=ns, grpc_workers=4)
               for role in ("decode", "prefill")]
    channels = [grpc.insecure_channel(n.address) for n in started]
    yield started, channels
    for ch in channels:
        ch.close()
    for n in started:
        n.stop()


CASES = [  # (node, method, streams responses)
    (0, "/pdserve.v1.DecodeNode/Decode", True),
    (0, "/pdserve.v1.DecodeNode/AbortDecode", False),
    (0, "/pdserve.v1.KVTransfer/ReserveBlocks", False),
    (0, "/pdserve.v1.KVTransfer/ReleaseReservation", False),
    (0, "/pdserve.v1.KVTransfer/RenewReservation", False),
    (1, "/pdserve.v1.PrefillNode/Prefill", False),
    (1, HEALTH, False),
]


@pytest.mark.parametrize("node, method, stream", CASES, ids=[c[1].rsplit("/", 1)[1] for c in CASES])
@pytest.mark.parametrize("data", [TRUNCATED, BAD_UTF8, NOT_PROTOBUF], ids=["truncated", "bad_utf8", "not_protobuf"])
def test_live_nodes_refuse_malformed_bytes_by_field(nodes, node, method, stream, data):
    servers, channels = nodes
    code, details, _ = raw_unary(channels[node], method, data, stream)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code.name}: {details}"
    assert "Exception deserializing" not in details
    assert details.startswith(method) and "is not a valid" in details, details
    if data == BAD_UTF8:
        assert "field " in details and "UTF-8" in details, details
    assert servers[node].gate.inflight == 0  # refused before it took a long-call slot


def test_live_push_with_a_broken_message_and_the_node_serves_on(nodes):
    from protos.convert import sampling_to_proto
    from tests.helpers import prompt
    from tokens.sampling_params import SamplingParams

    servers, channels = nodes
    code, details, _ = raw_push(channels[0], [b"\x0a\xff"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "KVBlockMessage" in details, details
    assert servers[0].gate.inflight == 0
    # still serving: a well-formed Decode runs to its end, and health says SERVING
    req = kv_pb2.DecodeRequest(request_id="after", prompt_token_ids=prompt(1, 20),
                               sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True)))
    out = list(kv_pb2_grpc.DecodeNodeStub(channels[0]).Decode(req, timeout=60))
    assert sum(len(r.chunk.token_ids) for r in out if r.HasField("chunk")) == 4
    assert out[-1].complete.finish_reason == serving_pb2.FINISH_REASON_LENGTH
    for ch in channels:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
