"""Block hashes must be identical in every process and on every machine: the router, prefill
and decode nodes compare them through Redis."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokens.block_hash import hash_block_tokens, hash_prompt_blocks, root_hash

REPO = Path(__file__).resolve().parents[1]

# Frozen on purpose: a change here means every index entry and transfer header in the field
# stops matching. Change the encoding only together with the version string in block_hash.py.
GOLDEN = {
    "root": 0x99F92D1CDA07601E,
    "root_m": 0x0292C5BD76E9C8AB,
    "range10_bs4": [9323543082156678435, 13619354501167640392],
    "range10_bs4_smollm2": [9536697093376775413, 6439203388800386109],
}


def test_golden_values() -> None:
    assert root_hash() == GOLDEN["root"]
    assert root_hash(b"m") == GOLDEN["root_m"]
    assert hash_prompt_blocks(list(range(10)), 4) == GOLDEN["range10_bs4"]
    assert hash_prompt_blocks(list(range(10)), 4, b"smollm2") == GOLDEN["range10_bs4_smollm2"]


def test_encoding_is_the_documented_little_endian_layout() -> None:
    # Rebuilt byte by byte from the docstring, without struct, so the spec and code agree.
    def le(v: int, n: int) -> bytes:
        return v.to_bytes(n, "little")

    key = b"lora-7"
    root = int.from_bytes(
        hashlib.blake2b(b"pdserve/kv-block-hash/v1" + le(len(key), 4) + key, digest_size=8).digest(), "little"
    )
    tokens = [1, 2, 70000, 2**32 - 1]
    payload = le(root, 8) + le(len(key), 4) + key + le(len(tokens), 4) + b"".join(le(t, 4) for t in tokens)
    want = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    assert root_hash(key) == root
    assert hash_block_tokens(None, tokens, key) == want


def test_chain_and_full_blocks_only() -> None:
    toks = list(range(100, 111))  # 11 tokens, block 4 -> 2 full blocks, 3 left over
    h = hash_prompt_blocks(toks, 4)
    assert len(h) == 2
    assert h[0] == hash_block_tokens(None, toks[0:4])
    assert h[1] == hash_block_tokens(h[0], toks[4:8])
    # Continuing a chain from a parent equals hashing the whole prefix.
    assert hash_prompt_blocks(toks[4:], 4, parent=h[0]) == h[1:]
    assert hash_prompt_blocks(toks[:3], 4) == []
    assert all(0 <= x < 2**64 for x in h)


def test_position_extra_key_and_parent_all_matter() -> None:
    a = [5, 6, 7, 8]
    assert hash_block_tokens(None, a) == hash_block_tokens(root_hash(), a)
    assert hash_block_tokens(None, a) != hash_block_tokens(None, a, b"other-model")
    assert hash_block_tokens(None, a) != hash_block_tokens(1, a)
    # Same block after a different prefix is a different block.
    assert hash_prompt_blocks([1, 1, 1, 1] + a, 4)[1] != hash_prompt_blocks([2, 2, 2, 2] + a, 4)[1]
    # extra_key and tokens are length-prefixed: moving bytes between them changes the hash.
    assert hash_block_tokens(None, [1], b"\x01\x00\x00\x00") != hash_block_tokens(None, [1, 1], b"")


def test_token_ids_out_of_range_are_rejected() -> None:
    with pytest.raises(Exception):
        hash_block_tokens(None, [2**32])
    with pytest.raises(Exception):
        hash_block_tokens(None, [-1])


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_stable_across_processes(seed: str) -> None:
    code = (
        "import json; from tokens.block_hash import hash_prompt_blocks, root_hash;"
        "print(json.dumps([root_hash(b'x'), hash_prompt_blocks(list(range(64)), 16, b'x')]))"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    here = [root_hash(b"x"), hash_prompt_blocks(list(range(64)), 16, b"x")]
    assert json.loads(out.stdout) == here


def test_stays_torch_free() -> None:
    code = (
        "import sys, tokens.block_hash, engine.block_pool, engine.kv_cache_manager;"
        "print('torch' in sys.modules, 'numpy' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
