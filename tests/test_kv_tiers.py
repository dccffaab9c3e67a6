"""KV tiers bookkeeping with plain data: host slots, the disk tier's files and budget, the block
file format, and the device pool + tiers together with exact block ids, slots, swap-ins and
eviction order on tiny configurations. The tensor side is bytes here (``BytesKV``: block b's KV is
``pool[b]``); tests/test_kv_tiers_engine.py runs the same code on a real engine."""
from __future__ import annotations

import os

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.block_file import (
    BlockFileError,
    KVLayout,
    check_layout,
    encode_header,
    hash_of_name,
    read_header,
)
from engine.kv_tiers.disk import DiskTier, error_reason, write_block_file
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.tiers import KVTiers
from kv_index.events import TIER_DEVICE, TIER_DISK, TIER_HOST, BlockRemoved, BlockStored, fold_kv_events_by_tier
from tokens.block_hash import hash_prompt_blocks

BS = 4
LAYOUT = KVLayout("fp-test", BS, 1, 1, 1, "uint8", 1)  # a block is 2 * 4 = 8 bytes
BB = LAYOUT.block_bytes


def _size(name: str) -> int | None:
    return {"uint8": 1, "float32": 4}.get(name)


class BytesKV:
    """The tensor side as bytes: the device pool (one bytearray per block) and the host buffer."""

    def __init__(self, num_blocks: int, num_slots: int) -> None:
        self.pool = [bytearray(BB) for _ in range(num_blocks)]
        self.host = bytearray(num_slots * BB)

    def copy_out(self, pairs, ready) -> None:
        for block, slot in pairs:
            self.host[slot * BB:(slot + 1) * BB] = self.pool[block]

    def copy_in(self, pairs) -> None:
        for slot, block in pairs:
            self.pool[block][:] = self.host[slot * BB:(slot + 1) * BB]

    def slot_view(self, slot: int) -> memoryview:
        return memoryview(self.host)[slot * BB:(slot + 1) * BB]


def _tiered(num_blocks=4, slots=4, disk_dir=None, disk_files=0, max_inflight=64):
    kv = BytesKV(num_blocks, slots)
    disk = None
    if disk_dir is not None:
        probe = DiskTier(disk_dir, 10**9, LAYOUT, _size)
        file_bytes = probe.file_bytes
        probe.close()
        disk = DiskTier(disk_dir, disk_files * file_bytes, LAYOUT, _size)
    tiers = KVTiers(HostTier(slots), disk, BB, kv.copy_out, kv.slot_view, max_inflight=max_inflight)
    m = KVCacheManager(num_blocks, BS, tiers=tiers)
    return m, tiers, kv


def _settle(tiers: KVTiers) -> None:
    """Let the worker threads finish, then take their results (what the engine does per step)."""
    for _ in range(3):
        tiers.copier.wait_idle(5)
        if tiers.writer is not None:
            tiers.writer.wait_idle(5)
        tiers.service()


def _prefill(m: KVCacheManager, kv: BytesKV, sid: str, tokens: list[int]):
    """Allocate (with the prefix hit), apply swap-ins, 'compute' the rest (KV bytes derived from
    the tokens), register the full blocks."""
    hit = m.lookup_prefix(tokens)
    assert m.allocate_slots(sid, hit.num_tokens, len(tokens), hit)
    kv.copy_in(m.take_swap_ins())
    m.finish_swap_ins()
    table = m.get_block_table(sid)
    for i in range(hit.num_tokens // BS, len(table)):
        kv.pool[table[i]][:] = _kv_of(tokens[: (i + 1) * BS])
    m.cache_computed_blocks(sid, tokens, len(tokens))
    return hit


def _kv_of(prefix: list[int]) -> bytes:
    """What 'computing' a block gives: a function of every token up to its end."""
    return (sum(prefix) * 7919 + len(prefix)).to_bytes(8, "little")


A = list(range(100, 112))  # 12 tokens: 3 full blocks
B = list(range(200, 216))


# ---------------------------------------------------------------- host tier
def test_host_slots_lru_and_states() -> None:
    host = HostTier(3)
    e0 = host.reserve(10, None, (1,))
    e1 = host.reserve(11, 10, (2,))
    assert (e0.slot, e1.slot) == (0, 1) and host.free_slots() == [2]
    assert host.holds(10) and host.get(10, (1,)) is None  # filling: not a hit yet
    assert host.filled(0) is e0 and host.filled(1) is e1
    assert host.get(10, (1,)) is e0 and host.get(10, (9,)) is None  # tokens verified
    host.touch(e0)
    assert [e.block_hash for e in host.lru()] == [11, 10]
    e0.pins = 1
    with pytest.raises(ValueError, match="pinned"):
        host.evict(e0, spill=False)
    host.evict(e1, spill=True)  # spilling: the slot is not free until the write finished
    assert host.free_slots() == [2] and host.num_spilling == 1
    host.spilled(1)
    assert host.free_slots() == [2, 1]
    dup = host.reserve(10, None, (1,))  # a second copy of a ready hash frees its slot on fill
    assert host.filled(dup.slot) is None and host.free_slots() == [1, 2]


# ---------------------------------------------------------------- block files
def test_block_file_header_round_trip_and_refusals(tmp_path) -> None:
    payload = bytes(range(BB))
    path = tmp_path / "x.kvb"
    write_block_file(path, tmp_path / ".x.tmp", LAYOUT, 0xABC, 0x123, [5, 6, 7, 8], memoryview(payload))
    assert not (tmp_path / ".x.tmp").exists()
    with open(path, "rb") as f:
        h = read_header(f, _size)
        assert f.read() == payload
    assert (h.block_hash, h.parent_hash, h.token_ids, h.payload_len) == (0xABC, 0x123, (5, 6, 7, 8), BB)
    assert check_layout(h, LAYOUT) is None
    other = KVLayout("fp-other", BS, 1, 1, 1, "uint8", 1)
    assert "model fingerprint" in check_layout(h, other)
    assert "block size" in check_layout(h, KVLayout("fp-test", 8, 1, 1, 1, "uint8", 1))
    assert "dtype" in check_layout(h, KVLayout("fp-test", BS, 1, 1, 1, "float32", 4))
    # A flipped bit in the header (here a token id) fails its checksum.
    raw = bytearray(path.read_bytes())
    raw[len(encode_header(LAYOUT, 0, None, [0] * BS, BB, 0)) - 12] ^= 1
    path.write_bytes(bytes(raw))
    with open(path, "rb") as f, pytest.raises(BlockFileError) as err:
        read_header(f, _size)
    assert err.value.reason == "checksum"
    assert hash_of_name("0000000000000abc.kvb") == 0xABC and hash_of_name("abc.kvb") is None
    assert error_reason(OSError(28, "No space left on device")) == "no_space"
    assert error_reason(OSError(5, "Input/output error")) == "io_error"


def test_disk_budget_evicts_least_recently_used(tmp_path) -> None:
    d = DiskTier(tmp_path, 10**9, LAYOUT, _size)
    fb = d.file_bytes
    d.close()
    d = DiskTier(tmp_path, 2 * fb, LAYOUT, _size)
    e1, ev = d.plan_write(1, None, (1, 1, 1, 1))
    assert ev == [] and d.plan_write(1, None, (1, 1, 1, 1)) is None  # already there
    e2, _ = d.plan_write(2, 1, (2, 2, 2, 2))
    assert d.plan_write(3, 2, (3, 3, 3, 3)) is None  # both still being written: no room yet
    d.written(e1, True)
    d.written(e2, True)
    assert d.get(1, (1, 1, 1, 1)) is e1 and d.get(1, (0, 0, 0, 0)) is None
    d.entries.move_to_end(1)  # 1 was hit: 2 is now the least recently used
    e3, ev = d.plan_write(3, 2, (3, 3, 3, 3))
    assert [e.block_hash for e in ev] == [2] and list(d.entries) == [1, 3] and d.used_bytes == 2 * fb
    d.written(e3, False)  # a failed write gives its bytes back
    assert list(d.entries) == [1] and d.used_bytes == fb and d.num_ready == 1
    d.close()
    tiny = DiskTier(tmp_path / "tiny", fb - 1, LAYOUT, _size)  # not even one file fits
    assert not tiny.admitting and tiny.stopped_reason == "no_space" and tiny.plan_write(9, None, (0,) * 4) is None
    tiny.close()


def test_disk_directory_is_one_engines(tmp_path) -> None:
    d = DiskTier(tmp_path, 10**6, LAYOUT, _size)
    with pytest.raises(RuntimeError, match="in use by another process"):
        DiskTier(tmp_path, 10**6, LAYOUT, _size)
    d.close()
    DiskTier(tmp_path, 10**6, LAYOUT, _size).close()


def test_scan_keeps_ours_refuses_foreign_removes_damage(tmp_path) -> None:
    payload = memoryview(bytes(BB))
    d = DiskTier(tmp_path, 10**6, LAYOUT, _size)
    for h in (1, 2):
        write_block_file(d.path(h), d.temp_path(h), LAYOUT, h, None, [h] * BS, payload)
    other = KVLayout("fp-other-model", BS, 1, 1, 1, "uint8", 1)
    write_block_file(d.path(3), d.temp_path(3), other, 3, None, [3] * BS, payload)
    (tmp_path / ".0000000000000004.77.tmp").write_bytes(b"half a write")
    (tmp_path / "notes.txt").write_text("not ours")
    damaged = bytearray(d.path(2).read_bytes())
    damaged[10] ^= 0xFF  # the header's length field: its checksum fails
    d.path(2).write_bytes(bytes(damaged))
    os.utime(d.path(1), ns=(1, 1))
    res = d.scan()
    assert [e.block_hash for e in res.kept] == [1] and res.refused == {"foreign": 1} and res.removed == 2
    assert d.path(3).exists() and (tmp_path / "notes.txt").exists() and not d.path(2).exists()
    d.close()


# ---------------------------------------------------------------- device pool + tiers
def test_write_through_then_prefix_comes_back_from_host() -> None:
    m, tiers, kv = _tiered(num_blocks=4, slots=8, max_inflight=2)
    h0, h1, h2 = hash_prompt_blocks(A, BS)
    _prefill(m, kv, "a", A)
    assert [type(e).__name__ for e in m.take_events()] == ["BlockStored"] * 3
    tiers.service()  # at most max_inflight=2 copies in flight, each holding its device block
    assert tiers.device_pins == 2 and [b.ref_cnt for b in m.pool.blocks[:3]] == [2, 2, 1]
    _settle(tiers)
    assert tiers.device_pins == 0 and [b.ref_cnt for b in m.pool.blocks[:3]] == [1, 1, 1]
    assert [(e.block_hash, e.slot) for e in tiers.host.lru()] == [(h0, 0), (h1, 1), (h2, 2)]
    assert m.take_events() == [BlockStored((h0,), None, (tuple(A[0:4]),), TIER_HOST),
                               BlockStored((h1,), h0, (tuple(A[4:8]),), TIER_HOST),
                               BlockStored((h2,), h1, (tuple(A[8:12]),), TIER_HOST)]
    original = [bytes(kv.pool[b]) for b in m.get_block_table("a")]
    m.free("a")
    _prefill(m, kv, "b", B)  # takes all 4 blocks: A's device copies are evicted (the host keeps its own)
    assert m.take_events()[0] == BlockRemoved((h2, h1, h0))
    m.free("b")
    _settle(tiers)
    hit = m.lookup_prefix(A + [1])
    assert hit.blocks == [] and [h.entry.slot for h in hit.lower] == [0, 1, 2] and hit.num_tokens == 12
    assert m.allocate_slots("c", 12, 13, hit)
    # B's blocks joined the free queue as their copies finished, two at a time, tail first.
    assert m.get_block_table("c") == [2, 3, 0, 1]
    assert m.take_swap_ins() == [(0, 2), (1, 3), (2, 0)]  # (host slot, device block)
    kv.copy_in([(0, 2), (1, 3), (2, 0)])
    m.finish_swap_ins()
    assert [bytes(kv.pool[b]) for b in (2, 3, 0)] == original  # the same bytes came back
    assert tiers.stats[TIER_HOST].hits == 3 and m.pool.prefix_hit_tokens == 12
    m.cache_computed_blocks("c", A + [1], 12)  # now ordinary cached device blocks again
    assert [m.pool.cached[h].block_id for h in (h0, h1, h2)] == [2, 3, 0]


def test_host_evictions_spill_to_disk_and_disk_hits_come_back(tmp_path) -> None:
    m, tiers, kv = _tiered(num_blocks=4, slots=4, disk_dir=tmp_path, disk_files=8)
    assert tiers.spill_ahead == 1  # one slot kept free (or on its way) ahead of need
    hashes = hash_prompt_blocks(A, BS)
    _prefill(m, kv, "a", A)
    original = [bytes(kv.pool[b]) for b in m.get_block_table("a")]
    m.free("a")
    _settle(tiers)
    assert [e.block_hash for e in tiers.host.lru()] == list(hashes) and tiers.host.free_slots() == [3]
    _prefill(m, kv, "b", B)  # evicts A from the device pool; B's blocks push A's down to disk
    m.free("b")
    _settle(tiers)
    _settle(tiers)
    stored, removed, _ = fold_kv_events_by_tier(m.take_events())
    b0 = hash_prompt_blocks(B, BS)[0]  # 4 of B's into 4 slots, one kept free: B's first went down too
    assert stored[TIER_DISK] == [*hashes, b0] and removed[TIER_HOST] == [*hashes, b0]
    assert sorted(os.listdir(tmp_path)) == sorted([".lock"] + [f"{h:016x}.kvb" for h in (*hashes, b0)])
    assert m.held_tiers(A) == [TIER_DISK] * 3
    hit = m.lookup_prefix(A + [1])  # reads them back from their files into host slots
    assert [h.source for h in hit.lower] == [TIER_DISK] * 3
    assert m.allocate_slots("c", 12, 13, hit)
    kv.copy_in(m.take_swap_ins())
    m.finish_swap_ins()
    assert [bytes(kv.pool[b]) for b in m.get_block_table("c")[:3]] == original
    assert tiers.stats[TIER_DISK].hits == 3 and tiers.stats[TIER_DISK].onboard_seconds.count == 3
    tiers.close()


def test_corrupt_file_is_a_miss_and_counted(tmp_path) -> None:
    m, tiers, kv = _tiered(num_blocks=4, slots=2, disk_dir=tmp_path, disk_files=8)
    h0 = hash_prompt_blocks(A, BS)[0]
    _prefill(m, kv, "a", A)
    m.free("a")
    _settle(tiers)
    _settle(tiers)
    raw = bytearray(tiers.disk.path(h0).read_bytes())
    raw[-1] ^= 0x01  # one bit of the payload
    tiers.disk.path(h0).write_bytes(bytes(raw))
    _prefill(m, kv, "b", B)
    m.free("b")
    m.take_events()
    hit = m.lookup_prefix(A + [1])
    assert hit.num_tokens == 0  # h0 is the first block: nothing after it can be used
    assert tiers.stats[TIER_DISK].errors["checksum"] == 1
    _, removed, _ = fold_kv_events_by_tier(m.take_events())
    assert removed[TIER_DISK] == [h0]
    _settle(tiers)
    assert not tiers.disk.path(h0).exists()
    tiers.close()


def test_held_tiers_and_pin_prefix_for_export() -> None:
    m, tiers, kv = _tiered(num_blocks=4, slots=8)
    _prefill(m, kv, "a", A)
    _settle(tiers)
    hashes = hash_prompt_blocks(A, BS)
    assert m.held_tiers(A) == [TIER_DEVICE] * 3
    assert m.held_tiers(A, [hashes[0], 123]) == [TIER_DEVICE]  # a hash of another model stops it
    m.free("a")
    _prefill(m, kv, "b", B[:12])  # evicts A's last two blocks (freed tail first) from the device pool
    m.free("b")
    _settle(tiers)
    assert m.held_tiers(A) == [TIER_DEVICE, TIER_HOST, TIER_HOST]
    hit = m.pin_prefix("export:x", A, 3)
    assert hit.num_tokens == 12 and len(hit.blocks) == 1 and len(hit.lower) == 2
    table = m.get_block_table("export:x")
    assert m.take_swap_ins() == [(1, table[1]), (2, table[2])]
    m.finish_swap_ins()
    assert all(m.pool.blocks[b].ref_cnt == 1 for b in table)
    m.free("export:x")
    assert all(m.pool.blocks[b].ref_cnt == 0 for b in table)


def test_allocation_waits_for_copies_instead_of_failing() -> None:
    """Blocks held only by host-tier copies in flight never make an allocation fail."""
    m, tiers, kv = _tiered(num_blocks=3, slots=4)
    _prefill(m, kv, "a", A)
    m.free("a")
    tiers.service()
    assert tiers.device_pins == 3 and m.num_free_blocks == 0
    assert m.can_allocate("b", 0, 12) and m.allocate_slots("b", 0, 12)
    assert tiers.device_pins == 0
