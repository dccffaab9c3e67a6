"""KVCacheManager: exact block ids on tiny configs, then a stateful model check that also
simulates the KV contents, so a missed copy-on-write or a bad prefix hit shows up as a
sequence reading someone else's tokens."""
from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache_manager import KVCacheManager, PrefixHit
from kv_index.events import BlockRemoved, BlockStored
from tokens.block_hash import hash_block_tokens, hash_prompt_blocks

BS = 4


def _mgr(num_blocks: int = 8, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks=num_blocks, block_size=BS, **kw)


def _prefill(m: KVCacheManager, sid: str, tokens: list[int], use_cache: bool = True) -> PrefixHit:
    hit = m.lookup_prefix(tokens) if use_cache else PrefixHit([], 0)
    assert m.allocate_slots(sid, hit.num_tokens, len(tokens), hit)
    m.cache_computed_blocks(sid, tokens, len(tokens))
    return hit


A = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108 109]


def test_allocate_cache_free_exact_ids_and_events() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    assert m.get_block_table("a") == [0, 1, 2]
    h0, h1 = hash_prompt_blocks(A, BS)
    assert m.take_events() == [
        BlockStored((h0,), None, (tuple(A[0:4]),)),
        BlockStored((h1,), h0, (tuple(A[4:8]),)),
    ]
    m.free("a")
    assert not m.has_seq("a")
    assert m.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.num_free_blocks == 8 and m.usage == 0.0


def test_prefix_hit_reuses_the_exact_blocks() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    m.free("a")
    b = A[:8] + [7, 7, 7]
    hit = m.lookup_prefix(b)
    assert [x.block_id for x in hit.blocks] == [0, 1] and hit.num_tokens == 8
    # Both hit blocks leave the free queue, plus one fresh block for tokens 8..10.
    assert m.num_new_blocks("b", 8, len(b), hit) == 3
    assert m.allocate_slots("b", 8, len(b), hit)
    assert m.get_block_table("b") == [0, 1, 3]
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 2]
    assert m.take_copies() == []
    assert m.pool.prefix_query_tokens == 10 + 11 and m.pool.prefix_hit_tokens == 0 + 8
    # While "b" holds them, a second hit shares them without taking any free block.
    hit2 = m.lookup_prefix(A[:8] + [1])
    assert m.num_new_blocks("c", 8, 9, hit2) == 1


def test_hit_leaves_at_least_one_token_to_compute() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    assert m.lookup_prefix(A[:8]).num_tokens == 4  # (8 - 1) // 4 = 1 block
    assert m.lookup_prefix(A[:9]).num_tokens == 8
    assert m.lookup_prefix(A[:4]).num_tokens == 0
    assert m.lookup_prefix([]).num_tokens == 0


def test_hit_stops_at_first_miss_and_tokens_are_verified() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    assert m.lookup_prefix([0, 0, 0, 0] + A[4:]).num_tokens == 0  # same block 1, other prefix
    m.free("a")
    m.reset_prefix_cache()
    # A colliding entry: registered under A's first hash but holding other tokens.
    (blk,) = m.pool.allocate(1)
    m.pool.cache_full_block(blk, hash_prompt_blocks(A, BS)[0], [9, 9, 9, 9], None)
    assert m.lookup_prefix(A).num_tokens == 0


def test_extra_key_separates_models() -> None:
    m1, m2 = _mgr(extra_key=b"model-1"), _mgr(extra_key=b"model-2")
    _prefill(m1, "a", A)
    _prefill(m2, "a", A)
    (e1, _), (e2, _) = m1.take_events(), m2.take_events()
    assert e1.block_hashes != e2.block_hashes
    assert e1.block_hashes[0] == hash_block_tokens(None, A[:4], b"model-1")


def test_fork_then_copy_on_write_exact_pairs() -> None:
    m = _mgr()
    _prefill(m, "a", A[:6])  # blocks 0 (full, cached), 1 (2 of 4 slots)
    m.fork("a", "b")
    assert m.get_block_table("b") == [0, 1]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    # "b" writes position 6, inside shared block 1: it gets a copy, block 0 stays shared.
    assert m.num_new_blocks("b", 6, 7) == 1
    assert m.allocate_slots("b", 6, 7)
    assert m.take_copies() == [(1, 2)]
    assert m.take_copies() == []
    assert m.get_block_table("b") == [0, 2] and m.get_block_table("a") == [0, 1]
    assert [m.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    # "a" is now the only holder of block 1: it writes in place.
    assert m.allocate_slots("a", 6, 7)
    assert m.take_copies() == []
    # A write that also grows: copy of the partial block plus a fresh one, copies first.
    m.fork("a", "c")
    assert m.allocate_slots("c", 7, 10)
    assert m.take_copies() == [(1, 3)]
    assert m.get_block_table("c") == [0, 3, 4]


def test_writing_into_a_cached_block_copies_it_and_keeps_the_cache_intact() -> None:
    m = _mgr()
    _prefill(m, "a", A[:8])  # blocks 0, 1 both full and cached
    m.take_events()
    m.truncate("a", 6)  # roll back below a cached block's end
    assert m.get_block_table("a") == [0, 1]
    assert m.allocate_slots("a", 6, 8)
    assert m.take_copies() == [(1, 2)]
    assert m.get_block_table("a") == [0, 2]
    assert m.pool.free_block_ids()[-1] == 1  # still cached, evictable
    assert m.lookup_prefix(A[:9]).num_tokens == 8
    m.cache_computed_blocks("a", A[:6] + [5, 5], 8)
    (ev,) = m.take_events()
    assert isinstance(ev, BlockStored) and ev.token_ids == ((104, 105, 5, 5),)


def test_truncate_frees_tail_first() -> None:
    m = _mgr()
    assert m.allocate_slots("a", 0, 13)
    assert m.get_block_table("a") == [0, 1, 2, 3]
    m.truncate("a", 5)
    assert m.get_block_table("a") == [0, 1]
    assert m.pool.free_block_ids() == [4, 5, 6, 7, 3, 2]
    m.truncate("a", 4)
    assert m.get_block_table("a") == [0]


def test_truncate_forgets_hash_progress() -> None:
    m = _mgr()
    _prefill(m, "a", A[:8])
    m.take_events()
    m.truncate("a", 4)
    new = A[:4] + [1, 2, 3, 4]
    assert m.allocate_slots("a", 4, 8)
    m.cache_computed_blocks("a", new, 8)
    h = hash_prompt_blocks(new, BS)
    assert m.take_events() == [BlockStored((h[1],), h[0], ((1, 2, 3, 4),))]


def test_failure_changes_nothing_and_eviction_is_reported() -> None:
    m = _mgr()
    _prefill(m, "a", A[:8])
    m.free("a")
    m.take_events()
    assert m.allocate_slots("b", 0, 20)  # 5 blocks: 2..7 minus one, never-used first
    assert m.get_block_table("b") == [2, 3, 4, 5, 6]
    hit = m.lookup_prefix(A[:9])
    assert hit.num_tokens == 8
    before = (m.pool.free_block_ids(), m.get_block_table("b"))
    assert not m.can_allocate("c", 8, 8 + 3 * BS + 1, hit)  # 2 revived + 3 fresh > 3 free
    assert not m.allocate_slots("c", 8, 8 + 3 * BS + 1, hit)
    assert (m.pool.free_block_ids(), m.get_block_table("b")) == before
    assert not m.has_seq("c") and m.take_events() == []
    assert m.allocate_slots("c", 0, 12)  # a miss instead: evicts block 1 (tail) then 0
    assert m.get_block_table("c") == [7, 1, 0]
    assert m.take_events() == [BlockRemoved(tuple(hash_prompt_blocks(A[:8], BS)[::-1]))]


def test_can_allocate_honours_the_reserve() -> None:
    m = _mgr()
    assert m.can_allocate("a", 0, 6 * BS, reserve_blocks=2)
    assert not m.can_allocate("a", 0, 6 * BS + 1, reserve_blocks=2)
    assert m.can_allocate("a", 0, 8 * BS)


def test_stale_hit_and_misuse_are_errors() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    m.free("a")
    hit = m.lookup_prefix(A)
    assert m.allocate_slots("x", 0, 8 * BS)  # evicts everything, the hit's blocks too
    with pytest.raises(ValueError, match="stale"):
        m.allocate_slots("b", hit.num_tokens, len(A), hit)
    with pytest.raises(ValueError):
        m.allocate_slots("x", 5, 4)
    m.free("x")
    hit = m.lookup_prefix(A)
    _prefill(m, "a", A)
    with pytest.raises(ValueError):
        m.allocate_slots("a", 10, 11, m.lookup_prefix(A))
    with pytest.raises(ValueError):
        m.fork("a", "a")
    m.free("never-seen")  # aborting a request that never got blocks is fine


def test_reset_prefix_cache() -> None:
    m = _mgr()
    _prefill(m, "a", A)
    assert not m.reset_prefix_cache()
    m.free("a")
    assert m.reset_prefix_cache()
    assert m.lookup_prefix(A).num_tokens == 0


def test_disabled_prefix_cache_never_hits_or_hashes() -> None:
    m = _mgr(enable_prefix_caching=False)
    _prefill(m, "a", A)
    m.free("a")
    assert m.lookup_prefix(A).num_tokens == 0
    assert m.take_events() == [] and m.pool.cached == {}


# ---- stateful model check ------------------------------------------------------------------

NB = 12
# Prompts start from a few shared heads so prefix hits (and evictions of hit blocks) happen.
HEADS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
token = st.integers(0, 3)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.m = KVCacheManager(NB, BS)
        self.tokens: dict[str, list[int]] = {}  # every token of a live seq is computed
        self.kv: dict[int, list[int | None]] = {i: [None] * BS for i in range(NB)}  # fake KV
        self.next_id = 0

    # -- helpers --

    def _snapshot(self):
        p = self.m.pool
        return (
            {s: self.m.get_block_table(s) for s in self.tokens if self.m.has_seq(s)},
            [b.ref_cnt for b in p.blocks],
            p.free_block_ids(),
            dict(p.cached),
            len(p._events),
            len(self.m._copies),
        )

    def _grow(self, sid: str, computed: int, new_tokens: list[int], hit: PrefixHit | None, cache: bool) -> bool:
        """allocate_slots, then do what the model runner would: copies, then KV writes."""
        old = self.tokens.get(sid, [])[:computed]
        total = computed + len(new_tokens)
        can = self.m.can_allocate(sid, computed, total, hit)
        needed = self.m.num_new_blocks(sid, computed, total, hit)
        free_before = self.m.num_free_blocks
        before = self._snapshot()
        ok = self.m.allocate_slots(sid, computed, total, hit)
        assert ok == can
        if not ok:
            event("allocation refused")
            assert self._snapshot() == before
            return False
        assert free_before - self.m.num_free_blocks <= needed  # COW sources may come back
        for src, dst in self.m.take_copies():
            event("copy on write")
            assert src != dst
            self.kv[dst] = list(self.kv[src])
        table = self.m.get_block_table(sid)
        toks = old + new_tokens
        for pos in range(computed, total):
            self.kv[table[pos // BS]][pos % BS] = toks[pos]
        self.tokens[sid] = toks
        if cache:
            self.m.cache_computed_blocks(sid, toks, total)
        return True

    def _pick(self, i: int) -> str:
        return sorted(self.tokens)[i % len(self.tokens)]

    # -- rules --

    @rule(head=st.sampled_from(HEADS), tail=st.lists(token, max_size=9), use_hit=st.booleans(), cache=st.booleans())
    def add_seq(self, head: list[int], tail: list[int], use_hit: bool, cache: bool) -> None:
        sid = f"s{self.next_id}"
        self.next_id += 1
        prompt = head + tail
        hit = self.m.lookup_prefix(prompt) if use_hit else None
        computed = hit.num_tokens if hit else 0
        if hit:
            event("prefix hit")
            assert computed <= len(prompt) - 1 and computed % BS == 0
            for i, b in enumerate(hit.blocks):
                assert self.kv[b.block_id] == prompt[i * BS : (i + 1) * BS]
        self.tokens[sid] = prompt[:computed]  # the hit part is "already computed"
        if not self._grow(sid, computed, prompt[computed:], hit, cache):
            del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 50), new=st.lists(token, min_size=1, max_size=6), cache=st.booleans())
    def append(self, i: int, new: list[int], cache: bool) -> None:
        sid = self._pick(i)
        self._grow(sid, len(self.tokens[sid]), new, None, cache)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 50))
    def fork(self, i: int) -> None:
        parent = self._pick(i)
        child = f"s{self.next_id}"
        self.next_id += 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 50))
    def free(self, i: int) -> None:
        sid = self._pick(i)
        self.m.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 50), keep=st.integers(0, 40))
    def truncate(self, i: int, keep: int) -> None:
        sid = self._pick(i)
        keep = min(keep, len(self.tokens[sid]))
        self.m.truncate(sid, keep)
        del self.tokens[sid][keep:]

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = all(b.ref_cnt == 0 for b in self.m.pool.blocks)
        assert self.m.reset_prefix_cache() == idle
        if idle:
            assert self.m.pool.cached == {}

    @rule()
    def drain_events(self) -> None:
        self.m.take_events()

    # -- invariants --

    @invariant()
    def tables_match_tokens_and_kv(self) -> None:
        for sid, toks in self.tokens.items():
            table = self.m.get_block_table(sid)
            assert len(table) == _cdiv(len(toks), BS)
            for pos, t in enumerate(toks):
                assert self.kv[table[pos // BS]][pos % BS] == t, (sid, pos)

    @invariant()
    def refcounts_and_free_queue(self) -> None:
        holders = [0] * NB
        for sid in self.tokens:
            for b in self.m.get_block_table(sid):
                holders[b] += 1
        p = self.m.pool
        assert [b.ref_cnt for b in p.blocks] == holders
        free_ids = p.free_block_ids()
        assert len(free_ids) == len(set(free_ids))
        assert set(free_ids) == {i for i, n in enumerate(holders) if n == 0}

    @invariant()
    def cache_is_consistent_with_kv(self) -> None:
        for h, b in self.m.pool.cached.items():
            assert b.block_hash == h
            assert self.kv[b.block_id] == list(b.token_ids)
        for b in self.m.pool.blocks:
            if b.block_hash is not None:
                assert self.m.pool.cached[b.block_hash] is b

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for sid in list(self.tokens):
            self.m.free(sid)
        assert self.m.num_free_blocks == NB
        assert all(b.ref_cnt == 0 for b in self.m.pool.blocks)


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
