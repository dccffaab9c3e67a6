"""Engine behaviour on tiny random-weight models: batching invariants, preemption, abort,
prefix caching, forks, seeds and bad input."""
from __future__ import annotations

import random

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.models.tiny import save_tiny_model
from tokens.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """This module's own tiny model, in place of conftest's: seed 3, not 0 (the same sizes)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=3)


def make_engine(path, num_blocks=256, budget=512, max_seqs=16, caching=True, block_size=4):
    return LLMEngine(
        EngineConfig(
            model=str(path), dtype="float32", device="cpu",
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        ),
        load_tokenizer=False,
    )


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def token_ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_batched_greedy_equals_one_at_a_time(tiny_dir):
    ps = prompts()
    batched = token_ids(make_engine(tiny_dir).generate(ps, GREEDY))
    eng = make_engine(tiny_dir)
    alone = [token_ids(eng.generate([p], GREEDY))[0] for p in ps]
    assert batched == alone


def test_chunked_prefill_equals_one_shot(tiny_dir):
    ps = prompts(seed=1)
    one_shot = token_ids(make_engine(tiny_dir, budget=512).generate(ps, GREEDY))
    chunked_engine = make_engine(tiny_dir, budget=7)
    chunked = token_ids(chunked_engine.generate(ps, GREEDY))
    assert chunked == one_shot


def test_preemption_then_resume_gives_the_same_tokens(tiny_dir):
    ps = prompts(8, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)
    ref = token_ids(make_engine(tiny_dir).generate(ps, params))
    tight = make_engine(tiny_dir, num_blocks=24, block_size=4)
    got = token_ids(tight.generate(ps, params))
    assert tight.scheduler.num_preemptions > 0
    assert got == ref
    assert tight.kv.num_free_blocks == tight.num_blocks


def test_abort_frees_all_blocks(tiny_dir):
    eng = make_engine(tiny_dir, budget=16)
    ids = [eng.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=50)) for p in prompts(5)]
    for _ in range(4):
        eng.step()
    for rid in ids:
        assert eng.abort(rid)
    outs = eng.step()
    assert {o.request_id for o in outs if o.finished} == set(ids)
    assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert not eng.has_unfinished_requests()
    assert not eng.abort("never-added")


def test_prefix_cache_hit_reuses_blocks_and_keeps_output(tiny_dir):
    eng = make_engine(tiny_dir, block_size=4)
    shared = list(range(10, 30))
    first = eng.generate([shared + [5, 6, 7]], GREEDY)[0]
    second = eng.generate([shared + [5, 6, 7]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    cold = make_engine(tiny_dir, caching=False).generate([shared + [5, 6, 7]], GREEDY)[0]
    assert cold.outputs[0].token_ids == first.outputs[0].token_ids


def test_kv_events_report_stored_and_removed_blocks(tiny_dir):
    eng = make_engine(tiny_dir, num_blocks=8, block_size=4)
    eng.generate([list(range(3, 15))], SamplingParams(temperature=0.0, max_tokens=2))
    stored = [e for e in eng.take_kv_events() if type(e).__name__ == "BlockStored"]
    assert sum(len(e.block_hashes) for e in stored) == 3
    # A different long prompt needs every block: the cached ones get evicted.
    eng.generate([list(range(100, 126))], SamplingParams(temperature=0.0, max_tokens=2))
    removed = [e for e in eng.take_kv_events() if type(e).__name__ == "BlockRemoved"]
    assert removed


def test_n_samples_with_seed_are_distinct_and_reproducible(tiny_dir):
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=123)
    a = make_engine(tiny_dir).generate([[5, 6, 7, 8, 9]], params)[0]
    b = make_engine(tiny_dir).generate([[5, 6, 7, 8, 9], [40, 41]], [params, SamplingParams(max_tokens=4)])[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert token_ids([a]) == token_ids([b])
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_logprobs_are_returned_per_token(tiny_dir):
    out = make_engine(tiny_dir).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))[0]
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 4
    assert all(lp <= 0.0 for lp in c.logprobs)


def test_bad_requests_name_the_limit(tiny_dir):
    eng = make_engine(tiny_dir, num_blocks=64, block_size=4)
    ctx = eng.max_model_len
    with pytest.raises(InvalidRequestError, match=rf"{ctx + 5} tokens.*{ctx}"):
        eng.add_request(prompt_token_ids=[5] * (ctx + 5))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request(prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=0))
    with pytest.raises(InvalidRequestError, match=str(ctx)):
        eng.add_request(prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=ctx))
    with pytest.raises(InvalidRequestError, match="KV blocks"):
        eng.add_request(prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=300))
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request(prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match="token ids"):
        eng.add_request(prompt_token_ids=[5, 10**6])
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert not eng.has_unfinished_requests()


def test_bfloat16_engine_runs(tiny_dir):
    eng = LLMEngine(EngineConfig(model=str(tiny_dir), dtype="bfloat16", device="cpu",
                                 cache=CacheConfig(num_blocks=64)), load_tokenizer=False)
    out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert eng.kv_cache.dtype == torch.bfloat16


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=10, min_tokens=10),
], ids=["greedy", "seeded"])
def test_prefill_role_hands_kv_to_a_decode_role_engine(tiny_dir, params):
    """The disaggregated path without the network: engine P prefills and holds the blocks,
    their KV is copied into blocks reserved on engine D, D continues; tokens equal one engine
    (seeded sampling too: generators derive from (seed, sample, step), not from history)."""
    prompt = list(range(20, 58))
    ref = make_engine(tiny_dir).generate([prompt], params)[0].outputs[0].token_ids

    p_eng, d_eng = make_engine(tiny_dir), make_engine(tiny_dir)
    # D already holds the first 8 tokens (2 blocks) in its prefix cache: they are not sent.
    d_eng.generate([prompt[:9]], SamplingParams(temperature=0.0, max_tokens=1))
    from dataclasses import replace

    first = p_eng.generate([prompt], replace(params, max_tokens=1, min_tokens=0), hold_kv=True)[0]
    rid = first.request_id
    src = p_eng.held_block_table(rid)
    dst, cached = d_eng.reserve_kv("r1", prompt)
    assert cached == 8 and len(dst) == len(src)
    skip = cached // d_eng.block_size
    d_eng.kv_cache[:, dst[skip:]] = p_eng.kv_cache[:, src[skip:]]
    p_eng.release_kv(rid)
    assert p_eng.kv.num_free_blocks == p_eng.num_blocks

    d_eng.add_prefilled_request("r1", prompt, first.outputs[0].token_ids, params, num_cached_tokens=0)
    got = []
    while d_eng.has_unfinished_requests():
        for out in d_eng.step():
            got += out.outputs[0].new_token_ids
    assert got == ref
    assert d_eng.kv.num_free_blocks == d_eng.num_blocks
