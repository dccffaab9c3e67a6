"""The step-cost model adaptive speculation chooses k with (engine/speculative/control.py).

``StepCost`` predicts the time of one forward over T query tokens. On CPU it starts from the
matmul times the kernel plan measured for every row count (engine/models/cpu_linear.py) and
learns the rest (attention, sampling, Python) from the steps the engine actually runs;
elsewhere it starts from the linear prior in the config (``1 + verify_fixed_cost + k *
verify_token_cost`` plain decode steps) and learns the same way. ``expected_tokens`` is what a
verification of k drafts yields at acceptance ``a``: the two sides of the controller's
tokens-per-ms rule.
"""
from __future__ import annotations

from typing import Callable

from engine.config import SpeculativeConfig


def expected_tokens(a: float, k: int) -> float:
    """1 + a + a^2 + ... + a^k: tokens one verification of k drafts yields on average."""
    return sum(a**i for i in range(k + 1))


class StepCost:
    """Predicted time (ms) of one decode/verification forward over ``t`` query rows.

    Kept apart for steps with and without a verification in them: a verifying step pays a
    fixed extra (the verification's own logits, probabilities and sampling; a large share of a
    CPU step at batch 8, docs/benchmarks.md), which a plain decode step of the same row count
    does not.

    ``cost(t, v) = prior(t, v)`` until (t, v) has been observed ``MIN_SEEN`` times, then its
    own exponential average. The prior is the measured matmul curve plus a residual
    (everything that is not a matmul) refitted from every observation of the same kind (v);
    without a curve it is ``base * linear prior`` (``verify_fixed_cost``, ``verify_token_cost``)
    with ``base`` refitted the same way. So the controller can weigh a k it has not tried yet
    and still converges on what this machine really does.
    """

    DECAY = 0.9
    MIN_SEEN = 3

    def __init__(self, cfg: SpeculativeConfig, gemm_ms: Callable[[int], float] | None = None) -> None:
        self.cfg = cfg
        self.gemm_ms = gemm_ms
        # Without a curve the unit is one plain decode step until one is observed.
        start = gemm_ms(1) * 0.3 if gemm_ms is not None else 1.0
        self._base = {False: start, True: start}  # residual (or unit) per kind of step
        self._base_seen = {False: False, True: False}
        self._avg: dict[tuple[int, bool], float] = {}
        self._seen: dict[tuple[int, bool], int] = {}

    def prior(self, t: int, verifying: bool | None = None) -> float:
        v = t > 1 if verifying is None else verifying
        if self.gemm_ms is not None:
            return self.gemm_ms(t) + self._base[v]  # _base: the non-matmul residual
        extra = (self.cfg.verify_fixed_cost if v else 0.0) + max(0, t - 1) * self.cfg.verify_token_cost
        return self._base[v] * (1.0 + extra)

    def cost(self, t: int, verifying: bool | None = None) -> float:
        """``verifying`` None: a batch-1 view (a step of t > 1 rows is a verification)."""
        key = (t, t > 1 if verifying is None else verifying)
        if self._seen.get(key, 0) >= self.MIN_SEEN:
            return self._avg[key]
        return self.prior(*key)

    def observe(self, t: int, ms: float, verifying: bool | None = None) -> None:
        if t < 1 or ms <= 0:
            return
        v = t > 1 if verifying is None else verifying
        key = (t, v)
        self._avg[key] = ms if key not in self._avg else self.DECAY * self._avg[key] + (1 - self.DECAY) * ms
        self._seen[key] = self._seen.get(key, 0) + 1
        if self.gemm_ms is not None:
            fit = max(0.0, ms - self.gemm_ms(t))
        else:
            fit = ms / (self.prior(t, v) / self._base[v])
        if not self._base_seen[v]:
            self._base[v], self._base_seen[v] = fit, True
            if not self._base_seen[not v]:  # the other kind starts from here, not from a guess
                self._base[not v] = fit
        else:
            self._base[v] = self.DECAY * self._base[v] + (1 - self.DECAY) * fit

    def snapshot(self) -> dict[str, float]:
        """"t" (plain) or "t+v" (verifying) -> predicted ms, for the kinds observed."""
        return {f"{t}{'+v' if v else ''}": round(self.cost(t, v), 3) for t, v in sorted(self._avg)}
