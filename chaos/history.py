"""What the clients saw, and whether it is what a run without the fault would have given: the
figures of a scenario and the history check of a nemesis run. Plain data in, plain data out (no
sockets, no clock): tests build histories by hand.

A request is one ``RequestLog``: the request's key (which names its fault-free reference) and
the attempts the client made at it, each with the tokens it received and how it ended.

    attempt 1   o0 o1 o2  X (UNAVAILABLE: the stream was cut)        the client retries
    attempt 2   o0 o1 o2 o3 ... o47  length                           completed

Every request must end in exactly one of two ways:

    completed   exactly one attempt finished, and it is the last; its tokens are the
                reference's (fewer: tokens were lost; more: ``duplicated_tokens``; others:
                ``outputs_identical`` is false, as it is when no request completed at all:
                nothing compared is not a pass)
    failed      no attempt finished and the last ended in a typed error once the client's
                retry budget was spent (or with an error that is not retried): UNAVAILABLE,
                RESOURCE_EXHAUSTED, or INTERNAL from a failing engine step. Only where the
                scenario allows it (all decode nodes down, a nemesis run); elsewhere it is lost

Anything else is ``lost``: an attempt that never ended (a hang), an untyped error, a client
deadline, a retryable error the client stopped retrying before its budget was spent, fewer
tokens than the reference. Tokens of the attempts before the last are what a client throws
away when it retries; they count for nothing, except a second finished attempt, whose tokens
are all duplicated.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# Status codes a request may fail with once its retry budget is spent (and only where failures
# are allowed at all). A client deadline (DEADLINE_EXCEEDED) is a hang, not one of them.
TYPED_FAILURES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
# INTERNAL is typed only when a failing engine step caused it (its second failure ends the
# request with the step's error: docs/cluster.md, Faults); any other INTERNAL is a bug.
STEP_ERROR_PREFIX = "engine step failed:"


@dataclass(slots=True)
class Attempt:
    """One try at a request: what came back and how it ended (``ended`` None: it never did)."""

    started: float
    tokens: list = field(default_factory=list)  # token ids (gRPC) or token texts (HTTP)
    times: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    ended: float | None = None
    finish: str | None = None  # the finish reason, when it completed
    code: str | None = None  # the status code's name, when it failed ("UNAVAILABLE", ...)
    message: str = ""
    retryable: bool = False
    sdk_attempts: int = 1  # calls the SDK made for it (retries refused before the first chunk)

    @property
    def completed(self) -> bool:
        return self.ended is not None and self.finish is not None and self.code is None


@dataclass(slots=True)
class RequestLog:
    key: str  # the request's identity: its reference output is looked up by it
    submitted: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    budget_spent: bool = False  # the client stopped retrying because its retry budget ran out

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def ended(self) -> bool:
        last = self.last
        return last is not None and last.ended is not None and (last.completed or not self.retrying)

    @property
    def retrying(self) -> bool:
        """The last attempt failed retryably and the client has budget left (it tries again)."""
        last = self.last
        return last is not None and last.code is not None and last.retryable and not self.budget_spent

    def tokens_now(self) -> int:
        return len(self.last.tokens) if self.last is not None else 0


def completed_once(log: RequestLog) -> bool:
    """Exactly one attempt finished, and it is the last (its tokens are the judge's to compare)."""
    done = [a for a in log.attempts if a.completed]
    return len(done) == 1 and done[0] is log.last


def typed_failure(a: Attempt) -> bool:
    if a.code in TYPED_FAILURES:
        return True
    return a.code == "INTERNAL" and a.message.startswith(STEP_ERROR_PREFIX)


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one request ended: ``outcome`` is "completed", "failed" or "lost"."""

    key: str
    outcome: str
    identical: bool = True  # a completed request's tokens equal the reference's
    duplicated_tokens: int = 0
    why: str = ""


def judge(log: RequestLog, reference: Sequence | None, failures_allowed: bool) -> Verdict:
    """One request against its fault-free tokens (module docstring)."""
    if reference is None:
        return Verdict(log.key, "lost", False, 0, "no fault-free reference for this request")
    done = [a for a in log.attempts if a.completed]
    if done:
        final = done[-1]
        dup = max(0, len(final.tokens) - len(reference)) + sum(len(a.tokens) for a in done[:-1])
        identical = list(final.tokens) == list(reference)
        if final is not log.attempts[-1]:
            return Verdict(log.key, "lost", identical, dup, "an attempt after the completed one")
        if len(done) > 1:
            return Verdict(log.key, "completed", identical, dup, f"completed {len(done)} times")
        if len(final.tokens) < len(reference):
            return Verdict(log.key, "lost", False, dup,
                           f"completed with {len(final.tokens)} of the reference's {len(reference)} tokens")
        return Verdict(log.key, "completed", identical, dup, "" if identical else "tokens differ from the reference")
    last = log.last
    if last is None:
        return Verdict(log.key, "lost", True, 0, "never sent")
    if last.ended is None:
        return Verdict(log.key, "lost", True, 0, "an attempt never ended (a hang)")
    if not typed_failure(last):
        return Verdict(log.key, "lost", True, 0, f"ended in {last.code}: {last.message}")
    if last.retryable and not log.budget_spent:
        return Verdict(log.key, "lost", True, 0, "the client stopped retrying before its budget was spent")
    if not failures_allowed:
        return Verdict(log.key, "lost", True, 0, f"failed ({last.code}) where every request must complete")
    return Verdict(log.key, "failed", True, 0, f"{last.code} after {len(log.attempts)} attempt(s)")


def figures(logs: Sequence[RequestLog], reference: Mapping[str, Sequence], failures_allowed: bool = False) -> dict:
    """A scenario's figures: ``requests``, ``completed``, ``failed`` (typed, allowed), ``lost``,
    ``duplicated_tokens``, ``outputs_identical`` (every completed request, and at least one
    completed: a run where nothing completed compared nothing), ``retried`` (requests the
    client tried more than once)."""
    verdicts = [judge(log, reference.get(log.key), failures_allowed) for log in logs]
    completed = [v for v in verdicts if v.outcome == "completed"]
    return {"requests": len(logs),
            "completed": len(completed),
            "failed": sum(v.outcome == "failed" for v in verdicts),
            "lost": sum(v.outcome == "lost" for v in verdicts),
            "duplicated_tokens": sum(v.duplicated_tokens for v in verdicts),
            "outputs_identical": bool(completed) and all(v.identical for v in completed),
            "retried": sum(len(log.attempts) > 1 for log in logs)}


def problems(logs: Sequence[RequestLog], reference: Mapping[str, Sequence], failures_allowed: bool = False,
             limit: int = 10) -> list[str]:
    """The first ``limit`` requests that were not fine, each with why (for the report)."""
    out = []
    for log in logs:
        v = judge(log, reference.get(log.key), failures_allowed)
        if v.outcome == "lost" or not v.identical or v.duplicated_tokens:
            out.append(f"{v.key}: {v.why or 'duplicated tokens'}")
            if len(out) >= limit:
                break
    return out


def recovery_s(logs: Iterable[RequestLog], fault_at: float) -> float:
    """The longest wait, from the fault, for the next token of a request still open at the fault
    (whichever attempt brought it: after a retry that is the retry's first token). Requests
    that got no token after the fault do not count (they are lost or failed, counted there)."""
    waits = []
    for log in logs:
        times = sorted(t for a in log.attempts for t in a.times)
        if log.submitted <= fault_at and times and times[-1] >= fault_at:
            waits.append(next(t for t in times if t >= fault_at) - fault_at)
    return round(max(waits, default=0.0), 3)


def first_after(times: Iterable[float], since: float) -> float | None:
    """Seconds from ``since`` to the earliest of ``times`` at or after it (None: none)."""
    later = [t for t in times if t >= since]
    return round(min(later) - since, 3) if later else None


@dataclass(frozen=True, slots=True)
class Figure:
    """Another figure of the same result, as an Expect's value: ``Expect("transfers_refused",
    "==", Figure("transfers_damaged"))``. A missing or None figure fails the check."""

    name: str


@dataclass(frozen=True, slots=True)
class Expect:
    """One check of a scenario's result: ``result[field] <op> value``, ``value`` a constant or
    a ``Figure`` of the same result. Ops: "==", "<=", ">=", "not_none" (value unused). A
    missing field fails every check, and a None figure (either side) every op but "not_none"."""

    field: str
    op: str
    value: object = None

    @property
    def name(self) -> str:
        value = self.value.name if isinstance(self.value, Figure) else self.value
        return f"{self.field} {self.op}" + ("" if self.op == "not_none" else f" {value}")

    def holds(self, result: Mapping) -> bool:
        if self.field not in result:
            return False
        got = result[self.field]
        if self.op == "not_none":
            return got is not None
        want = result.get(self.value.name) if isinstance(self.value, Figure) else self.value
        if got is None or want is None:
            return False
        if self.op == "==":
            return got == want
        if self.op == "<=":
            return got <= want
        if self.op == ">=":
            return got >= want
        raise ValueError(f"unknown op {self.op!r}")


# What every scenario must show (the "done when"); a scenario adds its own.
BASE_EXPECTATIONS = (Expect("lost", "==", 0), Expect("duplicated_tokens", "==", 0),
                     Expect("outputs_identical", "==", True))


def checks(result: Mapping, expectations: Iterable[Expect], failures_allowed: bool = False) -> dict[str, bool]:
    """Each check's name -> whether it holds. Besides the base checks and ``expectations``:
    every request completed, unless the scenario allows typed failures."""
    out = {e.name: e.holds(result) for e in BASE_EXPECTATIONS}
    if not failures_allowed:
        out["completed == requests"] = result.get("completed") == result.get("requests")
    for e in expectations:
        out[e.name] = e.holds(result)
    return out


def exit_code(results: Iterable[Mapping]) -> int:
    """0 when every check of every result holds (and there was a result), else 1."""
    results = list(results)
    return 0 if results and all(all(r.get("checks", {}).values()) and r.get("checks") for r in results) else 1
