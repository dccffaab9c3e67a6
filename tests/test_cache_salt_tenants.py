"""Tenants and the KV cache (issue 49): a cache salt seeds the root of a prompt's chained block
hashes, so requests of two salts never share a block or see each other's cached prompts. Pure
parts (the hash, the router's salt, the engine's prefix cache), then two API keys probing each
other through a real router over real prefill and decode nodes (tiny model, real Redis): key B
sending key A's prompt gets cached_prompt_tokens 0 and a block of its own, and with
``--cache-salt-scope none`` the keys share."""
from __future__ import annotations

import hashlib
import json
import struct
import urllib.request
import uuid

import pytest

import pdserve
from engine.kv_cache_manager import KVCacheManager
from router.prepare import MAX_CACHE_SALT_CHARS, derive_cache_salt
from security.api_keys import ApiKeys
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, wait_for
from tokens.block_hash import chain_root, hash_block_tokens, hash_prompt_blocks, root_hash

KEY_A, KEY_B = "sk-a-" + uuid.uuid4().hex, "sk-b-" + uuid.uuid4().hex


# ------------------------------------------------------------------ pure parts
def test_no_salt_keeps_every_hash_and_a_salt_reseeds_the_whole_chain():
    # The golden values of tests/test_block_hash.py: unsalted hashes are what they always were.
    assert hash_prompt_blocks(list(range(10)), 4, b"smollm2", salt=b"") == [9536697093376775413, 6439203388800386109]
    assert chain_root(b"m") is None and root_hash(b"m", b"") == root_hash(b"m")
    toks = list(range(100, 112))
    plain, a, b = (hash_prompt_blocks(toks, 4, b"fp", salt=s) for s in (b"", b"tenant-a", b"tenant-b"))
    assert len({*plain, *a, *b}) == 9  # every block of every chain differs
    # The salt is in the root only: later blocks chain as usual.
    assert a[0] == hash_block_tokens(root_hash(b"fp", b"tenant-a"), toks[:4], b"fp")
    assert a[1:] == hash_prompt_blocks(toks[4:], 4, b"fp", parent=a[0])
    # Encoding of a salted root: the unsalted payload, then "salt" and the length-prefixed salt.
    payload = b"pdserve/kv-block-hash/v1" + struct.pack("<I", 2) + b"fp" + b"salt" + struct.pack("<I", 1) + b"s"
    assert root_hash(b"fp", b"s") == int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def test_the_routers_salt_is_per_key_and_per_request_salt():
    keys = ApiKeys([KEY_A, KEY_B])
    a, b = keys.identity(f"Bearer {KEY_A}"), keys.identity(f"bearer  {KEY_B} ")
    assert a == hashlib.sha256(KEY_A.encode()).digest() and b and a != b
    assert keys.identity("Bearer sk-wrong") is None and keys.identity(None) is None
    assert derive_cache_salt(b"", "") == b""  # no tenant, no salt: the unsalted hashes
    salts = [derive_cache_salt(t, s) for t, s in ((a, ""), (b, ""), (b"", "x"), (a, "x"), (b, "x"))]
    assert len(set(salts)) == 5 and all(len(s) == 16 for s in salts)
    assert derive_cache_salt(b"ab", "c") != derive_cache_salt(b"a", "bc")  # length-prefixed parts


def test_the_prefix_cache_matches_only_within_a_salt():
    kv = KVCacheManager(num_blocks=8, block_size=4, extra_key=b"fp")
    prompt = list(range(1, 14))  # 3 full blocks, 1 token to compute
    assert kv.allocate_slots("a#0", 0, len(prompt), None)
    kv.cache_computed_blocks("a#0", prompt, len(prompt), b"salt-a")
    assert kv.lookup_prefix(prompt, b"salt-a").num_tokens == 12
    assert kv.lookup_prefix(prompt, b"salt-b").num_tokens == 0 and kv.lookup_prefix(prompt).num_tokens == 0
    assert kv.held_tiers(prompt, salt=b"salt-a") == [0, 0, 0] and kv.held_tiers(prompt, salt=b"salt-b") == []
    stored = [h for ev in kv.take_events() for h in ev.block_hashes]
    assert stored == hash_prompt_blocks(prompt, 4, b"fp", salt=b"salt-a")  # what the router's index hears


# ------------------------------------------------------------------ two keys through a real router
PROMPT = [(i * 37) % 480 + 7 for i in range(80)]  # > short_prompt_tokens: the prefill node, then KV
SHORT = [(i * 53) % 480 + 5 for i in range(24)]  # < short_prompt_tokens: prefilled on the decode node


@pytest.fixture(scope="module")
def tenants(redis_server, tiny_model, tok_dir):
    """One prefill and one decode node, and two routers over them with keys A and B: one salting
    by key (the default), one with --cache-salt-scope none."""
    ns = f"salt-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_model, num_blocks=64)
    nodes = {role: start_node(role, f"{role}-0", eng, redis_url=redis_server.url, namespace=ns, lease_s=1.5,
                              heartbeat_s=0.2) for role in ("prefill", "decode")}
    common = dict(namespace=ns, max_model_len=256, short_prompt_tokens=32, vocab_size=512, api_keys=(KEY_A, KEY_B))
    routers = {scope: start_router(redis_server.url, tok_dir, cache_salt_scope=scope, http_port=http, **common)
               for scope, http in (("key", 0), ("none", None))}
    try:
        for r in routers.values():
            with pdserve.Client(r.address, api_key=KEY_A, retries=0, timeout=30) as c:
                assert wait_for(c.health, timeout=20, every=0.1), "the router never saw its nodes"
        yield {"nodes": nodes, "routers": routers}
    finally:
        for r in routers.values():
            r.stop()
        for s in nodes.values():
            s.stop()


def _cached(router, key: str, prompt: list[int] = PROMPT, **kw) -> int:
    with pdserve.Client(router.address, api_key=key, retries=0, timeout=30) as c:
        # Two tokens: the decode node continues from the pushed KV (and caches it), not the prefill node alone.
        done = c.complete(token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True, **kw)
    return done.usage.cached_prompt_tokens


def _http_cached(router, key: str, **body) -> int:
    """The same prompt over the OpenAI API (its Authorization header is the tenant)."""
    req = urllib.request.Request(
        f"http://{router.http_address}/v1/completions", method="POST",
        data=json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}).encode(),
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())["usage"]["prompt_tokens_details"]["cached_tokens"]


def _copies_of_first_block(node) -> int:
    """Cached device blocks on ``node`` holding PROMPT's first 16 tokens (one per salt): read on
    the engine's thread."""
    first = tuple(PROMPT[:16])
    return node.aengine.run(lambda e: sum(1 for b in e.kv.pool.cached.values() if tuple(b.token_ids) == first))


def test_one_key_cannot_reuse_or_probe_anothers_cached_prompt(tenants):
    by_key, shared = tenants["routers"]["key"], tenants["routers"]["none"]
    prefill, decode = tenants["nodes"]["prefill"], tenants["nodes"]["decode"]
    assert _cached(by_key, KEY_A) == 0
    assert _cached(by_key, KEY_A) == 64  # A's own prompt is cached: 4 of its 5 blocks
    assert _cached(by_key, KEY_B) == 0  # B sends A's prompt: no hit, nothing to learn
    # B computed blocks of its own, on both nodes (the decode node cached the KV pushed to it).
    assert _copies_of_first_block(prefill) == 2 and _copies_of_first_block(decode) == 2
    assert _cached(by_key, KEY_B, cache_salt="team") == 0  # the request's salt adds to the key's
    # A short prompt is prefilled on the decode node: its cache is salted the same way.
    assert _cached(by_key, KEY_A, SHORT) == 0 and _cached(by_key, KEY_A, SHORT) == 16
    assert _cached(by_key, KEY_B, SHORT) == 0
    # Over HTTP the same: B's key finds B's blocks; A with B's salt (a body field) finds none.
    assert _http_cached(by_key, KEY_B) == 64 and _http_cached(by_key, KEY_A, cache_salt="team") == 0
    # Scope none: keys share (the blocks above were salted by key, so the first one misses).
    assert _cached(shared, KEY_A) == 0 and _cached(shared, KEY_B) == 64
    assert _cached(shared, KEY_B, cache_salt="team") == 0 and _cached(shared, KEY_A, cache_salt="team") == 64
    with pytest.raises(pdserve.InvalidRequestError, match=f"at most {MAX_CACHE_SALT_CHARS} characters"):
        _cached(shared, KEY_A, cache_salt="x" * (MAX_CACHE_SALT_CHARS + 1))
    # Every salted chain went through the reservation's and the transfer's hash checks: none refused.
    assert prefill.num_transfer_failures == 0
