"""Tensor parallelism inside one engine (engine/parallel/): the refusals as plain logic; TP 2 on
real worker processes over a real gloo group gives TP 1's greedy tokens through the paged KV
path; a worker killed (SIGKILL) or frozen (SIGSTOP) fails the next step with a clear error
within its bound."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.models.config import ModelConfig
from engine.parallel.executor import start_tp_engine
from engine.parallel.kv_regroup import LandingArea, gather_blocks, landing_slots, scatter_blocks
from engine.parallel.plan import (
    TensorParallelConfig,
    TensorParallelError,
    check_tensor_parallel,
    fitting_sizes,
    shard_config,
    shard_slice,
)
from engine.parallel.step import StepInputs, pack, payload_len, unpack
from tokens.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 42, 101, 7], [300, 12, 9], list(range(20, 43)), [77] * 5]


def _cfg(heads: int, kv_heads: int, intermediate: int = 1536) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", model_type="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=intermediate, num_layers=30, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5, rope_scaling=None,
                       max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
                       o_proj_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,), sliding_window=None)


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_both_numbers():
    smollm2 = _cfg(9, 3)  # SmolLM2-135M's heads
    check_tensor_parallel(smollm2, 3, "cpu", 0)
    with pytest.raises(TensorParallelError) as e:
        check_tensor_parallel(smollm2, 2, "cpu", 0)
    msg = str(e.value)
    assert "9 attention heads" in msg and "3 KV heads" in msg and "size 2" in msg and "1, 3 fit" in msg
    with pytest.raises(TensorParallelError, match="KV heads \\(2\\)"):
        check_tensor_parallel(_cfg(12, 2), 3, "cpu", 0)  # 12 heads split, 2 KV heads do not
    with pytest.raises(TensorParallelError, match="MLP intermediate size \\(100\\)"):
        check_tensor_parallel(_cfg(8, 8, intermediate=100), 8, "cpu", 0)
    assert fitting_sizes(smollm2) == [1, 3]


def test_more_ranks_than_devices_is_refused():
    check_tensor_parallel(_cfg(8, 4), 4, "cuda", 4)
    with pytest.raises(TensorParallelError, match="needs 4 cuda devices, this machine has 2"):
        check_tensor_parallel(_cfg(8, 4), 4, "cuda", 2)
    with pytest.raises(TensorParallelError, match=">= 1"):
        TensorParallelConfig(size=0)


def test_the_shard_plan_splits_heads_and_mlp_and_replicates_the_rest():
    cfg = shard_config(_cfg(9, 3), 3)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim) == (3, 1, 512, 64)
    q = shard_slice("model.layers.4.self_attn.q_proj.weight", (576, 576), 2, 3)
    assert (q.dim, q.start, q.length) == (0, 384, 192)
    k = shard_slice("model.layers.4.self_attn.k_proj.bias", (192,), 1, 3)
    assert (k.dim, k.start, k.length) == (0, 64, 64)
    down = shard_slice("model.layers.0.mlp.down_proj.weight", (576, 1536), 1, 3)
    assert (down.dim, down.start, down.length) == (1, 512, 512)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.o_proj.bias",
                 "model.layers.0.self_attn.q_norm.weight"):
        assert shard_slice(name, (576,), 1, 3) is None, name


def test_a_step_round_trips_through_its_tensors():
    step = StepInputs(input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 9], q_lens=[3, 1], seq_lens=[3, 10],
                      block_tables=[[4], [1, 2, 3]], block_copies=[(3, 7)])
    header, payload = pack(step)
    assert payload.numel() == payload_len(header)
    back = unpack(header, payload)
    assert back.block_tables == [[4, 0, 0], [1, 2, 3]]  # padded as AttentionMetadata pads them
    assert dataclasses.replace(back, block_tables=step.block_tables) == step


def _config(model: str) -> EngineConfig:
    return EngineConfig(model=model, cpu_kernels="torch", num_threads=1,
                        cache=CacheConfig(block_size=4, num_blocks=96))


def _greedy(engine: LLMEngine, n: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(r.outputs[0].token_ids) for r in engine.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def tp1_run(tiny_model) -> tuple[list[list[int]], torch.Tensor]:
    """TP 1's greedy tokens and its KV pool after them."""
    engine = LLMEngine(_config(tiny_model), load_tokenizer=False)
    return _greedy(engine), engine.kv_cache


@pytest.fixture(scope="module")
def tp1_tokens(tp1_run) -> list[list[int]]:
    return tp1_run[0]


def test_tp2_gives_tp1s_greedy_tokens_and_stops_cleanly(tiny_model, tp1_tokens, tp1_run):
    with start_tp_engine(_config(tiny_model), TensorParallelConfig(size=2, start_timeout_s=60),
                         load_tokenizer=False) as tp:
        # Rank 0 holds one of the two KV heads in a pool of the same number of blocks.
        assert tp.engine.kv_cache.shape[4] == 1 and tp.engine.kv_cache.shape[1] == 96
        assert _greedy(tp.engine) == tp1_tokens
        # Every rank's KV, gathered with all its heads (what a send carries: kv_regroup.py), is
        # TP 1's pool (same allocator, same blocks); scattered elsewhere it gathers back the same.
        full = gather_blocks(tp.kv_pools, range(96))  # [L, 96, 2, bs, 2, D]
        torch.testing.assert_close(full, tp1_run[1], atol=1e-5, rtol=1e-4)
        scatter_blocks(full[:, :4], tp.kv_pools, [90, 91, 92, 93])
        assert torch.equal(gather_blocks(tp.kv_pools, [90, 91, 92, 93]), full[:, :4])
        # A second batch reuses cached prefix blocks on every rank (same tables everywhere).
        assert _greedy(tp.engine) == tp1_tokens
        proc = tp.workers.procs[0]
    assert proc.returncode == 0  # asked to stop, it stopped


def test_a_landing_area_is_bounded_and_scatters_into_the_rank_pools():
    pools = [torch.zeros(2, 10, 2, 4, 1, 3), torch.zeros(2, 10, 2, 4, 1, 3)]  # two ranks' [L, N, 2, bs, 1, D]
    area = LandingArea(pools, slots=3)
    assert area.tensor.shape == (2, 3, 2, 4, 2, 3)  # full-head
    slots = area.take("a", [7, 2])
    assert slots == (0, 1) and area.take("b", [1, 2]) is None and area.free_slots == 1  # bounded
    area.tensor[:, 1] = torch.arange(96.0).view(2, 2, 4, 2, 3)
    area.scatter("a", [1], range(1, 2))  # layer 1 of slot 1 -> engine block 2, heads split by rank
    assert torch.equal(pools[0][1, 2], area.tensor[1, 1, :, :, :1])
    assert torch.equal(pools[1][1, 2], area.tensor[1, 1, :, :, 1:])
    assert pools[0][0].abs().sum() == 0  # layer 0 untouched
    area.free("a")
    area.free("a")  # idempotent
    assert area.free_slots == 3 and sorted(area.take("b", [1, 2, 3])) == [0, 1, 2]
    assert landing_slots(num_blocks=1000, tp=4, max_model_len=2048, block_size=16) == 250
    assert landing_slots(num_blocks=1000, tp=8, max_model_len=4096, block_size=16) == 256  # one longest prompt
    assert landing_slots(num_blocks=100, tp=2, max_model_len=8192, block_size=16) == 100  # never past the pool


def test_speculation_and_kv_tiers_are_refused(tiny_model):
    cfg = _config(tiny_model)
    with pytest.raises(TensorParallelError, match="speculative"):
        start_tp_engine(dataclasses.replace(cfg, speculative=dataclasses.replace(cfg.speculative, method="ngram")),
                        TensorParallelConfig(size=2), load_tokenizer=False)
    with pytest.raises(TensorParallelError, match="KV tiers"):
        start_tp_engine(dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, host_cache_mib=1)),
                        TensorParallelConfig(size=2), load_tokenizer=False)
    with pytest.raises(TensorParallelError, match="does not divide the model's attention heads \\(4\\)"):
        start_tp_engine(cfg, TensorParallelConfig(size=3), load_tokenizer=False)


def _fault(tiny_model, sig: int, step_timeout_s: float) -> tuple[str, float]:
    tp = start_tp_engine(_config(tiny_model), TensorParallelConfig(size=2, start_timeout_s=60,
                                                                   step_timeout_s=step_timeout_s),
                         load_tokenizer=False)
    pid = tp.workers.procs[0].pid
    try:
        engine = tp.engine
        engine.add_request(prompt_token_ids=PROMPTS[0], params=SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        engine.step()
        os.kill(pid, sig)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError) as e:
            for _ in range(10):
                engine.step()
        took = time.monotonic() - t0
        with pytest.raises(TensorParallelError):  # failed as a whole: at once from now on
            engine.step()
        assert all(p.poll() is not None for p in tp.workers.procs)  # none left running
        return str(e.value), took
    finally:
        if sig == signal.SIGSTOP and tp.workers.procs[0].poll() is None:
            os.kill(pid, signal.SIGCONT)
        tp.close()


def test_a_killed_worker_fails_the_next_step_at_once(tiny_model):
    msg, took = _fault(tiny_model, signal.SIGKILL, step_timeout_s=30.0)
    print(msg)
    assert "rank 1" in msg and "-9" in msg, msg
    assert took < 5.0


def test_a_frozen_worker_fails_the_step_within_the_step_timeout(tiny_model):
    msg, took = _fault(tiny_model, signal.SIGSTOP, step_timeout_s=2.0)
    print(msg)
    assert "more than 2 s" in msg, msg
    assert 1.5 < took < 8.0


def test_workers_that_do_not_join_in_time_fail_the_start_and_are_stopped(tiny_model):
    # Half a second is less than a worker needs to import torch and load its shard.
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="did not all join within 0.5 s"):
        start_tp_engine(_config(tiny_model), TensorParallelConfig(size=2, start_timeout_s=0.5),
                        load_tokenizer=False)
    assert time.monotonic() - t0 < 5.0
