"""The SDK's I/O-free core, shared by the blocking client (client.py) and the asyncio one
(aio.py): request building, response accumulation, the retry decision and its delay, deadlines
and per-stream state. Nothing here waits or touches a socket; the two clients add only the
channel and how they wait (``time.sleep`` or ``await asyncio.sleep``).

Retries: a call that fails with UNAVAILABLE (no router reachable, or one draining) or
RESOURCE_EXHAUSTED (overload) before the server sent anything is retried, within the call's
deadline and a time budget (by default ``DEFAULT_RETRY_BUDGET_S`` from the first failure, however
many attempts that takes: a router restart takes seconds, which a fixed count of fast retries does
not ride out). Each wait is the server's retry hint (``retry-after-ms`` trailing metadata; none:
0) plus exponential backoff with full jitter, so clients refused together do not come back
together. When the budget is spent the error says so, with the last status. Once a Generate stream has
delivered a message it is never retried, so output is never duplicated: cut by UNAVAILABLE (a
router restart, a dropped connection) it raises ``StreamInterruptedError``, retryable by the
caller. The channel reconnects on the same short backoff (``reconnect_options``), so a router
that comes back on its address is found again by the next attempt, not after gRPC's own
reconnect backoff (1 s growing to 120 s) ran out.
"""
from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve import checks, errors
from pdserve.types import Chunk, Completion, ModelInfo, Timings, TokenLogprob, ToolCall, Usage
from protos.conventions import MAX_MESSAGE_BYTES, grpc_options
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc

DEFAULT_TARGET = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"  # the key sent when the client is given none
DEFAULT_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PdServe"].full_name
Metadata = Sequence[tuple[str, str]]
# A retry starts at most this long after the call's first failure (None: no limit besides the
# timeout). Ten seconds ride out a router restart (a process start and its tokenizer load, a few
# seconds) or a Kubernetes pod replacement behind a Service, while a router that is really gone
# is reported within seconds, not after the request's whole timeout.
DEFAULT_RETRY_BUDGET_S = 10.0
DEFAULT_BACKOFF = (0.1, 2.0)  # (base, cap) seconds of the exponential backoff with full jitter
SLO_CLASSES = tuple(pb.SloClass.Name(v).removeprefix("SLO_CLASS_").lower()
                    for v in pb.SloClass.values() if v != pb.SLO_CLASS_UNSPECIFIED)


@dataclass(frozen=True, slots=True)
class TLS:
    """TLS settings. Each PEM may be given as bytes or as a file path.

    root_certificates: CAs to trust (None: the system's). certificate_chain + private_key:
    a client certificate for mutual TLS. server_name_override: the name to verify the server's
    certificate against when it differs from the target's host (tests, IP targets).
    """

    root_certificates: bytes | str | Path | None = None
    certificate_chain: bytes | str | Path | None = None
    private_key: bytes | str | Path | None = None
    server_name_override: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.root_certificates),
            private_key=_pem(self.private_key),
            certificate_chain=_pem(self.certificate_chain),
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name_override)] if self.server_name_override else []


def _pem(value: bytes | str | Path | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


# ----------------------------------------------------------------------------- requests
def build_request(prompt: Any = None, *, messages: Sequence[Mapping[str, Any]] | None = None,
                  token_ids: Sequence[int] | None = None, model: str = "",
                  request_id: str | None = None, slo_class: str | None = None,
                  session_id: str = "", cache_salt: str = "", response_format: Mapping[str, Any] | None = None,
                  structured: Mapping[str, Any] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                  tool_choice: str | Mapping[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                  **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from one of: ``prompt`` (str: text; list of dicts: chat messages;
    list of ints: token ids), ``messages=`` or ``token_ids=``. Sampling keywords left None
    mean the server's default; so does ``slo_class=None`` (the router's default class).

    Structured output, as over HTTP: ``response_format=`` OpenAI's (``{"type": "json_object"}``,
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``) or ``structured=``
    vLLM's ``structured_outputs`` object (``{"json": schema}``, ``{"regex": ...}``,
    ``{"choice": [...]}``, ``{"grammar": ...}``, ``{"json_object": True}``); one of them.
    Tools (chat prompts only): ``tools=`` OpenAI's function list, ``tool_choice=`` ("none",
    "auto", "required" or ``{"type": "function", "function": {"name": ...}}``),
    ``parallel_tool_calls=``; the calls come back parsed in ``Completion.tool_calls``.
    ``cache_salt=`` (vLLM's): cached prompt blocks are reused only among requests with the same
    salt (and, with API keys on, by default only among requests of the same key).
    Raises InvalidRequestError naming the argument for what the wire cannot carry
    (pdserve/checks.py)."""
    if prompt is not None:
        if isinstance(prompt, str):
            text: str | None = prompt
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, prompt
        else:
            text, messages = None, prompt
    else:
        text = None
    given = sum(x is not None for x in (text, messages, token_ids))
    if given != 1:
        raise checks.invalid("prompt", "give exactly one of a text prompt, messages or token_ids")
    if slo_class is not None and slo_class not in SLO_CLASSES:
        raise checks.invalid("slo_class", f"slo_class must be one of {sorted(SLO_CLASSES)}, got {slo_class!r}")
    req = pb.GenerateRequest(
        model=checks.check_str("model", model), request_id=checks.check_str("request_id", request_id or uuid.uuid4().hex),
        session_id=checks.check_str("session_id", session_id),
        cache_salt=checks.check_str("cache_salt", cache_salt),
        slo_class=pb.SloClass.Value(f"SLO_CLASS_{slo_class.upper()}") if slo_class else pb.SLO_CLASS_UNSPECIFIED,
        sampling=sampling_message(**sampling))
    constraint = checks.structured_message(response_format, structured)
    if constraint is not None:
        req.sampling.structured.CopyFrom(constraint)
    if text is not None:
        req.text = checks.check_str("prompt", text)
    elif messages is not None:
        req.chat.messages.extend(checks.check_messages(messages))
    else:
        ids = checks.check_token_ids("token_ids", token_ids)
        if not ids:
            raise checks.invalid("token_ids", "token_ids is empty: a prompt needs at least one token")
        req.tokens.ids.extend(ids)
    if tools is not None or tool_choice is not None or parallel_tool_calls is not None:
        checks.add_tools(req, tools, tool_choice, parallel_tool_calls)
    return req


def sampling_message(*, max_tokens: int | None = None, temperature: float | None = None,
                     top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                     seed: int | None = None, stop: Sequence[str] | str | None = None,
                     stop_token_ids: Sequence[int] | None = None, n: int | None = None,
                     logprobs: int | None = None, min_tokens: int | None = None,
                     repetition_penalty: float | None = None, presence_penalty: float | None = None,
                     frequency_penalty: float | None = None, ignore_eos: bool | None = None,
                     include_stop_str_in_output: bool | None = None) -> pb.SamplingParams:
    fields = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  seed=seed, n=n, logprobs=logprobs, min_tokens=min_tokens,
                  repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                  frequency_penalty=frequency_penalty, ignore_eos=ignore_eos,
                  include_stop_str_in_output=include_stop_str_in_output)
    checks.check_sampling(fields)
    msg = pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    if stop is not None:
        msg.stop.extend(checks.check_stop(stop))
    if stop_token_ids is not None:
        msg.stop_token_ids.extend(checks.check_token_ids("stop_token_ids", stop_token_ids))
    return msg


# ----------------------------------------------------------------------------- responses
def finish_reason_name(value: int) -> str:
    """FINISH_REASON_STOP -> "stop"; unknown future values keep a readable name."""
    try:
        return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:
        return f"unknown({value})"


def _logprobs(items) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                 for lp in items)


class ResponseAccumulator:
    """Turns GenerateResponse messages into Chunks and, per sample, a Completion."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._ids: dict[int, list[int]] = {}
        self._lps: dict[int, list[TokenLogprob]] = {}
        self.completions: dict[int, Completion] = {}
        self.request_id: str | None = None

    def feed(self, resp: pb.GenerateResponse) -> Chunk | None:
        """The Chunk to yield, or None; raises the mapped exception on an in-stream Error."""
        self.request_id = resp.request_id or self.request_id
        kind = resp.WhichOneof("kind")
        if kind == "chunk":
            c = resp.chunk
            chunk = Chunk(text=c.text, token_ids=tuple(c.token_ids), index=c.index, logprobs=_logprobs(c.logprobs))
            self._text.setdefault(c.index, []).append(c.text)
            self._ids.setdefault(c.index, []).extend(c.token_ids)
            self._lps.setdefault(c.index, []).extend(chunk.logprobs)
            return chunk
        if kind == "complete":
            c = resp.complete
            u, t = c.usage, c.timings
            self.completions[c.index] = Completion(
                index=c.index, text="".join(self._text.get(c.index, [])),
                token_ids=tuple(self._ids.get(c.index, [])),
                finish_reason=finish_reason_name(c.finish_reason),
                usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.spec_drafts,
                            u.spec_draft_tokens, u.spec_accepted_tokens, tuple(u.spec_acceptance_per_position),
                            u.spec_mean_accepted_length),
                timings=Timings(t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.total_s),
                logprobs=tuple(self._lps.get(c.index, [])),
                tool_calls=tuple(ToolCall(t.id, t.name, t.arguments) for t in c.tool_calls),
            )
            return None
        if kind == "error":
            where = f" (sample {resp.error.index})" if resp.error.HasField("index") else ""
            raise errors.from_code_number(resp.error.code, resp.error.message + where)
        # A heartbeat (a node's sign of life, which the router never forwards) or a kind this
        # SDK does not know yet: nothing for the caller.
        return None


def models_from(resp: pb.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.id, m.max_context_length) for m in resp.models]


# ----------------------------------------------------------------------------- retries
class Backoff:
    """Exponential backoff with full jitter: attempt k sleeps U(0, min(cap, base * 2**k))."""

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base, self.cap = base, cap
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        # The exponent is bounded: with no retry count limit, 2 ** 1024 would overflow a float.
        return self._rng.uniform(0.0, min(self.cap, self.base * 2.0 ** min(attempt, 60)))


class Deadline:
    """The remaining time of one logical call across its retries (None: no deadline)."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        r = self.remaining()
        return r is not None and r <= 0


# Statuses a call that delivered nothing is retried on: nothing reached a router (or it is
# draining), or the cluster is overloaded. Every other status says something about the request.
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class RetryPolicy:
    """Whether a failed attempt is retried, and after how long: UNAVAILABLE and
    RESOURCE_EXHAUSTED only, at most ``retries`` times (None: no count limit), the next attempt
    starting at most ``budget_s`` after the first failure (None: no time limit) and before the
    call's deadline. The wait is the server's hint (``retry_after_s``) plus the backoff."""

    def __init__(self, retries: int | None, backoff: Backoff, budget_s: float | None = DEFAULT_RETRY_BUDGET_S) -> None:
        if retries is not None and retries < 0:
            raise ValueError(f"retries must be >= 0 or None, got {retries}")
        if budget_s is not None and not budget_s >= 0:
            raise ValueError(f"retry_budget_s must be >= 0 or None, got {budget_s}")
        self.retries = retries
        self.backoff = backoff
        self.budget_s = budget_s

    def delay(self, code: grpc.StatusCode, attempts: int, deadline: Deadline, elapsed: float = 0.0,
              retry_after_s: float | None = None) -> float | None:
        """Seconds to wait before attempt ``attempts + 1``, ``elapsed`` seconds after the first
        failure, or None: do not retry (a status not retried, out of retries, past the retry
        budget, or the deadline would pass while waiting)."""
        return self.decide(code, attempts, deadline, elapsed, retry_after_s)[0]

    def decide(self, code: grpc.StatusCode, attempts: int, deadline: Deadline, elapsed: float = 0.0,
               retry_after_s: float | None = None) -> tuple[float | None, str]:
        """``delay``, plus why a retryable status is not retried ("" when retried or not retryable)."""
        if code not in RETRIED_CODES:
            return None, ""
        if self.retries is not None and attempts > self.retries:
            return None, f"retries={self.retries} used up"
        hint = retry_after_s if retry_after_s is not None and retry_after_s > 0 else 0.0
        delay = hint + self.backoff.delay(attempts - 1)
        if self.budget_s is not None and elapsed + delay > self.budget_s:
            return None, (f"retry budget spent: the next attempt would start {elapsed + delay:.2f} s after the "
                          f"first failure, past retry_budget_s={self.budget_s:g}")
        remaining = deadline.remaining()
        if remaining is not None and remaining <= delay:
            return None, "the call's timeout would pass while waiting to retry"
        return delay, ""


class Attempts:
    """One logical call's attempts: its deadline, how many were made, when the first failed."""

    def __init__(self, timeout: float | None, policy: RetryPolicy) -> None:
        self.deadline = Deadline(timeout)
        self.policy = policy
        self.count = 0
        self.first_failure: float | None = None

    def begin(self) -> float | None:
        """Start an attempt; returns its timeout. Raises DeadlineExceededError once it passed."""
        if self.deadline.expired():
            raise errors.DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while retrying")
        self.count += 1
        return self.deadline.remaining()

    def retry_delay(self, err: grpc.RpcError) -> float:
        """The wait before the next attempt; raises the typed error when there is none (for a
        retryable status, its message says why it was not retried again)."""
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        typed = errors.from_rpc_error(err)
        delay, why = self.policy.decide(typed.code, self.count, self.deadline, now - self.first_failure,
                                        getattr(typed, "retry_after_s", None))
        if delay is None:
            raise (errors.gave_up(typed, why, self.count, now - self.first_failure) if why else typed) from None
        return delay


# ----------------------------------------------------------------------------- streams, clients
class StreamState:
    """What a sync or async Generate stream keeps: the request, its attempts, the completions."""

    def __init__(self, client: ClientCore, request: pb.GenerateRequest, timeout: float | None,
                 metadata: Metadata) -> None:
        self._client = client
        self._request = request
        self._attempts = Attempts(timeout, client.retry)
        self._metadata = metadata
        self._acc = ResponseAccumulator()
        self._call = None
        self._received = 0  # messages this stream delivered (any: never retried again)
        self.request_id = request.request_id

    @property
    def attempts(self) -> int:
        return self._attempts.count

    @property
    def completions(self) -> list[Completion]:
        return [self._acc.completions[i] for i in sorted(self._acc.completions)]

    @property
    def completion(self) -> Completion | None:
        return self._acc.completions.get(0)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def _start(self, stub) -> None:
        self._call = stub.Generate(self._request, timeout=self._attempts.begin(), metadata=self._metadata)

    def _feed(self, resp: pb.GenerateResponse) -> Chunk | None:
        self._received += 1
        return self._acc.feed(resp)

    def _retry_delay(self, err: grpc.RpcError) -> float:
        """Wait this long, then attempt again; raises when the stream must not be retried (it
        already delivered output) or the policy says no."""
        if self._received:
            raise errors.interrupted(err, self._received) from None
        return self._attempts.retry_delay(err)


class ClientCore:
    """Configuration, the channel and its stubs, and request building, for both clients.
    ``channels`` is the module that makes the channel: ``grpc`` or ``grpc.aio``."""

    def __init__(self, channels, target: str, *, timeout: float | None, retries: int | None,
                 backoff: tuple[float, float], tls: TLS | None, metadata: Metadata | None,
                 max_message_bytes: int, api_key: str | None = None,
                 retry_budget_s: float | None = DEFAULT_RETRY_BUDGET_S) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = RetryPolicy(retries, Backoff(*backoff), retry_budget_s)
        options = grpc_options(max_message_bytes) + reconnect_options(backoff) + (tls.options() if tls else [])
        self._channel = (channels.secure_channel(target, tls.credentials(), options=options) if tls
                         else channels.insecure_channel(target, options=options))
        self._stub = pb_grpc.PdServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = api_key_metadata(api_key, os.environ) + tuple(metadata or ())

    @property
    def retries(self) -> int | None:
        return self.retry.retries

    @property
    def retry_budget_s(self) -> float | None:
        return self.retry.budget_s

    def _md(self, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
        return self._metadata + tuple(extra or ())

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts(self.timeout if timeout is None else timeout, self.retry)

    def _stream_args(self, prompt: Any, timeout: float | None, metadata: Metadata | None,
                     kwargs: dict) -> tuple[pb.GenerateRequest, float | None, tuple]:
        return build_request(prompt, **kwargs), self.timeout if timeout is None else timeout, self._md(metadata)


def reconnect_options(backoff: tuple[float, float]) -> list[tuple[str, int]]:
    """Channel options that make gRPC retry a refused connection on the SDK's own backoff: while
    a channel waits out its reconnect backoff, every call on it fails at once with UNAVAILABLE,
    so a longer channel backoff than the SDK's would use up the retries against a router that
    is already back."""
    base_ms, cap_ms = max(1, int(backoff[0] * 1000)), max(1, int(backoff[1] * 1000))
    return [("grpc.initial_reconnect_backoff_ms", base_ms), ("grpc.min_reconnect_backoff_ms", base_ms),
            ("grpc.max_reconnect_backoff_ms", max(base_ms, cap_ms))]


def api_key_metadata(api_key: str | None, env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The ``authorization`` header of ``api_key`` (None: ``$PDSERVE_API_KEY``; "": none)."""
    key = env.get(API_KEY_ENV, "") if api_key is None else api_key
    return (("authorization", f"Bearer {key}"),) if key else ()


def check_single_sample(kwargs: dict) -> None:
    if kwargs.get("n", 1) not in (None, 1):
        raise checks.invalid("n", "complete() returns one sample; use complete_all() for n > 1")

