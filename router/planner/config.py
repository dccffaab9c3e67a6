"""The planner's configuration: one frozen dataclass, checked at start, and its flags (defined
once here for ``python -m frontend.server`` and ``pdserve up``)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

MODES = ("off", "advisory", "active")


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    # off: no planner; advisory: decide and report (metric, log, span, the plan record with
    # applied false), change nothing; active: decide and act.
    mode: str = "advisory"
    interval_s: float = 5.0  # one decision round every this many seconds
    # After an action (roles, pool targets, threshold) no other action for this long: a role
    # switch drains a node and a new node warms up; acting again before the figures show the
    # effect of the last act is how planners flap.
    cooldown_s: float = 30.0
    # The leader's lease in Redis (kv_index/plan.py): another router takes over this long
    # after the leader stops renewing. More than two rounds, so one slow round keeps it.
    lease_s: float = 15.0
    # Pool bounds per role, for the role mix and (with resize) the pool sizes. max None: up to
    # the nodes now running.
    min_prefill_nodes: int = 0
    max_prefill_nodes: int | None = None
    min_decode_nodes: int = 1
    max_decode_nodes: int | None = None
    # Pool sizes follow the planner too (pool targets: kv_index/pool_targets.py): one node more or
    # fewer within the bounds; needs both maxima. Off: the total stays the nodes running and only
    # the role mix changes (two nodes stay two: 1P+1D or 2 colocated).
    resize: bool = False
    # The short-prompt threshold the planner may set (prompts with fewer uncached tokens
    # prefill on their decode node): between these, in powers of two.
    min_short_prompt_tokens: int = 16
    max_short_prompt_tokens: int = 2048
    # Hysteresis: a new layout or threshold must promise this much more predicted goodput
    # (relative) than the current one, and win this many rounds in a row.
    switch_margin: float = 0.15
    confirm_rounds: int = 2
    # Pool sizes: grow when the best layout's busiest pool is predicted above scale_up_util,
    # shrink when one node fewer would keep every pool below scale_down_util.
    scale_up_util: float = 0.85
    scale_down_util: float = 0.5
    # The signal window: requests of the last window_s seconds, stretched back (up to four
    # windows) to the last min_requests when it holds fewer; no decision before min_requests
    # requests finished (the figures say nothing yet).
    window_s: float = 60.0
    min_requests: int = 8
    # The load is the window's rate of admitted requests, or the last burst_window_s seconds'
    # (at most half the window: the rest is what they are compared with) when they stand out
    # of it as a burst (router/planner/signals.py burst_rate). 0: the window's rate always.
    burst_window_s: float = 10.0
    # Per-request SLO the model scores layouts against: this many times the request's unloaded
    # TTFT (its prefill + transfer) and the unloaded TPOT (a decode step at batch 1), capped by
    # its SLO class's budget (router/admission.py); the serve benchmark's definition.
    ttft_slo_factor: float = 5.0
    tpot_slo_factor: float = 2.0
    # The targets scaled by each of these, a layout scored by its mean predicted attainment over
    # them. (1.0,): the SLO alone. Points under 1 value headroom: two layouts that both meet the
    # SLO, one with TPOT at 95% of its target and one at 60%, score alike at the SLO and apart
    # at 0.67x (the first is what a burst or a misfit cost model tips over); points over 1
    # credit a layout that misses it narrowly over one that misses it by far.
    slo_band: tuple[float, ...] = (1.0,)
    # Calibration (router/planner/model.py, calibrate): the window's measured mean TPOT and TTFT
    # over the model's for the current layout scale every layout's prediction, within
    # [calibration_min_scale, calibration_max_scale], once the window holds this many samples.
    calibrate: bool = True
    calibration_min_samples: int = 8
    calibration_min_scale: float = 0.5
    calibration_max_scale: float = 4.0
    # Append each round's signals and decision to this file as JSON lines (router/planner/record.py):
    # the input series to judge and tune the planner offline. None: no recording.
    record: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"planner mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("interval_s", "lease_s", "window_s", "ttft_slo_factor", "tpot_slo_factor"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):  # NaN fails too
                raise ValueError(f"planner {name} must be a finite number > 0, got {v}")
        if not (self.burst_window_s >= 0 and math.isfinite(self.burst_window_s)):
            raise ValueError(f"planner burst_window_s must be a finite number >= 0, got {self.burst_window_s}")
        if not (self.cooldown_s >= 0 and math.isfinite(self.cooldown_s)):
            raise ValueError(f"planner cooldown_s must be a finite number >= 0, got {self.cooldown_s}")
        if self.lease_s <= 2 * self.interval_s:
            raise ValueError(f"planner lease_s ({self.lease_s}) must exceed two rounds of interval_s "
                             f"({self.interval_s}): a leader renews once a round")
        if not self.slo_band or not all(b > 0 and math.isfinite(b) for b in self.slo_band):
            raise ValueError(f"planner slo_band must be one or more finite numbers > 0, got {list(self.slo_band)}")
        self._check_bounds()
        if not 1 <= self.min_short_prompt_tokens <= self.max_short_prompt_tokens:
            raise ValueError(f"the short-prompt threshold range must satisfy 1 <= min ({self.min_short_prompt_tokens})"
                             f" <= max ({self.max_short_prompt_tokens})")
        if not 0 <= self.switch_margin < 10 or self.confirm_rounds < 1 or self.min_requests < 1:
            raise ValueError("planner switch_margin must be in [0, 10), confirm_rounds and min_requests >= 1")
        if not (0 < self.calibration_min_scale <= 1 <= self.calibration_max_scale < math.inf) \
                or self.calibration_min_samples < 1:
            raise ValueError(f"planner calibration bounds must satisfy 0 < calibration_min_scale "
                             f"({self.calibration_min_scale}) <= 1 <= calibration_max_scale "
                             f"({self.calibration_max_scale}) < inf, and calibration_min_samples >= 1")
        if not 0 < self.scale_down_util < self.scale_up_util <= 1:
            raise ValueError(f"planner utilizations must satisfy 0 < scale_down_util ({self.scale_down_util}) < "
                             f"scale_up_util ({self.scale_up_util}) <= 1")

    def _check_bounds(self) -> None:
        """Bounds that cannot hold are refused with the reason."""
        if self.min_prefill_nodes < 0:
            raise ValueError(f"min_prefill_nodes must be >= 0, got {self.min_prefill_nodes}")
        if self.min_decode_nodes < 1:
            raise ValueError(f"min_decode_nodes must be >= 1, got {self.min_decode_nodes}: decode nodes are the only "
                             "ones that decode (and prefill when no prefill node is up), so a decode pool that may "
                             "shrink to zero could leave the cluster serving nothing")
        for role, lo, hi in (("prefill", self.min_prefill_nodes, self.max_prefill_nodes),
                             ("decode", self.min_decode_nodes, self.max_decode_nodes)):
            if hi is not None and lo > hi:
                raise ValueError(f"min_{role}_nodes ({lo}) is above max_{role}_nodes ({hi}): no pool size satisfies both")
        if self.resize and (self.max_prefill_nodes is None or self.max_decode_nodes is None):
            raise ValueError("planner resize needs max_prefill_nodes and max_decode_nodes: pools that may grow need "
                             "a ceiling")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def acts(self) -> bool:
        return self.mode == "active"

    @property
    def resizes(self) -> bool:
        """Whether pool sizes may change; else only the role mix does."""
        return self.resize


def add_planner_arguments(p: argparse.ArgumentParser) -> None:
    """The planner's flags of ``python -m frontend.server`` and ``pdserve up``: each sets the
    PlannerConfig field of its dest, with that field's default."""
    d = {f.name: f.default for f in fields(PlannerConfig)}
    p.add_argument("--planner", choices=MODES, default=d["mode"], dest="planner",
                   help="off; advisory: decide and report only (metric, log, span, plan record); active: also "
                   "switch node roles, set pool targets and the short-prompt threshold")
    p.add_argument("--planner-interval-s", type=float, default=d["interval_s"], help="seconds between decisions")
    p.add_argument("--planner-cooldown-s", type=float, default=d["cooldown_s"],
                   help="seconds after an action before the planner acts again")
    p.add_argument("--planner-window-s", type=float, default=d["window_s"],
                   help="seconds of finished requests a decision reads (shorter: it follows a shifting mix sooner, "
                   "on fewer requests)")
    p.add_argument("--planner-burst-window-s", type=float, default=d["burst_window_s"],
                   help="judge layouts at the rate of the last this many seconds when it stands out of the window's "
                   "as a burst (at most half the window; 0: the window's rate always)")
    p.add_argument("--planner-ttft-slo-factor", type=float, default=d["ttft_slo_factor"],
                   help="the SLO the planner scores layouts against: this many times a request's unloaded TTFT")
    p.add_argument("--planner-tpot-slo-factor", type=float, default=d["tpot_slo_factor"],
                   help="... and this many times the unloaded TPOT (a decode step at batch 1)")
    p.add_argument("--planner-slo-band", type=slo_band, default=d["slo_band"], metavar="B,B,...",
                   help="score a layout by its mean predicted attainment over the SLO scaled by each of these "
                   "(e.g. 0.67,1,1.33: headroom counts); default: the SLO alone")
    p.add_argument("--planner-record", default=d["record"], metavar="FILE",
                   help="append every round's signals and decision to FILE as JSON lines (to replay the planner "
                   "offline: router/planner/record.py)")
    p.add_argument("--planner-resize", action="store_true", default=d["resize"],
                   help="let pool sizes follow the planner too (pool targets, one node more or fewer within the "
                   "bounds; needs --max-prefill-nodes and --max-decode-nodes); default: only node roles change")
    for role in ("prefill", "decode"):
        for bound in ("min", "max"):
            name = f"{bound}_{role}_nodes"
            p.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name],
                           help=f"the planner keeps {role} nodes {'at least' if bound == 'min' else 'at most'} this "
                           + ("many" if bound == "min" else "many (default: the nodes running)"))


# The flags' destinations, which are also ClusterConfig's field names (deploy/launcher.py).
PLANNER_FIELDS = ("planner", "planner_interval_s", "planner_cooldown_s", "planner_window_s",
                  "planner_burst_window_s", "planner_resize",
                  "planner_ttft_slo_factor", "planner_tpot_slo_factor", "planner_slo_band", "planner_record",
                  "min_prefill_nodes", "max_prefill_nodes", "min_decode_nodes", "max_decode_nodes")


def planner_config(args) -> PlannerConfig:
    """The PlannerConfig of parsed ``add_planner_arguments`` flags, or of anything with the same
    attributes (``PLANNER_FIELDS``: a ClusterConfig); ValueError: refused."""
    return PlannerConfig(mode=args.planner, interval_s=args.planner_interval_s, cooldown_s=args.planner_cooldown_s,
                         lease_s=lease_for(args.planner_interval_s),
                         min_prefill_nodes=args.min_prefill_nodes, max_prefill_nodes=args.max_prefill_nodes,
                         min_decode_nodes=args.min_decode_nodes, max_decode_nodes=args.max_decode_nodes,
                         resize=args.planner_resize, window_s=args.planner_window_s,
                         burst_window_s=args.planner_burst_window_s,
                         ttft_slo_factor=args.planner_ttft_slo_factor, tpot_slo_factor=args.planner_tpot_slo_factor,
                         slo_band=tuple(args.planner_slo_band), record=args.planner_record)


def slo_band(text: str) -> tuple[float, ...]:
    """``--planner-slo-band``: comma-separated factors (PlannerConfig checks them)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def lease_for(interval_s: float) -> float:
    """The lease of a planner deciding every ``interval_s``: the default, or three rounds."""
    default = next(f.default for f in fields(PlannerConfig) if f.name == "lease_s")
    return max(default, 3 * interval_s)
