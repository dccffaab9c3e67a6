"""The planner's configuration: one frozen dataclass, checked at start, whose fields declare
its flags (settings/flags.py; the flags of ``python -m frontend.server`` and ``pdserve up``)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from settings.flags import add_arguments, dest_of, flagged, from_args, setting

MODES = ("off", "advisory", "active")


def slo_band(text: str) -> tuple[float, ...]:
    """``--planner-slo-band``: comma-separated factors (PlannerConfig checks them)."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _bound_help(role: str, bound: str) -> str:
    return (f"the planner keeps {role} nodes {'at least' if bound == 'min' else 'at most'} this "
            + ("many" if bound == "min" else "many (default: the nodes running)"))


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    # off: no planner; advisory: decide and report (metric, log, span, the plan record with
    # applied false), change nothing; active: decide and act.
    mode: str = setting("advisory", flag="--planner", dest="planner", choices=MODES,
                        help="off; advisory: decide and report only (metric, log, span, plan record); active: also "
                        "switch node roles, set pool targets and the short-prompt threshold")
    interval_s: float = setting(5.0, flag="--planner-interval-s", dest="planner_interval_s",
                                help="seconds between decisions")  # one decision round every this many seconds
    # After an action (roles, pool targets, threshold) no other action for this long: a role
    # switch drains a node and a new node warms up; acting again before the figures show the
    # effect of the last act is how planners flap.
    cooldown_s: float = setting(30.0, flag="--planner-cooldown-s", dest="planner_cooldown_s",
                                help="seconds after an action before the planner acts again")
    # The leader's lease in Redis (kv_index/plan.py): another router takes over this long
    # after the leader stops renewing. More than two rounds, so one slow round keeps it. (Not a
    # node's registry lease, NodeConfig.lease_s.) No flag: three rounds (``lease_for``).
    leader_lease_s: float = 15.0
    # How long the role wishes and pool targets it writes stand (kv_index/roles.py): a node
    # restarted past it keeps its configured role, a pool keeps its size, until the planner acts
    # again. Longer than a switch with its retries; short enough that the wishes of a planner
    # gone (its router stopped, a reinstall that kept Redis) stop steering the cluster. No flag.
    wish_ttl_s: float = 600.0
    # Pool bounds per role, for the role mix and (with resize) the pool sizes. max None: up to
    # the nodes now running.
    min_prefill_nodes: int = setting(0, flag="--min-prefill-nodes", help=_bound_help("prefill", "min"))
    max_prefill_nodes: int | None = setting(None, flag="--max-prefill-nodes", help=_bound_help("prefill", "max"))
    min_decode_nodes: int = setting(1, flag="--min-decode-nodes", help=_bound_help("decode", "min"))
    max_decode_nodes: int | None = setting(None, flag="--max-decode-nodes", help=_bound_help("decode", "max"))
    # Pool sizes follow the planner too (pool targets: kv_index/pool_targets.py): one node more or
    # fewer within the bounds; needs both maxima. Off: the total stays the nodes running and only
    # the role mix changes (two nodes stay two: 1P+1D or 2 colocated).
    resize: bool = setting(False, flag="--planner-resize", dest="planner_resize",
                           help="let pool sizes follow the planner too (pool targets, one node more or fewer within "
                           "the bounds; needs --max-prefill-nodes and --max-decode-nodes); default: only node roles "
                           "change")
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
    window_s: float = setting(60.0, flag="--planner-window-s", dest="planner_window_s",
                              help="seconds of finished requests a decision reads (shorter: it follows a shifting mix "
                              "sooner, on fewer requests)")
    min_requests: int = 8
    # The load is the window's rate of admitted requests, or the last burst_window_s seconds'
    # (at most half the window: the rest is what they are compared with) when they stand out
    # of it as a burst (router/planner/signals.py burst_rate). 0: the window's rate always.
    burst_window_s: float = setting(10.0, flag="--planner-burst-window-s", dest="planner_burst_window_s",
                                    help="judge layouts at the rate of the last this many seconds when it stands out "
                                    "of the window's as a burst (at most half the window; 0: the window's rate always)")
    # Per-request SLO the model scores layouts against: this many times the request's unloaded
    # TTFT (its prefill + transfer) and the unloaded TPOT (a decode step at batch 1), capped by
    # its SLO class's budget (router/admission.py); the serve benchmark's definition.
    ttft_slo_factor: float = setting(5.0, flag="--planner-ttft-slo-factor", dest="planner_ttft_slo_factor",
                                     help="the SLO the planner scores layouts against: this many times a request's "
                                     "unloaded TTFT")
    tpot_slo_factor: float = setting(2.0, flag="--planner-tpot-slo-factor", dest="planner_tpot_slo_factor",
                                     help="... and this many times the unloaded TPOT (a decode step at batch 1)")
    # The targets scaled by each of these, a layout scored by its mean predicted attainment over
    # them. (1.0,): the SLO alone. Points under 1 value headroom: two layouts that both meet the
    # SLO, one with TPOT at 95% of its target and one at 60%, score alike at the SLO and apart
    # at 0.67x (the first is what a burst or a misfit cost model tips over); points over 1
    # credit a layout that misses it narrowly over one that misses it by far.
    slo_band: tuple[float, ...] = setting((1.0,), flag="--planner-slo-band", dest="planner_slo_band", type=slo_band,
                                          to_field=tuple, metavar="B,B,...",
                                          help="score a layout by its mean predicted attainment over the SLO scaled by "
                                          "each of these (e.g. 0.67,1,1.33: headroom counts); default: the SLO alone")
    # Calibration (router/planner/model.py, calibrate): the window's measured mean TPOT and TTFT
    # over the model's for the current layout scale every layout's prediction, within
    # [calibration_min_scale, calibration_max_scale], once the window holds this many samples.
    calibrate: bool = True
    calibration_min_samples: int = 8
    calibration_min_scale: float = 0.5
    calibration_max_scale: float = 4.0
    # Append each round's signals and decision to this file as JSON lines (router/planner/record.py):
    # the input series to judge and tune the planner offline. None: no recording.
    record: str | None = setting(None, flag="--planner-record", dest="planner_record", metavar="FILE",
                                 help="append every round's signals and decision to FILE as JSON lines (to replay the "
                                 "planner offline: router/planner/record.py)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"planner mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("interval_s", "leader_lease_s", "window_s", "ttft_slo_factor", "tpot_slo_factor", "wish_ttl_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):  # NaN fails too
                raise ValueError(f"planner {name} must be a finite number > 0, got {v}")
        if not (self.burst_window_s >= 0 and math.isfinite(self.burst_window_s)):
            raise ValueError(f"planner burst_window_s must be a finite number >= 0, got {self.burst_window_s}")
        if not (self.cooldown_s >= 0 and math.isfinite(self.cooldown_s)):
            raise ValueError(f"planner cooldown_s must be a finite number >= 0, got {self.cooldown_s}")
        if self.leader_lease_s <= 2 * self.interval_s:
            raise ValueError(f"planner leader_lease_s ({self.leader_lease_s}) must exceed two rounds of interval_s "
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
    """The planner's flags of ``python -m frontend.server`` and ``pdserve up``: one per
    PlannerConfig field that declares one, under its dest (``PLANNER_FIELDS``)."""
    add_arguments(p, PlannerConfig)


# The flags' destinations, which are also ClusterConfig's field names (deploy/cluster_config.py).
PLANNER_FIELDS = tuple(dest_of(f, flag) for f, flag in flagged(PlannerConfig))


def planner_config(args) -> PlannerConfig:
    """The PlannerConfig of parsed ``add_planner_arguments`` flags, or of anything with the same
    attributes (``PLANNER_FIELDS``: a ClusterConfig); ValueError: refused."""
    return from_args(PlannerConfig, args, leader_lease_s=lease_for(args.planner_interval_s))


def lease_for(interval_s: float) -> float:
    """The leader's lease of a planner deciding every ``interval_s``: the default, or three rounds."""
    default = next(f.default for f in fields(PlannerConfig) if f.name == "leader_lease_s")
    return max(default, 3 * interval_s)
