"""torch_ref attention vs a naive per-token loop over random paged caches; KV cache helpers."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from engine.attention import get_attention_backend
from engine.attention.kv_cache import allocate_kv_cache, bytes_per_block, copy_blocks, kv_cache_shape
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_ref import TorchRefBackend, split_short

BS = 4
D = 8


def naive_attention(q, cache, meta: AttentionMetadata) -> torch.Tensor:
    """Token by token: look each KV position up through the block table, softmax in float64."""
    hq, hkv = q.shape[1], cache.shape[3]
    out = torch.empty_like(q)
    t = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.q_lens, meta.seq_lens)):
        ctx = seq_len - q_len
        table = meta.block_tables[s].tolist()
        keys = torch.stack([cache[table[p // BS], 0, p % BS] for p in range(seq_len)])  # [S, Hkv, D]
        vals = torch.stack([cache[table[p // BS], 1, p % BS] for p in range(seq_len)])
        for i in range(q_len):
            visible = ctx + i + 1
            for h in range(hq):
                kh = h // (hq // hkv)
                scores = (keys[:visible, kh].double() @ q[t, h].double()) * D**-0.5  # [visible]
                out[t, h] = (scores.softmax(0) @ vals[:visible, kh].double()).to(q.dtype)
            t += 1
    return out


def random_step(q_lens, ctx_lens, hq, hkv, num_blocks=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, seq_lens = [], []
    for q, c in zip(q_lens, ctx_lens):
        n = q + c
        tables.append([free.pop() for _ in range((n + BS - 1) // BS)])
        seq_lens.append(n)
    meta = AttentionMetadata.build(list(q_lens), seq_lens, tables, BS)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=hkv, head_dim=D)
    kv = torch.randn(kv_cache_shape(cfg, num_blocks, BS), generator=gen)  # garbage in unused slots
    t = sum(q_lens)
    q = torch.randn(t, hq, D, generator=gen)
    k = torch.randn(t, hkv, D, generator=gen)
    v = torch.randn(t, hkv, D, generator=gen)
    return meta, kv, q, k, v


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1), (6, 3)])
@pytest.mark.parametrize(
    "q_lens,ctx_lens",
    [
        ([1, 3, 17], [9, 0, 0]),
        ([1, 1, 1, 1], [0, 5, 12, 30]),  # pure decode, ragged contexts
        ([17, 3, 1, 16], [6, 13, 0, 2]),  # long chunk with context + short group incl. q_len 16
        ([40], [0]),  # one whole prefill: SDPA's own causal path
    ],
)
def test_torch_ref_matches_naive(hq, hkv, q_lens, ctx_lens):
    meta, kv, q, k, v = random_step(q_lens, ctx_lens, hq, hkv)
    backend = TorchRefBackend(hq, hkv, D)
    backend.begin_step(meta)
    got = backend.forward(0, q, k, v, kv[0])
    # The new K/V are in their slots ...
    flat_k = kv[0][:, 0].reshape(-1, hkv, D)
    flat_v = kv[0][:, 1].reshape(-1, hkv, D)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(flat_v[meta.slot_mapping], v, atol=0, rtol=0)
    # ... and attention over them and the old context matches the naive loop.
    torch.testing.assert_close(got, naive_attention(q, kv[0], meta), atol=1e-5, rtol=1e-5)


def test_verifications_beside_decodes_split_into_their_own_batch_and_still_match_naive():
    # Same lengths, so only the query length separates them: with a free call the decodes and
    # the verifications run as separate padded batches; the result must not change.
    q_lens, ctx_lens = [1, 13, 1, 5, 1, 1], [20, 19, 22, 21, 18, 23]
    meta, kv, q, k, v = random_step(q_lens, ctx_lens, 6, 3)
    backend = TorchRefBackend(6, 3, D, group_cost_cells=0)
    backend.begin_step(meta)
    assert len(backend._shorts) >= 2
    torch.testing.assert_close(backend.forward(0, q, k, v, kv[0]), naive_attention(q, kv[0], meta),
                               atol=1e-5, rtol=1e-5)


def test_split_short_weighs_padded_queries():
    lens = [400, 410, 390, 405, 395, 400, 402, 398]
    decodes = [1] * 8
    # All decodes of similar length: one batch (a call costs more than the padding it saves).
    assert [sorted(g) for g in split_short(list(range(8)), lens, decodes, 1024)] == [list(range(8))]
    # One of them verifies 12 drafts: padding all eight to 13 queries costs ~3x the positions,
    # so it runs alone and the decodes stay together.
    one_verifies = [1, 1, 1, 13, 1, 1, 1, 1]
    groups = split_short(list(range(8)), lens, one_verifies, 1024)
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 4, 5, 6, 7], [3]]
    # Weighing queries as free (the old rule) keeps the single batch.
    assert len(split_short(list(range(8)), lens, one_verifies, 1024, query_weight=0.0)) == 1
    # Short contexts: the extra call costs more than the padded queries, so they stay merged.
    assert len(split_short(list(range(8)), [20] * 8, one_verifies, 1024)) == 1
    # Lengths still split as before: short and long sequences apart.
    assert sorted(map(sorted, split_short([0, 1, 2, 3], [40, 700, 60, 650], [1] * 4, 256))) == [[0, 2], [1, 3]]
    assert split_short([], [], [], 1024) == []


def test_begin_step_state_is_reused_across_layers():
    meta, kv, q, k, v = random_step([1, 3, 17], [4, 2, 0], 4, 2)
    kv2 = kv.expand(2, *kv.shape[1:]).clone()
    backend = TorchRefBackend(4, 2, D)
    backend.begin_step(meta)
    a = backend.forward(0, q, k, v, kv2[0])
    b = backend.forward(1, q, k, v, kv2[1])
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_get_attention_backend_on_cpu_is_torch_ref():
    backend = get_attention_backend(torch.device("cpu"), 4, 2, D, torch.float32)
    assert isinstance(backend, TorchRefBackend)


def test_kv_cache_helpers():
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=D)
    kv = allocate_kv_cache(cfg, 5, BS, torch.bfloat16, "cpu")
    assert kv.shape == (3, 5, 2, BS, 2, D) and kv.dtype == torch.bfloat16 and not kv.any()
    assert bytes_per_block(cfg, BS, torch.bfloat16) == kv[:, 0].numel() * 2
    kv.copy_(torch.randn(kv.shape))
    before = kv.clone()
    copy_blocks(kv, [(1, 2), (2, 3)])  # sources read before any write: 3 gets the old 2
    assert torch.equal(kv[:, 2], before[:, 1]) and torch.equal(kv[:, 3], before[:, 2])
    assert torch.equal(kv[:, 0], before[:, 0]) and torch.equal(kv[:, 4], before[:, 4])
    copy_blocks(kv, [])
