"""pdserve client SDK: ``import pdserve``.

    with pdserve.Client("127.0.0.1:50051") as client:
        for chunk in client.generate("Hello", max_tokens=32):
            print(chunk.text, end="")

Torch-free and server-free: it needs grpcio, protobuf and the generated stubs only.
"""
from pdserve.aio import AsyncClient, AsyncStream
from pdserve.client import Client, Stream
from pdserve.core import TLS
from pdserve.errors import (
                            AuthenticationError,
                            CancelledError,
                            DeadlineExceededError,
                            InvalidRequestError,
                            NotFoundError,
                            PdServeError,
                            ResourceExhaustedError,
                            StreamInterruptedError,
                            UnavailableError,
)
from pdserve.types import Chunk, Completion, ModelInfo, Timings, TokenLogprob, ToolCall, Usage

__all__ = [
    "AsyncClient", "AsyncStream", "AuthenticationError", "CancelledError", "Chunk", "Client", "Completion", "DeadlineExceededError",
    "InvalidRequestError", "ModelInfo", "NotFoundError", "PdServeError", "ResourceExhaustedError", "Stream",
    "StreamInterruptedError",
    "TLS", "Timings", "TokenLogprob", "ToolCall", "UnavailableError", "Usage",
]
