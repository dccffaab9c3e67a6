"""What the router holds about one request while it runs (router/orchestrator.py drives it).

Two objects, split by how they change:

- ``Prepared``: one attempt, validated and placed. Frozen: the next attempt (a migration, or a
  fresh node id after a failed prefill) is a ``dataclasses.replace`` of it, never an edit, so
  a caller holding an attempt always holds the whole of it.
- ``Running``: the request across its attempts. Mutable, owned by the orchestrator's event
  loop: what Abort needs to stop it wherever it is, what a migration continues from, and the
  router-side timings every Complete reports (``Running.timings``, the one place they are
  put together).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from protos.pdserve.v1 import serving_pb2 as pb
from router.placement import Placement
from router.request_trace import RequestTrace
from tokens.sampling_params import SamplingParams


def fresh_node_id(client_id: str) -> str:
    """The id the nodes see: unique per attempt, so a retry never meets its own leftovers and
    clients cannot collide on the nodes."""
    return f"{client_id}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Prepared:
    """One attempt of a request, validated and placed."""

    client_id: str
    node_id: str  # fresh_node_id(client_id)
    prompt: list[int]
    params: SamplingParams
    sampling: pb.SamplingParams  # normalized: every field explicit
    block_hashes: list[int]
    fingerprint: str
    block_size: int
    placement: Placement
    slo_class: str = "relaxed"
    # A migrated attempt: the last ``resumed`` tokens of ``prompt`` are output already streamed.
    resumed: int = 0
    # The salt of the prompt's block hashes (router/prepare.py, cache_salt): every node call
    # of every attempt carries it, so the nodes hash the prompt as block_hashes was.
    cache_salt: bytes = b""

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt, without the tokens a migration appended."""
        return len(self.prompt) - self.resumed


@dataclass(slots=True)
class Running:
    """One request across its attempts. Durations are seconds from ``arrival``
    (``time.monotonic``)."""

    arrival: float
    node_request_id: str | None = None  # the current attempt's id on the nodes
    decode_address: str | None = None
    prefill_call: object | None = None  # the Prefill call in flight (Abort cancels it)
    aborted: bool = False
    trace: RequestTrace = field(default_factory=RequestTrace.off)  # the request's spans
    output_ids: list[int] = field(default_factory=list)  # tokens relayed to the client (n = 1)
    migrations: int = 0
    step_errors: int = 0  # engine step failures met (router/migration.py STEP_ERROR_BUDGET)
    # Counts the attempts (_execute calls): a stream relays only while its attempt is the
    # current one, so nothing from a replaced attempt reaches the client.
    attempt: int = 0
    queue_s: float | None = None  # arrival -> the first attempt started (placement, admission)
    prefill_s: float | None = None  # the prefill node's report, latest attempt that prefilled
    transfer_s: float | None = None  # its KV transfer
    # A moment, not a duration: when the prefill node's first token came back (None: the
    # first token came from a decode node).
    prefill_token_at: float | None = None
    first_token_s: dict[int, float] = field(default_factory=dict)  # per sample: its first chunk relayed

    def timings(self, index: int, node: pb.Timings | None = None, now: float | None = None) -> pb.Timings:
        """Sample ``index``'s timings as the client sees them. ``node``: the decode node's own,
        which fill what the router did not see (its prefill time when it prefilled, a first
        token the router never relayed)."""
        now = time.monotonic() if now is None else now
        if self.prefill_token_at is not None:
            first = self.prefill_token_at - self.arrival
        else:
            first = self.first_token_s.get(index, node.first_token_s if node is not None else now - self.arrival)
        prefill_s = self.prefill_s if self.prefill_s is not None else node.prefill_s if node is not None else 0.0
        return pb.Timings(queue_s=self.queue_s or 0.0, prefill_s=prefill_s, transfer_s=self.transfer_s or 0.0,
                          first_token_s=first, total_s=now - self.arrival)
