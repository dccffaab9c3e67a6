"""The router's channels to nodes are bounded (issue 49): nodes come and go under new addresses,
and a channel kept per address ever seen held a connection and buffers for every node long gone.
Real grpc.aio servers on loopback stand in for nodes: a node that left (its server stopped)
has its channel closed once idle, a channel with a Decode stream in flight is never closed, idle
ones beyond the bound go least recently used first, and a live node whose channel was closed
gets a new one at its next call."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from router.node_client import NodeClient


class _Node(kv_pb2_grpc.KVTransferServicer, kv_pb2_grpc.DecodeNodeServicer):
    def __init__(self) -> None:
        self.released: list[str] = []
        self.streaming = asyncio.Event()
        self.finish = asyncio.Event()

    async def ReleaseReservation(self, request, context):
        self.released.append(request.request_id)
        return kv_pb2.ReleaseReservationResponse()

    async def Decode(self, request, context):
        yield pb.GenerateResponse()
        self.streaming.set()
        await self.finish.wait()


async def _node() -> tuple[grpc.aio.Server, _Node, str]:
    server, node = grpc.aio.server(), _Node()
    kv_pb2_grpc.add_KVTransferServicer_to_server(node, server)
    kv_pb2_grpc.add_DecodeNodeServicer_to_server(node, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, node, f"127.0.0.1:{port}"


def _config() -> RouterConfig:
    return RouterConfig(redis_url="redis://127.0.0.1:1/0", model_name="m", tokenizer_dir="unused", max_model_len=64,
                        control_timeout_s=2.0)


def test_idle_channels_of_gone_nodes_are_closed_busy_ones_kept():
    async def run() -> None:
        client = NodeClient(_config(), idle_s=0.3, max_idle=8)
        (gone_srv, gone, gone_addr), (busy_srv, busy, busy_addr) = await _node(), await _node()
        try:
            await client.release(gone_addr, "r1")
            assert gone.released == ["r1"] and client.open_channels == 1
            gone_channel = client._channels[gone_addr].channel
            await gone_srv.stop(None)  # the node leaves: nothing will call it again but a failing call
            await client.release(gone_addr, "r2")  # logged, not raised: UNAVAILABLE

            stream = client.decode(busy_addr, kv_pb2.DecodeRequest(request_id="d"), None)
            await stream.read()
            await busy.streaming.wait()
            await asyncio.sleep(0.4)  # both idle past idle_s; only the gone node's has no call
            await client.release(busy_addr, "r3")  # a call sweeps
            await asyncio.sleep(0)  # the close runs on the loop
            assert gone_addr not in client._channels and busy_addr in client._channels
            with pytest.raises(grpc.aio.UsageError):  # closed: gRPC refuses to start a call on it
                await kv_pb2_grpc.KVTransferStub(gone_channel).ReleaseReservation(
                    kv_pb2.ReleaseReservationRequest(request_id="x"), timeout=1)
            busy.finish.set()
            assert await stream.read() is grpc.aio.EOF  # the stream in flight was never cut
            await asyncio.sleep(0.4)
            client._sweep(time.monotonic())
            await asyncio.sleep(0)
            assert client.open_channels == 0  # its call ended, then it idled past idle_s too
            await client.release(busy_addr, "r4")  # a live node's channel comes back at its next call
            assert busy.released == ["r3", "r4"] and client.open_channels == 1
        finally:
            await client.close()
            await busy_srv.stop(None)

    asyncio.run(run())


def test_idle_channels_beyond_the_bound_go_least_recently_used_first():
    async def run() -> None:
        client = NodeClient(_config(), idle_s=3600, max_idle=2)
        server, node, addr = await _node()
        port = addr.rsplit(":", 1)[1]
        # Four addresses of one server, as four nodes would be: distinct channels.
        addrs = [f"127.0.0.1:{port}", f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}", f"ipv4:127.0.0.1:{port}"]
        try:
            for i, a in enumerate(addrs):
                await client.release(a, f"r{i}")
            assert client.open_channels == 4
            client._sweep(time.monotonic())
            await asyncio.sleep(0)
            assert set(client._channels) == set(addrs[2:])  # the two most recently used stay
            assert len(node.released) == 4
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(run())
