"""`pdserve up --tls --api-key` as a user runs it: the embedded cluster (password-protected
Redis, Ray node actors that read their certificates in their own processes, the router) on
SmolLM2-135M, then `pdserve generate` and `pdserve status` from the command line."""
from __future__ import annotations

import json
import os
import ssl
import stat
import urllib.request
from pathlib import Path

import pytest

import pdserve

KEY = "sk-cluster-test-key"
pytestmark = [pytest.mark.e2e, pytest.mark.local_cluster(prefill_nodes=1, decode_nodes=1, short_prompt_tokens=16,
                                                          tls=True, api_keys=(KEY,))]
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow, one per line, nothing else."}]


def test_a_tls_cluster_serves_only_clients_with_the_key(local_cluster):
    tls = pdserve.TLS(root_certificates=local_cluster.tls.ca_file)
    with pdserve.Client(local_cluster.address, tls=tls, api_key=KEY, timeout=120, retries=0) as c:
        done = c.complete(PROMPT, max_tokens=24, temperature=0.0)
    assert done.text.strip() and done.timings.prefill_s > 0  # disaggregated: prefill -> KV (mTLS) -> decode
    with pdserve.Client(local_cluster.address, tls=tls, api_key="", retries=0) as c:
        with pytest.raises(pdserve.AuthenticationError):
            c.complete(PROMPT, max_tokens=4)
    ctx = ssl.create_default_context(cafile=local_cluster.tls.ca_file)
    with urllib.request.urlopen(f"https://{local_cluster.http_address}/health", timeout=30, context=ctx) as r:
        assert r.status == 200
    assert stat.S_IMODE(os.stat(Path(local_cluster.tls.key_file).parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(local_cluster.tls.key_file).st_mode) == 0o600


def test_the_cli_finds_the_ca_and_status_shows_no_secret(local_cluster, capsys, monkeypatch):
    from deploy.cli import main
    from deploy.launcher import state_file

    local_cluster._write_state()  # this cluster's, should another test's cluster have written since
    assert stat.S_IMODE(os.stat(state_file()).st_mode) == 0o600  # it holds the Redis URL with its password
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert main(["generate", "--url", local_cluster.address, "Say hi.", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["status", "--json"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    password = local_cluster.redis.password
    assert password not in out.out + out.err and report["cluster"]["redis_url"].startswith("redis://:***@")
    assert report["router"] is not None and "error" not in report["router"]  # /metrics over HTTPS, our CA
    assert {r["node_id"] for rows in report["pools"].values() for r in rows} == {"prefill-0", "decode-0"}
