"""The cluster token: one secret every node of a cluster shares (a file, mounted like the TLS
files), with which nodes authenticate each other on the prefix-fetch link when there is no TLS
(docs/security.md, "Prefix fetch").

A prefix fetch hands a peer the right to write KV that then serves every later request as
cached blocks, and KV bytes cannot be checked against their tokens; so both ends must prove
they belong to the cluster, and neither may give the secret away to a peer that does not::

    fetching node                                               holder
      nonce  = 16 random bytes
      its reservation admits push_token(nonce)
      PushPrefix(..., token=nonce)
        + metadata x-pdserve-cluster-mac = HMAC(T, request) -->  check: none UNAUTHENTICATED, another
                                                                 PERMISSION_DENIED (before it pins
                                                                 or dials anything)
                  <== KV pushes carrying push_token(nonce) ====  only a holder with T derives it

The token itself never crosses a socket: a caller without it cannot make a holder probe, pin
or dial; a holder without it (a stranger that got itself named) learns a nonce only, and its
pushes carry the wrong token, refused before a byte lands (kv_transfer/validate.py
``check_token``). What is left without TLS: someone who watches the traffic can replay a
request or reuse a derived token while its reservation lives, as with every plaintext hop.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from pathlib import Path

import grpc

# gRPC metadata key of a request's MAC (lower case, as gRPC wants).
MAC_METADATA_KEY = "x-pdserve-cluster-mac"
# A shorter token is refused by name: 32 hex characters are 128 bits.
MIN_TOKEN_CHARS = 32
# Bytes of a derived push token (the reservation tokens' size, kv_transfer/validate.py).
PUSH_TOKEN_BYTES = 16
# Domain separation: a MAC of one use is never valid for another.
_PUSH_LABEL = b"pdserve/cluster-token/push-token/v1\0"
_REQUEST_LABEL = b"pdserve/cluster-token/request/v1\0"


def generate_token() -> str:
    """A fresh token for a cluster's token file (64 hex characters)."""
    return secrets.token_hex(32)


class ClusterToken:
    """The shared secret; its repr hides it, and nothing here logs or returns it."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_TOKEN_CHARS:
            raise ValueError(f"a cluster token needs at least {MIN_TOKEN_CHARS} characters, got {len(secret)}")
        self._secret = bytes(secret)

    def __repr__(self) -> str:
        return "ClusterToken(<hidden>)"

    @classmethod
    def from_file(cls, path: str) -> ClusterToken:
        """The token in ``path`` (surrounding whitespace ignored). OSError or ValueError name the
        file and what is wrong with it, never its content."""
        try:
            text = Path(path).read_bytes().strip()
        except OSError as e:
            raise OSError(f"cannot read the cluster token file {path!r}: {e.strerror}") from None
        if len(text) < MIN_TOKEN_CHARS:
            raise ValueError(f"the cluster token file {path!r} holds {len(text)} characters; at least "
                             f"{MIN_TOKEN_CHARS} are needed (make one with: python -c "
                             "'import secrets; print(secrets.token_hex(32))')")
        return cls(text)

    def push_token(self, nonce: bytes) -> bytes:
        """The reservation token a holder must carry for a fetch that sent it ``nonce``."""
        return hmac.new(self._secret, _PUSH_LABEL + nonce, hashlib.sha256).digest()[:PUSH_TOKEN_BYTES]

    def mac(self, payload: bytes) -> str:
        return hmac.new(self._secret, _REQUEST_LABEL + payload, hashlib.sha256).hexdigest()

    def metadata(self, payload: bytes) -> tuple[tuple[str, str], ...]:
        """The call metadata that authenticates a request whose bytes are ``payload``."""
        return ((MAC_METADATA_KEY, self.mac(payload)),)

    def check(self, metadata: Iterable | None, payload: bytes) -> tuple[grpc.StatusCode, str] | None:
        """None when ``metadata`` (a call's invocation metadata) carries this token's MAC of
        ``payload``; else the status and message to refuse the call with."""
        given = None
        for item in metadata or ():
            key, value = item  # a (key, value) pair, or grpc's namedtuple of them
            if key == MAC_METADATA_KEY:
                given = value if isinstance(value, str) else value.decode("ascii", "replace")
        if not given:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"this node takes this call only from members of its cluster: send the cluster token's "
                    f"MAC in the {MAC_METADATA_KEY!r} metadata (the nodes' --cluster-token-file)")
        if not hmac.compare_digest(given.encode(), self.mac(payload).encode()):
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{MAC_METADATA_KEY}: not this cluster's token (or the request was changed on the way)")
        return None
