"""TLS on every gRPC hop, from PEM files.

    client --TLS (+ API key)--> router --mTLS--> prefill / decode node --mTLS--> decode node
                                                          (KV blocks)

Every cluster member (the router, each node) has one certificate, signed by the cluster's CA,
that it serves with and also presents as a client: a node's server asks every caller for a
certificate signed by that CA (``require_client_auth``), so only the router and other nodes can
place work or push KV. The router's client-facing port asks for one only when configured to.

Files are read when a server or channel is made, not when the config is built: a node config
crosses to a Ray worker on another machine, where the same paths are mounted (the Helm chart
mounts one Secret on every pod).

``server_name``: the name peers verify a member's certificate against instead of the host they
dial. Nodes register pod or machine IPs; a certificate made for a fixed name (say
``pdserve-cluster``) saves issuing one per IP.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


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


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"cannot read the TLS {what} {path!r}: {e.strerror}") from None


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
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file, "CA file"),
                                        private_key=_read(tls.key_file, "key file"),
                                        certificate_chain=_read(tls.cert_file, "certificate file"))


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
