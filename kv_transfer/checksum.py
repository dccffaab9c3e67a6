"""Payload checksums, computed incrementally chunk by chunk on both ends.

XXH3-64 (from the `xxhash` dependency) is what nodes send; CRC32 (zlib) stays accepted. Both
ends checksum every byte, so the faster hash is a direct cut of transfer time: CRC32 alone once
cost a third of a loopback transfer. ``pdserve bench transfer`` measures both in its
``components`` (docs/benchmarks.md).
"""
from __future__ import annotations

import zlib

from protos.pdserve.v1 import kv_pb2

try:
    import xxhash
except ImportError:  # optional: only XXH3_64 transfers need it
    xxhash = None


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data) -> None:
        self._value = zlib.crc32(data, self._value)  # releases the GIL for large buffers

    def value(self) -> int:
        return self._value


class _Xxh3:
    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, data) -> None:
        self._state.update(data)

    def value(self) -> int:
        return self._state.intdigest()


_ALGORITHMS = {kv_pb2.CHECKSUM_ALGORITHM_CRC32: _Crc32}
if xxhash is not None:
    _ALGORITHMS[kv_pb2.CHECKSUM_ALGORITHM_XXH3_64] = _Xxh3


def supported() -> tuple[int, ...]:
    """ChecksumAlgorithm values this process can compute."""
    return tuple(_ALGORITHMS)


def new_checksum(algorithm: int) -> _Crc32 | _Xxh3:
    """A running checksum: update(bytes-like) per chunk, then value(). KeyError if unsupported."""
    return _ALGORITHMS[algorithm]()
