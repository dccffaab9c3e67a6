"""Proto <-> plain-data conversions shared by the router and the nodes (torch-free).

Unset optional proto fields mean the engine's default, so a client that leaves temperature
unset gets the engine default (1.0), not greedy. Enum names are derived from the proto enums
(``FINISH_REASON_STOP`` <-> ``FinishReason.STOP``), so the wire stays their one definition.
"""
from __future__ import annotations

from collections.abc import Sequence

from protos.pdserve.v1 import serving_pb2 as pb
from tokens.sampling_params import SamplingParams, StructuredOutput
from tokens.stop import FinishReason

_DEFAULTS = SamplingParams()


def finish_reason_to_proto(reason: FinishReason | str) -> int:
    """``FinishReason.STOP`` (or "stop") -> ``FINISH_REASON_STOP``."""
    return pb.FinishReason.Value(f"FINISH_REASON_{FinishReason(reason).name}")


def slo_class_from_proto(value: int) -> str | None:
    """``SLO_CLASS_INTERACTIVE`` -> "interactive"; None for UNSPECIFIED (the server's default
    class applies) and for values this build does not know."""
    if value == pb.SLO_CLASS_UNSPECIFIED or value not in pb.SloClass.values():
        return None
    return pb.SloClass.Name(value).removeprefix("SLO_CLASS_").lower()


def token_logprobs_to_proto(token_ids: Sequence[int], logprobs: Sequence[float] | None,
                            top_logprobs: Sequence[Sequence[tuple[int, float]] | None] | None) -> list[pb.TokenLogprobs]:
    """One TokenLogprobs per token, or none when the logprobs do not cover every token (the
    request did not ask for them)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        return []
    tops = top_logprobs or [None] * len(token_ids)
    return [pb.TokenLogprobs(token_id=tok, logprob=lp,
                             top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in (top or [])])
            for tok, lp, top in zip(token_ids, logprobs, tops)]


def _f(x: float) -> float:
    # The wire carries float32: 0.9 arrives as 0.899999976. Round back to what was meant.
    return float(f"{x:.7g}")


def structured_from_proto(m: pb.StructuredOutput) -> StructuredOutput:
    """``STRUCTURED_KIND_JSON_SCHEMA`` -> kind "json_schema". UNSPECIFIED and values this build
    does not know become a kind that StructuredOutput.validate refuses by name."""
    if m.kind == pb.STRUCTURED_KIND_UNSPECIFIED:
        kind = "unspecified"
    elif m.kind in pb.StructuredKind.values():
        kind = pb.StructuredKind.Name(m.kind).removeprefix("STRUCTURED_KIND_").lower()
    else:
        kind = f"unknown ({m.kind})"
    return StructuredOutput(kind=kind, spec=m.spec, strict=m.strict if m.HasField("strict") else True)


def structured_to_proto(o: StructuredOutput) -> pb.StructuredOutput:
    msg = pb.StructuredOutput(kind=pb.StructuredKind.Value(f"STRUCTURED_KIND_{o.kind.upper()}"), spec=o.spec)
    if not o.strict:
        msg.strict = False
    return msg


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
        structured=structured_from_proto(s.structured) if s.HasField("structured") else None,
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
    if p.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(p.structured))
    return msg
