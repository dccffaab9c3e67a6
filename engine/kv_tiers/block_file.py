"""The disk tier's file format: one KV block per file, a self-describing header, two checksums.

A file is the header followed by the block's KV bytes exactly as one host-tier slot holds them
(``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of ``dtype``, C order)::

    offset 0   magic "PDKV", format version, header length
               block size, layers, KV heads, head dim, dtype, model fingerprint
               the block's chained hash, its parent's, its token ids
               payload length, XXH3-64 of the payload
               XXH3-64 of every header byte before this field
    header_len payload (payload_len bytes)

Everything a reader needs to refuse a file is in the header, so a node restarted with another
model, block size or dtype refuses each file after reading its first few hundred bytes
(``check_layout``), and the tokens are there to verify a hit without the payload. The header
checksum catches a flipped bit in the hash or the tokens before they are trusted; the payload's
catches one in the KV. Torch-free: the payload is any buffer.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"PDKV"
VERSION = 1
SUFFIX = ".kvb"
# magic, version, header_len, flags, block_size, layers, kv heads, head dim, n_tokens,
# block hash, parent hash, payload_len, payload checksum, fingerprint length, dtype length
_FIXED = struct.Struct("<4sHIHIIIIIQQQQHH")
_CHECKSUM = struct.Struct("<Q")
_HAS_PARENT = 1
# A header this long is not one of ours (a block of 1024 tokens with a long fingerprint is
# ~4.2 KiB): reading stops before a corrupt length makes it allocate much.
MAX_HEADER_BYTES = 64 * 1024


class BlockFileError(ValueError):
    """A file that is not a valid block file of this format; ``reason``: ``format`` (not ours),
    ``torn`` (ours, cut short: a write a crash or power cut interrupted, which no engine can
    use) or ``checksum`` (a byte changed)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What makes KV bytes usable by an engine: the model (its fingerprint already includes the
    dtype), the block size and the block's shape and element type."""

    fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16", ...
    element_size: int

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.element_size


@dataclass(frozen=True, slots=True)
class BlockHeader:
    layout: KVLayout
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    payload_len: int
    payload_checksum: int
    header_len: int


def payload_checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_header(layout: KVLayout, block_hash: int, parent_hash: int | None, token_ids, payload_len: int,
                  checksum: int) -> bytes:
    fp = layout.fingerprint.encode()
    dt = layout.dtype.encode()
    tokens = tuple(int(t) for t in token_ids)
    tail = fp + dt + struct.pack(f"<{len(tokens)}I", *tokens)
    header_len = _FIXED.size + len(tail) + _CHECKSUM.size
    fixed = _FIXED.pack(MAGIC, VERSION, header_len, _HAS_PARENT if parent_hash is not None else 0,
                        layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim, len(tokens),
                        block_hash, parent_hash or 0, payload_len, checksum, len(fp), len(dt))
    body = fixed + tail
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def read_header(f, element_size_of) -> BlockHeader:
    """Read and check the header from the start of the open binary file ``f``, leaving ``f``
    at the payload. ``element_size_of(dtype name)`` -> bytes per element (None: unknown dtype,
    a ``format`` error). Raises ``BlockFileError``."""
    first = f.read(_FIXED.size)
    if len(first) < _FIXED.size:
        # Empty or cut inside the fixed fields: ours if what is there is our magic's start.
        torn = first[:4] == MAGIC[:len(first)]
        raise BlockFileError("torn" if torn else "format", "shorter than a block file header")
    (magic, version, header_len, flags, block_size, layers, heads, head_dim, n_tokens, block_hash, parent,
     payload_len, checksum, fp_len, dt_len) = _FIXED.unpack(first)
    if magic != MAGIC:
        raise BlockFileError("format", f"not a block file (magic {magic!r})")
    if version != VERSION:
        raise BlockFileError("format", f"block file format version {version}, this node reads {VERSION}")
    expected = _FIXED.size + fp_len + dt_len + 4 * n_tokens + _CHECKSUM.size
    if header_len != expected or header_len > MAX_HEADER_BYTES:
        raise BlockFileError("checksum", f"header length {header_len} does not match its fields ({expected})")
    rest = f.read(header_len - _FIXED.size)
    if len(rest) < header_len - _FIXED.size:
        raise BlockFileError("torn", "truncated block file header")
    body, (stored,) = first + rest[:-_CHECKSUM.size], _CHECKSUM.unpack(rest[-_CHECKSUM.size:])
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise BlockFileError("checksum", "block file header checksum mismatch")
    tail = rest[:-_CHECKSUM.size]
    try:
        fingerprint = tail[:fp_len].decode()
        dtype = tail[fp_len:fp_len + dt_len].decode()
    except UnicodeDecodeError as err:
        raise BlockFileError("format", f"undecodable header field: {err}") from None
    tokens = struct.unpack(f"<{n_tokens}I", tail[fp_len + dt_len:])
    element_size = element_size_of(dtype)
    if element_size is None:
        raise BlockFileError("format", f"unknown dtype {dtype!r}")
    layout = KVLayout(fingerprint, block_size, layers, heads, head_dim, dtype, element_size)
    return BlockHeader(layout, block_hash, parent if flags & _HAS_PARENT else None, tokens, payload_len, checksum,
                       header_len)


def check_layout(header: BlockHeader, mine: KVLayout) -> str | None:
    """Why a file written under ``header.layout`` is unusable by an engine of layout ``mine``
    (None: it is usable)."""
    theirs = header.layout
    for field, label in (("fingerprint", "model fingerprint"), ("block_size", "block size"),
                         ("dtype", "dtype"), ("num_layers", "layer count"), ("num_kv_heads", "KV heads"),
                         ("head_dim", "head dim")):
        a, b = getattr(theirs, field), getattr(mine, field)
        if a != b:
            return f"{label} {a!r}, this engine's is {b!r}"
    if header.payload_len != mine.block_bytes:
        return f"payload of {header.payload_len} bytes, a block here is {mine.block_bytes}"
    if len(header.token_ids) != mine.block_size:
        return f"{len(header.token_ids)} token ids for a block of {mine.block_size}"
    return None


def file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def hash_of_name(name: str) -> int | None:
    """The block hash a file name encodes, or None for a name this format does not write."""
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None
