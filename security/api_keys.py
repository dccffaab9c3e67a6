"""API keys on the client routes: ``authorization: Bearer KEY`` in gRPC metadata or the HTTP
header (what the OpenAI clients send).

A presented key is hashed and compared with every configured key's hash by
``hmac.compare_digest``: the time taken depends neither on where the first differing byte is
nor on the key's length. Keys never appear in a log line, an error message or a repr.

gRPC: ``ApiKeyInterceptor`` answers UNAUTHENTICATED before the servicer runs. The standard
health service stays open (probes carry no credentials, and it tells nothing but SERVING).

``ApiKeys.identity`` names the tenant a request came from (the accepted key's digest, never the
key): the router salts each tenant's KV-cache blocks by it (router/prepare.py), so one key
cannot reuse or probe the prompts another key's requests left in the cache.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

import grpc

API_KEY_ENV = "PDSERVE_API_KEY"
# Methods answered without a key: health probes (kubelet, load balancers) send none.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)

MISSING = "no API key: send the header 'authorization: Bearer <key>'"
INVALID = "invalid API key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a router accepts (several, so a key can be rotated without downtime)."""

    __slots__ = ("_digests",)

    def __init__(self, keys: Iterable[str]) -> None:
        keys = [k for k in keys]
        if not keys or any(not k or k != k.strip() for k in keys):
            raise ValueError("API keys must be non-empty, without surrounding whitespace")
        self._digests = tuple(_digest(k) for k in keys)

    def __repr__(self) -> str:
        return f"ApiKeys(<{len(self._digests)} keys>)"

    def accepts(self, presented: str) -> bool:
        d = _digest(presented)
        ok = False
        for known in self._digests:  # no early exit: every key is compared every time
            ok |= hmac.compare_digest(d, known)
        return ok

    def identity(self, header: str | None) -> bytes | None:
        """The accepted key's SHA-256 digest for ``header`` (an Authorization value): a stable,
        one-way name of the tenant; None when it carries no accepted key. Every configured key
        is compared, as in ``accepts``."""
        key = bearer_token(header)
        if key is None:
            return None
        d = _digest(key)
        found = None
        for known in self._digests:
            if hmac.compare_digest(d, known):
                found = known
        return found

    def check_authorization(self, header: str | None) -> str | None:
        """None when ``header`` (an Authorization value) carries an accepted key, else why not."""
        key = bearer_token(header)
        if key is None:
            return MISSING
        return None if self.accepts(key) else INVALID


def bearer_token(header: str | None) -> str | None:
    """The key of ``Bearer KEY`` (scheme case-insensitive), or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def keys_from(flag_values: Iterable[str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """Keys from flags, else from ``$PDSERVE_API_KEY`` (comma-separated for several)."""
    keys = tuple(flag_values or ())
    if not keys and env.get(API_KEY_ENV):
        keys = tuple(k.strip() for k in env[API_KEY_ENV].split(",") if k.strip())
    return keys


def authorization_of(metadata) -> str | None:
    """The ``authorization`` value of gRPC invocation metadata (None: absent)."""
    return _metadata_value(metadata, "authorization")


def _metadata_value(metadata, name: str) -> str | None:
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # never reached: makes this an async generator, as streaming handlers are

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """grpc.aio server interceptor: every method but health needs an accepted key."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        why = self.keys.check_authorization(authorization_of(handler_call_details.invocation_metadata))
        return handler if why is None else _refusal(handler, why)
