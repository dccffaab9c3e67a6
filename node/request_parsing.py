"""Requests a node cannot parse are the caller's error: INVALID_ARGUMENT naming the field.

A sync gRPC server parses each request with the handler's ``request_deserializer`` (the
generated ``Message.FromString``) and, when that raises, ends the call with INTERNAL
"Exception deserializing request!": a status that blames the node and tells the caller nothing.
This interceptor takes the parsing over for every method of the server (the node's services,
health, reflection): the handler gets the raw bytes, parses them itself, and bytes protobuf
refuses get INVALID_ARGUMENT with ``protos.wire_check``'s account of the field that broke
(``field prompt_token_ids: ...``), before the call takes a long-call slot or reaches the
servicer. Client-streaming calls (PushBlocks) parse each message as it arrives; the first bad
one ends the call. The router's asyncio server does the same for its own API
(``frontend/grpc_parsing.py``). Plain grpc and protobuf.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import Message

from protos.wire_check import MalformedMessageError, parse


def _message_class(deserializer: Callable) -> type[Message] | None:
    # The generated code passes ``Request.FromString``, a method bound to the message class.
    owner = getattr(deserializer, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, Message) else None


def parse_or_abort(deserializer: Callable, method: str, raw: bytes, context: grpc.ServicerContext):
    """The request ``raw`` holds, or an INVALID_ARGUMENT abort naming what is wrong with it."""
    cls = _message_class(deserializer)
    try:
        return parse(cls, raw) if cls is not None else deserializer(raw)
    except MalformedMessageError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: {e}")
    except Exception as e:  # a deserializer that is not a protobuf message's
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request could not be parsed: {e}")


class ParseRequestsInterceptor(grpc.ServerInterceptor):
    """Every handler's requests parsed by ``parse_or_abort`` instead of by gRPC."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        des, method, ser = handler.request_deserializer, handler_call_details.method, handler.response_serializer

        def one(inner):
            def call(raw: bytes, context):
                return inner(parse_or_abort(des, method, raw, context), context)
            return call

        def each(inner):
            def call(raws: Iterator[bytes], context):
                return inner((parse_or_abort(des, method, raw, context) for raw in raws), context)
            return call

        # request_deserializer=None: the behaviour receives the bytes as they arrived.
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(one(handler.unary_unary), None, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(one(handler.unary_stream), None, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(each(handler.stream_unary), None, ser)
        return grpc.stream_stream_rpc_method_handler(each(handler.stream_stream), None, ser)
