"""The chart gives every node the cluster token (issue 49, "prefix fetch trusts the holder"):
the secrets hook generates it once, the supervisor passes ``--cluster-token-file`` and every
pod a node may run on mounts it at that path, so `pdserve nodes` may bind the pod's address
with TLS off (deploy/nodes.py ``bind_problem``) and fetches are signed; turned off with TLS
off, the rendered supervisor is one `pdserve nodes` refuses, by name."""
from __future__ import annotations

import argparse

from tests.test_helm_chart import containers, hook_args, one, pod_specs, render


def _supervisor_args(docs: list[dict]) -> argparse.Namespace:
    from deploy import nodes
    from deploy.cli import _add_engine_args

    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    args = next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"]
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    nodes.add_arguments(p)
    return p.parse_args(args)


def _template(a: argparse.Namespace):
    from deploy import nodes
    from deploy.cli import engine_config_from_args

    return nodes.template_from_args(a, engine_config_from_args(a), {})


def test_every_node_pod_mounts_the_token_the_supervisor_names_and_the_hook_makes():
    from deploy import k8s_secrets, nodes

    docs = render({"tls": {"enabled": False}})
    a = _supervisor_args(docs)
    assert a.cluster_token_file == "/etc/pdserve/cluster-token/token" and not a.insecure_bind
    assert nodes.bind_problem(_template(a)) == ""  # 0.0.0.0, TLS off, but a token: allowed
    for where, spec in pod_specs(docs):
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        mounts = {m["mountPath"] for c in containers(spec) for m in c.get("volumeMounts", [])}
        if where in ("head", "prefill", "decode"):  # where the supervisor and the node actors run
            assert secrets.get("pdserve-cluster-token") == "pd-pdserve-cluster-token", where
            assert "/etc/pdserve/cluster-token" in mounts, where
        else:  # the router, Redis and the hook have no use for it
            assert "pdserve-cluster-token" not in secrets, where
    h = hook_args(docs)
    assert h.cluster_token_secret == "pd-pdserve-cluster-token"
    (made,) = [w for w in k8s_secrets.wanted_from_args(h) if w.name == h.cluster_token_secret]
    token = made.make()["token"]
    assert len(token) >= 32 and made.make()["token"] != token  # random, made once by the hook


def test_an_operators_secret_is_mounted_and_never_generated():
    docs = render({"nodes": {"clusterToken": {"name": "ops-token", "key": "t"}}})
    rc = one(docs, "RayCluster")
    vols = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
    assert {"name": "pdserve-cluster-token", "secret": {"secretName": "ops-token", "defaultMode": 0o440}} in vols
    assert hook_args(docs).cluster_token_secret is None
    assert _supervisor_args(docs).cluster_token_file == "/etc/pdserve/cluster-token/t"


def test_without_token_or_tls_the_rendered_supervisor_is_refused_by_name():
    from deploy import nodes

    docs = render({"tls": {"enabled": False}, "nodes": {"clusterToken": {"enabled": False}}})
    a = _supervisor_args(docs)
    assert a.cluster_token_file is None
    assert "not loopback, with TLS off and no cluster token" in nodes.bind_problem(_template(a))
    assert not any(v.get("name") == "pdserve-cluster-token" for _, s in pod_specs(docs) for v in s.get("volumes", []))
    # TLS on (the default) is enough without the token.
    docs = render({"nodes": {"clusterToken": {"enabled": False}}})
    assert nodes.bind_problem(_template(_supervisor_args(docs))) == ""
