"""Rejection-sampling math on hand-built p / q (no model)."""
from __future__ import annotations

import torch
from scipy import stats

from engine.speculative.rejection_sampler import sample_inverse_cdf, verify_by_target_samples, verify_drafts


def test_greedy_keeps_the_longest_matching_prefix_plus_the_next_argmax():
    p = torch.eye(4)[[1, 2, 3, 0]]  # argmax per position: 1, 2, 3, 0
    u = torch.zeros(2, 4)
    assert verify_drafts([1, 2, 3], p, None, u, greedy=True) == (3, 0)  # all accepted + bonus
    assert verify_drafts([1, 0, 3], p, None, u, greedy=True) == (1, 2)  # mismatch at 2nd: argmax there
    assert verify_drafts([3, 2, 3], p, None, u, greedy=True) == (0, 1)


def test_one_hot_draft_is_accepted_with_probability_p():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    # u < p(d) = 0.5 accepts draft 0; then the bonus is drawn from p[1] at u = 0.95 -> token 2.
    assert verify_drafts([0], p, None, torch.tensor([[0.4, 0.0], [0.0, 0.95]]), greedy=False) == (1, 2)
    # u = 0.6 rejects: recovered from p[0] without token 0 = (0, .6, .4); u = 0.5 -> token 1, 0.7 -> 2.
    assert verify_drafts([0], p, None, torch.tensor([[0.6, 0.0], [0.5, 0.0]]), greedy=False) == (0, 1)
    assert verify_drafts([0], p, None, torch.tensor([[0.6, 0.0], [0.7, 0.0]]), greedy=False) == (0, 2)


def test_draft_probs_ratio_and_residual():
    p = torch.tensor([[0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[0.6, 0.2, 0.2]])
    # draft 0 has p/q = 1/3: u = 0.3 accepts, u = 0.34 rejects.
    assert verify_drafts([0], p, q, torch.tensor([[0.3, 0.0], [0.0, 0.0]]), greedy=False)[0] == 1
    # residual max(p - q, 0) = (0, .3, .1) -> normalized (0, .75, .25): u=0.7 -> 1, u=0.8 -> 2
    assert verify_drafts([0], p, q, torch.tensor([[0.34, 0.0], [0.7, 0.0]]), greedy=False) == (0, 1)
    assert verify_drafts([0], p, q, torch.tensor([[0.34, 0.0], [0.8, 0.0]]), greedy=False) == (0, 2)


def test_draft_with_zero_target_probability_is_always_rejected():
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    for u in (0.0, 0.5, 0.999):
        assert verify_drafts([0], p, None, torch.tensor([[u, 0.0], [0.3, 0.0]]), greedy=False) == (0, 1)


def test_emitted_token_is_distributed_as_the_target():
    """Draw the draft from q and the uniforms at random: the first emitted token ~ p_0."""
    gen = torch.Generator().manual_seed(0)
    v, trials = 6, 20000
    p = torch.softmax(torch.randn(3, v, generator=gen) * 1.5, dim=1)  # [k + 1, V]
    q = torch.softmax(torch.randn(2, v, generator=gen) * 1.5, dim=1)  # [k, V]
    counts = torch.zeros(v)
    second = torch.zeros(v)  # the second emitted token when d_1 was accepted -> ~ p_1
    for _ in range(trials):
        d = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        n, nxt = verify_drafts(d, p, q, torch.rand(2, 3, generator=gen), greedy=False)
        emitted = d[:n] + [nxt]
        counts[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    assert stats.chisquare(counts, p[0] * trials).pvalue > 0.001
    assert stats.chisquare(second, p[1] * second.sum()).pvalue > 0.001


def test_inverse_cdf_never_returns_a_zero_weight_token():
    w = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    assert {sample_inverse_cdf(w, u) for u in (0.0, 0.29, 0.3, 0.99999, 0.9999999999)} <= {1, 3}
    assert sample_inverse_cdf(w, 0.1) == 1 and sample_inverse_cdf(w, 0.5) == 3


def test_verify_by_target_samples_accepts_while_the_targets_own_draws_agree():
    assert verify_by_target_samples([4, 5, 6], [4, 5, 6, 9]) == (3, 9)  # all accepted + bonus
    assert verify_by_target_samples([4, 5, 6], [4, 7, 6, 9]) == (1, 7)  # the target's draw replaces d2
    assert verify_by_target_samples([4], [3, 8]) == (0, 3)
    assert verify_by_target_samples([], [2]) == (0, 2)


def test_acceptance_by_target_samples_matches_the_one_hot_rejection_rate():
    """Accepting d iff a p-sample equals d happens with probability p(d): the same rate as
    the u < p(d) test of rejection sampling with a one-hot q."""
    import torch

    from engine.sampler import exponential_race

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).repeat(20000, 1)
    draws = exponential_race(p, torch.empty_like(p).exponential_(generator=g)).tolist()
    accepted = sum(verify_by_target_samples([1], [d, 0])[0] for d in draws) / len(draws)
    assert abs(accepted - 0.3) < 0.015
    assert 3 not in draws
