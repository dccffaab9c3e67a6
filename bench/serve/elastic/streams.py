"""What every layout of `pdserve bench serve --compare elastic` serves (bench/serve/elastic/run.py):
the streams (the fixed mixes back to back, the phases play), each cut into its workloads'
segments, and a stream's records, roles and planner decisions split by workload (``cut``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bench.serve import phases as ph
from bench.serve import workload as wl
from bench.serve.elastic import figures as fig
from bench.serve.elastic.sampler import RoleSampler
from bench.serve.metrics import Record

DEFAULT_SHARES = (0.1, 0.2, 0.4)
# The shipped phases file's rates were written for a 0.5/s machine; with the rate following the
# machine they scale by rate / this (an explicit --rate plays them as written).
PHASES_REFERENCE_RATE = 0.5



@dataclass(frozen=True, slots=True)
class Segment:
    """One workload's stretch of a stream: requests arriving in [start, end) are its own, those
    in [measured_from, end) are measured."""

    workload: str
    kind: str  # "mix" or "phases"
    start: float
    measured_from: float
    end: float
    long_share: float | None = None


@dataclass(frozen=True, slots=True)
class Stream:
    """Requests sent in one go: the fixed mixes back to back, or the phases play."""

    name: str
    phases: tuple[ph.Phase, ...]
    segments: tuple[Segment, ...]
    seed: int
    per_pass: bool  # True: each pass draws its own requests (the fixed mixes' halves)

    def requests(self, pass_index: int, cap: int | None) -> list[wl.LoadRequest]:
        return ph.phased(self.phases, self.seed + (7 * pass_index if self.per_pass else 0), max_tokens_cap=cap)


def streams(args, rate: float | None = None) -> list[Stream]:
    """The streams every layout serves: the fixed mixes at ``args.rate`` (else ``rate``, the
    machine's: ``auto_rate``), the phases as written (with ``rate``: scaled by it over
    ``PHASES_REFERENCE_RATE``)."""
    shares = [float(x) for x in args.long_shares.split(",") if x.strip()] if args.long_shares else DEFAULT_SHARES
    explicit = args.rate is not None
    scale = 1.0 if explicit or not rate else rate / PHASES_REFERENCE_RATE
    rate = args.rate if explicit else rate or PHASES_REFERENCE_RATE
    if not (rate > 0 and args.mix_seconds > 0 and args.lead_s >= 0 and all(0 <= s <= 1 for s in shares)):
        raise SystemExit(f"--compare elastic needs --rate > 0, --mix-seconds > 0, --lead-s >= 0 and long shares in "
                         f"[0, 1], got {rate}, {args.mix_seconds}, {args.lead_s}, {list(shares)}")
    phases, segments, t = [], [], 0.0
    for s in shares:
        if args.lead_s > 0:
            phases.append(ph.Phase(args.lead_s, rate, s, f"lead {s:g}"))
        phases.append(ph.Phase(args.mix_seconds, rate, s, f"long {s:g}"))
        segments.append(Segment(f"long_share={s:g}", "mix", t, t + max(0.0, args.lead_s),
                                t + max(0.0, args.lead_s) + args.mix_seconds, s))
        t = segments[-1].end
    out = [Stream("mixes", tuple(phases), tuple(segments), args.seed * 1000, per_pass=True)] if shares else []
    if args.phases:
        try:
            play = tuple(replace(p, rate=p.rate * scale) for p in ph.load_phases(args.phases))
        except ph.PhasesError as e:
            raise SystemExit(f"--phases: {e}") from None
        out.append(Stream("phases", play, (Segment("phases", "phases", 0.0, 0.0, ph.total_seconds(play)),),
                          args.seed * 1000 + 500, per_pass=False))
    return out


@dataclass(slots=True)
class Run:
    """One workload served by one layout in one pass."""

    records: list[Record]  # every request of the workload (lead included)
    measured: list[Record]
    samples: list[tuple[float, dict[str, str]]]  # t from the workload's start
    thresholds: list[tuple[float, int]]
    decisions: dict[str, float]  # "action/reason" -> planner rounds
    plans: list[tuple[float, str, str, str]]  # (t, action, reason, detail) where they changed


def cut(stream: Stream, records: list[Record], sampler: RoleSampler) -> dict[str, Run]:
    """A stream's records, roles and decisions, split by workload. A segment's roles and
    decisions run from its start to the next one's (the last: to the stream's end)."""
    out = {}
    for i, seg in enumerate(stream.segments):
        until = stream.segments[i + 1].start if i + 1 < len(stream.segments) else math.inf
        own = [r for r in records if seg.start <= r.scheduled_s < seg.end]
        shift = [(t - seg.start, v) for t, v in fig.between(sampler.samples, seg.start, until)]
        out[seg.workload] = Run(own, [r for r in own if r.scheduled_s >= seg.measured_from], shift,
                                [(t - seg.start, v) for t, v in fig.between(sampler.thresholds, seg.start, until)],
                                fig.counter_delta(sampler.decisions, seg.start, until),
                                [(round(t - seg.start, 1), *x) for t, *x in fig.between(sampler.plans, seg.start, until)])
    return out
