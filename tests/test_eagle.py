"""EAGLE drafting on a tiny random target and a tiny random EAGLE layer: the incremental draft
KV (catch-up, dropped draft positions, rollback) gives the same drafts as recomputing the
layer from scratch over the same features; checkpoint errors are clear."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.engine import LLMEngine
from engine.models.config import ModelConfig
from engine.models.tiny import save_tiny_model
from engine.speculative.proposers import build_proposer
from engine.speculative.proposers.eagle import _SeqState, load_eagle, save_tiny_eagle
from tokens.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = save_tiny_model(root / "target", arch="llama", seed=3)
    cfg = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    return target, save_tiny_eagle(root / "eagle", cfg, seed=5), cfg


def _engine(target, eagle, k=3):
    return LLMEngine(
        EngineConfig(model=str(target), dtype="float32", device="cpu",
                     cache=CacheConfig(block_size=4, num_blocks=256),
                     scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4),
                     speculative=SpeculativeConfig(method="eagle", draft_model=str(eagle),
                                                   num_speculative_tokens=k, adaptive=False)),
        load_tokenizer=False, proposer_factory=build_proposer)


def _from_scratch(prop, tokens, feat_of, start, k):
    """Drafts recomputed with no cache: the layer over positions start .. t, then each draft
    appended and everything run again."""
    toks = list(tokens[start:])
    feats = [feat_of[p - 1] for p in range(start, len(tokens))]
    drafts = []
    for _ in range(k):
        st = _SeqState(preemptions=0)
        g = prop._run(st, torch.tensor(toks), torch.stack(feats), start, keep=False)[-1:]
        d = int(prop.target.compute_logits(g).argmax(dim=-1))
        drafts.append(d)
        toks.append(d)
        feats.append(g[0])
    return drafts


def test_incremental_drafts_match_a_from_scratch_recomputation(setup):
    target, eagle, _ = setup
    eng = _engine(target, eagle)
    prop = eng.proposer
    seen: dict[str, dict[int, torch.Tensor]] = {}
    checks = []
    original = prop.propose

    def propose(requests):
        for sid, entries in prop.features.items():
            for first, rows in entries:
                for j in range(rows.shape[0]):
                    seen.setdefault(sid, {})[first + j] = rows[j].clone()
        out = original(requests)
        for r, p in zip(requests, out):
            if p.token_ids:
                st = prop._seqs[r.seq.seq_id]
                checks.append((list(r.seq.token_ids), dict(seen[r.seq.seq_id]), st.start, p.token_ids))
        return out

    prop.propose = propose
    prompts = [[5, 9, 11, 40, 7, 7, 3], [100, 200, 300, 17, 18, 19, 20, 21, 22]]
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16))
    assert len(checks) >= 8
    assert {c[2] for c in checks} == {1}  # locally prefilled: the context starts at position 1
    for tokens, feat_of, start, drafts in checks:
        assert _from_scratch(prop, tokens, feat_of, start, len(drafts)) == drafts
    assert eng.kv.num_free_blocks == eng.num_blocks
    assert not prop._seqs and not prop.features  # finished requests leave nothing behind


def test_a_request_prefilled_elsewhere_drafts_after_one_decode(setup):
    """The decode-node path: prompt KV arrives from another engine without features, so the
    first step drafts nothing and the draft layer's context starts at the first position
    decoded here; greedy output still equals a single engine's."""
    from dataclasses import replace

    target, eagle, _ = setup
    prompt = list(range(20, 58))
    params = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=14)
    plain = LLMEngine(EngineConfig(model=str(target), dtype="float32", device="cpu",
                                   cache=CacheConfig(block_size=4, num_blocks=256)), load_tokenizer=False)
    want = plain.generate([prompt], params)[0].outputs[0].token_ids
    first = plain.generate([prompt], replace(params, max_tokens=1, min_tokens=0), hold_kv=True)[0]
    eng = _engine(target, eagle)
    dst, cached = eng.reserve_kv("r1", prompt)
    eng.kv_cache[:, dst] = plain.kv_cache[:, plain.held_block_table(first.request_id)]
    eng.add_prefilled_request("r1", prompt, first.outputs[0].token_ids, params, num_cached_tokens=0)
    got, drafted = [], []
    while eng.has_unfinished_requests():
        for out in eng.step():
            got += out.outputs[0].new_token_ids
        drafted.append(eng.stats()["speculative"]["drafts"])
    assert got == want
    assert drafted[0] == 0 and drafted[-1] > 0  # nothing to draft from at first, then drafts
    assert eng.proposer._seqs == {} and eng.kv.num_free_blocks == eng.num_blocks


def test_checkpoint_errors_name_the_problem(setup, tmp_path):
    target, eagle, cfg = setup
    wrong = ModelConfig.from_hf({**json.loads((target / "config.json").read_text()), "hidden_size": 32,
                                 "num_attention_heads": 2, "num_key_value_heads": 1})
    with pytest.raises(ValueError, match="hidden 64 / vocab 512, the model has 32"):
        load_eagle(eagle, wrong, torch.float32, torch.device("cpu"))
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((eagle / "config.json").read_text())
    tensors = load_file(str(eagle / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*down_proj"):
        load_eagle(broken, cfg, torch.float32, torch.device("cpu"))
    tensors["layers.0.mlp.down_proj.weight"] = torch.zeros(cfg.hidden_size, cfg.intermediate_size)
    tensors["layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'layers.0.mlp.extra.weight'"):
        load_eagle(broken, cfg, torch.float32, torch.device("cpu"))
