"""Blocking client of the pdserve router (gRPC); ``pdserve.AsyncClient`` is the asyncio twin.
Requests, retries and deadlines are decided in pdserve/core.py; this file only waits."""
from __future__ import annotations

import time
from collections.abc import Iterator
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
    build_request,
    check_single_sample,
    models_from,
)
from pdserve.types import Chunk, Completion, ModelInfo
from protos.pdserve.v1 import serving_pb2 as pb

__all__ = ["Client", "Stream", "TLS", "build_request"]


class Stream(StreamState):
    """Iterator of Chunks of one Generate call. After iteration, ``completions`` holds one
    Completion per sample and ``completion`` the first. Use as a context manager (or call
    ``cancel()``) to stop the request early; the server then aborts it."""

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        while True:
            self._start(self._client._stub)
            try:
                for resp in self._call:
                    chunk = self._feed(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                time.sleep(self._retry_delay(e))
            finally:
                # Reached when the caller stops iterating early too: end the call on the server.
                self._call.cancel()


class Client(ClientCore):
    """pdserve client: ``with pdserve.Client("host:port") as c: print(c.complete("Hi").text)``.

    ``api_key``: sent as ``authorization: Bearer KEY`` on every call (None: ``$PDSERVE_API_KEY``
    if set). ``tls``: ``pdserve.TLS(root_certificates="ca.pem")`` for a router serving TLS (plus
    ``certificate_chain`` and ``private_key`` where it asks for a client certificate).

    Retries: a call refused with UNAVAILABLE (the router restarting or draining, a refused
    connection) or RESOURCE_EXHAUSTED (overload) before any output is retried after the
    server's retry hint plus exponential backoff with full jitter (``backoff`` = (base, cap)
    seconds) for up to ``retry_budget_s`` (10 s) from its first
    failure, within ``timeout``; ``retries`` caps the count too (None: only time bounds it; 0:
    never retry). A stream that already delivered output is never retried: it raises the
    retryable ``StreamInterruptedError`` and the caller decides."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 retries: int | None = None, retry_budget_s: float | None = DEFAULT_RETRY_BUDGET_S,
                 backoff: tuple[float, float] = DEFAULT_BACKOFF, tls: TLS | None = None,
                 metadata: Metadata | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 api_key: str | None = None) -> None:
        super().__init__(grpc, target, timeout=timeout, retries=retries, backoff=backoff, tls=tls,
                         metadata=metadata, max_message_bytes=max_message_bytes, api_key=api_key,
                         retry_budget_s=retry_budget_s)

    def _unary(self, method, request, timeout: float | None):
        attempts = self._attempts(timeout)
        while True:
            try:
                return method(request, timeout=attempts.begin(), metadata=self._md(None))
            except grpc.RpcError as e:
                time.sleep(attempts.retry_delay(e))

    def generate(self, prompt: Any = None, *, timeout: float | None = None, metadata: Metadata | None = None,
                 **kwargs: Any) -> Stream:
        """Stream the output: ``for chunk in client.generate("Hi", max_tokens=32): ...``.

        ``prompt``: text, chat messages (list of {"role", "content"}) or token ids; or pass
        ``messages=`` / ``token_ids=``. Other keywords: model, request_id, slo_class, session_id,
        cache_salt and the sampling fields (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
        stop_token_ids, n, logprobs, min_tokens, the penalties, ignore_eos); structured output
        (``response_format=`` OpenAI's, or ``structured=`` vLLM's structured_outputs object) and
        tools (``tools=``, ``tool_choice=``, ``parallel_tool_calls=``): see ``build_request``.
        """
        return Stream(self, *self._stream_args(prompt, timeout, metadata, kwargs))

    def complete_all(self, prompt: Any = None, **kwargs: Any) -> list[Completion]:
        """Run to the end; one Completion per sample, by index."""
        stream = self.generate(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.completions

    def complete(self, prompt: Any = None, **kwargs: Any) -> Completion:
        """Run one sample to the end and return its full text (n > 1: use complete_all)."""
        check_single_sample(kwargs)
        return self.complete_all(prompt, **kwargs)[0]

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a running request; False when none had this id."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout).found

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return models_from(self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout))

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the router reports SERVING (it has a live decode node)."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
