"""The planner's model checked on an elastic benchmark's recordings (router/planner/evaluate.py).

    python -m bench.serve.elastic.model RESULT.json PREFIX [--slo-band ...]

RESULT.json: the benchmark's ``--json`` output (its ``stream_starts``); PREFIX: its
``--planner-records`` prefix. The fixed and colocated passes served the same requests at the
same offsets into each stream, one static layout each (their planners advisory), so rounds
``ROUND_BIN_S`` apart in both are paired: did the model, running on either, rank the two
layouts as they measured? And per layout, how far its own attainment was from the measured one.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
from collections.abc import Sequence

from router.planner.evaluate import (
    add_model_args,
    config_from,
    current_layout,
    ranking,
    summarize_current,
    summarize_ranking,
)
from router.planner.record import read_rounds
from router.planner.signals import PlannerSignals

# Rounds within this many seconds of the same offset into the same stream are paired (the
# planner's interval in the benchmark: 2 s).
ROUND_BIN_S = 2.0


def by_offset(rounds: Sequence[PlannerSignals], starts: Sequence[tuple[float, str]]) -> dict[tuple[str, int], PlannerSignals]:
    """Rounds keyed by (stream, offset into it in ``ROUND_BIN_S`` bins); ``starts``: (wall clock, stream)."""
    starts = sorted(starts)
    walls = [w for w, _ in starts]
    out = {}
    for s in rounds:
        i = bisect.bisect_right(walls, s.at) - 1
        if i >= 0:
            out[(starts[i][1], round((s.at - walls[i]) / ROUND_BIN_S))] = s
    return out


def pairs(result: dict, prefix: str, a: str = "fixed", b: str = "colocated") -> list[tuple[PlannerSignals, PlannerSignals]]:
    """(layout a's round, layout b's round) at the same offset, over every pass both recorded."""
    out = []
    for p in sorted({x["pass"] for x in result["stream_starts"]}):
        keyed = []
        for lay in (a, b):
            path = f"{prefix}_{lay}_pass{p}.jsonl"
            if not os.path.exists(path):
                break
            starts = [(x["wall_start"], x["stream"]) for x in result["stream_starts"] if x["layout"] == lay and x["pass"] == p]
            keyed.append(by_offset([s for s, _ in read_rounds(path)], starts))
        if len(keyed) == 2:
            out += [(keyed[0][k], keyed[1][k]) for k in sorted(keyed[0].keys() & keyed[1].keys())]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve.elastic.model", description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="the benchmark's --json output")
    p.add_argument("prefix", help="its --planner-records prefix")
    add_model_args(p)
    args = p.parse_args(argv)
    with open(args.result) as f:
        result = json.loads(f.readline())
    cfg = config_from(args)
    current = {}
    for lay in ("fixed", "colocated", "elastic"):
        paths = sorted(f"{args.prefix}_{lay}_pass{i}.jsonl" for i in (1, 2))
        rows = [r for path in paths if os.path.exists(path) for r in current_layout(read_rounds(path), cfg)]
        if rows:
            current[lay] = summarize_current(rows)
    out = {"current_layout": current,
           "ranking": {"a": "fixed", "b": "colocated", **summarize_ranking(ranking(pairs(result, args.prefix), cfg))}}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
