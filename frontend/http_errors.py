"""Every failure of the HTTP API in OpenAI's error shape (``{"error": {message, type, code,
param}}``), with the status a client can act on: 400 names the limit, 404 an unknown model, 429
(overload, SLO) and 503 (no node) carry ``Retry-After`` and ``retry-after-ms`` (the official
client honours both).

``ErrorResponse`` is the one exception the routes raise; it is built from a gRPC status (the
orchestrator's ``RouterError``, an error message in a response stream) or directly. FastAPI's own
refusals, a body that fails validation and an unknown route or method, are mapped to the same
shape by the handlers ``add_error_handlers`` installs, and so is any unexpected exception (500,
``internal_error``; the traceback goes to the log, not to the client).
"""
from __future__ import annotations

import math

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from frontend import openai_protocol as oai
from protos.pdserve.v1 import serving_pb2 as pb
from router.validation import RouterError

# gRPC status -> (HTTP status, OpenAI error type). 499 is nginx's "client closed request".
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}
_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
# A 503 without a hint from the cluster: about one node-view refresh.
DEFAULT_RETRY_AFTER_MS = 1000
# GenerateRequest's prompt fields, as the OpenAI request names them.
_PROMPT_PARAMS = {"text": "prompt", "tokens": "prompt", "tokens.ids": "prompt", "chat": "messages",
                  "chat.messages": "messages"}


class ErrorResponse(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | int | None = None,
                 param: str | None = None, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after_ms = retry_after_ms

    @staticmethod
    def from_grpc(code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                  param: str | None = None) -> ErrorResponse:
        status, type_ = HTTP_STATUS.get(code, (500, "internal_error"))
        if status in (429, 503) and retry_after_ms is None:
            retry_after_ms = DEFAULT_RETRY_AFTER_MS
        return ErrorResponse(status, message, type_, code.name.lower(), param, retry_after_ms=retry_after_ms)

    @staticmethod
    def from_router_error(e: RouterError) -> ErrorResponse:
        """The orchestrator's refusal, its field named as the OpenAI request names it."""
        return ErrorResponse.from_grpc(e.code, e.message, e.retry_after_ms, _PROMPT_PARAMS.get(e.param, e.param))

    @staticmethod
    def from_stream(err: pb.Error) -> ErrorResponse:
        """An error message of a response stream (its code is a gRPC status value)."""
        return ErrorResponse.from_grpc(_CODE_BY_VALUE.get(err.code, grpc.StatusCode.INTERNAL), err.message)

    @staticmethod
    def internal(e: BaseException) -> ErrorResponse:
        """A fault of the router itself (a bug): the client learns that much, the log the rest."""
        return ErrorResponse(500, f"the router failed on this request ({type(e).__name__}); its log has the "
                             "details", "internal_error", "internal_error")

    @staticmethod
    def unsupported(e: oai.UnsupportedError) -> ErrorResponse:
        return ErrorResponse(400, str(e), "invalid_request_error", "unsupported", e.param)

    def body(self) -> dict:
        return oai.error_json(self.message, self.type, self.code, self.param)

    def response(self, close: bool = False) -> JSONResponse:
        """``close``: the request's body was not read, so the connection cannot carry another."""
        headers = {}
        if self.retry_after_ms is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000))),
                       "retry-after-ms": str(self.retry_after_ms)}
        if close:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
# Names pydantic puts in an error's loc for the member types of a union, not fields.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _param(loc) -> str | None:
    """A validation error's field path (``messages.0.content``), without "body" and the
    union member tags pydantic inserts (``function-after[_utf8(), str]``)."""
    keep = [str(x) for x in loc if isinstance(x, int)
            or (x != "body" and x not in _TYPE_TAGS and str(x).isidentifier())]
    return ".".join(keep) or None


async def _error(request: Request, exc: ErrorResponse):
    return exc.response()


async def _invalid(request: Request, exc: RequestValidationError):
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": ""}]
    # A union field (prompt, stop, content) fails once per member type: our own value
    # checks (token id ranges, UTF-8) say more than "Input should be a valid string".
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
        offset = first.get("loc", ("body", "?"))[-1]
        why = first.get("ctx", {}).get("error", first["msg"])
        return JSONResponse(oai.error_json(f"the request body is not valid JSON ({why} at byte {offset})",
                                           "invalid_request_error", "invalid_json"), status_code=400)
    param = _param(first.get("loc", ()))
    message = f"{param}: {first['msg']}" if param else f"the request body: {first['msg']}"
    return JSONResponse(oai.error_json(message, "invalid_request_error", "invalid_value", param),
                        status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException):
    # FastAPI's own refusals (a body it cannot decode, unknown routes, wrong methods) in
    # OpenAI's error shape, like every other error of this API.
    message, code = str(exc.detail), _HTTP_CODES.get(exc.status_code)
    if exc.status_code == 400:  # FastAPI says this only of a body it could not decode
        message = f"the request body must be JSON in UTF-8 ({message})"
    type_ = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return JSONResponse(oai.error_json(message, type_, code), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _router_error(request: Request, exc: RouterError):
    # The orchestrator's refusal that reached a route unconverted (a batch's later prompt).
    return ErrorResponse.from_router_error(exc).response()


async def _unexpected(request: Request, exc: Exception):
    # Starlette's outermost middleware calls this for any other exception, then re-raises it
    # for the server to log; without it the client would get a plain-text 500.
    return ErrorResponse.internal(exc).response()


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ErrorResponse, _error)
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
