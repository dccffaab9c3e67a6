"""A Redis URL with its password from the environment, so the password stays out of command
lines, values files and process listings.

    redis://redis.pdserve.svc:6379/0   +   PDSERVE_REDIS_PASSWORD=s3cr/t@   ->
    redis://:s3cr%2Ft%40@redis.pdserve.svc:6379/0

The password is percent-encoded: redis-py's ``from_url`` decodes it, so any character survives
(a Kubernetes ``$(VAR)`` substitution into the URL would not encode it). ``rediss://`` (TLS),
``redis+cluster://`` (Redis Cluster, kv_index/client.py) and a user name in the URL (Redis 6
ACLs) are kept as they are.
"""
from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import quote, urlsplit, urlunsplit

PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` as its password; a URL that already has one is an error (two
    sources of one secret would hide which is used)."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster") or not parts.hostname:
        raise ValueError(f"not a network Redis URL (redis://HOST, rediss://HOST, redis+cluster://HOST): {url!r}")
    if parts.password is not None:
        raise ValueError("the Redis URL already has a password; give it in one place only")
    user = quote(parts.username, safe="") if parts.username else ""
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def resolve_redis_url(url: str, env: Mapping[str, str]) -> str:
    """``url`` with the password from ``$PDSERVE_REDIS_PASSWORD`` when that is set and non-empty."""
    password = env.get(PASSWORD_ENV)
    return with_password(url, password) if password else url


def redact(url: str) -> str:
    """``url`` safe to print: its password replaced by ``***`` (a URL without one is returned
    as it is; anything unparseable is hidden whole)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return "<redis url>"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc.rpartition('@')[2]}"))
