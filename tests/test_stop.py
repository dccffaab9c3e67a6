"""The stop rule (tokens/stop.py) the scheduler and the router share, on plain data."""
from __future__ import annotations

from tokens.sampling_params import SamplingParams
from tokens.stop import FinishReason, stop_reason

EOS = frozenset({2})


def reason(last, n_out, n_tokens, max_model_len=100, **params):
    return stop_reason(last, n_out, n_tokens, SamplingParams(**params), EOS, max_model_len)


def test_eos_and_stop_ids_stop_once_min_tokens_are_out():
    assert reason(2, 1, 11, max_tokens=8) is FinishReason.STOP
    assert reason(2, 1, 11, max_tokens=8, min_tokens=2) is None  # min_tokens not out yet
    assert reason(2, 2, 12, max_tokens=8, min_tokens=2) is FinishReason.STOP
    assert reason(2, 1, 11, max_tokens=8, ignore_eos=True) is None
    assert reason(7, 1, 11, max_tokens=8, stop_token_ids=(7,)) is FinishReason.STOP
    assert reason(7, 1, 11, max_tokens=8, stop_token_ids=(7,), ignore_eos=True) is FinishReason.STOP


def test_length_is_max_tokens_or_the_context():
    assert reason(5, 8, 18, max_tokens=8) is FinishReason.LENGTH
    assert reason(5, 3, 100, max_tokens=8) is FinishReason.LENGTH  # the context is full
    assert reason(5, 3, 99, max_tokens=8) is None
    assert reason(2, 8, 18, max_tokens=8) is FinishReason.STOP  # a stop token wins over the length


def test_names_are_what_clients_see():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort", "error", "tool_calls"]
    assert f"{FinishReason.STOP}" == "stop"
