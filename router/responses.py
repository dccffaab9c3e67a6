"""The responses the router writes itself instead of relaying a node's: the ends of a stream
(Complete per sample after an abort or an error, a request the prefill node's token already
finished) and the touches it puts on a decode node's messages before the client gets them.

A stream ends with a Complete for every sample, whatever happened; an in-stream ``Error``
comes first when output had already started (before any output, the failure is the call's
status instead: router/validation.py ``RouterError``).
"""
from __future__ import annotations

import grpc

from protos.convert import finish_reason_to_proto
from protos.pdserve.v1 import kv_pb2
from protos.pdserve.v1 import serving_pb2 as pb
from router.request_state import Prepared, Running
from router.tokenizer import PromptTokenizer
from tokens.detokenizer import IncrementalDetokenizer
from tokens.stop import FinishReason


def complete(index: int, reason: FinishReason, usage: pb.Usage | None = None,
             timings: pb.Timings | None = None) -> pb.GenerateResponse:
    done = pb.Complete(index=index, finish_reason=finish_reason_to_proto(reason))
    if usage is not None:
        done.usage.CopyFrom(usage)
    if timings is not None:
        done.timings.CopyFrom(timings)
    return pb.GenerateResponse(complete=done)


def aborted(prep: Prepared) -> list[pb.GenerateResponse]:
    return [complete(i, FinishReason.ABORT, pb.Usage(prompt_tokens=prep.num_prompt_tokens))
            for i in range(prep.params.n)]


def error_tail(code: grpc.StatusCode, message: str, n: int) -> list[pb.GenerateResponse]:
    """How a stream that already had output ends on a failure: the error, then every sample's
    Complete(ERROR)."""
    return [pb.GenerateResponse(error=pb.Error(code=code.value[0], message=message)),
            *(complete(i, FinishReason.ERROR) for i in range(n))]


def completed_by_prefill(prep: Prepared, first: kv_pb2.PrefillResponse, reason: FinishReason, run: Running,
                         tokenizer: PromptTokenizer) -> list[pb.GenerateResponse]:
    """The prefill node's one token ends the request (n = 1): its chunk and Complete."""
    tok = first.first_token_ids[0]
    detok = IncrementalDetokenizer(tokenizer, prep.prompt)
    chunk = pb.Chunk(index=0, token_ids=[tok], text=detok.step([tok]) + detok.flush())
    if first.first_logprobs:
        chunk.logprobs.append(first.first_logprobs[0])
    usage = pb.Usage(prompt_tokens=prep.num_prompt_tokens, completion_tokens=prep.resumed + 1,
                     cached_prompt_tokens=first.cached_tokens)
    return [pb.GenerateResponse(chunk=chunk), complete(0, reason, usage, run.timings(0))]


def fill_relayed_complete(done: pb.Complete, prep: Prepared, run: Running,
                          first: kv_pb2.PrefillResponse | None) -> None:
    """A decode node's Complete as the client gets it: the router's timings, the prefill node's
    cache reuse, and the client's own prompt (a migrated attempt's prompt held earlier output)."""
    done.timings.CopyFrom(run.timings(done.index, done.timings))
    usage = done.usage
    if first is not None:
        usage.cached_prompt_tokens = first.cached_tokens
    usage.prompt_tokens = prep.num_prompt_tokens
    usage.cached_prompt_tokens = min(usage.cached_prompt_tokens, prep.num_prompt_tokens)


def prepend_first_logprobs(chunk: pb.Chunk, first: kv_pb2.PrefillResponse) -> None:
    """The decode node's first chunk starts with the prefill node's token(s) but cannot know
    their logprobs (the prefill node computed them): put them in front, so every streamed token
    has its logprob."""
    n = len(first.first_logprobs)
    if (list(chunk.token_ids[:n]) == list(first.first_token_ids)
            and len(chunk.logprobs) == len(chunk.token_ids) - n):
        merged = list(first.first_logprobs) + list(chunk.logprobs)
        del chunk.logprobs[:]
        chunk.logprobs.extend(merged)
