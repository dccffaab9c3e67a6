"""TLS on every gRPC hop, from PEM files.

    client --TLS (+ API key)--> router --mTLS--> prefill / decode node --mTLS--> decode node
                                                          (KV blocks)

Every cluster member (the router, each node) has one certificate, signed by the cluster's CA,
that it serves with and also presents as a client: a node's server asks every caller for a
certificate signed by that CA (``require_client_auth``). The router's client-facing port asks for
one only when configured to (``tls_client_auth``), and the same CA signs those clients'
certificates. So a certificate's signature says "the cluster's CA issued it", not "a member":
the CA writes the holder's kind into every certificate as a URI subject alternative name
(``MEMBER_URI``, ``CLIENT_URI``; security/ca.py, the chart's cert-manager Certificates), and a
node serves only callers whose certificate names ``MEMBER_URI`` (``MembersOnlyInterceptor``): an
API client's certificate reaches the router and nothing behind it, whatever the network allows.

Certificates are checked for their dates when read: an expired one (or one not yet valid)
refuses a server's start by name (``server_credentials``) rather than failing every handshake
later, and is logged once by name where a channel is made (``channel_credentials``, on a
request's path, where the handshake then fails as it would); one in the last third of its life
logs a warning once.

Files are read when a server or channel is made, not when the config is built: a node config
crosses to a Ray worker on another machine, where the same paths are mounted (the Helm chart
mounts one Secret on every pod).

``server_name``: the name peers verify a member's certificate against instead of the host they
dial. Nodes register pod or machine IPs; a certificate made for a fixed name (say
``pdserve-cluster``) saves issuing one per IP.
"""
from __future__ import annotations

import datetime
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

log = logging.getLogger(__name__)

# The kinds of holder the cluster's CA writes into certificates, as URI subject alternative
# names. Members (the router, the nodes) serve and call nodes; clients call only the router.
MEMBER_URI = "urn:pdserve:member"
CLIENT_URI = "urn:pdserve:client"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_file: str | None = None  # this member's certificate chain (PEM)
    key_file: str | None = None  # its private key (PEM)
    ca_file: str | None = None  # the CA that signs the cluster's members (PEM)
    server_name: str | None = None  # verify peers' certificates against this name, not their host

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS needs both a certificate file and its key file (or neither)")
        if self.cert_file is None and self.ca_file is None:
            raise ValueError("TLS needs a certificate and key, a CA file, or both")

    @property
    def mutual(self) -> bool:
        """Whether this member can both prove who it is and check who its peers are."""
        return self.cert_file is not None and self.ca_file is not None


def tls_files(cert_file: str | None, key_file: str | None, ca_file: str | None,
              server_name: str | None = None) -> TlsFiles | None:
    """The TLS settings of a config's flat fields; None when none is set (plaintext)."""
    if cert_file is None and key_file is None and ca_file is None:
        if server_name is not None:
            raise ValueError("tls_server_name is set but no TLS file is")
        return None
    return TlsFiles(cert_file, key_file, ca_file, server_name)


def _read(path: str | None, what: str, refuse: bool = True) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"cannot read the TLS {what} {path!r}: {e.strerror}") from None
    if what != "key file":
        check_dates(data, path, bundle=what == "CA file", refuse=refuse)
    return data


_warned: set[tuple[str, object]] = set()  # (file, expiry or problem) already logged


def check_dates(pem: bytes, path: str, now: datetime.datetime | None = None, *, bundle: bool = False,
                refuse: bool = True) -> None:
    """Refuse certificates that are expired or not yet valid, naming ``path`` and the date, and
    warn once per file and date about one in the last third of its life (where cert-manager
    renews): an expired certificate would fail every handshake, on every hop, with nothing in
    the error saying why. ``bundle`` (a CA file, which may hold several roots): refused only
    when none of them is valid now, warned about only when it holds one. ``refuse=False`` (a
    channel, made on a request's path): the refusal is logged once instead, and the handshake
    fails as it would."""
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError:
        return  # not PEM we can read: gRPC's own parser names the file's problem
    now = now or datetime.datetime.now(datetime.timezone.utc)
    problem = None
    if bundle and len(certs) > 1:
        if not any(c.not_valid_before_utc <= now <= c.not_valid_after_utc for c in certs):
            problem = f"no certificate in the TLS CA file {path!r} is valid now: issue a new CA"
        certs = []  # several roots: none is warned about
    for cert in certs:
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        who = cert.subject.rfc4514_string() or "(no subject)"
        if now > end:
            problem = f"the TLS certificate {who} in {path!r} expired on {end:%Y-%m-%d %H:%M} UTC: issue a new one"
        elif now < start:
            problem = (f"the TLS certificate {who} in {path!r} is not valid before {start:%Y-%m-%d %H:%M} UTC: "
                       "is this machine's clock right?")
        if problem:
            break
        if now > end - (end - start) / 3 and (path, end) not in _warned:
            _warned.add((path, end))
            log.warning("the TLS certificate %s in %r expires on %s UTC (%d days left): renew it before then "
                        "(docs/security.md, 'Certificate lifetime')", who, path, f"{end:%Y-%m-%d %H:%M}",
                        (end - now).days)
    if problem is None:
        return
    problem += " (docs/security.md, 'Certificate lifetime')"
    if refuse:
        raise ValueError(problem)
    if (path, problem) not in _warned:
        _warned.add((path, problem))
        log.error("%s", problem)


def server_credentials(tls: TlsFiles, *, require_client_auth: bool) -> grpc.ServerCredentials:
    """A server's credentials; ``require_client_auth``: only callers with a certificate signed
    by ``tls.ca_file`` get through the handshake."""
    if tls.cert_file is None:
        raise ValueError("a TLS server needs a certificate and key file")
    if require_client_auth and tls.ca_file is None:
        raise ValueError("checking client certificates needs a CA file")
    pair = (_read(tls.key_file, "key file"), _read(tls.cert_file, "certificate file"))
    return grpc.ssl_server_credentials([pair], root_certificates=_read(tls.ca_file, "CA file"),
                                       require_client_auth=require_client_auth)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """A client's credentials: trust ``ca_file`` (None: the system's CAs) and present this
    member's certificate when it has one (mutual TLS)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "CA file", refuse=False),
                                        private_key=_read(tls.key_file, "key file"),
                                        certificate_chain=_read(tls.cert_file, "certificate file", refuse=False))


@functools.lru_cache(maxsize=256)
def certificate_uris(pem: bytes) -> frozenset[str]:
    """The URI subject alternative names of the (first) certificate in ``pem``."""
    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return frozenset()
    return frozenset(san.get_values_for_type(x509.UniformResourceIdentifier))


def refuse_non_members(context: grpc.ServicerContext, method: str) -> None:
    """Abort the call unless the peer's certificate names ``MEMBER_URI``. The handshake already
    checked that the cluster's CA signed it; this checks what the CA said it is for."""
    pem = context.auth_context().get("x509_pem_cert")
    if not pem:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: only cluster members may call a node, "
                      "with a certificate from the cluster's CA")
    if MEMBER_URI not in certificate_uris(pem[0]):
        context.abort(grpc.StatusCode.PERMISSION_DENIED,
                      f"{method}: only cluster members may call a node: this certificate is signed by the "
                      f"cluster's CA but does not name {MEMBER_URI} (a URI subject alternative name); a "
                      "client certificate is for the router")


class MembersOnlyInterceptor(grpc.ServerInterceptor):
    """Every method of a (sync) gRPC server served only to members (``refuse_non_members``),
    before anything else looks at the request: health, reflection and the node's services
    alike, since a client that reaches a node's port skips the router's API keys and limits."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def guard(inner):
            def call(request, context):
                refuse_non_members(context, method)
                return inner(request, context)
            return call

        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(guard(handler.unary_unary), des, ser)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(guard(handler.unary_stream), des, ser)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(guard(handler.stream_unary), des, ser)
        return grpc.stream_stream_rpc_method_handler(guard(handler.stream_stream), des, ser)


def members_only(tls: TlsFiles | None) -> tuple[grpc.ServerInterceptor, ...]:
    """The interceptors a node's server puts first: none without TLS (then nothing identifies a
    caller; the reservation and cluster tokens guard what they guard)."""
    return (MembersOnlyInterceptor(),) if tls is not None else ()


def channel_options(tls: TlsFiles | None, options: list[tuple[str, object]]) -> list[tuple[str, object]]:
    if tls is not None and tls.server_name:
        return [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return list(options)


def channel(address: str, tls: TlsFiles | None, options: list[tuple[str, object]]) -> grpc.Channel:
    """A blocking channel to ``address``: TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(tls), options=channel_options(tls, options))


def aio_channel(address: str, tls: TlsFiles | None, options: list[tuple[str, object]]) -> grpc.aio.Channel:
    """``channel`` for grpc.aio."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=channel_options(tls, options))


def add_port(server, address: str, tls: TlsFiles | None, *, require_client_auth: bool) -> int:
    """Bind ``address`` on a grpc or grpc.aio server, over TLS when ``tls`` is set; returns the
    port (0: could not bind)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, server_credentials(tls, require_client_auth=require_client_auth))


def uvicorn_ssl(tls: TlsFiles | None, *, require_client_auth: bool) -> dict:
    """uvicorn.Config keywords for HTTPS with the same files ({} without TLS)."""
    if tls is None or tls.cert_file is None:
        return {}
    import ssl

    out: dict = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if require_client_auth:
        out.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return out
