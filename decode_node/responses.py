"""Engine outputs -> the client API's GenerateResponse messages (plain conversion, no I/O).

One RequestOutput carries the new tokens of the samples that moved in one step; each becomes a
Chunk, and a sample that finished also gets its Complete. When the request ends, every sample
that has not completed yet (an abort before an n > 1 request forked) completes with the
request's finish reason, so a reader always gets exactly n Completes. A stream with nothing
to say for a while gets a Heartbeat instead (decode_node/server.py decides when).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from engine.outputs import RequestOutput
from protos.convert import finish_reason_to_proto, token_logprobs_to_proto
from protos.pdserve.v1 import serving_pb2 as pb


class ResponseBuilder:
    """Per request: turns its outputs into GenerateResponses, tracking completed samples."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.completed: set[int] = set()
        self.num_messages = 0

    def responses(self, out: RequestOutput) -> Iterator[pb.GenerateResponse]:
        for c in out.outputs:
            if c.new_token_ids or c.text_delta:
                yield self._msg(chunk=pb.Chunk(index=c.index, token_ids=c.new_token_ids, text=c.text_delta,
                                               logprobs=token_logprobs_to_proto(c.new_token_ids, c.new_logprobs,
                                                                                 c.new_top_logprobs)))
            if c.finish_reason is not None and c.index not in self.completed:
                yield self._complete(out, c.index, c.finish_reason, len(c.token_ids))
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            for index in range(self.n):
                if index not in self.completed:
                    yield self._complete(out, index, reason, 0)

    def error(self, code: int, message: str) -> Iterator[pb.GenerateResponse]:
        """A failure after output started: one Error, then FINISH_REASON_ERROR for every
        sample still open."""
        yield self._msg(error=pb.Error(code=code, message=message))
        for index in range(self.n):
            if index not in self.completed:
                self.completed.add(index)
                yield self._msg(complete=pb.Complete(index=index, finish_reason=pb.FINISH_REASON_ERROR))

    def heartbeat(self, engine_progress: int) -> pb.GenerateResponse:
        """A sign of life on a silent stream (the caller checks that the engine moved). Not
        counted in ``num_messages``: a failure after heartbeats only is still one before any
        output, answered as the call's status."""
        return pb.GenerateResponse(request_id=self.request_id,
                                   heartbeat=pb.Heartbeat(engine_progress=engine_progress))

    def _complete(self, out: RequestOutput, index: int, reason: str, completion_tokens: int) -> pb.GenerateResponse:
        self.completed.add(index)
        m = out.metrics
        timings = pb.Timings(
            queue_s=m.queue_s or 0.0,
            first_token_s=m.ttft_s or 0.0,
            total_s=time.monotonic() - m.arrival_time,
        )
        usage = pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens,
                         cached_prompt_tokens=out.num_cached_tokens)
        spec = next((c.spec for c in out.outputs if c.index == index and c.spec is not None), None)
        if spec is not None:
            usage.spec_drafts, usage.spec_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            usage.spec_accepted_tokens = spec.num_accepted_tokens
            usage.spec_acceptance_per_position.extend(spec.acceptance_per_position)
            usage.spec_mean_accepted_length = spec.mean_accepted_length
        return self._msg(complete=pb.Complete(index=index, finish_reason=finish_reason_to_proto(reason),
                                              usage=usage, timings=timings))

    def _msg(self, **kind) -> pb.GenerateResponse:
        self.num_messages += 1
        return pb.GenerateResponse(request_id=self.request_id, **kind)
