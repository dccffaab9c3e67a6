"""Sampler tests on hand-built logits: filters, penalties, seeds, statistics, logprobs."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    exponential_race,
    processed_probs,
)
from tokens.sampling_params import SamplingParams


def row(prompt=(), output=(), generator=None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator)


def support(probs: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(p > 0).flatten().tolist() for p in probs]


def logits_for(probs: list[float]) -> torch.Tensor:
    """One row [1, V] whose softmax is exactly-ish `probs` (0 -> -inf)."""
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in probs]])


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_index_tiebreak():
    logits = torch.tensor(
        [
            [0.1, 3.0, -1.0, 3.0],  # tie between 1 and 3 -> 1
            [5.0, 5.0, 5.0, 5.0],  # all tied -> 0
            [-2.0, -3.0, -1.5, -9.0],
        ]
    )
    rows = [row(temperature=0.0) for _ in range(3)]
    out = Sampler()(logits, rows)
    assert out.token_ids == [1, 0, 2] == torch.argmax(logits, dim=1).tolist()
    probs = processed_probs(logits, rows)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]


def test_greedy_after_penalties():
    # Token 1 wins on raw logits, but repetition penalty 4 on it (seen in prompt) -> 2.0/4.
    logits = torch.tensor([[1.0, 2.0, 1.5]])
    out = Sampler()(logits, [row(prompt=[1], temperature=0.0, repetition_penalty=4.0)])
    assert out.token_ids == [2]


def test_greedy_and_random_rows_mixed_in_one_batch():
    logits = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 50.0], [7.0, 0.0, 0.0]])
    rows = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0)]
    assert Sampler()(logits, rows).token_ids == [1, 2, 0]


# ---------------------------------------------------------------- filters


def test_top_k_keeps_exactly_k_highest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [1.0, 1.0, 1.0, 0.0, 2.0]])
    probs = processed_probs(logits, [row(top_k=2), row(top_k=3)])
    # Row 1: tie among 0,1,2 for places 2-3 -> stable sort keeps the lowest ids.
    assert support(probs) == [[1, 2], [0, 1, 4]]
    # Renormalized softmax over the kept tokens.
    e = torch.exp(torch.tensor([4.0, 3.0]))
    torch.testing.assert_close(probs[0, [1, 2]], e / e.sum())


def test_top_k_disabled_values():
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    probs = processed_probs(logits, [row(top_k=0), row(top_k=-1), row(top_k=3)])
    assert support(probs) == [[0, 1, 2]] * 3
    torch.testing.assert_close(probs, torch.softmax(logits, dim=1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05 (token order shuffled to exercise the scatter back).
    logits = logits_for([0.15, 0.5, 0.05, 0.3]).repeat(4, 1)
    rows = [row(top_p=0.5), row(top_p=0.7), row(top_p=0.85), row(top_p=0.9)]
    probs = processed_probs(logits, rows)
    # mass before each (sorted): 0, .5, .8, .95 -> keep while < top_p.
    assert support(probs) == [[1], [1, 3], [0, 1, 3], [0, 1, 3]]
    torch.testing.assert_close(probs[1, [1, 3]], torch.tensor([0.5 / 0.8, 0.3 / 0.8]))


def test_top_p_applies_after_top_k_renormalization():
    # top_k=2 leaves .5/.8 = .625 and .3/.8 = .375; top_p=0.6 then keeps only the first.
    logits = logits_for([0.5, 0.3, 0.2])
    assert support(processed_probs(logits, [row(top_k=2, top_p=0.6)])) == [[0]]
    assert support(processed_probs(logits, [row(top_p=0.6)])) == [[0, 1]]


def test_top_p_one_keeps_tiny_tail():
    logits = torch.tensor([[30.0, 0.0, -30.0, -60.0]])
    assert support(processed_probs(logits, [row(top_p=1.0)])) == [[0, 1, 2, 3]]


def test_min_p_relative_to_most_likely():
    # probs .5 .3 .15 .05; min_p .4 -> threshold .2 keeps {.5, .3}; min_p .1 -> .05 keeps 3.
    logits = logits_for([0.05, 0.5, 0.15, 0.3]).repeat(2, 1)
    probs = processed_probs(logits, [row(min_p=0.4), row(min_p=0.1)])
    assert support(probs) == [[1, 3], [1, 2, 3]]


def test_min_p_after_temperature():
    # logits 0, -1: ratio e^-1 = .37 at T=1 (kept by min_p .3), e^-2 = .14 at T=.5 (dropped).
    logits = torch.tensor([[0.0, -1.0]])
    assert support(processed_probs(logits, [row(min_p=0.3)])) == [[0, 1]]
    assert support(processed_probs(logits, [row(min_p=0.3, temperature=0.5)])) == [[0]]


def test_min_p_combined_with_top_k_in_sorted_path():
    logits = logits_for([0.05, 0.5, 0.15, 0.3])
    probs = processed_probs(logits, [row(top_k=3, min_p=0.4)])
    assert support(probs) == [[1, 3]]


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    probs = processed_probs(logits, [row(temperature=0.7)])
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, dim=1))


def test_rows_with_different_params_vectorized():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]] * 4)
    rows = [row(top_k=1), row(temperature=0.0), row(), row(top_p=0.99, min_p=0.2)]
    probs = processed_probs(logits, rows)
    assert support(probs) == [[1], [1], [0, 1, 2, 3], [1, 2]]
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(4))


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.0]])
    r = row(prompt=[0, 1], output=[1, 4], repetition_penalty=2.0)
    out = apply_penalties(logits, [r])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.0]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0, 0.0]]  # input untouched


def test_presence_and_frequency_over_output_only():
    logits = torch.zeros((1, 4))
    r = row(prompt=[3, 3], output=[0, 0, 0, 1], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [r])
    # token 0: -.5 - 3*.25; token 1: -.5 - .25; token 3 only in the prompt: untouched.
    assert out.tolist() == [[-1.25, -0.75, 0.0, 0.0]]


def test_negative_presence_penalty_encourages():
    out = apply_penalties(torch.zeros((1, 3)), [row(output=[2], presence_penalty=-1.0)])
    assert out.tolist() == [[0.0, 0.0, 1.0]]


def test_penalties_per_row():
    logits = torch.ones((2, 3))
    rows = [row(output=[0], frequency_penalty=1.0), row(output=[0])]
    assert apply_penalties(logits, rows).tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros((3, 6))
    rows = [
        row(output=[1], min_tokens=2, stop_token_ids=(4,)),  # 1 < 2: masked
        row(output=[1, 1], min_tokens=2, stop_token_ids=(4,)),  # reached: free
        row(output=[], ignore_eos=True, stop_token_ids=(4,)),  # EOS only, always
    ]
    out = apply_penalties(logits, rows, eos_token_ids=(5, 0))
    inf = -math.inf
    assert out.tolist() == [
        [inf, 0, 0, 0, inf, inf],
        [0, 0, 0, 0, 0, 0],
        [inf, 0, 0, 0, 0, inf],
    ]


def test_min_tokens_sampler_never_emits_eos():
    # EOS dominates, yet with min_tokens the sampler must pick something else.
    logits = torch.tensor([[20.0, 0.0, 0.0], [20.0, 0.0, 0.0]])
    sampler = Sampler(eos_token_ids=(0,))
    rows = [row(min_tokens=3, temperature=0.0), row(min_tokens=3, temperature=1.0)]
    for _ in range(50):
        assert 0 not in sampler(logits, rows).token_ids
    assert sampler(logits[:1], [row(temperature=0.0)]).token_ids == [0]


# ---------------------------------------------------------------- draws and seeds


def test_exponential_race_never_picks_zero_probability_even_with_zero_noise():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]])
    noise = torch.tensor([[0.0, 1.0, 0.0, 1.0]])  # 0/0 would be nan and win argmax
    assert exponential_race(probs, noise).tolist() == [1]
    noise = torch.tensor([[1.0, 0.0, 1.0, 2.0]])
    assert exponential_race(probs, noise).tolist() == [1]


def test_seeded_rows_reproducible_and_independent_of_batch_position():
    torch.manual_seed(0)
    target = torch.randn(1, 50)
    others = torch.randn(3, 50)
    params = dict(temperature=1.0, top_k=20, seed=1234)

    def seeded_tokens(batch: torch.Tensor, pos: int, steps: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        sampler = Sampler(seed=7)
        rows = [row(temperature=1.3) for _ in range(batch.shape[0])]
        rows[pos] = row(generator=gen, **params)
        return [sampler(batch, rows).token_ids[pos] for _ in range(steps)]

    alone = seeded_tokens(target, 0, 20)
    in_batch = seeded_tokens(torch.cat([others[:2], target, others[2:]]), 2, 20)
    first = seeded_tokens(torch.cat([target, others]), 0, 20)
    assert alone == in_batch == first
    assert len(set(alone)) > 1  # it really samples


def test_unseeded_rows_follow_sampler_seed():
    logits = torch.zeros((4, 100))
    rows = [row() for _ in range(4)]
    a = Sampler(seed=3)(logits, rows).token_ids
    assert a == Sampler(seed=3)(logits, rows).token_ids
    assert a != Sampler(seed=4)(logits, rows).token_ids


def draw_many(logits: torch.Tensor, r: SamplingRow, n: int) -> torch.Tensor:
    """Draw n tokens from one row by batching it n times (shared generator)."""
    sampler = Sampler(seed=11)
    batch = logits.expand(n, -1).contiguous()
    return torch.tensor(sampler(batch, [r] * n).token_ids)


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.7),
        dict(temperature=0.7, top_k=5),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=0.7, min_p=0.1, top_k=6),
    ],
    ids=["temp", "top_k", "top_p", "min_p"],
)
def test_draw_statistics_match_processed_probs(params):
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.5, -1.0, 0.7]])
    r = row(**params)
    probs = processed_probs(logits, [r])[0].double()
    tokens = draw_many(logits, r, 30_000)
    counts = torch.bincount(tokens, minlength=8).double()
    in_support = probs > 0
    assert counts[~in_support].sum() == 0, "drew a token outside the support"
    # float32 probs sum to 1 only within ~1e-7; scipy checks the totals to 1.5e-8.
    expected = probs[in_support] / probs[in_support].sum() * counts.sum()
    assert expected.min() > 5  # chi-square validity
    result = chisquare(counts[in_support].numpy(), expected.numpy())
    assert result.pvalue > 0.001, result


def test_seeded_draw_statistics():
    # Per-row generator path: draws over many steps follow processed_probs too.
    logits = torch.tensor([[0.5, 1.5, 0.0, 1.0]])
    r = row(temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(5))
    probs = processed_probs(logits, [r])[0].double()
    sampler = Sampler()
    tokens = torch.tensor([sampler(logits, [r]).token_ids[0] for _ in range(4000)])
    counts = torch.bincount(tokens, minlength=4).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0
    expected = probs[keep] / probs[keep].sum() * 4000
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 0.001


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_penalized_log_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.5, 4.0, 1.0]])
    rows = [
        row(temperature=0.0, logprobs=2, output=[1], presence_penalty=1.5),
        row(temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, rows)
    penalized = logits.clone()
    penalized[0, 1] -= 1.5
    expected = torch.log_softmax(penalized, dim=1)
    assert out.token_ids == [2, 2]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected[[0, 1], [2, 2]])
    assert out.top_logprobs is not None
    assert [t for t, _ in out.top_logprobs[0]] == [2, 1]  # 2.0 > 1.5 (= 3 - 1.5) > 1.0
    torch.testing.assert_close(
        torch.tensor([lp for _, lp in out.top_logprobs[0]]), expected[0, [2, 1]]
    )
    assert out.top_logprobs[1] == []


def test_logprobs_ignore_temperature_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    r = row(temperature=0.5, top_k=1, logprobs=3)
    out = Sampler()(logits, [r])
    assert out.token_ids == [0]
    expected = torch.log_softmax(logits, dim=1)[0]
    assert out.logprobs == pytest.approx([expected[0].item()])
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2]
    assert all(math.isfinite(lp) for _, lp in out.top_logprobs[0])


def test_no_logprobs_requested():
    out = Sampler()(torch.zeros((2, 3)), [row(), row()])
    assert out.logprobs is None and out.top_logprobs is None


def test_row_count_mismatch_raises():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros((2, 3)), [row()])


def test_penalties_with_empty_histories_and_mixed_rows():
    logits = torch.ones((3, 4))
    rows = [
        row(repetition_penalty=2.0),  # nothing seen yet
        row(output=[], presence_penalty=1.0, frequency_penalty=1.0),
        row(prompt=[3], output=[3], repetition_penalty=2.0, frequency_penalty=0.5),
    ]
    out = apply_penalties(logits, rows)
    assert out.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0.0]]  # 1/2 - 0.5
