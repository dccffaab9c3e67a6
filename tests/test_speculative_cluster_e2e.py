"""Speculative decoding in the disaggregated path: real Redis, Ray, gRPC and SmolLM2.

The decode node drafts with a bfloat16 copy of the target (``low_precision``), whose KV for the
prompt does not arrive with the transfer: the decode node builds it itself on the first
proposal (docs/speculative.md). Greedy outputs must equal the single-process engine's, and
the usage of each response carries the speculation counters.
"""
from __future__ import annotations

import pytest

import pdserve
from engine.config import SpeculativeConfig
from tokens.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.e2e,
    # Every prompt here is disaggregated (short_prompt_tokens 16).
    pytest.mark.local_cluster(prefill_nodes=1, decode_nodes=1, short_prompt_tokens=16, engine=dict(
        speculative=SpeculativeConfig(method="low_precision", num_speculative_tokens=4, adaptive=False))),
]

TEXT = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
PROMPTS = [
    f"Add a docstring to each function and return the full code:\n\n{TEXT}",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]


def test_speculative_decode_node_matches_the_plain_engine(local_cluster, smollm2_reference):
    ref = smollm2_reference
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    want = ref.generate([ref.encode(p, chat=True) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=32))
    with pdserve.Client(local_cluster.address, timeout=180) as client:
        got = [client.complete(m, max_tokens=32, temperature=0.0) for m in msgs]
    for g, w in zip(got, want):
        assert list(g.token_ids) == w.outputs[0].token_ids
        assert g.timings.prefill_s > 0  # the prompt KV came from the prefill node
        u = g.usage
        assert u.spec_drafts > 0 and u.spec_draft_tokens >= u.spec_accepted_tokens > 0
        assert len(u.spec_acceptance_per_position) >= 1
        assert u.spec_mean_accepted_length == pytest.approx(u.spec_accepted_tokens / u.spec_drafts, rel=1e-4)
