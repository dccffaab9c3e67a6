"""A throwaway CA for a cluster on one machine (``pdserve up --tls``), for the Helm chart's
generated certificates (deploy/k8s_secrets.py, valid ``valid_days``) and for tests.

    ThrowawayCA(dir)  ->  dir/ca.pem            the CA certificate (give it to clients)
      .issue(name)        dir/name.pem, .key    a member's certificate (the router, the nodes):
                                                serverAuth + clientAuth, for localhost,
                                                127.0.0.1, ::1 and MEMBER_NAME, and the URI
                                                MEMBER_URI that nodes admit callers by
      .issue_client(name) dir/name.pem, .key    an API client's certificate, for a router that
                                                asks for one (tls_client_auth): clientAuth only,
                                                no host name, the URI CLIENT_URI; nodes refuse it

Two kinds because the router's clients and the cluster's members trust the same CA: a member
certificate handed to a client would let it call nodes directly, past the router's API keys
and limits (security/tls.py, ``MembersOnlyInterceptor``). A client certificate names no host, so
it cannot serve as a node to the router either.

The CA's key lives only in memory and dies with the object: nothing more can be signed once the
cluster is up. Certificates expire with the CA, ``valid_days`` after it was made; `pdserve up`
makes new ones at every start. Private keys are written 0600 in a directory made 0700
(``private_dir``).
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from security.tls import CLIENT_URI, MEMBER_URI, TlsFiles

# The name every member's certificate carries besides its loopback addresses: a peer dialling
# an address the certificate does not name verifies against this (``TlsFiles.server_name``).
MEMBER_NAME = "pdserve-cluster"
VALID_DAYS = 30


def private_dir(prefix: str = "pdserve-tls-") -> Path:
    """A fresh temporary directory only this user can read (mkdtemp makes it 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


class ThrowawayCA:
    def __init__(self, directory: Path, common_name: str = "pdserve throwaway CA", valid_days: int = VALID_DAYS,
                 now: datetime.datetime | None = None) -> None:
        """``now``: when validity starts (default: now; tests back-date to make expired files)."""
        self.dir = Path(directory)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = now or datetime.datetime.now(datetime.timezone.utc)
        self._not_before = now - datetime.timedelta(minutes=5)  # tolerate a little clock skew
        self._not_after = now + datetime.timedelta(days=valid_days)
        self.cert = (x509.CertificateBuilder()
                     .subject_name(_name(common_name)).issuer_name(_name(common_name))
                     .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(self._not_before).not_valid_after(self._not_after)
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                  content_commitment=False, key_encipherment=False,
                                                  data_encipherment=False, key_agreement=False,
                                                  encipher_only=False, decipher_only=False), critical=True)
                     .sign(self._key, hashes.SHA256()))
        self.ca_file = self.dir / "ca.pem"
        self.ca_file.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    @property
    def not_after(self):
        """When the CA and every certificate it issued expire (UTC)."""
        return self._not_after

    def issue(self, name: str, hosts: tuple[str, ...] = ("localhost", "127.0.0.1", "::1", MEMBER_NAME)) -> TlsFiles:
        """A member's certificate for ``hosts`` (DNS names or IP addresses), good for serving
        and for presenting as a client; files ``name.pem`` and ``name.key``."""
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        sans.append(x509.UniformResourceIdentifier(MEMBER_URI))
        return self._write(name, sans, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])

    def issue_client(self, name: str = "client") -> TlsFiles:
        """An API client's certificate: the router admits it where it asks clients for one,
        nodes refuse it. Files ``name.pem`` and ``name.key``."""
        return self._write(name, [x509.UniformResourceIdentifier(CLIENT_URI)], [ExtendedKeyUsageOID.CLIENT_AUTH])

    def _write(self, name: str, sans: list[x509.GeneralName], usages: list) -> TlsFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(_name(name)).issuer_name(self.cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(self._not_before).not_valid_after(self._not_after)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
                .sign(self._key, hashes.SHA256()))
        cert_file, key_file = self.dir / f"{name}.pem", self.dir / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_file, key)
        return TlsFiles(cert_file=str(cert_file), key_file=str(key_file), ca_file=str(self.ca_file))
