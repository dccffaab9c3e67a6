"""asyncio client of the pdserve router: the same surface as ``pdserve.Client`` with ``async``
methods and async iterators (grpc.aio underneath). Requests, retries and deadlines are decided
in pdserve/core.py; this file only waits."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from pdserve.core import (
    DEFAULT_BACKOFF,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RETRY_BUDGET_S,
    DEFAULT_TARGET,
    SERVICE_NAME,
    TLS,
    ClientCore,
    Metadata,
    StreamState,
    check_single_sample,
    models_from,
)
from pdserve.types import Chunk, Completion, ModelInfo
from protos.pdserve.v1 import serving_pb2 as pb


class AsyncStream(StreamState):
    """Async iterator of Chunks; ``completions`` / ``completion`` once it is exhausted."""

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        while True:
            self._start(self._client._stub)
            try:
                async for resp in self._call:
                    chunk = self._feed(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                await asyncio.sleep(self._retry_delay(e))
            finally:
                self._call.cancel()


class AsyncClient(ClientCore):
    """``async with pdserve.AsyncClient(target) as c: async for chunk in c.generate("Hi"): ...``"""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 retries: int | None = None, retry_budget_s: float | None = DEFAULT_RETRY_BUDGET_S,
                 backoff: tuple[float, float] = DEFAULT_BACKOFF, tls: TLS | None = None,
                 metadata: Metadata | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 api_key: str | None = None) -> None:
        super().__init__(grpc.aio, target, timeout=timeout, retries=retries, backoff=backoff, tls=tls,
                         metadata=metadata, max_message_bytes=max_message_bytes, api_key=api_key,
                         retry_budget_s=retry_budget_s)

    async def _unary(self, method, request, timeout: float | None):
        attempts = self._attempts(timeout)
        while True:
            try:
                return await method(request, timeout=attempts.begin(), metadata=self._md(None))
            except grpc.RpcError as e:
                await asyncio.sleep(attempts.retry_delay(e))

    def generate(self, prompt: Any = None, *, timeout: float | None = None, metadata: Metadata | None = None,
                 **kwargs: Any) -> AsyncStream:
        """Same arguments as ``Client.generate``; iterate with ``async for``."""
        return AsyncStream(self, *self._stream_args(prompt, timeout, metadata, kwargs))

    async def complete_all(self, prompt: Any = None, **kwargs: Any) -> list[Completion]:
        stream = self.generate(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.completions

    async def complete(self, prompt: Any = None, **kwargs: Any) -> Completion:
        check_single_sample(kwargs)
        return (await self.complete_all(prompt, **kwargs))[0]

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).found

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return models_from(await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout))

    async def health(self, *, timeout: float | None = None) -> bool:
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
