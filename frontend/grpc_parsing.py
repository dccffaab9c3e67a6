"""Register a grpc.aio servicer whose requests are parsed by us, not by gRPC.

With the generated ``add_*Servicer_to_server`` gRPC parses each request itself, and bytes it
cannot parse end the call with UNKNOWN "Unexpected DecodeError: Error parsing message". Here
the handlers take the raw bytes and parse them with ``protos.wire_check.parse``, so a
malformed, truncated or non-UTF-8 request gets INVALID_ARGUMENT naming the field instead.
Only unary-request methods are supported (every method of the client-facing PdServe is).
"""
from __future__ import annotations

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from protos.wire_check import MalformedMessageError, parse


def add_parsing_servicer(servicer: object, service: ServiceDescriptor, server: grpc.aio.Server) -> None:
    """Like the generated ``add_<Service>Servicer_to_server``, with our request parsing."""
    handlers = {m.name: _handler(getattr(servicer, m.name), m) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _handler(impl, method: MethodDescriptor) -> grpc.RpcMethodHandler:
    if method.client_streaming:
        raise ValueError(f"{method.full_name}: client-streaming methods are not supported")
    request_cls = GetMessageClass(method.input_type)
    serialize = GetMessageClass(method.output_type).SerializeToString

    async def request_or_abort(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            return parse(request_cls, raw)
        except MalformedMessageError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    if method.server_streaming:
        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext):
            request = await request_or_abort(raw, context)
            async for response in impl(request, context):
                yield response

        # request_deserializer=None: the behaviour receives the bytes as they arrived.
        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=None,
                                                    response_serializer=serialize)

    async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext):
        return await impl(await request_or_abort(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=None,
                                               response_serializer=serialize)
