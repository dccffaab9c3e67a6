"""Node and client identities under one CA (issue 49): the router's API clients and the cluster's
members trust the same CA, so a certificate's signature alone would let a client certificate
call nodes directly, past the router's API keys. Real mutual TLS on loopback: a real decode node
(tiny model) refuses a client certificate of its own CA on every kind of call and serves a
member's; the router asking for client certificates admits the client's. Plus the certificates
the CA writes and the date checks on certificate files, as plain data."""
from __future__ import annotations

import datetime
import logging
import shutil
import uuid

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import kv_pb2, kv_pb2_grpc
from security import tls as tls_
from security.ca import ThrowawayCA, private_dir
from tests.clusters import start_node, start_router
from tests.helpers import engine_config


@pytest.fixture(scope="module")
def ca():
    directory = private_dir()
    authority = ThrowawayCA(directory)
    yield {"member": authority.issue("member"), "client": authority.issue_client("client"), "ca": authority}
    shutil.rmtree(directory)


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_a_client_certificate_cannot_call_a_node_a_members_can(ca, redis_server, tiny_model, tok_dir):
    member, client = ca["member"], ca["client"]
    ns = f"ident-{uuid.uuid4().hex[:6]}"
    files = dict(tls_cert_file=member.cert_file, tls_key_file=member.key_file, tls_ca_file=member.ca_file)
    node = start_node("decode", "decode-0", engine_config(tiny_model, num_blocks=16), redis_url=redis_server.url,
                      namespace=ns, grpc_workers=4, **files)
    try:
        with tls_.channel(node.address, member, []) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            kv = kv_pb2_grpc.KVTransferStub(ch)
            reserve = kv.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                request_id="r-member", model_fingerprint=node.engine.fingerprint, block_size=node.engine.block_size,
                prompt_token_ids=list(range(3, 23)),
                num_tokens=20), timeout=10)
            assert reserve.token and reserve.block_ids  # a member placed work: the node reserved blocks
            kv.ReleaseReservation(kv_pb2.ReleaseReservationRequest(request_id="r-member"), timeout=10)
        with tls_.channel(node.address, client, []) as ch:
            kv = kv_pb2_grpc.KVTransferStub(ch)
            calls = {
                "health": lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10),
                "reserve": lambda: kv.ReserveBlocks(kv_pb2.ReserveBlocksRequest(
                    request_id="r-client", model_fingerprint=node.engine.fingerprint,
                    block_size=node.engine.block_size, num_tokens=20), timeout=10),
                "push (client stream)": lambda: kv.PushBlocks(iter([kv_pb2.KVBlockMessage()]), timeout=10),
                "decode (server stream)": lambda: list(kv_pb2_grpc.DecodeNodeStub(ch).Decode(
                    kv_pb2.DecodeRequest(request_id="r-client"), timeout=10)),
            }
            for what, call in calls.items():
                try:
                    call()
                    raise AssertionError(f"{what}: a client certificate was served by a node")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (what, e.code(), e.details())
                    assert tls_.MEMBER_URI in e.details() and "router" in e.details()
    finally:
        node.stop()

    # The router, asking its clients for a certificate from the same CA, admits the client's.
    router = start_router(redis_server.url, tok_dir, namespace=ns, max_model_len=64, tls_client_auth=True, **files)
    try:
        with tls_.channel(router.address, client, []) as ch:
            assert _code(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                                       timeout=10)) == grpc.StatusCode.OK
    finally:
        router.stop()


def _uris(cert: x509.Certificate) -> set[str]:
    return set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
               .get_values_for_type(x509.UniformResourceIdentifier))


def test_the_ca_writes_each_kind_into_its_certificates(ca):
    member = x509.load_pem_x509_certificate(open(ca["member"].cert_file, "rb").read())
    client = x509.load_pem_x509_certificate(open(ca["client"].cert_file, "rb").read())
    assert _uris(member) == {tls_.MEMBER_URI} and _uris(client) == {tls_.CLIENT_URI}
    usages = {c: set(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) for c in (member, client)}
    assert usages[member] == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert usages[client] == {ExtendedKeyUsageOID.CLIENT_AUTH}  # it can never serve as a member
    client_names = client.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert not client_names.get_values_for_type(x509.DNSName) and not client_names.get_values_for_type(x509.IPAddress)
    assert tls_.certificate_uris(open(ca["member"].cert_file, "rb").read()) == frozenset({tls_.MEMBER_URI})


def test_certificate_dates_are_checked_when_files_are_read(ca, caplog):
    pem = open(ca["member"].cert_file, "rb").read()
    end = ca["ca"].not_after
    tls_.check_dates(pem, "member.pem", now=end - datetime.timedelta(days=20))  # fresh: silent
    with caplog.at_level(logging.WARNING, logger="security.tls"):
        tls_.check_dates(pem, "member.pem", now=end - datetime.timedelta(days=3))
        tls_.check_dates(pem, "member.pem", now=end - datetime.timedelta(days=2))  # warned once per file
    assert len(caplog.records) == 1 and "expires on" in caplog.text and "member.pem" in caplog.text
    with pytest.raises(ValueError, match=r"member\.pem.*expired on"):
        tls_.check_dates(pem, "member.pem", now=end + datetime.timedelta(minutes=1))
    with pytest.raises(ValueError, match="not valid before"):
        tls_.check_dates(pem, "member.pem", now=end - datetime.timedelta(days=60))
    # Real files: a server refuses to start on an expired certificate, naming it; a channel (made
    # on a request's path) logs it once and lets the handshake fail as it would.
    directory = private_dir()
    try:
        past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3)
        expired = ThrowawayCA(directory, valid_days=1, now=past).issue("old")
        with pytest.raises(ValueError, match=r"old\.pem.*expired on"):
            tls_.server_credentials(expired, require_client_auth=True)
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="security.tls"):
            tls_.channel_credentials(expired)
            tls_.channel_credentials(expired)
        assert [r.levelno for r in caplog.records] == [logging.ERROR] * 2  # the CA file and the certificate
        assert "expired on" in caplog.text
    finally:
        shutil.rmtree(directory)
    # A CA bundle with one valid root among expired ones passes; none valid is refused.
    bundle = pem + open(ca["member"].ca_file, "rb").read()
    tls_.check_dates(bundle, "bundle.pem", now=end - datetime.timedelta(days=1), bundle=True)
    with pytest.raises(ValueError, match="no certificate in the TLS CA file"):
        tls_.check_dates(bundle, "bundle.pem", now=end + datetime.timedelta(days=1), bundle=True)
