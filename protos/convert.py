"""Proto <-> engine plain-data conversions shared by the router and the nodes (torch-free).

Unset optional proto fields mean the engine's default, so a client that leaves temperature
unset gets the engine default (1.0), not greedy.
"""
from __future__ import annotations

from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import serving_pb2 as pb

_DEFAULTS = SamplingParams()

FINISH_TO_PROTO = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def _f(x: float) -> float:
    # The wire carries float32: 0.9 arrives as 0.899999976. Round back to what was meant.
    return float(f"{x:.7g}")


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Build engine SamplingParams (not yet validated: call ``.validate(vocab)``)."""
    return SamplingParams(
        n=s.n if s.HasField("n") else _DEFAULTS.n,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else _DEFAULTS.max_tokens,
        min_tokens=s.min_tokens,
        temperature=_f(s.temperature) if s.HasField("temperature") else _DEFAULTS.temperature,
        top_k=s.top_k,
        top_p=_f(s.top_p) if s.HasField("top_p") else _DEFAULTS.top_p,
        min_p=_f(s.min_p),
        repetition_penalty=(_f(s.repetition_penalty) if s.HasField("repetition_penalty")
                            else _DEFAULTS.repetition_penalty),
        presence_penalty=_f(s.presence_penalty),
        frequency_penalty=_f(s.frequency_penalty),
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        include_stop_str_in_output=s.include_stop_str_in_output,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
    )


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=p.n,
        max_tokens=p.max_tokens,
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_k=max(p.top_k, 0),
        top_p=p.top_p,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg
