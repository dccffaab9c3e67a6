"""asyncio client of the pdserve router: the same surface as ``pdserve.Client`` with
``async`` methods and async iterators (grpc.aio underneath)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import errors
from pdserve.client import (SERVICE_NAME, TLS, Backoff, Deadline, Metadata, StreamState, _deadline_error,
                            build_request, channel_options)
from pdserve.types import Chunk, Completion, ModelInfo
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc


class AsyncStream(StreamState):
    """Async iterator of Chunks; ``completions`` / ``completion`` once it is exhausted."""

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        c = self._client
        received = False
        while True:
            if self._deadline.expired():
                raise _deadline_error()
            self.attempts += 1
            self._call = c._stub.Generate(self._request, timeout=self._deadline.remaining(),
                                          metadata=self._metadata)
            try:
                async for resp in self._call:
                    received = True
                    chunk = self._acc.feed(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                if not received and await c._should_retry(e, self.attempts, self._deadline):
                    continue
                raise errors.from_rpc_error(e) from None
            finally:
                self._call.cancel()


class AsyncClient:
    """``async with pdserve.AsyncClient(target) as c: async for chunk in c.generate("Hi"): ...``"""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, retries: int = 3,
                 backoff: tuple[float, float] = (0.1, 2.0), tls: TLS | None = None,
                 metadata: Metadata | None = None, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        options = channel_options(tls, max_message_bytes)
        self._channel = (grpc.aio.secure_channel(target, tls.credentials(), options=options) if tls
                         else grpc.aio.insecure_channel(target, options=options))
        self._stub = pb_grpc.PdServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout
        self.retries = retries
        self._backoff = Backoff(*backoff)
        self._metadata = tuple(metadata or ())

    def _md(self, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
        return self._metadata + tuple(extra or ())

    async def _should_retry(self, e: grpc.RpcError, attempts: int, deadline: Deadline) -> bool:
        if e.code() != grpc.StatusCode.UNAVAILABLE or attempts > self.retries:
            return False
        delay = self._backoff.delay(attempts - 1)
        remaining = deadline.remaining()
        if remaining is not None and remaining <= delay:
            return False
        await asyncio.sleep(delay)
        return True

    async def _unary(self, method, request, timeout: float | None):
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempts = 0
        while True:
            if deadline.expired():
                raise _deadline_error()
            attempts += 1
            try:
                return await method(request, timeout=deadline.remaining(), metadata=self._md(None))
            except grpc.RpcError as e:
                if await self._should_retry(e, attempts, deadline):
                    continue
                raise errors.from_rpc_error(e) from None

    def generate(self, prompt: Any = None, *, timeout: float | None = None, metadata: Metadata | None = None,
                 **kwargs: Any) -> AsyncStream:
        """Same arguments as ``Client.generate``; iterate with ``async for``."""
        request = build_request(prompt, **kwargs)
        return AsyncStream(self, request, self.timeout if timeout is None else timeout, self._md(metadata))

    async def complete_all(self, prompt: Any = None, **kwargs: Any) -> list[Completion]:
        stream = self.generate(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.completions

    async def complete(self, prompt: Any = None, **kwargs: Any) -> Completion:
        if kwargs.get("n", 1) not in (None, 1):
            raise ValueError("complete() returns one sample; use complete_all() for n > 1")
        return (await self.complete_all(prompt, **kwargs))[0]

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).found

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo(m.id, m.max_context_length) for m in resp.models]

    async def health(self, *, timeout: float | None = None) -> bool:
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
