"""Speculative decoding through the engine on tiny random models: greedy outputs identical for
every proposer and for mixed batches, stops inside an accepted run, rollback without leaks or
hashes of unverified tokens, and the sampling distribution preserved (chi-square)."""
from __future__ import annotations

import random

import pytest
import torch
from scipy import stats

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.engine import LLMEngine
from engine.models.tiny import save_tiny_model
from engine.sampler import SamplingRow, processed_probs
from engine.speculative.proposers import build_proposer
from engine.speculative.proposers.eagle import save_tiny_eagle
from engine.speculative.proposers.heads import save_tiny_heads
from tokens.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": save_tiny_model(root / "target", arch="llama", seed=3),
        "draft": save_tiny_model(root / "draft", arch="llama", seed=4, num_hidden_layers=1),
        "heads": save_tiny_heads(root / "heads", hidden_size=64, vocab_size=512),
        "eagle": save_tiny_eagle(root / "eagle", target_config(root / "target")),
    }


def target_config(path):
    import json

    from engine.models.config import ModelConfig

    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def make_engine(path, spec=SpeculativeConfig(), num_blocks=512, block_size=4, budget=256, max_seqs=16):
    return LLMEngine(
        EngineConfig(model=str(path), dtype="float32", device="cpu",
                     cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
                     scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                     speculative=spec),
        load_tokenizer=False, proposer_factory=build_proposer,
    )


def prompts(n=6, seed=0):
    rng = random.Random(seed)
    ps = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for _ in range(n)]
    return ps + [p * 3 for p in ps[:2]]  # repeated text: n-gram lookup finds matches


def spec_configs(models):
    return {
        "ngram": SpeculativeConfig(method="ngram", adaptive=False),
        "early_exit": SpeculativeConfig(method="early_exit", early_exit_layers=1, adaptive=False),
        "draft": SpeculativeConfig(method="draft", draft_model=str(models["draft"]), draft_dtype="float32",
                                   adaptive=False),
        "low_precision": SpeculativeConfig(method="low_precision", adaptive=False, num_speculative_tokens=3),
        "medusa": SpeculativeConfig(method="medusa", draft_model=str(models["heads"]), adaptive=False),
        "eagle": SpeculativeConfig(method="eagle", draft_model=str(models["eagle"]), adaptive=False),
        "ngram_adaptive": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    }


@pytest.fixture(scope="module")
def reference(models):
    return [o.outputs[0].token_ids for o in make_engine(models["target"]).generate(prompts(), GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "early_exit", "draft", "low_precision", "medusa", "eagle",
                                    "ngram_adaptive"])
def test_greedy_identical_with_and_without_speculation(models, reference, method):
    eng = make_engine(models["target"], spec_configs(models)[method])
    outs = eng.generate(prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    st = eng.stats()["speculative"]
    assert st["drafts"] > 0 and st["draft_tokens"] >= st["accepted_tokens"]
    assert st["step_cost_ms"] and all(v > 0 for v in st["step_cost_ms"].values()) and st["draft_round_ms"] >= 0
    assert eng.kv.num_free_blocks == eng.num_blocks  # every rollback and finish gave blocks back
    spec = outs[0].outputs[0].spec
    assert spec is not None and spec.num_drafts >= 0


def test_mixed_batch_greedy_and_sampled_with_small_budget(models, reference):
    """Greedy and random requests, different k per sequence (adaptive), chunked prefill
    alongside verification, a KV pool small enough to preempt: greedy ones stay identical."""
    ps = prompts()
    sampled = SamplingParams(temperature=0.9, top_k=50, max_tokens=20, min_tokens=20, seed=7)
    params = [GREEDY if i % 2 == 0 else sampled for i in range(len(ps))]
    spec = SpeculativeConfig(method="draft", draft_model=str(models["draft"]), draft_dtype="float32",
                             num_speculative_tokens=4)
    eng = make_engine(models["target"], spec, num_blocks=48, budget=24)
    outs = eng.generate(ps, params)
    for i, o in enumerate(outs):
        assert len(o.outputs[0].token_ids) == 20
        if i % 2 == 0:
            assert o.outputs[0].token_ids == reference[i]
    assert eng.kv.num_free_blocks == eng.num_blocks
    # Seeded sampling with a sampling drafter is reproducible for a fixed k schedule. (With
    # adaptive k the schedule follows measured step times, and with a q that is not one-hot
    # the tokens depend on the drafts: same distribution, not the same tokens.)
    from dataclasses import replace

    fixed = replace(spec, adaptive=False)
    first = make_engine(models["target"], fixed, num_blocks=48, budget=24).generate(ps, params)
    again = make_engine(models["target"], fixed, num_blocks=48, budget=24).generate(ps, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


@pytest.mark.parametrize("method", ["ngram", "ngram_adaptive", "medusa", "eagle"])
def test_seeded_sampling_gives_the_same_tokens_with_deterministic_drafts(models, method):
    """One-hot drafts are verified against the target's own samples (drawn as plain decoding
    draws them), so seeded requests get exactly the tokens of a run without speculation."""
    ps = prompts()
    params = [SamplingParams(temperature=t, top_k=tk, top_p=tp, max_tokens=20, min_tokens=20, seed=100 + i)
              for i, (t, tk, tp) in enumerate([(0.8, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.8), (0.6, 20, 0.9)] * 2)]
    want = [o.outputs[0].token_ids for o in make_engine(models["target"]).generate(ps, params)]
    eng = make_engine(models["target"], spec_configs(models)[method])
    got = [o.outputs[0].token_ids for o in eng.generate(ps, params)]
    assert got == want
    assert eng.stats()["speculative"]["drafts"] > 0


def test_stop_inside_an_accepted_run_cuts_it(models, reference):
    spec = SpeculativeConfig(method="low_precision", adaptive=False, num_speculative_tokens=5)
    eng = make_engine(models["target"], spec)
    want = reference[1]
    stop_tok = want[7]
    first = want.index(stop_tok)
    out = eng.generate([prompts()[1]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=(stop_tok,)))[0]
    assert out.outputs[0].token_ids == want[: first + 1] and out.outputs[0].finish_reason == "stop"
    out = eng.generate([prompts()[1]], SamplingParams(temperature=0.0, max_tokens=9, min_tokens=9))[0]
    assert out.outputs[0].token_ids == want[:9] and out.outputs[0].finish_reason == "length"
    assert eng.kv.num_free_blocks == eng.num_blocks


def test_rollback_registers_no_hash_for_unverified_tokens(models):
    """Every cached block's tokens are the true tokens of some sequence: a rejected draft's
    tokens never end up hashed in the prefix cache (nor in a BlockStored event)."""
    spec = SpeculativeConfig(method="draft", draft_model=str(models["draft"]), draft_dtype="float32",
                             adaptive=False, num_speculative_tokens=5)
    eng = make_engine(models["target"], spec)
    ps = prompts()
    outs = eng.generate(ps, GREEDY)
    assert eng.stats()["speculative"]["draft_tokens"] > eng.stats()["speculative"]["accepted_tokens"]
    bs = eng.block_size
    true_blocks = set()
    for p, o in zip(ps, outs):
        full = p + o.outputs[0].token_ids
        true_blocks |= {tuple(full[i : i + bs]) for i in range(0, len(full) - bs + 1, bs)}
    stored = [e for e in eng.take_kv_events() if type(e).__name__ == "BlockStored"]
    assert stored
    for e in stored:
        for toks in e.token_ids:
            assert tuple(toks) in true_blocks


@pytest.mark.parametrize("setting", [dict(temperature=0.8), dict(temperature=1.0, top_k=3),
                                     dict(temperature=1.0, top_p=0.7)])
def test_sampling_distribution_is_preserved(tmp_path_factory, setting):
    """Tiny vocabulary (8 tokens): 10^4 samples of tokens 2 and 3 (those produced by
    verification with a real draft distribution q != p) match their exact marginals."""
    root = tmp_path_factory.mktemp("chi")
    kw = dict(vocab_size=8, bos_token_id=0, eos_token_id=1, initializer_range=0.3)
    target = save_tiny_model(root / "t", arch="llama", seed=11, **kw)
    # Same seed, one layer: shares the target's embedding and first layer, so q is close to p
    # but not equal (both accepted drafts and recovered tokens occur).
    draft = save_tiny_model(root / "d", arch="llama", seed=11, num_hidden_layers=1, **kw)
    # A batch of 1000 speculates only with the per-step budget lifted (it shrinks to 0 at 64).
    spec = SpeculativeConfig(method="draft", draft_model=str(draft), draft_dtype="float32", adaptive=False,
                             num_speculative_tokens=2, max_tokens_per_step=4096, max_batch_size=4096)
    eng = make_engine(target, spec, num_blocks=4096, budget=4096, max_seqs=1024)
    prompt = [3, 5, 2, 7]
    params = SamplingParams(max_tokens=3, min_tokens=3, **setting)
    trials = 10_000
    outs = []
    for _ in range(trials // 1000):
        outs += eng.generate([prompt] * 1000, params)
    st = eng.stats()["speculative"]
    assert 0 < st["accepted_tokens"] < st["draft_tokens"]
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [trials, 3]

    # Exact marginals from the target alone: P(t2) = sum_t1 P(t1) P(t2 | t1), etc.
    base = make_engine(target)
    model = base.loaded.model

    def dist(history):  # the sampler's distribution after prompt + history: [8]
        ids = torch.tensor(prompt + history)
        logits = _full_logits(base, ids)
        row = SamplingRow(params=params, prompt_token_ids=prompt, output_token_ids=history)
        return processed_probs(logits[None], [row], base.eos_token_ids)[0].double()

    p1 = dist([])
    p12 = torch.stack([dist([a]) for a in range(8)])  # [8, 8]
    p2 = p1 @ p12
    p3 = sum(p1[a] * p12[a, b] * dist([a, b]) for a in range(8) for b in range(8))
    for col, exact in ((1, p2), (2, p3)):
        counts = torch.bincount(toks[:, col], minlength=8).double()
        keep = exact * trials >= 5  # chi-square needs expected counts >= 5 per cell
        assert counts[~keep].sum() <= max(20, 5 * (~keep).sum())  # near-impossible tokens stay rare
        obs, exp = counts[keep], exact[keep] / exact[keep].sum() * counts[keep].sum()
        assert stats.chisquare(obs.numpy(), exp.numpy()).pvalue > 0.001
    del model


def _full_logits(eng, ids):
    """Last-position logits of a one-off forward over ``ids`` through a scratch sequence."""
    from engine.attention.metadata import AttentionMetadata

    n = len(ids)
    blocks = list(range((n + eng.block_size - 1) // eng.block_size))
    meta = AttentionMetadata.build([n], [n], [blocks], eng.block_size, "cpu")
    eng.runner.backend.begin_step(meta)
    with torch.inference_mode():
        h = eng.loaded.model(ids, torch.arange(n), eng.kv_cache, eng.runner.backend)
        return eng.loaded.model.compute_logits(h[-1:])[0]


@pytest.mark.parametrize("positions, layer", [("final", None), ("final", 0), ("last", None)])
def test_target_states_reach_the_proposer_as_declared(models, positions, layer):
    """The runner's one hook: a proposer that declares TargetStates gets the target's states of
    exactly the positions it asked for (prefill chunks, decodes, accepted runs; never a rejected
    draft), equal to a plain forward over the final sequence (transformers' hidden states)."""
    import transformers

    from engine.speculative.proposer import Proposal, TargetStates

    prompt = [5, 9, 11, 40, 7, 7, 3, 5, 9, 11, 40, 7, 60, 61]
    plain = make_engine(models["target"]).generate([prompt], GREEDY)[0].outputs[0].token_ids
    tokens = prompt + plain

    class Recording:
        """Drafts the true continuation with its third token wrong: verifications accept a run
        and reject the rest."""

        draft_cost, batched = 0.0, True
        target_states = TargetStates(positions, layer)

        def __init__(self) -> None:
            self.got: list[tuple[int, torch.Tensor]] = []

        def propose(self, requests):
            out = []
            for r in requests:
                n = len(r.seq.token_ids)
                draft = list(tokens[n : n + r.k])
                if len(draft) >= 3:
                    draft[2] = (draft[2] + 1) % 512
                out.append(Proposal(draft))
            return out

        def observe_target(self, seq_id, first_position, states):
            self.got.append((first_position, states))

        def copy_blocks(self, pairs):
            pass

        def forget(self, seq_id):
            pass

    eng = LLMEngine(EngineConfig(model=str(models["target"]), dtype="float32", device="cpu",
                                 cache=CacheConfig(block_size=4, num_blocks=512),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
                                 speculative=SpeculativeConfig(method="ngram", adaptive=False,
                                                               num_speculative_tokens=4)),
                    load_tokenizer=False, proposer_factory=lambda e: Recording())
    assert eng.generate([prompt], GREEDY)[0].outputs[0].token_ids == plain
    stats = eng.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted runs and rejections
    hf = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
    want = hidden[-1][0] if layer is None else hidden[layer + 1][0]  # [len - 1, H]
    pieces = eng.proposer.got
    if positions == "final":  # every position whose input is final, once, in order
        firsts = [first for first, _ in pieces]
        got = torch.cat([rows for _, rows in pieces])
        assert firsts == sorted(firsts) and got.shape[0] == len(tokens) - 1
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:  # per step, the state of the position that produced the newest token
        assert all(rows.shape[0] == 1 for _, rows in pieces)
        for first, rows in pieces:
            torch.testing.assert_close(rows[0], want[first], atol=1e-4, rtol=1e-4)
        assert pieces[-1][0] == len(tokens) - 2


def test_low_precision_declines_where_its_draft_cannot_pay(models, reference, monkeypatch):
    """An adaptive low_precision drafter compares its measured matmul time with the target's
    (both kernel plans measured on this machine) and declines when a draft round would cost
    MAX_DRAFT_COST target steps or more: the engine then decodes without speculation, exactly.
    The threshold is moved instead of the machine, so the test means the same on every CPU."""
    from engine.speculative.proposers import low_precision

    adaptive = SpeculativeConfig(method="low_precision", num_speculative_tokens=3)
    monkeypatch.setattr(low_precision, "MAX_DRAFT_COST", 0.0)
    declined = make_engine(models["target"], adaptive)
    assert declined.spec is None
    assert declined.stats()["speculative"] is None
    assert [o.outputs[0].token_ids for o in declined.generate(prompts(), GREEDY)] == reference

    monkeypatch.setattr(low_precision, "MAX_DRAFT_COST", float("inf"))
    kept = make_engine(models["target"], adaptive)
    assert kept.spec is not None
    # the measured ratio replaced the prior, and the draft runs the kernels measured for it
    assert kept.spec.controller.draft_cost != low_precision.BF16_DRAFT_COST
    assert kept.spec.proposer.model.linear_plan is not None
    assert [o.outputs[0].token_ids for o in kept.generate(prompts(), GREEDY)] == reference

    monkeypatch.setattr(low_precision, "MAX_DRAFT_COST", 0.0)
    forced = make_engine(models["target"], SpeculativeConfig(method="low_precision", adaptive=False,
                                                             num_speculative_tokens=3))
    assert forced.spec is not None  # adaptive off: drafting was ordered, and is done


def test_a_whole_batch_caller_gets_the_gate_judged_by_its_slowest_request(models):
    """generate() waits for every request: once none is queued the gate is told so (and values
    steps by the laggard); step-driven serving never is, nor is a queue with requests left."""
    eng = make_engine(models["target"], SpeculativeConfig(method="ngram", num_speculative_tokens=4), max_seqs=2)
    seen = []
    real = eng.spec.observe_step

    def observe(sched, sampled, ms, whole_batch=False):
        seen.append((eng.scheduler.num_waiting, whole_batch))
        real(sched, sampled, ms, whole_batch)

    eng.spec.observe_step = observe
    eng.generate(prompts(n=3), SamplingParams(temperature=0.0, max_tokens=8))
    assert any(w for _, w in seen) and all(not w for n, w in seen if n > 0)  # queued: per token
    assert all(w for n, w in seen if n == 0)
    seen.clear()
    list(eng.stream(prompts(n=1)[0], SamplingParams(temperature=0.0, max_tokens=8)))
    assert seen and not any(w for _, w in seen)
    assert eng._whole_batch is False
