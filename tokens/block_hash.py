"""Chained hashes of full KV blocks, shared by the engine's prefix cache, the router's global
index and the transfer headers. Stdlib only: the router imports this and must stay torch-free.

A block's hash covers its own tokens *and* every block before it, through the parent hash::

    tokens:  | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49     (block_size 16)
    hashes:  |    h0     |    h1     |    h2     |  (partial: never hashed)

    h0 = H(root(extra_key), extra_key, t0..t15)
    h1 = H(h0,              extra_key, t16..t31)
    h2 = H(h1,              extra_key, t32..t47)

so equal hashes at the same position mean an equal prefix. ``extra_key`` carries whatever else
decides the KV besides the tokens (model fingerprint, LoRA); it seeds the root too, so chains of
different models never meet.

A cache salt (vLLM's ``cache_salt``; the router derives one per API key and per request's own
salt, router/prepare.py) goes into the root only::

    root(extra_key)        = H(domain, extra_key)                    no salt: as it always was
    root(extra_key, salt)  = H(domain, extra_key, "salt", salt)      h0 = H(root(...), extra_key, t0..t15)

Every later block chains from its parent, so a salt changes every hash of the chain, and chains
of two salts never share a block: in the engine's prefix cache and its tiers, the router's
index and the transfer headers alike. Without a salt every hash is byte-identical to what it
was before salts existed (disk-tier files and index entries keep matching).

The byte encoding is explicit little-endian and the digest is blake2b, so a hash is the same in
every process and on every machine (never Python's ``hash()``, which is salted per process).
A hash is only a hint: whoever reuses a block compares its stored tokens first.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int  # 64-bit unsigned

# Bumping the version string changes every hash, which is what an encoding change must do:
# old index entries then simply miss instead of matching blocks laid out differently.
_ROOT_DOMAIN = b"pdserve/kv-block-hash/v1"
_SALT_TAG = b"salt"
_DIGEST_SIZE = 8


def _digest(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=_DIGEST_SIZE).digest(), "little")


def _encode_key(extra_key: bytes) -> bytes:
    # Length-prefixed so that (extra_key, tokens) pairs cannot run into each other.
    return struct.pack("<I", len(extra_key)) + extra_key


def root_hash(extra_key: bytes = b"", salt: bytes = b"") -> BlockHash:
    """The parent hash of a chain's first block. An empty ``salt`` is no salt: the root is then
    exactly the unsalted one (the encoding of salted roots is a strict extension of it)."""
    payload = _ROOT_DOMAIN + _encode_key(extra_key)
    if salt:
        payload += _SALT_TAG + _encode_key(salt)
    return _digest(payload)


def chain_root(extra_key: bytes = b"", salt: bytes = b"") -> BlockHash | None:
    """The ``parent`` to start a chain with: None without a salt (``hash_block_tokens`` then
    uses the unsalted root itself), the salted root with one."""
    return root_hash(extra_key, salt) if salt else None


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b""
) -> BlockHash:
    """Hash of one block given its parent's hash (``None``: the chain's first block).

    Encoding: ``u64 parent | u32 len(extra_key) | extra_key | u32 n | n x u32 token id``,
    all little-endian. Token ids must fit in 32 bits unsigned (struct raises otherwise).
    """
    if parent is None:
        parent = root_hash(extra_key)
    n = len(token_ids)
    payload = b"".join(
        (
            struct.pack("<Q", parent),
            _encode_key(extra_key),
            struct.pack(f"<I{n}I", n, *token_ids),
        )
    )
    return _digest(payload)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    parent: BlockHash | None = None,
    salt: bytes = b"",
) -> list[BlockHash]:
    """Hashes of every FULL block of ``token_ids``; a trailing partial block is left out.

    ``parent`` continues an existing chain (the hash of the block just before ``token_ids[0]``);
    without one the chain starts at the root of ``extra_key`` and ``salt``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if parent is None:
        parent = chain_root(extra_key, salt)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
    return hashes
