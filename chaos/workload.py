"""The requests a chaos run sends, and the client that sends them the way a careful user would.

Half the requests are greedy, half sampled with a seed (temperature 0.8, top_p 0.95): seeded
sampling draws each step from a generator derived from (seed, sample, step), so both kinds
have one right answer, the one a run without the fault gives (docs/cluster.md, seeded
sampling across nodes). Some go over the OpenAI-compatible HTTP API (``logprobs`` on, so the
stream names each token) and the rest over gRPC through the SDK. Every prompt starts with a
per-run salt: no node has its KV cached from an earlier run.

The client retries as a user would: a stream cut by UNAVAILABLE (``StreamInterruptedError``,
a dropped HTTP connection), a refusal (UNAVAILABLE, RESOURCE_EXHAUSTED, HTTP 429 / 503) gets
the whole request sent again, after a backoff, until ``RetryBudget`` is spent; greedy and
seeded requests give the same tokens again, and the tokens of the failed attempt are thrown
away. The SDK's own retries of calls refused before their first chunk are on (they are what
restart-router checks). Every attempt is recorded (chaos/history.py judges them).
"""
from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chaos.history import Attempt, RequestLog

# Chat questions of different lengths: with the chat template and the salted system line every
# prompt is longer than `pdserve up`'s short_prompt_tokens, so each takes the disaggregated path.
QUESTIONS = (
    "What is the capital of France?",
    "Name three colors and one thing of each color.",
    "What is 12 times 12? Explain the steps.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "What does a CPU do in a computer?",
    "Give me one tip for better sleep.",
    "Translate 'thank you very much' into German and French.",
    "What is the largest planet in the solar system, and how large is it?",
    "Why is the sky blue?",
    "List the first five prime numbers.",
    "What is a load balancer?",
    "Describe a cat in one sentence.",
)
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
GREEDY = {"temperature": 0.0}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    key: str  # unique in a run; names the reference output
    messages: tuple[tuple[str, str], ...]
    max_tokens: int
    sampling: tuple[tuple[str, object], ...]  # temperature, top_p, seed
    protocol: str = "grpc"  # or "http"

    @property
    def chat(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.messages]


def make_specs(n: int, max_tokens: int, salt: str, http_every: int = 0, seed0: int = 1000) -> list[RequestSpec]:
    """``n`` requests in pairs (greedy, then sampled with seed ``seed0 + i``); the last pair of
    every ``http_every`` pairs goes over HTTP (0: none). With 8 requests and ``http_every`` 2,
    requests 2, 3, 6, 7 are HTTP: each half of the batch has both kinds over both protocols."""
    specs = []
    for i in range(n):
        sampled = i % 2 == 1
        sampling = {**SAMPLED, "seed": seed0 + i} if sampled else GREEDY
        protocol = "http" if http_every and (i // 2) % http_every == http_every - 1 else "grpc"
        messages = (("system", f"Chaos run {salt}: answer plainly."), ("user", QUESTIONS[i % len(QUESTIONS)]))
        specs.append(RequestSpec(f"{salt}-{i}-{'sampled' if sampled else 'greedy'}-{protocol}", messages, max_tokens,
                                 tuple(sorted(sampling.items())), protocol))
    return specs


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """How long a client keeps retrying one request: at most ``attempts`` attempts, none
    started later than ``seconds`` after the first; backoff ``base`` * 2^k (capped) with jitter."""

    attempts: int = 10
    seconds: float = 60.0
    base_s: float = 0.5
    cap_s: float = 4.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0.5, 1.0) * min(self.cap_s, self.base_s * 2 ** (attempt - 1))


@dataclass(slots=True)
class Endpoints:
    """Where the router answers; a restarted router may come back elsewhere (not here: same ports)."""

    grpc: str
    http: str | None = None
    timeout_s: float = 180.0  # one attempt's deadline: a hang ends as DEADLINE_EXCEEDED (lost)
    sdk_retry_budget_s: float = 10.0


class Sender:
    """Sends one spec with retries, recording each attempt into its RequestLog."""

    def __init__(self, ep: Endpoints, budget: RetryBudget, rng: random.Random | None = None) -> None:
        import pdserve

        self.ep = ep
        self.budget = budget
        self._rng = rng or random.Random()
        self._client = pdserve.Client(ep.grpc, timeout=ep.timeout_s, retry_budget_s=ep.sdk_retry_budget_s)

    def send(self, spec: RequestSpec, log: RequestLog) -> None:
        log.submitted = time.monotonic()
        while True:
            a = Attempt(started=time.monotonic())
            log.attempts.append(a)
            if spec.protocol == "http":
                self._http(spec, a)
            else:
                self._grpc(spec, a)
            a.ended = time.monotonic()
            if a.completed or not a.retryable:
                return
            if len(log.attempts) >= self.budget.attempts or time.monotonic() - log.submitted > self.budget.seconds:
                log.budget_spent = True
                return
            time.sleep(self.budget.delay(len(log.attempts), self._rng))

    def _grpc(self, spec: RequestSpec, a: Attempt) -> None:
        stream = None
        try:
            with self._client.generate(spec.chat, max_tokens=spec.max_tokens, ignore_eos=True,
                                       **dict(spec.sampling)) as stream:
                for chunk in stream:
                    if chunk.token_ids:
                        a.tokens.extend(chunk.token_ids)
                        a.times.append(time.monotonic())
                a.finish = stream.completion.finish_reason if stream.completion else None
                if a.finish is None:
                    a.code, a.message = "UNKNOWN", "the stream ended without a completion"
        except Exception as e:  # noqa: BLE001 - every failure is recorded and judged
            code = getattr(e, "code", None)
            a.code = getattr(code, "name", None) or type(e).__name__
            a.message = getattr(e, "message", None) or str(e)
            a.retryable = bool(getattr(e, "retryable", False))
        finally:
            if stream is not None:
                a.sdk_attempts = stream.attempts

    def _http(self, spec: RequestSpec, a: Attempt) -> None:
        host, port = self.ep.http.rsplit(":", 1)
        body = {"model": "", "messages": spec.chat, "max_tokens": spec.max_tokens, "ignore_eos": True,
                "stream": True, "logprobs": True, **dict(spec.sampling)}
        conn = http.client.HTTPConnection(host, int(port), timeout=self.ep.timeout_s)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                _http_refusal(a, resp.status, resp.read())
                return
            _read_sse(resp, a)
        except (OSError, http.client.HTTPException) as e:
            # refused, reset, or cut mid-stream: the router went away
            a.code, a.message, a.retryable = "UNAVAILABLE", f"HTTP connection: {type(e).__name__}: {e}", True
        finally:
            conn.close()

    def close(self) -> None:
        self._client.close()


def _http_refusal(a: Attempt, status: int, raw: bytes) -> None:
    try:
        err = json.loads(raw)["error"]
        message = err.get("message", "")
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode(errors="replace")
    a.code = {429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}.get(status, f"HTTP_{status}")
    a.message = f"HTTP {status}: {message}"
    a.retryable = status in (429, 503)


def _read_sse(resp: http.client.HTTPResponse, a: Attempt) -> None:
    """The chat stream's events: each token's text from ``logprobs.content``, the finish
    reason, an error event, ``[DONE]``. A stream that stops before ``[DONE]`` was cut."""
    while True:
        line = resp.readline()
        if not line:
            a.code, a.message, a.retryable = "UNAVAILABLE", "HTTP stream cut before [DONE]", True
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            if a.finish is None and a.code is None:
                a.code, a.message = "UNKNOWN", "[DONE] without a finish reason"
            return
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            a.code = str(err.get("code") or "unknown").upper()
            a.message = err.get("message", "")
            a.retryable = a.code in ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
            continue
        for choice in event.get("choices", ()):
            content = (choice.get("logprobs") or {}).get("content") or ()
            if content:
                a.tokens.extend(t["token"] for t in content)
                a.times.append(time.monotonic())
            if choice.get("finish_reason"):
                a.finish = choice["finish_reason"]


class Batch:
    """Concurrent requests (one thread each), each sent with retries by one shared Sender."""

    def __init__(self, ep: Endpoints, specs: Sequence[RequestSpec], budget: RetryBudget = RetryBudget(),
                 timeout_s: float = 300.0) -> None:
        self.specs = list(specs)
        self.logs = [RequestLog(s.key) for s in self.specs]
        self.timeout_s = timeout_s
        self._sender = Sender(ep, budget)
        self._threads = [threading.Thread(target=self._sender.send, args=(s, log), daemon=True)
                         for s, log in zip(self.specs, self.logs)]
        for t in self._threads:
            t.start()

    def wait_until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: timed out waiting for {what}")
            time.sleep(0.01)

    def under_way(self, min_tokens: int) -> bool:
        """Every request has ``min_tokens`` tokens in its current attempt, or has ended."""
        return all(log.tokens_now() >= min_tokens or log.ended for log in self.logs)

    def done(self) -> bool:
        return not any(t.is_alive() for t in self._threads)

    def join(self) -> list[RequestLog]:
        deadline = time.monotonic() + self.timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._sender.close()
        return self.logs


@dataclass(slots=True)
class Reference:
    """The fault-free tokens of each request, by key."""

    tokens: dict[str, list] = field(default_factory=dict)

    @staticmethod
    def of(logs: Sequence[RequestLog]) -> "Reference":
        """From a fault-free run; raises if any of its requests did not complete at the first try."""
        bad = [f"{log.key}: {log.last.code} {log.last.message}" for log in logs
               if log.last is None or not log.last.completed or len(log.attempts) != 1]
        if bad:
            raise RuntimeError(f"the fault-free run failed: {bad[:4]}")
        return Reference({log.key: list(log.last.tokens) for log in logs})
