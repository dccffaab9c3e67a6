"""The chart's certificates carry the member and client identities (issue 49): cert-manager's
member Certificate names the member URI and, with tls.clientAuth, a client Certificate from the
same CA names the client URI with the client usage only; the secrets hook's generated bundle
holds both kinds. The bundle's real bytes against a real mutual-TLS gRPC server guarded as a
node's is (security/tls.py members_only): the member certificate is served, the client's refused."""
from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from security import tls as tls_
from tests.test_helm_chart import one, render


def _certificates(values: dict) -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"] for d in render(values) if d["kind"] == "Certificate"}


def test_cert_manager_writes_each_identity():
    certs = _certificates({"tls": {"provider": "certManager"}})
    assert certs["pd-pdserve-tls"]["uris"] == [tls_.MEMBER_URI] and "pd-pdserve-tls-client" not in certs
    certs = _certificates({"tls": {"provider": "certManager", "clientAuth": True}})
    member, client = certs["pd-pdserve-tls"], certs["pd-pdserve-tls-client"]
    assert client["uris"] == [tls_.CLIENT_URI] and client["issuerRef"] == member["issuerRef"]
    assert "server auth" not in client["usages"] and "client auth" in client["usages"]
    assert not client.get("dnsNames") and not client.get("ipAddresses")  # it can serve as nobody
    assert client["secretName"] == "pd-pdserve-tls-client" and client["duration"] == member["duration"]
    # Pods mount the members' Secret only: the client's is for clients.
    rc = one(render({"tls": {"provider": "certManager", "clientAuth": True}}), "RayCluster")
    vols = [v for v in rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert "pd-pdserve-tls-client" not in {v["secret"]["secretName"] for v in vols}


def test_the_hooks_bundle_holds_a_member_and_a_client_certificate(tmp_path):
    from deploy.k8s_secrets import tls_bundle

    bundle = tls_bundle(["pdserve-cluster"], days=30)
    for key, data in bundle.items():
        (tmp_path / key).write_bytes(data)
    assert tls_.certificate_uris(bundle["tls.crt"]) == {tls_.MEMBER_URI}
    assert tls_.certificate_uris(bundle["client.crt"]) == {tls_.CLIENT_URI}
    member = tls_.TlsFiles(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), str(tmp_path / "ca.crt"),
                           server_name="pdserve-cluster")
    client = tls_.TlsFiles(str(tmp_path / "client.crt"), str(tmp_path / "client.key"), str(tmp_path / "ca.crt"),
                           server_name="pdserve-cluster")

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=tls_.members_only(member))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = tls_.add_port(server, "127.0.0.1:0", member, require_client_auth=True)
    server.start()
    try:
        def check(files: tls_.TlsFiles) -> grpc.StatusCode:
            with tls_.channel(f"127.0.0.1:{port}", files, []) as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                except grpc.RpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

        assert check(member) == grpc.StatusCode.OK
        assert check(client) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(None)
