"""Security on real sockets (docs/security.md): API keys on the router's gRPC and HTTP routes,
TLS on every hop with mutual TLS between members (a tiny random model on real prefill and
decode node servers, a real Redis), the embedded Redis's password, and no secret in logs or
`pdserve status`."""
from __future__ import annotations

import json
import logging
import ssl
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

import pdserve
from kv_index.redis_url import redact
from node.config import NodeConfig
from router.config import RouterConfig
from security import tls as tls_
from security.api_keys import ApiKeys, bearer_token, keys_from
from security.ca import ThrowawayCA, private_dir
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, wait_for

API_KEY = "sk-right-" + uuid.uuid4().hex


# ------------------------------------------------------------------ pure parts
def test_api_keys_accept_only_configured_keys():
    keys = ApiKeys(["k1", "k2"])
    assert keys.accepts("k1") and keys.accepts("k2")
    assert not keys.accepts("k3") and not keys.accepts("") and not keys.accepts("k1 ")
    assert keys.check_authorization("Bearer k2") is None
    assert keys.check_authorization("bearer  k1 ") is None
    assert "no API key" in keys.check_authorization(None)
    assert "no API key" in keys.check_authorization("Basic k1")
    assert keys.check_authorization("Bearer nope") == "invalid API key"
    assert "k1" not in repr(keys)
    assert bearer_token("Bearer") is None
    with pytest.raises(ValueError):
        ApiKeys([])
    assert keys_from(None, {"PDSERVE_API_KEY": "a, b"}) == ("a", "b")
    assert keys_from(["x"], {"PDSERVE_API_KEY": "a"}) == ("x",)


def test_secrets_stay_out_of_reprs_and_shown_urls():
    assert redact("redis://:s3cr%2Ft@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    cfg = RouterConfig(redis_url="redis://:pw-secret@h:1/0", model_name="m", tokenizer_dir="d", max_model_len=8,
                       api_keys=("key-secret",))
    node = NodeConfig(node_id="n", role="decode", redis_url="redis://:pw-secret@h:1/0")
    for text in (repr(cfg), repr(node)):
        assert "secret" not in text


def test_tls_settings_are_checked_when_configured():
    with pytest.raises(ValueError, match="both a certificate file and its key"):
        NodeConfig(node_id="n", role="decode", redis_url="redis://h:1", tls_cert_file="c.pem")
    with pytest.raises(ValueError, match="mutual"):
        NodeConfig(node_id="n", role="decode", redis_url="redis://h:1", tls_cert_file="c", tls_key_file="k")
    with pytest.raises(ValueError, match="tls_client_auth needs tls_ca_file"):
        RouterConfig(redis_url="redis://h:1", model_name="m", tokenizer_dir="d", max_model_len=8,
                     tls_cert_file="c", tls_key_file="k", tls_client_auth=True)
    with pytest.raises(ValueError, match="tls_server_name"):
        tls_.tls_files(None, None, None, "name")


# ------------------------------------------------------------------ Redis
def test_embedded_redis_refuses_a_client_without_its_password(redis_server):
    assert redis_server.password and redis_server.password in redis_server.url
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_server.host, port=redis_server.port).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=redis_server.host, port=redis_server.port, password="wrong").ping()
    assert redis.Redis.from_url(redis_server.url).ping()


def test_status_never_shows_the_redis_password(redis_server, capsys):
    from deploy.cli import main

    ns = f"st-{uuid.uuid4().hex[:6]}"
    for extra in ([], ["--json"]):
        assert main(["status", "--redis-url", redis_server.url, "--namespace", ns, *extra]) == 0
        out = capsys.readouterr()
        assert redis_server.password not in out.out + out.err
        assert ":***@" in out.out
    bad = redis_server.url.replace(str(redis_server.port), "1")  # nothing listens: the error names the URL
    assert main(["status", "--redis-url", bad, "--namespace", ns]) == 2
    out = capsys.readouterr()
    assert "cannot read" in out.err and redis_server.password not in out.out + out.err


# ------------------------------------------------------------------ a TLS cluster with API keys
@pytest.fixture(scope="module")
def certs():
    import shutil

    ours, theirs = private_dir(), private_dir()
    member = ThrowawayCA(ours).issue("member")
    stranger = ThrowawayCA(theirs).issue("member")  # the same name, from another CA
    yield {"member": member, "stranger": stranger, "ca": member.ca_file}
    shutil.rmtree(ours)
    shutil.rmtree(theirs)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def secure(redis_server, certs, tiny_model, tok_dir):
    """A router (TLS, API key) over one prefill and one decode node (mutual TLS), every log
    record of the module captured at DEBUG."""
    root = logging.getLogger()
    capture, level = _Capture(), root.level
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    ns = f"sec-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=128)
    m = certs["member"]
    member = dict(tls_cert_file=m.cert_file, tls_key_file=m.key_file, tls_ca_file=m.ca_file)
    nodes = {role: start_node(role, f"{role}-0", eng, redis_url=redis_server.url, namespace=ns, lease_s=1.5,
                              heartbeat_s=0.2, grpc_workers=4, **member) for role in ("prefill", "decode")}
    router = start_router(redis_server.url, tok_dir, namespace=ns, max_model_len=256, http_port=0,
                          short_prompt_tokens=32, vocab_size=512, api_keys=(API_KEY,), **member)
    try:
        with client(router, api_key="") as c:  # health needs no key
            assert wait_for(c.health, timeout=20, every=0.1), "the router never saw its nodes"
        yield {"router": router, "nodes": nodes, "capture": capture}
    finally:
        router.stop()
        for s in nodes.values():
            s.stop()
        root.removeHandler(capture)
        root.setLevel(level)


def client(router, api_key: str | None, **tls) -> pdserve.Client:
    ca = tls.pop("ca", None) or router.config.tls_ca_file
    return pdserve.Client(router.address, tls=pdserve.TLS(root_certificates=ca, **tls), api_key=api_key,
                          retries=0, timeout=60)


PROMPT = [(i * 31) % 500 + 3 for i in range(80)]  # > short_prompt_tokens: prefill node, then KV over mTLS


def test_grpc_refuses_a_missing_or_wrong_key_and_serves_the_right_one(secure):
    router = secure["router"]
    for key, why in (("", "no API key"), ("sk-wrong", "invalid API key")):
        with client(router, api_key=key) as c:
            with pytest.raises(pdserve.AuthenticationError, match=why) as e:
                c.complete(token_ids=PROMPT, max_tokens=4)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(pdserve.AuthenticationError):
                c.models()
    prefills = secure["nodes"]["prefill"].num_prefills
    with client(router, api_key=API_KEY) as c:
        done = c.complete(token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
        assert len(done.token_ids) == 6 and done.finish_reason == "length"
        assert c.models() == [pdserve.ModelInfo("m", 256)]
    # TLS round trip on every hop: client -> router -> prefill node -> (KV) decode node -> router.
    assert secure["nodes"]["prefill"].num_prefills == prefills + 1
    assert secure["nodes"]["prefill"].num_transfer_failures == 0


def test_the_sdk_takes_its_key_from_the_environment(secure, monkeypatch):
    import asyncio

    monkeypatch.setenv("PDSERVE_API_KEY", API_KEY)
    with client(secure["router"], api_key=None) as c:
        assert c.models() == [pdserve.ModelInfo("m", 256)]

    async def models(key):
        tls = pdserve.TLS(root_certificates=secure["router"].config.tls_ca_file)
        async with pdserve.AsyncClient(secure["router"].address, tls=tls, api_key=key, retries=0) as c:
            return await c.models()

    assert asyncio.run(models(None)) == [pdserve.ModelInfo("m", 256)]
    with pytest.raises(pdserve.AuthenticationError):
        asyncio.run(models("sk-wrong"))


def test_client_certificates_when_the_router_asks_for_them(redis_server, certs):
    from engine.models.builtin import resolve_builtin

    m = certs["member"]
    router = start_router(redis_server.url, resolve_builtin("smollm2-135m"), namespace="ca-" + uuid.uuid4().hex,
                          max_model_len=64, http_port=0, tls_cert_file=m.cert_file, tls_key_file=m.key_file,
                          tls_ca_file=m.ca_file, tls_client_auth=True)
    try:
        with client(router, api_key="", certificate_chain=m.cert_file, private_key=m.key_file) as c:
            assert c.models() == [pdserve.ModelInfo("m", 64)]
        with client(router, api_key="") as c:  # no client certificate
            with pytest.raises(pdserve.UnavailableError):
                c.models()
        ctx = ssl.create_default_context(cafile=m.ca_file)
        ctx.load_cert_chain(m.cert_file, m.key_file)
        with urllib.request.urlopen(f"https://{router.http_address}/health", timeout=10, context=ctx) as r:
            assert r.status == 200
        with pytest.raises(OSError):  # HTTPS without a client certificate
            urllib.request.urlopen(f"https://{router.http_address}/health", timeout=10,
                                   context=ssl.create_default_context(cafile=m.ca_file))
    finally:
        router.stop()


def test_a_plaintext_client_or_an_untrusted_router_certificate_gets_nowhere(secure, certs):
    router = secure["router"]
    with grpc.insecure_channel(router.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with client(router, api_key=API_KEY, ca=certs["stranger"].ca_file) as c:  # trusts another CA
        with pytest.raises(pdserve.UnavailableError):
            c.models()


def _health(address: str, tls: tls_.TlsFiles | None) -> grpc.StatusCode | int:
    with tls_.channel(address, tls, []) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code()


def test_nodes_admit_only_peers_with_a_cluster_certificate(secure, certs):
    member, stranger = certs["member"], certs["stranger"]
    for node in secure["nodes"].values():
        assert _health(node.address, member) == health_pb2.HealthCheckResponse.SERVING
        assert _health(node.address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert _health(node.address, tls_.TlsFiles(ca_file=member.ca_file)) == grpc.StatusCode.UNAVAILABLE  # no cert
        # A certificate from another CA, which trusts ours for the server side: refused by the node.
        foreign = tls_.TlsFiles(stranger.cert_file, stranger.key_file, member.ca_file)
        assert _health(node.address, foreign) == grpc.StatusCode.UNAVAILABLE


def _http(router, path: str, key: str | None, body: dict | None = None) -> tuple[int, dict, dict]:
    ctx = ssl.create_default_context(cafile=router.config.tls_ca_file)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"https://{router.http_address}{path}", headers=headers,
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def test_https_refuses_a_missing_or_wrong_key_in_openai_shape(secure):
    router = secure["router"]
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for key, code in ((None, None), ("sk-wrong", "invalid_api_key")):
        for path, body in (("/v1/models", None), ("/v1/chat/completions", chat)):
            status, headers, out = _http(router, path, key, body)
            assert status == 401 and headers.get("www-authenticate") == "Bearer"
            assert set(out["error"]) == {"message", "type", "param", "code"}
            assert out["error"]["type"] == "invalid_request_error" and out["error"]["code"] == code
    status, _, out = _http(router, "/v1/models", API_KEY)
    assert status == 200 and out["data"][0]["id"] == "m"
    assert _http(router, "/health", None)[0] == 200  # probes need no key
    with pytest.raises(OSError):  # plain HTTP to the HTTPS port: the connection is dropped
        urllib.request.urlopen(f"http://{router.http_address}/health", timeout=10)


def test_no_secret_in_the_logs(secure, redis_server):
    with client(secure["router"], api_key="sk-wrong-" + API_KEY) as c:  # a wrong key that contains the right one
        with pytest.raises(pdserve.AuthenticationError) as e:
            c.models()
    assert API_KEY not in str(e.value)
    text = "\n".join(secure["capture"].lines)
    assert secure["capture"].lines, "nothing was captured: the check would prove nothing"
    assert API_KEY not in text and redis_server.password not in text
