"""Typed exceptions for every failure the pdserve API reports, mapped from gRPC status codes.

The same mapping covers statuses that end an RPC and in-stream ``Error`` messages (whose
``code`` is the numeric grpc.StatusCode), so callers catch one family either way.
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from protos.conventions import retry_after_ms


class PdServeError(Exception):
    """Base class: ``code`` is the grpc.StatusCode, ``message`` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequestError(PdServeError):
    """The request breaks a limit or is malformed; the message names the limit. Do not retry."""


class NotFoundError(PdServeError):
    """Unknown model (the message lists the served ones) or request id."""


class ResourceExhaustedError(PdServeError):
    """The cluster is overloaded; retry after ``retry_after_s`` seconds (None: no hint)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after_s = retry_after_s


class UnavailableError(PdServeError):
    """No server or no live node answered; retried automatically before any output."""


class DeadlineExceededError(PdServeError):
    """The call's deadline passed."""


class CancelledError(PdServeError):
    """The call was cancelled (by this client)."""


_BY_CODE: dict[grpc.StatusCode, type[PdServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidRequestError,
    grpc.StatusCode.ALREADY_EXISTS: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
}
_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: grpc.StatusCode, message: str,
                trailing_metadata: Sequence[tuple[str, str | bytes]] | None = None) -> PdServeError:
    cls = _BY_CODE.get(code, PdServeError)
    if cls is ResourceExhaustedError:
        ms = retry_after_ms(trailing_metadata)
        return ResourceExhaustedError(code, message, ms / 1000.0 if ms is not None else None)
    return cls(code, message)


def from_code_number(number: int, message: str) -> PdServeError:
    """For in-stream Error messages, whose code is the numeric status."""
    return from_status(_CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)


def from_rpc_error(error: grpc.RpcError) -> PdServeError:
    """Map a finished call's RpcError (sync or aio) to the typed exception."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return from_status(code or grpc.StatusCode.UNKNOWN, details or "", trailing)
