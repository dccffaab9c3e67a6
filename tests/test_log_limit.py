"""Rate-limited warnings (telemetry/log_limit.py): plain data, an injected clock."""
from __future__ import annotations

import logging

from telemetry.log_limit import RateLimitedLog, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


def test_first_then_one_summary_per_interval():
    clock = Clock()
    lim = RateLimiter(10.0, clock)
    assert lim.note("a").log
    skipped = [lim.note("a") for _ in range(999)]
    assert not any(d.log for d in skipped)
    clock.t += 9.99
    assert not lim.note("a").log
    clock.t += 0.01
    d = lim.note("a")
    assert d.log and d.suppressed == 1000 and d.window_s == 10.0
    # A new window opened with that occurrence.
    clock.t += 3
    assert not lim.note("a").log
    clock.t += 60  # a quiet minute: the next one logs and reports the one skipped
    d = lim.note("a")
    assert d.log and d.suppressed == 1 and d.window_s == 63.0
    clock.t += 10
    d = lim.note("a")
    assert d.log and d.suppressed == 0


def test_reasons_are_independent():
    clock = Clock()
    lim = RateLimiter(10.0, clock)
    assert lim.note("ReserveBlocks RESOURCE_EXHAUSTED").log
    assert lim.note("Prefill RESOURCE_EXHAUSTED").log
    assert lim.note("ReserveBlocks UNAVAILABLE").log
    assert not lim.note("ReserveBlocks RESOURCE_EXHAUSTED").log


def test_log_thins_warnings_keeps_every_one_at_debug():
    clock = Clock()
    logger = logging.getLogger("pdserve.test.log_limit")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    h = Records()
    logger.addHandler(h)
    try:
        rl = RateLimitedLog(logger, 10.0, clock)
        for i in range(500):  # 500 refusals over 31 s of overload (0.0625: exact in binary)
            rl.warning("ReserveBlocks RESOURCE_EXHAUSTED", "request r%d: ReserveBlocks on %s failed", i, "decode-0")
            clock.t += 0.0625
        warnings = h.at(logging.WARNING)
        assert warnings == [
            "request r0: ReserveBlocks on decode-0 failed",
        ] + [f"request r{i}: ReserveBlocks on decode-0 failed "
             "(and 159 more ReserveBlocks RESOURCE_EXHAUSTED in the last 10 s, not logged)" for i in (160, 320, 480)]
        assert len(h.at(logging.DEBUG)) == 500 - 4
    finally:
        logger.removeHandler(h)


def test_orchestrator_node_call_failures_go_through_the_limiter():
    # The per-request warnings of the router's node calls that flood under overload: the
    # request's own (router/orchestrator.py) and the housekeeping ones (router/node_client.py).
    import inspect

    import router.node_client as client
    import router.orchestrator as orch

    src = inspect.getsource(orch) + inspect.getsource(client)
    for call in ("ReserveBlocks", "Prefill", "RenewReservation", "AbortDecode", "ReleaseReservation"):
        assert f'node_call_log.warning(f"{call} {{e.code().name}}"' in src, call
    assert isinstance(orch.node_call_log, RateLimitedLog) and isinstance(client.node_call_log, RateLimitedLog)
