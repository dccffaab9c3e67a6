"""The Helm chart's secrets hook (helm/pdserve/templates/secrets-hook.yaml): before install and
before every upgrade, create the release's generated Secrets, each only if it does not exist:

    --redis-password-secret NAME   key `password`: the built-in Redis's password
    --api-key-secret NAME          key `--api-key-key`: one API key clients send
    --cluster-token-secret NAME    key `token`: the secret nodes sign prefix fetches with
    --tls-secret NAME              `tls.crt`, `tls.key`, `ca.crt`: a CA and the one member
                                   certificate (serverAuth + clientAuth, the `--tls-name`s and
                                   loopback), valid `--tls-days` (security/ca.py); `client.crt`,
                                   `client.key`: a client certificate for the router's clients
                                   (tls.clientAuth), which nodes refuse

Why a hook rather than the chart's templates: Helm's random functions give a new value on every
render and `lookup` is empty under `helm template` (and the GitOps tools that render that way),
so a Secret the chart rendered would change with every render. A Secret made here is never
written again: it is kept across upgrades and renders, and only an operator deletes it
(docs/deploy.md). An operator's own Secret is never named here: the chart passes only the ones
it generates.

It talks to the Kubernetes API with the standard library, from the pod's service-account token
and CA, so the node image needs nothing more. Values are never printed; only each Secret's name
and whether it was created or kept.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import ssl
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Labelled so an operator finds what the hook made: `kubectl get secret -l pdserve.io/generated`.
GENERATED_LABEL = "pdserve.io/generated"
TIMEOUT_S = 10.0  # per API call: the Job's own deadline bounds the whole run


class Wanted(NamedTuple):
    """A Secret to have: its name and how to make its data (called only when it is absent)."""

    name: str
    make: Callable[[], dict[str, bytes]]


def redis_password() -> dict[str, bytes]:
    # Alphanumeric: it passes through redis.conf (requirepass "..."), env and URLs unquoted.
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return {"password": "".join(secrets.choice(alphabet) for _ in range(32)).encode()}


def cluster_token() -> dict[str, bytes]:
    # 64 url-safe characters: past security/cluster_token.py's 32-character floor.
    return {"token": secrets.token_urlsafe(48).encode()}


def api_key(key: str) -> dict[str, bytes]:
    return {key: f"pdk-{secrets.token_urlsafe(32)}".encode()}


def tls_bundle(names: Sequence[str], days: int, common_name: str = "pdserve release CA") -> dict[str, bytes]:
    """A fresh CA and one member certificate for ``names`` and loopback, as a kubernetes.io/tls
    Secret's data plus ``ca.crt``, and a client certificate (``client.crt``, ``client.key``):
    made now or never, since the CA's key dies with this call."""
    from security.ca import ThrowawayCA, private_dir

    directory = private_dir("pdserve-k8s-tls-")
    try:
        ca = ThrowawayCA(directory, common_name, valid_days=days)
        member, client = ca.issue("member", hosts=(*names, "127.0.0.1", "::1")), ca.issue_client("client")
        return {"tls.crt": Path(member.cert_file).read_bytes(), "tls.key": Path(member.key_file).read_bytes(),
                "ca.crt": Path(member.ca_file).read_bytes(), "client.crt": Path(client.cert_file).read_bytes(),
                "client.key": Path(client.key_file).read_bytes()}
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def wanted_from_args(args: argparse.Namespace) -> list[Wanted]:
    out = []
    if args.redis_password_secret:
        out.append(Wanted(args.redis_password_secret, redis_password))
    if args.api_key_secret:
        out.append(Wanted(args.api_key_secret, lambda: api_key(args.api_key_key)))
    if args.cluster_token_secret:
        out.append(Wanted(args.cluster_token_secret, cluster_token))
    if args.tls_secret:
        if not args.tls_name:
            raise SystemExit("--tls-secret needs at least one --tls-name")
        out.append(Wanted(args.tls_secret, lambda: tls_bundle(args.tls_name, args.tls_days)))
    return out


class KubeApi:
    """The two Secret calls this hook makes, over HTTPS to the API server."""

    def __init__(self, base_url: str, namespace: str, token: str, context: ssl.SSLContext | None = None) -> None:
        self._url = f"{base_url.rstrip('/')}/api/v1/namespaces/{namespace}/secrets"
        self._headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        self._context = context
        self.namespace = namespace

    @classmethod
    def in_cluster(cls, account: Path = SERVICE_ACCOUNT, environ: Mapping[str, str] = os.environ) -> KubeApi:
        host, port = environ["KUBERNETES_SERVICE_HOST"], environ.get("KUBERNETES_SERVICE_PORT", "443")
        host = f"[{host}]" if ":" in host else host
        context = ssl.create_default_context(cafile=str(account / "ca.crt"))
        return cls(f"https://{host}:{port}", (account / "namespace").read_text().strip(),
                   (account / "token").read_text().strip(), context)

    def exists(self, name: str) -> bool:
        try:
            self._call(urllib.request.Request(f"{self._url}/{name}", headers=self._headers))
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return False
            raise
        return True

    def create(self, name: str, data: Mapping[str, bytes], labels: Mapping[str, str]) -> bool:
        """True when created; False when another writer created it first (409)."""
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": self.namespace, "labels": dict(labels)},
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
        request = urllib.request.Request(self._url, data=json.dumps(body).encode(), method="POST",
                                         headers={**self._headers, "Content-Type": "application/json"})
        try:
            self._call(request)
        except urllib.error.HTTPError as err:
            if err.code == 409:
                return False
            raise
        return True

    def _call(self, request: urllib.request.Request) -> None:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=self._context) as resp:
            resp.read()


def ensure(api: KubeApi, wanted: Sequence[Wanted], labels: Mapping[str, str]) -> dict[str, str]:
    """Create each wanted Secret that does not exist -> {name: "created" | "kept"}. An existing
    Secret is never read nor written, and its value is never generated."""
    labels = {**labels, GENERATED_LABEL: "true"}
    done = {}
    for w in wanted:
        # A 409 on create: another writer (a concurrent install) made it in between; theirs stays.
        created = not api.exists(w.name) and api.create(w.name, w.make(), labels)
        done[w.name] = "created" if created else "kept"
    return done


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.k8s_secrets", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-password-secret", help="Secret for the built-in Redis's password (key `password`)")
    p.add_argument("--api-key-secret", help="Secret for one generated API key")
    p.add_argument("--api-key-key", default="api-key", help="key of the API key in that Secret")
    p.add_argument("--cluster-token-secret", help="Secret for the nodes' cluster token (key `token`)")
    p.add_argument("--tls-secret", help="Secret for a generated CA and member certificate")
    p.add_argument("--tls-name", action="append", default=[], help="a DNS name of the certificate (repeatable)")
    p.add_argument("--tls-days", type=int, default=365, help="days the certificate and its CA are valid")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="label of created Secrets")
    return p


def main(argv: Sequence[str] | None = None, api: KubeApi | None = None) -> int:
    args = build_parser().parse_args(argv)
    labels = dict(kv.split("=", 1) for kv in args.label)
    done = ensure(api or KubeApi.in_cluster(), wanted_from_args(args), labels)
    for name, what in done.items():
        print(f"secret {name}: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
