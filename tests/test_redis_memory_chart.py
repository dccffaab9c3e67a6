"""The chart's built-in Redis runs the memory settings `pdserve up`'s does (issue 49): a maxmemory
under the pod's limit and the policy that evicts only the index (deploy/redis_server.py says why
volatile-lfu). The rendered command line is run here with a real redis-server, which must accept
it and report those settings back; a value that could not work is refused by the schema."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
import redis

from deploy.redis_server import (
    HASH_MAX_ZIPLIST_ENTRIES,
    MAXMEMORY_POLICY,
    MAXMEMORY_SAMPLES,
    find_redis_server,
    free_port,
)
from tests.test_helm_chart import helm_python, one, render


def _redis_container(values: dict) -> dict:
    sts = one(render(values), "StatefulSet", "-redis")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


def _quantity_mib(q: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(q[:-2]) * units[q[-2:]]


def test_the_charts_redis_evicts_only_the_index_under_its_limit(tmp_path):
    c = _redis_container({})
    script = c["args"][0]
    assert f"--maxmemory-policy {MAXMEMORY_POLICY}" in script and f"--maxmemory-samples {MAXMEMORY_SAMPLES}" in script
    assert "--maxmemory 640mb" in script
    assert f"--hash-max-ziplist-entries {HASH_MAX_ZIPLIST_ENTRIES}" in script  # the index's buckets stay flat
    assert 640 <= 0.7 * _quantity_mib(c["resources"]["limits"]["memory"])  # headroom past maxmemory
    assert "--maxmemory 300mb" in _redis_container({"redis": {"builtin": {"maxMemoryMiB": 300}}})["args"][0]
    with pytest.raises(helm_python.HelmValuesError):
        render({"redis": {"builtin": {"maxMemoryMiB": 8}}})

    # The rendered command, as the pod runs it, with a real redis-server (its data and port here).
    port = free_port()
    line = (script.replace("exec redis-server", f"exec {find_redis_server()}")
            .replace("--dir /data", f"--dir {tmp_path} --port {port} --bind 127.0.0.1 --save ''"))
    proc = subprocess.Popen(["sh", "-c", line], env={**os.environ, "REDIS_PASSWORD": "pw"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        r = redis.Redis(port=port, password="pw", socket_timeout=2)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise AssertionError(proc.stderr.read().decode()) from None
                time.sleep(0.05)
        got = r.config_get("maxmemory*")
        assert got["maxmemory"] == str(640 << 20) and got["maxmemory-policy"] == MAXMEMORY_POLICY
        assert got["maxmemory-samples"] == str(MAXMEMORY_SAMPLES)
        assert r.config_get("hash-max-ziplist-entries")["hash-max-ziplist-entries"] == str(HASH_MAX_ZIPLIST_ENTRIES)
        r.close()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(tmp_path, ignore_errors=True)
