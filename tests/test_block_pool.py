"""BlockPool on tiny configs: exact block ids, LRU eviction order, verification, events."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool, NoFreeBlocksError
from kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored
from tokens.block_hash import hash_block_tokens

BS = 4


def _hash(i: int) -> int:
    return hash_block_tokens(None, [i] * BS)


def _pool(n: int = 8) -> BlockPool:
    return BlockPool(num_blocks=n, block_size=BS)


def test_fresh_pool_hands_out_ids_in_order_starting_at_zero() -> None:
    pool = _pool()
    assert pool.free_block_ids() == list(range(8))
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)


def test_allocate_too_many_raises_and_changes_nothing() -> None:
    pool = _pool()
    pool.allocate(6)
    before = pool.free_block_ids()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.free_block_ids() == before
    assert pool.allocate(0) == []


def test_free_appends_in_the_order_given_and_lru_evicts_tail_first() -> None:
    pool = _pool()
    seq = pool.allocate(3)  # ids 0, 1, 2: a sequence's head .. tail
    for i, b in enumerate(seq):
        pool.cache_full_block(b, _hash(i), [i] * BS, None if i == 0 else _hash(i - 1))
    pool.take_events()
    pool.free(reversed(seq))  # tail first
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_free_blocks == 8  # cached but evictable blocks count as free

    got = pool.allocate(6)  # the 5 never-used blocks, then the sequence's tail
    assert [b.block_id for b in got] == [3, 4, 5, 6, 7, 2]
    assert pool.take_events() == [BlockRemoved((_hash(2),))]
    assert _hash(2) not in pool.cached and got[-1].block_hash is None and got[-1].token_ids is None
    # The head of the sequence is still there to be hit.
    assert pool.get_cached_block(_hash(0), [0] * BS) is pool.blocks[0]
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [1, 0]
    assert pool.take_events() == [BlockRemoved((_hash(1), _hash(0)))]
    assert pool.cached == {}


def test_touch_revives_an_evictable_block_out_of_the_middle_of_the_queue() -> None:
    pool = _pool()
    blocks = pool.allocate(8)
    pool.cache_full_block(blocks[4], _hash(4), [4] * BS, None)
    pool.free(blocks)
    hit = pool.get_cached_block(_hash(4), [4] * BS)
    assert hit is blocks[4]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert pool.free_block_ids() == [0, 1, 2, 3, 5, 6, 7]
    pool.touch([hit])  # a second holder: no queue change
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 7
    pool.free([hit])
    assert pool.num_free_blocks == 7
    pool.free([hit])
    assert pool.free_block_ids() == [0, 1, 2, 3, 5, 6, 7, 4]


def test_verification_rejects_a_hash_hit_with_other_tokens() -> None:
    pool = _pool()
    (b,) = pool.allocate(1)
    # Simulate a collision: the block is registered under the hash of [1,1,1,1] but holds 9s.
    pool.cache_full_block(b, _hash(1), [9] * BS, None)
    assert pool.get_cached_block(_hash(1), [1] * BS) is None
    assert pool.get_cached_block(_hash(1), [9] * BS) is b
    assert pool.get_cached_block(_hash(2), [9] * BS) is None


def test_events_and_duplicate_hash_keeps_the_first_block() -> None:
    pool = _pool()
    a, b = pool.allocate(2)
    pool.cache_full_block(a, _hash(1), [1] * BS, None)
    pool.cache_full_block(b, _hash(1), [1] * BS, None)  # same content computed twice
    pool.cache_full_block(a, _hash(1), [1] * BS, None)  # re-registering is a no-op
    assert pool.cached == {_hash(1): a}
    assert b.block_hash is None
    assert pool.take_events() == [BlockStored((_hash(1),), None, ((1,) * BS,))]
    assert pool.take_events() == []
    with pytest.raises(ValueError):
        pool.cache_full_block(a, _hash(2), [2] * BS, None)  # would overwrite cached KV
    with pytest.raises(ValueError):
        pool.cache_full_block(b, _hash(3), [3] * (BS - 1), None)  # partial blocks never cached


def test_reset_prefix_cache_only_when_nothing_is_referenced() -> None:
    pool = _pool()
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, _hash(1), [1] * BS, None)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and a.block_hash is None
    assert pool.take_events() == [AllBlocksCleared()]


def test_disabled_prefix_caching_registers_nothing() -> None:
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, _hash(1), [1] * BS, None)
    assert pool.cached == {} and pool.take_events() == []


def test_double_free_is_an_error() -> None:
    pool = _pool()
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(ValueError):
        pool.free([a])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch"]), st.integers(0, 8)), max_size=60))
def test_free_queue_is_exactly_the_unreferenced_blocks(ops: list[tuple[str, int]]) -> None:
    pool = _pool()
    held = []  # one entry per reference
    for op, k in ops:
        if op == "alloc":
            if k <= pool.num_free_blocks:
                held += pool.allocate(k)
            else:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(k)
        elif op == "free" and held:
            pool.free([held.pop(k % len(held))])
        elif op == "touch" and held:
            b = held[k % len(held)]
            pool.touch([b])
            held.append(b)
        free_ids = pool.free_block_ids()
        assert len(free_ids) == len(set(free_ids))
        assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        for b in pool.blocks:
            assert b.ref_cnt == sum(1 for h in held if h is b)
    pool.free(held)
    assert pool.num_free_blocks == 8
