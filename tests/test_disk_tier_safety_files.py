"""The disk KV tier's files against what a real filesystem does to them (issue 49): modes whatever
the umask, files torn by a power cut, another model's files under the budget, a real write
failure that pauses the tier and a retry that ends the pause, and symlinks planted in the
directory, never followed. Real files, real os.stat, real symlinks; no model."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from engine.kv_tiers.block_file import KVLayout
from engine.kv_tiers.disk import DiskTier, write_block_file

BS = 4
LAYOUT = KVLayout("fp-test", BS, 1, 1, 1, "uint8", 1)  # a block's KV is 8 bytes
OTHER = KVLayout("fp-other-model", BS, 1, 1, 1, "uint8", 1)
PAYLOAD = memoryview(bytes(range(LAYOUT.block_bytes)))


def _size(name: str) -> int | None:
    return {"uint8": 1}.get(name)


def _write(d: DiskTier, h: int, layout: KVLayout = LAYOUT, mtime_ns: int | None = None) -> None:
    write_block_file(d.path(h), d.temp_path(h), layout, h, None, [h] * BS, PAYLOAD)
    if mtime_ns is not None:
        os.utime(d.path(h), ns=(mtime_ns, mtime_ns))


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)  # the usual default: files 0644, directories 0755
    yield
    os.umask(old)


def test_block_files_are_0600_in_a_0700_directory_whatever_the_umask(tmp_path, loose_umask):
    d = DiskTier(tmp_path / "new" / "kv", 10**6, LAYOUT, _size)
    _write(d, 1)
    assert _mode(d.directory) == 0o700 and _mode(d.path(1)) == 0o600 and _mode(d.directory / ".lock") == 0o600
    d.close()
    # A directory and files an older version left with the umask's modes are narrowed.
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    d = DiskTier(old, 10**6, LAYOUT, _size)
    _write(d, 2)
    d.close()
    os.chmod(old, 0o755)
    os.chmod(old / "0000000000000002.kvb", 0o644)
    os.chmod(old / ".lock", 0o644)
    d = DiskTier(old, 10**6, LAYOUT, _size)
    assert [e.block_hash for e in d.scan().kept] == [2]
    assert (_mode(old), _mode(old / "0000000000000002.kvb"), _mode(old / ".lock")) == (0o700, 0o600, 0o600)
    d.close()


def test_torn_files_are_deleted_and_not_counted_as_foreign(tmp_path):
    d = DiskTier(tmp_path, 10**6, LAYOUT, _size)
    for h in (1, 2, 3, 4, 5):
        _write(d, h)
    _write(d, 6, OTHER)
    full = d.path(1).stat().st_size
    os.truncate(d.path(2), full - 3)  # the payload cut short
    os.truncate(d.path(3), 40)  # cut inside the header
    os.truncate(d.path(4), 0)  # renamed, then the power went before any byte reached the disk
    os.truncate(d.path(6), full - 1)  # another model's, but torn: nobody can use it
    with open(d.path(5), "ab") as f:
        f.write(b"x")  # its size does not match its header either: damage, deleted the same way
    res = d.scan()
    assert [e.block_hash for e in res.kept] == [1]
    assert res.refused == {} and res.torn == 5 and res.removed == 5
    assert sorted(p.name for p in tmp_path.glob("*.kvb")) == ["0000000000000001.kvb"]
    d.close()


def test_another_models_files_count_in_the_budget_and_are_evicted_first(tmp_path):
    d = DiskTier(tmp_path, 10**6, LAYOUT, _size)
    fb = d.file_bytes
    _write(d, 1, OTHER, mtime_ns=10)
    _write(d, 2, OTHER, mtime_ns=20)
    _write(d, 3, mtime_ns=5)  # ours, and older than both: still not the first to go
    d.close()
    foreign_bytes = d.path(1).stat().st_size
    d = DiskTier(tmp_path, fb + 2 * foreign_bytes, LAYOUT, _size)
    res = d.scan()
    # Exactly room for the three: nothing deleted yet, all counted.
    assert [e.block_hash for e in res.kept] == [3] and [e.block_hash for e in res.foreign] == [1, 2]
    assert res.refused == {"foreign": 2} and d.used_bytes == fb + 2 * foreign_bytes
    assert d.get(1, [1] * BS) is None  # never a hit
    entry, evicted = d.plan_write(7, None, [7] * BS)  # a new block of ours: the oldest foreign file goes
    assert [e.block_hash for e in evicted] == [1] and list(d.entries) == [2, 3, 7]
    d.close()
    # Over the budget at start: the foreign files are deleted first, ours kept.
    d = DiskTier(tmp_path, fb + 1, LAYOUT, _size)
    res = d.scan()
    assert [e.block_hash for e in res.kept] == [3] and res.evicted == 2
    assert not d.path(1).exists() and not d.path(2).exists() and d.path(3).exists()
    d.close()


def test_a_real_write_failure_pauses_the_tier_then_a_retry_ends_the_pause(tmp_path):
    now = [100.0]
    kv = tmp_path / "kv"
    d = DiskTier(kv, 10**6, LAYOUT, _size, retry_s=(5.0, 300.0), clock=lambda: now[0])
    entry, _ = d.plan_write(1, None, [1] * BS)
    shutil.rmtree(kv)  # the volume went away: the kernel answers ENOENT
    with pytest.raises(FileNotFoundError):
        _write(d, 1)
    d.written(entry, False)
    d.write_failed("io_error", "writing a block file failed")
    assert not d.admitting and d.plan_write(2, None, [2] * BS) is None and d.stopped_reason == "io_error"
    now[0] += 4.0
    d.write_failed("io_error", "a write queued before the pause")  # does not lengthen it
    now[0] += 1.0
    assert d.admitting  # 5 s after the first failure: the next write is the retry
    entry, _ = d.plan_write(2, None, [2] * BS)
    with pytest.raises(FileNotFoundError):
        _write(d, 2)  # still gone: the next pause is twice as long
    d.written(entry, False)
    d.write_failed("io_error", "again")
    now[0] += 9.0
    assert not d.admitting
    now[0] += 1.0
    kv.mkdir()  # back
    entry, _ = d.plan_write(3, None, [3] * BS)
    _write(d, 3)
    d.written(entry, True)  # a write that succeeds ends the backoff
    assert d.admitting and d.get(3, [3] * BS) is entry and _mode(d.path(3)) == 0o600
    d.write_failed("no_space", "full")
    now[0] += 5.0
    assert d.admitting  # a pause of 5 s again, not 20
    d.close()
    assert not d.admitting  # closed: for good


def test_symlinks_planted_in_the_directory_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    src = DiskTier(outside, 10**6, LAYOUT, _size)
    _write(src, 9)  # a valid block file of our layout, outside the cache
    src.close()
    target = outside / "0000000000000009.kvb"
    victim = outside / "victim"
    victim.write_bytes(b"not yours")
    before = target.read_bytes()
    kv = tmp_path / "kv"
    d = DiskTier(kv, 10**6, LAYOUT, _size)
    os.symlink(target, d.path(9))  # a block file by name, the scan must not read through it
    res = d.scan()
    assert res.kept == [] and res.refused == {"symlink": 1} and 9 not in d.entries
    # A link at the temporary name: the write replaces the link, never writes the victim.
    os.symlink(victim, d.temp_path(4))
    _write(d, 4)
    assert victim.read_bytes() == b"not yours" and stat.S_ISREG(os.lstat(d.path(4)).st_mode)
    # A ready block replaced by a link after the scan: its read fails (ELOOP), a miss.
    entry, _ = d.plan_write(5, None, [9] * BS)
    d.written(entry, True)
    os.symlink(target, d.path(5))
    with pytest.raises(OSError):
        d.read_file(entry, memoryview(bytearray(LAYOUT.block_bytes)))
    assert target.read_bytes() == before
    d.close()
