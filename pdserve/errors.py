"""Typed exceptions for every failure the pdserve API reports, mapped from gRPC status codes.

The same mapping covers statuses that end an RPC and in-stream ``Error`` messages (whose
``code`` is the numeric grpc.StatusCode), so callers catch one family either way.
"""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from protos.conventions import retry_after_ms


class PdServeError(Exception):
    """Base class: ``code`` is the grpc.StatusCode, ``message`` the server's explanation.
    ``retryable``: sending the same request again may succeed (overload, no server reachable)."""

    retryable = False

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequestError(PdServeError, ValueError):
    """The request breaks a limit or is malformed; the message names the limit. Do not retry.
    Raised by the server (INVALID_ARGUMENT, ...) or, before sending, by the SDK itself, which
    then sets ``field`` to the argument at fault (pdserve/checks.py). A ValueError too."""

    field: str | None = None


class NotFoundError(PdServeError):
    """Unknown model (the message lists the served ones) or request id."""


class ResourceExhaustedError(PdServeError):
    """The cluster is overloaded; retry after ``retry_after_s`` seconds (None: no hint)."""

    retryable = True

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after_s = retry_after_s


class UnavailableError(PdServeError):
    """No server or no live node answered; retried automatically before any output.
    ``retry_after_s``: the server's hint (a draining router sends one), None without."""

    retryable = True

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(code, message)
        self.retry_after_s = retry_after_s


class StreamInterruptedError(UnavailableError):
    """A Generate stream was cut after it had delivered output (the router restarted, the
    connection dropped). The SDK does not retry it itself: a new attempt would stream the
    output again from the start. Retry the request if a repeated answer is acceptable (greedy
    and seeded requests give the same tokens); ``chunks_received`` says how far it got."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 chunks_received: int = 0) -> None:
        super().__init__(code, f"{message} (the stream was cut after {chunks_received} message(s) of output and is "
                               "not retried automatically, since that would repeat them: retry the request)",
                         retry_after_s)
        self.chunks_received = chunks_received


class DeadlineExceededError(PdServeError):
    """The call's deadline passed."""


class CancelledError(PdServeError):
    """The call was cancelled (by this client)."""


class AuthenticationError(PdServeError):
    """The router wants an API key and got none or a wrong one (``api_key=`` or
    ``$PDSERVE_API_KEY``). Do not retry."""


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
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
}
_CODE_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: grpc.StatusCode, message: str,
                trailing_metadata: Sequence[tuple[str, str | bytes]] | None = None) -> PdServeError:
    cls = _BY_CODE.get(code, PdServeError)
    if cls in (ResourceExhaustedError, UnavailableError):
        ms = retry_after_ms(trailing_metadata)
        return cls(code, message, ms / 1000.0 if ms is not None else None)
    return cls(code, message)


def from_code_number(number: int, message: str) -> PdServeError:
    """For in-stream Error messages, whose code is the numeric status."""
    return from_status(_CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message)


def interrupted(error: grpc.RpcError, chunks_received: int) -> PdServeError:
    """A stream that failed after delivering output: UNAVAILABLE (the connection or the
    router went away) becomes StreamInterruptedError; any other status maps as usual."""
    err = from_rpc_error(error)
    if isinstance(err, UnavailableError):
        return StreamInterruptedError(err.code, err.message, err.retry_after_s, chunks_received)
    return err


def gave_up(error: PdServeError, why: str, attempts: int, elapsed_s: float) -> PdServeError:
    """The same error, its message saying that the SDK stopped retrying it and why (the retry
    budget spent, the retries used up, the timeout near), so a caller can tell a cluster that
    stayed overloaded or unreachable for the whole budget from one refused request."""
    message = (f"{error.message} [not retried again: {why}; {attempts} attempt(s) over {elapsed_s:.2f} s, "
               f"last status {error.code.name}]")
    if isinstance(error, (ResourceExhaustedError, UnavailableError)):
        return type(error)(error.code, message, error.retry_after_s)
    return type(error)(error.code, message)


def from_rpc_error(error: grpc.RpcError) -> PdServeError:
    """Map a finished call's RpcError (sync or aio) to the typed exception."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return from_status(code or grpc.StatusCode.UNKNOWN, details or "", trailing)
