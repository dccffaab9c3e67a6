"""The router's local copy of the index as plain data (kv_index/local_index.py): its lookup on
hand-built entries, against a per-node walk written as the Redis script walks (schema.MATCH),
through runs learned, cut and killed; and the router setting that chooses it."""
from __future__ import annotations

import random

import pytest

from kv_index.local_index import LocalIndex, encode_groups, parse_groups
from kv_index.nodes import PrefixMatch
from kv_index.schema import TIER_DEVICE, TIER_DISK, TIER_HOST
from router.config import RouterConfig

DEV, HOST, DISK = 1 << TIER_DEVICE, 1 << TIER_HOST, 1 << TIER_DISK


def walk(entries: dict[int, dict[str, int]], hashes, ids) -> dict[str, PrefixMatch]:
    """The answer by definition: per node, its leading held blocks, each in its fastest tier."""
    out = {}
    for n in ids:
        blocks = host = disk = 0
        for h in hashes:
            m = entries.get(h, {}).get(n, 0)
            if not m:
                break
            blocks += 1
            host += not m & DEV and bool(m & HOST)
            disk += not m & (DEV | HOST)
        out[n] = PrefixMatch(blocks, host, disk)
    return out


def test_the_lookup_on_hand_built_entries():
    idx = LocalIndex()
    chain = list(range(100, 120))  # 20 chained hashes
    idx.apply("a", 1, False, [("+", TIER_DEVICE, chain[:12])])
    idx.apply("b", 1, False, [("+", TIER_DEVICE, chain[:4]), ("+", TIER_HOST, chain[4:8]), ("+", TIER_DISK, chain[8:])])
    idx.replace_node("c", {chain[0]: DEV | HOST, chain[1]: HOST, chain[3]: DEV}, 5)  # a hole at chain[2]
    got = idx.match(chain, ["a", "b", "c", "stranger"])
    assert got == {"a": PrefixMatch(12), "b": PrefixMatch(20, 4, 12), "c": PrefixMatch(2, 1, 0),
                   "stranger": PrefixMatch(0)}
    assert idx.match(chain[:6], ["b"]) == {"b": PrefixMatch(6, 2, 0)}  # the prompt ends inside a run
    assert idx.match([7] + chain, ["a", "b"]) == {"a": PrefixMatch(0), "b": PrefixMatch(0)}
    assert idx.match([], ["a"]) == {"a": PrefixMatch(0)} and idx.match(chain, []) == {}
    # A removal inside a's run, then a tier move of b's device head: the answers follow.
    idx.apply("a", 2, False, [("-", TIER_DEVICE, [chain[5]])])
    idx.apply("b", 2, False, [("-", TIER_DEVICE, chain[:4]), ("+", TIER_HOST, chain[:4])])
    assert idx.match(tuple(chain), ["a", "b"]) == {"a": PrefixMatch(5), "b": PrefixMatch(20, 8, 12)}
    idx.apply("a", 3, True, [("+", TIER_DISK, chain[:2])])  # cleared first, then stored on disk
    assert idx.match(chain, ["a"]) == {"a": PrefixMatch(2, 0, 2)} and idx.node_seq("a") == 3
    idx.drop_node("c")
    assert idx.node_seq("c") is None and idx.match(chain, ["c"]) == {"c": PrefixMatch(0)}
    assert idx.holdings("a") == {chain[0]: DISK, chain[1]: DISK}


def test_the_lookup_equals_the_walk_through_random_batches_runs_and_hints():
    rng = random.Random(7)
    chains = [[rng.getrandbits(64) for _ in range(rng.randrange(4, 40))] for _ in range(12)]
    for c in chains[6:]:  # half share a head with another chain
        c[:3] = chains[rng.randrange(6)][:3]
    nodes = ["n0", "n1", "n2", "n3"]
    idx, truth = LocalIndex(), {}
    seqs = dict.fromkeys(nodes, 0)

    def prompts():
        for c in chains:
            cut = rng.randrange(1, len(c) + 1)
            yield c[:cut] + [rng.getrandbits(64) for _ in range(rng.randrange(3))]

    for step in range(300):
        nid, chain = rng.choice(nodes), rng.choice(chains)
        i = rng.randrange(len(chain))
        part = chain[i:i + rng.randrange(1, 16)] if rng.random() < 0.5 else chain[:i + 1]
        op, tier = rng.choice("++-"), rng.choice((TIER_DEVICE, TIER_HOST, TIER_DISK))
        cleared = rng.random() < 0.02
        if cleared:
            for held in truth.values():
                held.pop(nid, None)
        for h in part:
            m = truth.setdefault(h, {}).get(nid, 0)
            m = m | (1 << tier) if op == "+" else m & ~(1 << tier)
            if m:
                truth[h][nid] = m
            else:
                truth[h].pop(nid, None)
        seqs[nid] += 1
        idx.apply(nid, seqs[nid], cleared, [(op, tier, part)])
        if step % 25 == 0:
            idx.learn_hints()  # the writer replays the prompts looked up block by block
        for p in prompts():
            ids = rng.sample(nodes, rng.randrange(1, 5))
            assert idx.match(p, ids) == walk(truth, p, ids), (step, p, ids)
    assert sum(len(v) for v in truth.values()) == idx.entries
    assert any(run is not None and run.live for _, run, _ in idx._blocks.values())  # the walk went through runs


def test_a_malformed_event_payload_is_refused():
    groups = [("+", 0, [255, 1, 2**64 - 1]), ("-", 1, [16])]
    data = encode_groups(groups)
    assert parse_groups(data) == groups
    assert parse_groups(b"") == []
    for bad in (data[:-1], b"*" + data[1:], data[:1] + b"9" + data[2:], data[:4]):
        with pytest.raises(ValueError):
            parse_groups(bad)


def test_the_router_setting_chooses_the_lookup():
    import argparse

    from settings.flags import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser, RouterConfig)  # the flags of python -m frontend.server
    base = ["--redis-url", "redis://127.0.0.1:1/0", "--model-name", "m", "--tokenizer-dir", "t",
            "--max-model-len", "64"]
    assert from_args(RouterConfig, parser.parse_args(base), api_keys=()).index_lookup == "local"
    assert from_args(RouterConfig, parser.parse_args([*base, "--index-lookup", "redis"]), api_keys=()).index_lookup == "redis"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--index-lookup", "memcached"])
    with pytest.raises(ValueError, match="index_lookup"):
        RouterConfig(redis_url="redis://x", model_name="m", tokenizer_dir="t", max_model_len=64, index_lookup="x")
