"""Our Llama-family model vs transformers on tiny random models, through the paged KV cache.

Each model is saved with ``save_pretrained`` and read back through ``load_model``, so these
tests cover the loader's happy path too. Block tables are scrambled (non-contiguous, out of
order) so any slot arithmetic mistake shows up as wrong logits.
"""
from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_VOCAB, save_hf_model, tiny_config
from engine.attention import get_attention_backend
from engine.attention.kv_cache import allocate_kv_cache
from engine.attention.metadata import AttentionMetadata
from engine.models.loader import load_model

ATOL = 1e-5
BLOCK = 4
NUM_BLOCKS = 64

CASES = {
    "llama-untied-gqa2": lambda: tiny_config(),
    "llama-tied-mha": lambda: tiny_config(tie_word_embeddings=True, num_key_value_heads=4),
    "llama-mqa": lambda: tiny_config(num_key_value_heads=1),
    "llama-attn-bias": lambda: tiny_config(attention_bias=True),
    "qwen2-bias": lambda: tiny_config("qwen2", tie_word_embeddings=True),
    "qwen3-qknorm": lambda: tiny_config("qwen3", num_key_value_heads=1),
    "mistral": lambda: tiny_config("mistral"),
    "rope-linear": lambda: tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-dynamic": lambda: tiny_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "rope-yarn": lambda: tiny_config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "rope-llama3": lambda: tiny_config(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
}


class PagedRunner:
    """Drives our model step by step over a paged cache with a scrambled block allocator."""

    def __init__(self, loaded, seed: int = 0):
        self.model, self.cfg = loaded.model, loaded.config
        self.kv = allocate_kv_cache(self.cfg, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
        self.attn = get_attention_backend(
            torch.device("cpu"), self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim, torch.float32
        )
        self.free = list(range(1, NUM_BLOCKS))  # block 0 left unused: padding in tables points there
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Append token chunks to sequences in one step; return each sequence's logits [q, V]."""
        q_lens, seq_lens, tables, ids, pos = [], [], [], [], []
        for sid, toks in chunks.items():
            ctx = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * BLOCK < ctx + len(toks):
                table.append(self.free.pop())
            q_lens.append(len(toks))
            seq_lens.append(ctx + len(toks))
            tables.append(table)
            ids += toks
            pos += range(ctx, ctx + len(toks))
            self.lens[sid] = ctx + len(toks)
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, BLOCK)
        self.attn.begin_step(meta)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, self.attn)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for sid, q in zip(chunks, q_lens):
            out[sid] = logits[start : start + q]
            start += q
        return out


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:  # [len, V]
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Build, save and load each case once per module: (hf_model, loaded) by case id."""
    out = {}
    root = tmp_path_factory.mktemp("tiny-models")
    for i, (name, build) in enumerate(CASES.items()):
        hf = save_hf_model(build(), root / name, seed=i)
        out[name] = (hf, load_model(str(root / name), torch.float32, "cpu"))
    return out


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_matches_hf(models, case):
    hf, loaded = models[case]
    runner = PagedRunner(loaded)
    tokens = _prompt(1, 13)
    got = runner.step({0: tokens})[0]
    torch.testing.assert_close(got, hf_logits(hf, tokens), atol=ATOL, rtol=0)
    for _ in range(6):  # greedy decode, one token per step, crossing block boundaries
        nxt = int(got[-1].argmax())
        tokens.append(nxt)
        got = runner.step({0: [nxt]})[0]
        torch.testing.assert_close(got[-1], hf_logits(hf, tokens)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama-untied-gqa2", "qwen3-qknorm", "rope-yarn"])
def test_chunked_prefill_equals_one_shot(models, case):
    hf, loaded = models[case]
    tokens = _prompt(2, 41)
    one_shot = PagedRunner(loaded, seed=1).step({0: tokens})[0]
    runner = PagedRunner(loaded, seed=2)
    first = runner.step({0: tokens[:18]})[0]  # long chunk, no context
    second = runner.step({0: tokens[18:]})[0]  # long chunk with context: masked path
    torch.testing.assert_close(torch.cat([first, second]), one_shot, atol=ATOL, rtol=0)
    torch.testing.assert_close(one_shot, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_mixed_batch_prefill_decode_and_verify(models):
    """One step holding a prefill chunk, decodes and a multi-token (verification) query."""
    hf, loaded = models["llama-untied-gqa2"]
    runner = PagedRunner(loaded, seed=3)
    a, b, c = _prompt(3, 9), _prompt(4, 21), _prompt(5, 5)
    runner.step({0: a, 1: b[:11]})
    runner.step({2: c})
    extra_a, extra_c = _prompt(6, 1), _prompt(7, 4)
    got = runner.step({0: extra_a, 1: b[11:], 2: extra_c})
    torch.testing.assert_close(got[0], hf_logits(hf, a + extra_a)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1], hf_logits(hf, b)[11:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[2], hf_logits(hf, c + extra_c)[-4:], atol=ATOL, rtol=0)


def test_greedy_generation_identical_to_hf_generate(models):
    hf, loaded = models["llama-tied-mha"]
    prompt = _prompt(8, 7)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    runner = PagedRunner(loaded)
    logits = runner.step({0: prompt})[0]
    out = []
    for _ in range(12):
        out.append(int(logits[-1].argmax()))
        logits = runner.step({0: [out[-1]]})[0]
    assert out == ref[0, len(prompt) :].tolist()


def test_early_exit_returns_normed_hidden_of_first_layers(models):
    hf, loaded = models["llama-untied-gqa2"]
    tokens = _prompt(9, 10)
    runner = PagedRunner(loaded)
    meta = AttentionMetadata.build([10], [10], [[5, 9, 2]], BLOCK)
    runner.attn.begin_step(meta)
    with torch.no_grad():
        ours = loaded.model(torch.tensor(tokens), torch.arange(10), runner.kv, runner.attn, num_layers=1)
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[1][0]
        ref = hf.model.norm(hs)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "original_max_position_embeddings": 16,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_rope_matches_hf_token_by_token(tmp_path, rope):
    """Past the threshold each position keeps its own frequencies, as in HF's cached decoding."""
    max_pos = 16 if rope["rope_type"] == "dynamic" else 64
    hf = save_hf_model(tiny_config(max_position_embeddings=max_pos, rope_scaling=rope), tmp_path / "m")
    runner = PagedRunner(load_model(str(tmp_path / "m"), torch.float32, "cpu"))
    tokens = _prompt(10, 12)
    ours = runner.step({0: tokens})[0]
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=True)
    torch.testing.assert_close(ours, out.logits[0], atol=ATOL, rtol=0)
    cache = out.past_key_values
    for _ in range(12):  # positions 12 .. 23 cross the threshold at 16
        nxt = int(ours[-1].argmax())
        ours = runner.step({0: [nxt]})[0]
        with torch.no_grad():
            out = hf(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.past_key_values
        torch.testing.assert_close(ours, out.logits[0], atol=ATOL, rtol=0)
