"""The elastic comparison's load on this machine (``--compare elastic`` without ``--rate``):
the fixed mixes' rate from what the first layout measures alone (serve_elastic.py)."""
from __future__ import annotations

import math

from bench.serve.metrics import Record

# Without --rate the fixed mixes' rate follows the machine: RATE_X_TPOT / the unloaded TPOT the
# first layout measures alone (its decode node, one core). Why: these VMs drift 2.5x in speed
# within a day (unloaded TPOT 40 ms one morning, 105-131 ms that afternoon), and one fixed rate
# put the layouts near their knees in the morning (1.0/s at 40 ms: the fixed layout scored 0.35
# and 0.12 on two passes at 10% documents) and all of them far past it in the afternoon (0.5/s at
# 120 ms: every layout overloaded, attainment 0-18%). Within one VM a node's whole cost scales
# with its speed, so requests per unloaded decode step is the load (not across CPUs: below);
# 0.035, chosen on seed 0's runs, is a little under the fixed layout's knee at 10% documents
# (about 0.04), where two decode nodes still have headroom.
RATE_X_TPOT = 0.035
# ... or RATE_X_LONG_TTFT / the unloaded median TTFT of a document (its prefill alone), where
# that is lower: the fixed layout's one prefill node then spends at most 0.4 x 1.5 = 60% of its
# time on documents in the 40% mix. Why: decode and prefill do not speed up alike across CPUs,
# so the TPOT alone does not say the load. On the AVX-512 Xeon of the first ten sessions
# (unloaded TPOT 63-82 ms, the prefill fit 3.0-3.4 ms a token) the TPOT rule gave 0.43-0.56 a
# second, about 1.3-1.8 documents' prefill time a second (this rule would have trimmed the
# fastest of those runs); on an EPYC (2026-12-04: TPOT 40 ms, 2.25-2.4 ms a token, a document
# 2.45 s) it gave 0.885, 2.2 documents' time a second, and every layout drowned in the 40% mix
# (fixed 0.035 request/s good, colocated 0.16).
RATE_X_LONG_TTFT = 1.5


def _by_rule(unloaded: list[Record]) -> tuple[float, float]:
    """(``RATE_X_TPOT`` / the unloaded median TPOT, ``RATE_X_LONG_TTFT`` / the unloaded median
    document TTFT; inf where no document measured one)."""
    tpots = sorted(t for r in unloaded if (t := r.tpot) is not None and t > 0)
    if not tpots:
        raise SystemExit("--compare elastic: no unloaded request measured a TPOT, so no rate follows; pass --rate")
    longs = sorted(t for r in unloaded if r.kind == "long" and (t := r.ttft) is not None and t > 0)
    return RATE_X_TPOT / tpots[len(tpots) // 2], RATE_X_LONG_TTFT / longs[len(longs) // 2] if longs else math.inf


def auto_rate(unloaded: list[Record]) -> float:
    """The fixed mixes' rate on this machine: ``RATE_X_TPOT`` / the unloaded median TPOT, or
    ``RATE_X_LONG_TTFT`` / the unloaded median document TTFT where lower (none measured: the
    TPOT's alone)."""
    return round(min(_by_rule(unloaded)), 3)


def rate_rule(unloaded: list[Record], rate: float) -> str:
    """Which of ``auto_rate``'s two rules set ``rate``, in words."""
    by_tpot = round(_by_rule(unloaded)[0], 3)
    if rate >= by_tpot:
        return f"{RATE_X_TPOT:g} / the unloaded TPOT {RATE_X_TPOT / rate * 1e3:.0f} ms"
    return f"{RATE_X_LONG_TTFT:g} / the unloaded document TTFT {RATE_X_LONG_TTFT / rate:.2f} s (the TPOT's: {by_tpot:g})"
