"""`pdserve status`'s planner lines: the current plan (what the leading router's planner decided,
why, with which figures, applied or advisory) and who leads (kv_index/plan.py). Its own module
so deploy/status.py stays one screen of concerns."""
from __future__ import annotations

from collections.abc import Mapping

from kv_index.plan import PlanStore

FIGURES_SHOWN = ("rate_rps", "long_share", "current_goodput_rps", "target_goodput_rps", "current_prefill_util",
                 "current_decode_util")


def plan_section(store: PlanStore, now: float) -> dict | None:
    """The JSON part: the plan record as published plus ``age_s``, and ``leader`` / ``lease_s``
    (the lease holder now and its seconds left; None: nobody leads). None when no planner ever
    published and none leads."""
    plan = store.read()
    leader = store.leader()
    if plan is None and leader is None:
        return None
    out = dict(plan or {})
    if plan is not None and isinstance(plan.get("at"), (int, float)):
        out["age_s"] = round(now - plan["at"], 1)
    out["leader"] = leader.holder if leader is not None else None
    out["lease_s"] = round(leader.ttl_s, 1) if leader is not None else None
    return out


def render_plan(section: Mapping | None) -> list[str]:
    """The terminal lines (none when there is no planner)."""
    if not section:
        return []
    lead = f"led by {section['leader']} (lease {section['lease_s']:.0f}s left)" if section.get("leader") else \
        "no leader (no router runs a planner, or Redis was unreachable for its lease)"
    lines = ["", f"planner: {section.get('mode', '-')}, {lead}"]
    if "action" not in section:
        return lines
    layout = section.get("layout") or {}
    state = "applied" if section.get("applied") else "not applied (advisory)" if section.get("mode") == "advisory" \
        else "not applied"
    age = f"{section['age_s']:.0f}s ago" if section.get("age_s") is not None else "-"
    lines.append(f"  plan ({age}): {section['action']} ({section.get('reason', '-')}), {state}; layout "
                 f"{layout.get('prefill', '-')} prefill + {layout.get('decode', '-')} decode, short-prompt threshold "
                 f"{section.get('threshold', '-')} tokens")
    if section.get("detail"):
        lines.append(f"  why: {section['detail']}")
    figs = section.get("figures") or {}
    shown = ", ".join(f"{k} {figs[k]}" for k in FIGURES_SHOWN if k in figs)
    if shown:
        lines.append(f"  figures: {shown}")
    return lines
