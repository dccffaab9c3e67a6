"""Blocking client of the pdserve router (gRPC). ``pdserve.AsyncClient`` is the asyncio twin.

Retries: a call that fails with UNAVAILABLE before the server sent anything is retried with
exponential backoff and full jitter, within the call's deadline. Once a Generate stream has
delivered a message it is never retried, so output is never duplicated.
"""
from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import errors
from pdserve.types import Chunk, Completion, ModelInfo, Timings, TokenLogprob, Usage
from protos.pdserve.v1 import serving_pb2 as pb
from protos.pdserve.v1 import serving_pb2_grpc as pb_grpc

SERVICE_NAME = "pdserve.v1.PdServe"
Metadata = Sequence[tuple[str, str]]

_SLO = {
    None: pb.SLO_CLASS_UNSPECIFIED,
    "interactive": pb.SLO_CLASS_INTERACTIVE,
    "standard": pb.SLO_CLASS_STANDARD,
    "batch": pb.SLO_CLASS_BATCH,
}


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


def channel_options(tls: TLS | None, max_message_bytes: int) -> list[tuple[str, Any]]:
    opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes),
                                   ("grpc.max_send_message_length", max_message_bytes)]
    return opts + (tls.options() if tls else [])


def build_request(prompt: Any = None, *, messages: Sequence[Mapping[str, str]] | None = None,
                  token_ids: Sequence[int] | None = None, model: str = "",
                  request_id: str | None = None, slo_class: str | None = None,
                  session_id: str = "", **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from one of: ``prompt`` (str: text; list of dicts: chat messages;
    list of ints: token ids), ``messages=`` or ``token_ids=``. Sampling keywords left None
    mean the server's default."""
    if prompt is not None:
        if isinstance(prompt, str):
            text: str | None = prompt
        elif prompt and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, prompt
        else:
            text, messages = None, prompt
    else:
        text = None
    given = sum(x is not None for x in (text, messages, token_ids))
    if given != 1:
        raise ValueError("give exactly one of a text prompt, messages or token_ids")
    if slo_class not in _SLO:
        raise ValueError(f"slo_class must be one of {sorted(k for k in _SLO if k)}, got {slo_class!r}")
    req = pb.GenerateRequest(model=model, request_id=request_id or uuid.uuid4().hex,
                             slo_class=_SLO[slo_class], session_id=session_id,
                             sampling=sampling_message(**sampling))
    if text is not None:
        req.text = text
    elif messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        req.tokens.ids.extend(int(t) for t in token_ids)
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
    msg = pb.SamplingParams(**{k: v for k, v in fields.items() if v is not None})
    if stop is not None:
        msg.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids is not None:
        msg.stop_token_ids.extend(stop_token_ids)
    return msg


def _finish_reason(value: int) -> str:
    # FINISH_REASON_STOP -> "stop"; unknown future values keep a readable name.
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
                finish_reason=_finish_reason(c.finish_reason),
                usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, u.spec_drafts,
                            u.spec_draft_tokens, u.spec_accepted_tokens, tuple(u.spec_acceptance_per_position),
                            u.spec_mean_accepted_length),
                timings=Timings(t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.total_s),
                logprobs=tuple(self._lps.get(c.index, [])),
            )
            return None
        if kind == "error":
            where = f" (sample {resp.error.index})" if resp.error.HasField("index") else ""
            raise errors.from_code_number(resp.error.code, resp.error.message + where)
        return None


class Backoff:
    """Exponential backoff with full jitter: attempt k sleeps U(0, min(cap, base * 2**k))."""

    def __init__(self, base: float, cap: float, rng: random.Random | None = None) -> None:
        self.base, self.cap = base, cap
        self._rng = rng or random.Random()

    def delay(self, attempt: int) -> float:
        return self._rng.uniform(0.0, min(self.cap, self.base * (2 ** attempt)))


class Deadline:
    """The remaining time of one logical call across its retries (None: no deadline)."""

    def __init__(self, timeout: float | None) -> None:
        self._end = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self._end is None else self._end - time.monotonic()

    def expired(self) -> bool:
        r = self.remaining()
        return r is not None and r <= 0


def _deadline_error() -> errors.DeadlineExceededError:
    return errors.DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded while retrying")


class StreamState:
    """What a sync or async Generate stream keeps: the request, its deadline, the completions."""

    def __init__(self, client, request: pb.GenerateRequest, timeout: float | None,
                 metadata: Metadata) -> None:
        self._client = client
        self._request = request
        self._deadline = Deadline(timeout)
        self._metadata = metadata
        self._acc = ResponseAccumulator()
        self._call = None
        self.attempts = 0
        self.request_id = request.request_id

    @property
    def completions(self) -> list[Completion]:
        return [self._acc.completions[i] for i in sorted(self._acc.completions)]

    @property
    def completion(self) -> Completion | None:
        return self._acc.completions.get(0)

    def cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()


class Stream(StreamState):
    """Iterator of Chunks of one Generate call. After iteration, ``completions`` holds one
    Completion per sample and ``completion`` the first. Use as a context manager (or call
    ``cancel()``) to stop the request early; the server then aborts it."""

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        c = self._client
        received = False
        while True:
            if self._deadline.expired():
                raise _deadline_error()
            self.attempts += 1
            self._call = c._stub.Generate(self._request, timeout=self._deadline.remaining(),
                                          metadata=self._metadata)
            try:
                for resp in self._call:
                    received = True
                    chunk = self._acc.feed(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                if not received and c._should_retry(e, self.attempts, self._deadline):
                    continue
                raise errors.from_rpc_error(e) from None
            finally:
                # Reached when the caller stops iterating early too: end the call on the server.
                self._call.cancel()


class Client:
    """pdserve client: ``with pdserve.Client("host:port") as c: print(c.complete("Hi").text)``."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout: float | None = None, retries: int = 3,
                 backoff: tuple[float, float] = (0.1, 2.0), tls: TLS | None = None,
                 metadata: Metadata | None = None, max_message_bytes: int = 64 * 1024 * 1024) -> None:
        options = channel_options(tls, max_message_bytes)
        self._channel = (grpc.secure_channel(target, tls.credentials(), options=options) if tls
                         else grpc.insecure_channel(target, options=options))
        self._stub = pb_grpc.PdServeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout
        self.retries = retries
        self._backoff = Backoff(*backoff)
        self._metadata = tuple(metadata or ())

    def _md(self, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
        return self._metadata + tuple(extra or ())

    def _should_retry(self, e: grpc.RpcError, attempts: int, deadline: Deadline) -> bool:
        """Sleep and return True when ``e`` deserves another attempt."""
        if e.code() != grpc.StatusCode.UNAVAILABLE or attempts > self.retries:
            return False
        delay = self._backoff.delay(attempts - 1)
        remaining = deadline.remaining()
        if remaining is not None and remaining <= delay:
            return False
        time.sleep(delay)
        return True

    def _unary(self, method, request, timeout: float | None):
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempts = 0
        while True:
            if deadline.expired():
                raise _deadline_error()
            attempts += 1
            try:
                return method(request, timeout=deadline.remaining(), metadata=self._md(None))
            except grpc.RpcError as e:
                if self._should_retry(e, attempts, deadline):
                    continue
                raise errors.from_rpc_error(e) from None

    def generate(self, prompt: Any = None, *, timeout: float | None = None, metadata: Metadata | None = None,
                 **kwargs: Any) -> Stream:
        """Stream the output: ``for chunk in client.generate("Hi", max_tokens=32): ...``.

        ``prompt``: text, chat messages (list of {"role", "content"}) or token ids; or pass
        ``messages=`` / ``token_ids=``. Other keywords: model, request_id, slo_class, session_id
        and the sampling fields (max_tokens, temperature, top_p, top_k, min_p, seed, stop,
        stop_token_ids, n, logprobs, min_tokens, the penalties, ignore_eos).
        """
        request = build_request(prompt, **kwargs)
        return Stream(self, request, self.timeout if timeout is None else timeout, self._md(metadata))

    def complete_all(self, prompt: Any = None, **kwargs: Any) -> list[Completion]:
        """Run to the end; one Completion per sample, by index."""
        stream = self.generate(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.completions

    def complete(self, prompt: Any = None, **kwargs: Any) -> Completion:
        """Run one sample to the end and return its full text (n > 1: use complete_all)."""
        if kwargs.get("n", 1) not in (None, 1):
            raise ValueError("complete() returns one sample; use complete_all() for n > 1")
        return self.complete_all(prompt, **kwargs)[0]

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Stop a running request; False when none had this id."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout).found

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        resp = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [ModelInfo(m.id, m.max_context_length) for m in resp.models]

    def health(self, *, timeout: float | None = None) -> bool:
        """True when the router reports SERVING (it has a live decode node)."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout)
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
