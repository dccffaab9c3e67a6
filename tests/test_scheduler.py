"""Scheduler invariants on plain data: a real KVCacheManager, a fake 'model' that maps token
histories to the next token deterministically, no torch."""
from __future__ import annotations

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import SampledTokens, Scheduler
from engine.sequence import FinishReason, Sequence, seq_id_of
from tokens.sampling_params import SamplingParams


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97 + 3


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, watermark=0.0, caching=True, chunked=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, enable_chunked_prefill=chunked),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, watermark=watermark,
                    enable_prefix_caching=caching),
        kv,
        max_model_len=1024,
        eos_token_ids=(),
    )
    return sched, kv


def add(sched, rid, prompt, max_tokens=5, n=1):
    seq = Sequence(request_id=rid, index=0, token_ids=list(prompt), num_prompt_tokens=len(prompt),
                   params=SamplingParams(max_tokens=max_tokens, n=n, temperature=0.0), arrival_time=0.0)
    sched.add_sequence(seq)
    return seq


def step(sched):
    out = sched.schedule()
    sampled = {}
    for item in out.scheduled:
        if item.sample:
            base = next_token(item.seq.token_ids)
            sampled[item.seq.seq_id] = SampledTokens([base + k for k in range(item.num_samples)])
    sched.update_from_output(out, sampled)
    return out


def run_all(sched, max_steps=1000):
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        outs.append(step(sched))
    raise AssertionError("did not finish")


def test_chunked_prefill_splits_prompt_under_budget_and_samples_once():
    sched, kv = make(budget=8)
    seq = add(sched, "a", list(range(20)), max_tokens=2)
    o1, o2, o3 = step(sched), step(sched), step(sched)
    assert [(i.start, i.num_new_tokens, i.sample) for i in o1.scheduled] == [(0, 8, False)]
    assert [(i.start, i.num_new_tokens, i.sample) for i in o2.scheduled] == [(8, 8, False)]
    assert [(i.start, i.num_new_tokens, i.sample) for i in o3.scheduled] == [(16, 4, True)]
    assert seq.num_output_tokens == 1
    run_all(sched)
    assert seq.finish_reason is FinishReason.LENGTH
    assert kv.num_free_blocks == kv.num_blocks


def test_chunked_equals_one_shot_tokens():
    prompts = {f"r{i}": [(i * 7 + j) % 50 + 3 for j in range(5 + 9 * i)] for i in range(5)}
    results = []
    for budget in (4, 7, 512):
        sched, _ = make(budget=budget)
        seqs = [add(sched, rid, p, max_tokens=6) for rid, p in prompts.items()]
        run_all(sched)
        results.append([s.output_token_ids for s in seqs])
    assert results[0] == results[1] == results[2]


def test_decodes_and_new_prefill_share_a_step():
    sched, _ = make(budget=16)
    add(sched, "a", [5, 6, 7], max_tokens=10)
    step(sched)  # prefill a
    add(sched, "b", list(range(3, 13)))
    out = step(sched)
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 10)]


def test_prefix_cache_hit_skips_cached_tokens():
    sched, kv = make(block_size=4)
    prompt = list(range(3, 14))  # 11 tokens: 2 full blocks
    a = add(sched, "a", prompt, max_tokens=2)
    run_all(sched)
    b = add(sched, "b", prompt, max_tokens=2)
    out = step(sched)
    assert out.scheduled[0].start == 8 and out.scheduled[0].num_new_tokens == 3
    assert b.num_cached_tokens == 8
    run_all(sched)
    assert a.output_token_ids == b.output_token_ids


def test_watermark_blocks_admission_of_new_requests():
    # 10 blocks of 4, watermark 0.2 -> 2 blocks must stay free after admitting.
    sched, kv = make(num_blocks=10, block_size=4, budget=64, watermark=0.2, caching=False)
    add(sched, "a", list(range(3, 3 + 24)), max_tokens=4)  # 6 blocks + growth
    step(sched)
    add(sched, "b", list(range(3, 3 + 9)), max_tokens=2)  # needs 3 blocks: 10-7-3 = 0 < 2
    out = step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert sched.num_waiting == 1


def test_preemption_by_recompute_gives_the_same_tokens():
    prompts = {f"r{i}": [(i * 5 + j) % 60 + 3 for j in range(6 + 3 * i)] for i in range(6)}
    ample, _ = make(num_blocks=256, caching=False)
    ref = [add(ample, rid, p, max_tokens=12) for rid, p in prompts.items()]
    run_all(ample)
    assert ample.num_preemptions == 0

    tight, kv = make(num_blocks=14, block_size=4, caching=True)
    seqs = [add(tight, rid, p, max_tokens=12) for rid, p in prompts.items()]
    run_all(tight)
    assert tight.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in ref]
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_frees_every_block_wherever_the_request_is():
    sched, kv = make(num_blocks=32, block_size=4, budget=8)
    add(sched, "running", list(range(3, 20)), max_tokens=50)
    add(sched, "waiting", list(range(3, 40)), max_tokens=50)
    step(sched)
    step(sched)
    sched.abort("running")
    sched.abort("waiting")
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == kv.num_blocks
    for s in sched.sequences("running") + sched.sequences("waiting"):
        assert s.finish_reason is FinishReason.ABORT


def test_n_samples_fork_share_prompt_blocks_with_copy_on_write():
    sched, kv = make(num_blocks=32, block_size=4, budget=64)
    prompt = list(range(3, 13))  # 10 tokens: 2 full + 1 partial block
    parent = add(sched, "r", prompt, max_tokens=3, n=3)
    step(sched)  # prefill + first tokens; forks into 3 samples
    seqs = sched.sequences("r")
    assert [s.index for s in seqs] == [0, 1, 2]
    tables = [kv.get_block_table(s.seq_id) for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    first = next_token(prompt)  # the fake model's k-th sample is first + k
    assert [s.output_token_ids for s in seqs] == [[first], [first + 1], [first + 2]]
    assert parent is seqs[0]
    out = step(sched)
    # The partial last block is shared: the first two writers copy it, the last owns it.
    assert len(out.block_copies) == 2
    tables = [kv.get_block_table(s.seq_id) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    run_all(sched)
    assert sched.request_finished("r")
    assert kv.num_free_blocks == kv.num_blocks


def test_max_num_seqs_caps_the_running_batch():
    sched, _ = make(max_seqs=2, budget=64)
    for i in range(4):
        add(sched, f"r{i}", [3, 4, 5 + i], max_tokens=3)
    out = step(sched)
    assert len(out.scheduled) == 2 and sched.num_waiting == 2


@pytest.mark.parametrize("caching", [True, False])
def test_many_requests_leave_no_block_behind(caching):
    sched, kv = make(num_blocks=20, block_size=4, budget=12, caching=caching)
    for i in range(12):
        add(sched, f"r{i}", [(i + j) % 40 + 3 for j in range(3 + i % 9)], max_tokens=4 + i % 5, n=1 + i % 3)
    run_all(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_lookahead_slots_never_preempt_another_sequence():
    """Two decoding sequences fill the pool; asking for draft slots that do not fit drops the
    drafts (plain decode this step) instead of preempting the other sequence."""
    sched, kv = make(num_blocks=4, block_size=4, budget=64)
    a = add(sched, "a", list(range(7)), max_tokens=20)
    b = add(sched, "b", list(range(10, 17)), max_tokens=20)
    step(sched)  # both prefilled: 7 tokens + 1 sampled = 2 blocks each, pool full
    assert kv.num_free_blocks == 0
    out = sched.schedule({a.seq_id: 6, b.seq_id: 6})
    assert not out.preempted
    assert [it.num_lookahead for it in out.scheduled] == [0, 0]
    assert {it.seq.seq_id for it in out.scheduled} == {a.seq_id, b.seq_id}


def test_resident_kv_passes_a_prompt_that_waits_for_memory():
    """A decode node's prefilled request holds its prompt's blocks while it waits. If it had to
    queue behind a prompt that waits for memory, and nothing runs to free any, the node would
    deadlock (it did under load); such a request may pass, a new prompt may not."""
    sched, kv = make(num_blocks=10, block_size=4, budget=64, caching=False)
    big = add(sched, "big", list(range(3, 3 + 36)), max_tokens=2)  # 9 blocks + growth: cannot fit yet
    prompt = list(range(50, 66))  # 4 blocks, its KV already in the pool (pushed by a prefill node)
    assert kv.allocate_slots(seq_id_of("resident", 0), 0, len(prompt))
    resident = Sequence(request_id="resident", index=0, token_ids=prompt + [next_token(prompt)],
                        num_prompt_tokens=len(prompt), params=SamplingParams(max_tokens=3, temperature=0.0),
                        arrival_time=0.0, num_computed_tokens=len(prompt))
    sched.add_sequence(resident)
    small = add(sched, "small", [7, 8, 9], max_tokens=2)  # would fit, but arrived after "big": waits
    out = step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["resident"]
    assert [s.request_id for s in sched.waiting] == ["big", "small"]
    run_all(sched)
    assert big.is_finished and small.is_finished and resident.is_finished
    assert kv.num_free_blocks == 10
